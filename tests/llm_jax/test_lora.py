"""LoRA adapters against PEFT (torch, CPU, float32): PEFT writes random adapters of tiny random models of
every family and of stories260K's Hugging Face copy, and its ``PeftModel`` logits are the reference for
our merged weights (``load(..., lora=)``, ``Model.with_lora``) and for the unmerged batch, where rows of
different adapters and of the base model run in one call. PEFT's scale rules (alpha / r, rsLoRA's
alpha / √r, per-module rank and alpha patterns, layers left alone) are read as PEFT reads them, and what
an adapter can hold that we do not run is refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.lora import LoraBatch, LoraWeights, merge_lora
from llm_jax.loading import load_lora
from llm_jax.model import forward
from tests.hf_models import save_peft_adapter
from tests.llm_jax.model.test_families import FAMILIES, build

ATOL = 1e-4  # float32 max |Δlogit| against PEFT
jit_forward = jax.jit(forward, static_argnames=("config", "backend"))


def peft_logits(model, tokens: np.ndarray, adapter: bool = True) -> np.ndarray:
    with torch.no_grad():
        if adapter:
            return model(torch.tensor(tokens)).logits.numpy()
        with model.disable_adapter():
            return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_and_batched_adapters_equal_peft(family, tmp_path):
    """Two adapters of one model: merged, each gives PEFT's logits; unmerged, rows of either adapter and of
    the base model in one batch each give theirs (the CPU kernels' prepared weights included)."""
    spec = FAMILIES[family]
    build(spec, tmp_path / "base")
    first = save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "a", seed=1)
    second = save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "b", seed=2, r=6, lora_alpha=3,
                               target_modules=["k_proj", "o_proj", "up_proj"])
    tokens = np.random.default_rng(0).integers(0, 160, size=(3, 21))
    ref_a, ref_b = peft_logits(first, tokens), peft_logits(second, tokens)
    ref_base = peft_logits(first, tokens, adapter=False)
    assert np.abs(ref_a - ref_base).max() > 100 * ATOL and np.abs(ref_b - ref_base).max() > 100 * ATOL

    for name, ref in (("a", ref_a), ("b", ref_b)):
        merged = llm_jax.load(tmp_path / "base", dtype="float32", lora=tmp_path / name, backend="xla")
        np.testing.assert_allclose(np.asarray(jit_forward(merged.params, merged.config, jnp.asarray(tokens))), ref,
                                   atol=ATOL, rtol=0)
    for backend in ("xla", "cpu"):
        model = llm_jax.load(tmp_path / "base", dtype="float32", backend=backend)
        adapters = [load_lora(tmp_path / n, model.config) for n in ("a", "b")]
        weights = LoraWeights.stack([None, *adapters], model.config)  # slot 0 empty
        slots = jnp.asarray(np.repeat([[1], [-1], [2]], tokens.shape[1], axis=1))
        out = np.asarray(jit_forward(model.weights, model.config, jnp.asarray(tokens), backend=model.backend,
                                     lora=LoraBatch.of_slots(weights, slots)))
        for row, ref in enumerate((ref_a, ref_base, ref_b)):
            np.testing.assert_allclose(out[row], ref[row], atol=ATOL, rtol=0, err_msg=f"{backend} row {row}")


def test_stories260k_adapter_of_the_hf_copy_runs_on_the_llama2c_file(stories, stories260k_dir, tmp_path):
    """An adapter trained on the Hugging Face copy applies to the llama2.c file (whose q/k rows the
    converter permuted into Hugging Face's order)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()
    adapter = save_peft_adapter(base, tmp_path / "ad", seed=3, scale=0.3)
    tokens = np.asarray([stories.tokenizer.encode("Once upon a time, there was a little girl named Lily.")])
    merged = stories.with_lora(tmp_path / "ad")
    np.testing.assert_allclose(np.asarray(jit_forward(merged.params, merged.config, jnp.asarray(tokens))),
                               peft_logits(adapter, tokens), atol=ATOL, rtol=0)


def test_peft_scale_rules(tmp_path):
    """rsLoRA, rank and alpha patterns and layers left alone, read as PEFT reads them."""
    spec = FAMILIES["llama3_gqa_rope_scaling"]
    build(spec, tmp_path / "base")
    adapter = save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "ad", seed=4, r=4, lora_alpha=6,
                                use_rslora=True, rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 8},
                                alpha_pattern={"v_proj": 20}, layers_to_transform=[1],
                                target_modules=["q_proj", "v_proj", "down_proj"])
    tokens = np.random.default_rng(1).integers(0, 160, size=(2, 17))
    merged = llm_jax.load(tmp_path / "base", dtype="float32", lora=tmp_path / "ad")
    np.testing.assert_allclose(np.asarray(jit_forward(merged.params, merged.config, jnp.asarray(tokens))),
                               peft_logits(adapter, tokens), atol=ATOL, rtol=0)
    loaded = load_lora(tmp_path / "ad", merged.config)
    assert loaded.rank == 8 and not np.any(loaded.weights["q_proj"][0][0])  # layer 0 left alone


def test_adapters_follow_the_model_onto_repeated_kv_heads(tmp_path):
    """A mesh may repeat K/V heads (``llm_jax.sharding``); the adapter's k/v updates are repeated with them."""
    spec = FAMILIES["llama32_mqa_tied"]  # one K/V head
    build(spec, tmp_path / "base")
    save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "ad", seed=5)
    model = llm_jax.load(tmp_path / "base", dtype="float32", backend="xla")
    adapter = load_lora(tmp_path / "ad", model.config)
    repeated = model.config.replace(n_kv_heads=4)
    params = jax.tree.map(lambda x: x, model.params)
    for name in ("k_proj", "v_proj"):
        params["layers"]["attn"][name] = jnp.repeat(params["layers"]["attn"][name], 4, axis=-2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 160, size=(1, 15)))
    expected = jit_forward(merge_lora(model.params, model.config, adapter), model.config, tokens)
    np.testing.assert_allclose(np.asarray(jit_forward(merge_lora(params, repeated, adapter), repeated, tokens)),
                               np.asarray(expected), atol=1e-5, rtol=0)


def test_adapters_run_unmerged_on_quantized_weights_and_refuse_to_merge_into_them(tmp_path):
    spec = FAMILIES["qwen2_bias_tied"]
    build(spec, tmp_path / "base")
    save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "ad", seed=6)
    quantized = llm_jax.load(tmp_path / "base", dtype="float32", quantize="int8", backend="xla")
    with pytest.raises(ValueError, match="cannot merge LoRA adapter 'ad' into quantized q_proj: merge it before"):
        quantized.with_lora(tmp_path / "ad")
    # Merged before quantizing vs unmerged over the quantized weights: the same adapter, close.
    merged_first = llm_jax.load(tmp_path / "base", dtype="float32", quantize="int8", lora=tmp_path / "ad",
                                backend="xla")
    weights = LoraWeights.stack([load_lora(tmp_path / "ad", quantized.config)], quantized.config)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 160, size=(1, 19)))
    unmerged = jit_forward(quantized.params, quantized.config, tokens,
                           lora=LoraBatch.of_slots(weights, jnp.zeros((1, 19), jnp.int32)))
    reference = jit_forward(merged_first.params, merged_first.config, tokens)
    base = jit_forward(quantized.params, quantized.config, tokens)
    error, effect = np.abs(np.asarray(unmerged - reference)).max(), np.abs(np.asarray(reference - base)).max()
    assert error < 0.1 * effect, (error, effect)


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("changes, message", [
    (dict(use_dora=True), "use_dora is true: DoRA's magnitude vectors are not supported"),
    (dict(peft_type="IA3"), "peft_type is 'IA3'; only LORA is supported"),
    (dict(bias="all"), "bias trains biases"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save lists \['lm_head'\]"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out is true"),
])
def test_what_an_adapter_holds_that_we_cannot_run_is_refused_by_name(tmp_path, changes, message):
    spec = FAMILIES["llama2_mha"]
    build(spec, tmp_path / "base")
    save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "ad", seed=7)
    _edit_config(tmp_path / "ad", **changes)
    with pytest.raises(ValueError, match=message):
        llm_jax.load(tmp_path / "base", lora=tmp_path / "ad")


def test_adapters_of_other_modules_or_models_are_refused_by_name(tmp_path):
    spec = FAMILIES["llama2_mha"]
    build(spec, tmp_path / "base")
    model = llm_jax.load(tmp_path / "base", backend="xla")
    save_peft_adapter(build(spec, tmp_path / "unused"), tmp_path / "head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"tensor base_model\.model\.lm_head\.\S+ is not a LoRA update of a layer"):
        model.with_lora(tmp_path / "head")
    other = FAMILIES["gemma_mqa"]  # another width of heads
    save_peft_adapter(build(other, tmp_path / "other_base"), tmp_path / "other")
    with pytest.raises(ValueError, match=r"o_proj has lora_A \(4, 64\) and lora_B \(32, 4\), expected \[r, 32\]"):
        model.with_lora(tmp_path / "other")
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        model.with_lora(tmp_path / "base")


def test_generate_cli_merges_an_adapter(stories, stories260k_dir, tmp_path, capsys):
    from llm_jax.cli import generate

    base = transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()
    save_peft_adapter(base, tmp_path / "ad", seed=8, scale=0.3)
    prompt = "Once upon a time"
    assert generate.main(["--model", str(stories260k_dir / "stories260K.bin"), "--lora", str(tmp_path / "ad"),
                          "--prompt", prompt, "--max-new-tokens", "20", "--ignore-eos", "--quiet"]) == 0
    expected = llm_jax.generate(stories.with_lora(tmp_path / "ad"), [prompt], max_new_tokens=20, ignore_eos=True)[0]
    assert capsys.readouterr().out == prompt + expected.text + "\n"
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--model", "m.bin", "--lora", str(tmp_path), "--prompt", "x"])
    assert exit_info.value.code == 2 and "not a PEFT adapter folder" in capsys.readouterr().err


def test_generate_runs_an_adapter_per_prompt_as_its_merged_model(stories, story_adapters):
    """One batch, unmerged: each prompt's tokens (greedy, seeded samples, beams, speculative, prompt
    log-probabilities) are those of its adapter merged into the weights."""
    tales, poems = story_adapters["tales"], story_adapters["poems"]
    merged = {tales: stories.with_lora(tales), None: stories, poems: stories.with_lora(poems)}
    prompts = ["Once upon a time", "The little dog", "Lily and Ben"]
    adapters = [tales, None, poems]
    greedy = llm_jax.generate(stories, prompts, max_new_tokens=24, ignore_eos=True, lora=adapters, prompt_logprobs=1)
    sampling = llm_jax.Sampling(temperature=0.9, top_p=0.9, seed=4)
    sampled = llm_jax.generate(stories, prompts, max_new_tokens=16, ignore_eos=True, lora=adapters, n=2,
                               sampling=sampling)
    ngram = llm_jax.Speculative(method="ngram", num_tokens=3)
    speculative = llm_jax.generate(stories, prompts, max_new_tokens=24, ignore_eos=True, lora=adapters,
                                   speculative=ngram)
    beams = llm_jax.generate(stories, prompts, max_new_tokens=12, lora=adapters, num_beams=3, num_return_sequences=2)
    for p, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        alone = llm_jax.generate(merged[adapter], [prompt], max_new_tokens=24, ignore_eos=True, prompt_logprobs=1)[0]
        assert greedy[p].output_ids == alone.output_ids == speculative[p].output_ids, prompt
        np.testing.assert_allclose(np.array(greedy[p].prompt_logprobs[1:], float),
                                   np.array(alone.prompt_logprobs[1:], float), atol=1e-4, rtol=0)
        alone_samples = llm_jax.generate(merged[adapter], [prompt], max_new_tokens=16, ignore_eos=True, n=2,
                                         sampling=sampling)
        assert [r.output_ids for r in sampled[2 * p:2 * p + 2]] == [r.output_ids for r in alone_samples]
        alone_beams = llm_jax.generate(merged[adapter], [prompt], max_new_tokens=12, num_beams=3,
                                       num_return_sequences=2)
        assert [r.output_ids for r in beams[2 * p:2 * p + 2]] == [r.output_ids for r in alone_beams]
    assert greedy[0].output_ids != llm_jax.generate(stories, prompts[:1], max_new_tokens=24,
                                                    ignore_eos=True)[0].output_ids


def test_embeddings_per_text_are_each_adapters_merged_models(stories, story_adapters):
    tales, poems = story_adapters["tales"], story_adapters["poems"]
    texts = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]
    ours = llm_jax.embed_texts(stories, texts, lora=[tales, None, poems], batch_size=2)
    for i, (text, adapter) in enumerate(zip(texts, [tales, None, poems])):
        model = stories if adapter is None else stories.with_lora(adapter)
        np.testing.assert_allclose(ours[i], llm_jax.embed_texts(model, [text])[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="lora has 2 entries for 3 texts"):
        llm_jax.embed_texts(stories, texts, lora=[tales, None])
