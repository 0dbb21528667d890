"""Sequence classifiers (``*ForSequenceClassification``: reward models, classifiers) against ``transformers``.

Each family's tiny random classifier, written by ``transformers``, loads with its ``score`` head in place of
the LM head; each text's logits equal ``transformers``' (float32, ≤ 1e-4) on the default backend and XLA,
in batches of texts of different lengths. Probabilities follow the head's ``problem_type`` as vLLM's
``/classify`` does (softmax, sigmoid, none), compared with torch's functions of ``transformers``' logits.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ConfigError, NoLanguageModelHead, Problem
from llm_jax.weights.convert import convert
from llm_jax.weights.to_gguf import save_gguf
from multi_device import PYTHON, REPO, cpu_devices_env
from tests.llm_jax.model.test_families import COMMON, FAMILIES

ATOL = 1e-4  # float32 max |Δlogit| against transformers
TEXTS = [[5, 9, 17], [3], [21, *range(30, 52)], [7, 7, 7, 7, 8], [100, 2, 90, 4, 11, 13, 17]]


def build_classifier(family: str, folder, *, num_labels: int = 3, seed: int = 0, **fields):
    """``family``'s tiny random classifier, saved to ``folder``: norms perturbed, biases and the head made
    large enough that the classes differ."""
    spec = FAMILIES[family]
    config = spec.config_class(**{**COMMON, **spec.fields, "num_labels": num_labels, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.4 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif name == "score.weight":
                param.copy_(torch.randn_like(param))
    model.save_pretrained(folder)
    return model


def reference_logits(torch_model, texts) -> np.ndarray:
    with torch.no_grad():
        return np.stack([torch_model(torch.tensor([ids])).logits[0].numpy() for ids in texts])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    torch_model = build_classifier(family, tmp_path)
    reference = reference_logits(torch_model, TEXTS)
    model = llm_jax.load(tmp_path)
    assert model.config.classifier.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert "score" in model.params and "lm_head" not in model.params
    for backend in ("auto", "xla"):
        result = llm_jax.classify(model.with_backend(backend), TEXTS, batch_size=2)  # three batches, padded rows
        np.testing.assert_allclose(result.logits, reference, atol=ATOL)
        np.testing.assert_allclose(result.probs, torch.softmax(torch.tensor(reference), -1).numpy(), atol=1e-5)
        assert result.labels == tuple(f"LABEL_{i}" for i in reference.argmax(-1))
    assert len(set(result.labels)) > 1, "the head must tell the texts apart for the test to mean anything"


@pytest.mark.parametrize("problem,num_labels", [("regression", 1), ("multi_label_classification", 4),
                                                (None, 1), ("single_label_classification", 2)])
def test_probabilities_follow_the_problem_type(problem, num_labels, tmp_path):
    id2label = {i: f"class {i}" for i in range(num_labels)}
    torch_model = build_classifier("qwen3_qk_norm", tmp_path, num_labels=num_labels, problem_type=problem,
                                   id2label=id2label, label2id={v: k for k, v in id2label.items()})
    reference = torch.tensor(reference_logits(torch_model, TEXTS))
    model = llm_jax.load(tmp_path)
    assert model.config.classifier.problem is Problem(problem or "single_label_classification")
    result = llm_jax.classify(model, TEXTS)
    np.testing.assert_allclose(result.logits, reference.numpy(), atol=ATOL)
    expected = {"regression": reference, "multi_label_classification": torch.sigmoid(reference),
                None: torch.sigmoid(reference), "single_label_classification": torch.softmax(reference, -1)}[problem]
    np.testing.assert_allclose(result.probs, expected.numpy(), atol=1e-5)
    assert result.labels == tuple(f"class {i}" for i in reference.numpy().argmax(-1))


def story_classifier(stories260k_dir, folder, seed: int = 1, **config):
    """stories260K's decoder with a random classifier head (``config``: ``num_labels``, ``id2label``, …),
    written to ``folder`` by ``transformers`` with the model's tokenizer; the torch model."""
    torch.manual_seed(seed)
    torch_model = transformers.AutoModelForSequenceClassification.from_pretrained(
        stories260k_dir / "hf", dtype=torch.float32, **config).eval()
    with torch.no_grad():
        torch_model.score.weight.normal_()
    torch_model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf").save_pretrained(folder)
    return torch_model


@pytest.fixture(scope="module")
def story_reward(stories260k_dir, tmp_path_factory):
    """stories260K with a one-logit head (a reward model's shape)."""
    folder = tmp_path_factory.mktemp("story_reward")
    return folder, story_classifier(stories260k_dir, folder, num_labels=1)


def test_a_reward_model_on_texts_and_through_a_checkpoint(story_reward, stories260k_dir, tmp_path):
    folder, torch_model = story_reward
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")
    texts = ["Once upon a time, there was a cat.", "The dog ran", "Lily and Tom played in the park all day long."]
    reference = reference_logits(torch_model, [tokenizer(t)["input_ids"] for t in texts])
    model = llm_jax.load(folder)
    result = llm_jax.classify(model, texts)
    np.testing.assert_allclose(result.logits, reference, atol=ATOL)
    np.testing.assert_allclose(result.probs, torch.sigmoid(torch.tensor(reference)).numpy(), atol=1e-5)
    # An llm_jax checkpoint keeps the head and the labels; int8 projections keep the head in floats.
    convert(folder, tmp_path / "ckpt")
    restored = llm_jax.load(tmp_path / "ckpt")
    assert restored.config.classifier == model.config.classifier
    np.testing.assert_array_equal(llm_jax.classify(restored, texts).logits, result.logits)
    with pytest.raises(ConfigError, match="sequence classifier is not written as GGUF"):
        save_gguf(tmp_path / "model.gguf", model.config, model.params, "F32")
    quantized = llm_jax.load(folder, quantize="int8")
    assert quantized.params["score"].dtype == np.float32
    np.testing.assert_allclose(llm_jax.classify(quantized, texts).logits, reference, rtol=0.03)  # int8 rounding


def test_a_classifier_does_not_generate_and_a_language_model_does_not_classify(story_reward, stories):
    model = llm_jax.load(story_reward[0])
    with pytest.raises(NoLanguageModelHead, match="sequence classifier"):
        llm_jax.generate(model, ["Once"], max_new_tokens=2)
    with pytest.raises(ValueError, match="not a sequence classifier"):
        llm_jax.classify(stories, ["Once"])
    embeddings = llm_jax.embed_texts(model, ["Once", "upon"])  # its hidden states still pool
    np.testing.assert_allclose(embeddings, llm_jax.embed_texts(stories, ["Once", "upon"]), atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(id2label={"0": "a", "2": "b"}), "id2label must name the labels 0 to 1"),
    (dict(id2label={"x": "a"}), "id2label must map"),
    (dict(id2label={"0": "a"}, num_labels=3), "num_labels=3 but id2label names 1"),
    (dict(problem_type="ranking"), "problem_type='ranking'"),
])
def test_bad_classifier_configs_are_refused(story_reward, change, message, tmp_path):
    folder = story_reward[0]
    hf = {**json.loads((folder / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=message):
        llm_jax.weights.hf_config.read_hf_config(tmp_path)


SHARDED = """
import json, sys
import numpy as np
import llm_jax
path, texts, lm = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
out = {}
for spec in ("model=4", "data=2,model=2"):
    model = llm_jax.load(path, mesh=spec)
    reranker = llm_jax.load(lm, mesh=spec).as_classifier([400, 428])
    out[spec] = [llm_jax.classify(m, texts, batch_size=2).logits.tolist() for m in (model, reranker)]
print(json.dumps(out))
"""


def test_a_classifier_on_a_mesh_gives_one_devices_logits(story_reward, stories260k_dir):
    """The head replicated, the decoder split by the sharding table (K/V heads repeated on model=4); a
    language model made a classifier on the mesh too."""
    folder, torch_model = story_reward
    texts = [[1, 400, 300, 200], [1, 9], [1, *range(40, 60)]]
    done = subprocess.run([PYTHON, "-c", SHARDED, str(folder), json.dumps(texts), str(stories260k_dir / "hf")],
                          env=cpu_devices_env(4), capture_output=True, text=True, timeout=900, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = reference_logits(torch_model, texts)
    one_device = llm_jax.classify(llm_jax.load(stories260k_dir / "hf").as_classifier([400, 428]), texts).logits
    for spec, (logits, reranked) in json.loads(done.stdout.strip().splitlines()[-1]).items():
        np.testing.assert_allclose(np.asarray(logits), reference, atol=ATOL, err_msg=spec)
        np.testing.assert_allclose(np.asarray(reranked), one_device, atol=ATOL, err_msg=spec)


def test_the_server_refuses_generation_flags_for_a_classifier(story_reward, stories260k_dir, monkeypatch):
    from llm_jax.cli.common import CliError
    from llm_jax.server import cli

    monkeypatch.setattr("llm_jax.compilation.enable_persistent_cache", lambda: None)
    args = ["--model", str(story_reward[0])]
    engine, model = cli.start_engine(cli.build_parser().parse_args(args))
    assert engine is None and model.config.classifier.num_labels == 1
    with pytest.raises(CliError, match="--speculative, --enable-lora: the model is a sequence classifier"):
        cli.start_engine(cli.build_parser().parse_args([*args, "--speculative", "ngram", "--enable-lora"]))
    with pytest.raises(CliError, match="--max-model-len 600 exceeds the model's context"):
        cli.start_engine(cli.build_parser().parse_args([*args, "--max-model-len", "600"]))
    with pytest.raises(CliError, match="--classifier-from-token: 'dog' is 2 tokens"):
        cli.start_engine(cli.build_parser().parse_args(["--model", str(stories260k_dir / "hf"),
                                                        "--classifier-from-token", "dog"]))


# --- a language model as a classifier of its next-token logits (rerankers: vLLM's classifier_from_token) ---


def restricted(logits_V: torch.Tensor, ids: list[int]) -> np.ndarray:
    """What a classifier of the next-token logits of ``ids`` gives: two tokens, the second's share of the two;
    one, the sigmoid of its logit; more, the softmax over them."""
    chosen = logits_V[ids]
    if len(ids) == 2:
        return torch.softmax(chosen, -1)[1:].numpy()
    return (torch.sigmoid(chosen) if len(ids) == 1 else torch.softmax(chosen, -1)).numpy()


@pytest.mark.parametrize("tokens", [["He", "She"], [346], [261, 265, 269]])
def test_a_language_model_as_a_classifier_of_its_next_tokens(stories260k_dir, tokens):
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")
    model = llm_jax.load(stories260k_dir / "hf").as_classifier(tokens)
    ids = [t if isinstance(t, int) else tokenizer(t, add_special_tokens=False)["input_ids"] for t in tokens]
    ids = [t[0] if isinstance(t, list) and len(t) == 1 else t for t in ids]  # each text one token
    assert model.config.classifier.num_labels == (1 if len(ids) == 2 else len(ids)) and "lm_head" not in model.params
    texts = ["Once upon a time, there was a little girl.", "The dog ran to the park and", "One day,"]
    result = llm_jax.classify(model, texts)
    with torch.no_grad():
        expected = np.stack([restricted(torch_model(torch.tensor([tokenizer(t)["input_ids"]])).logits[0, -1], ids)
                             for t in texts])
    np.testing.assert_allclose(result.probs, expected, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_bias_tied", "gemma_mqa"])
def test_a_tied_or_quantized_head_as_a_classifier(family, tmp_path):
    build_lm(family, tmp_path)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = [7, 90]
    with torch.no_grad():
        expected = np.stack([restricted(torch_model(torch.tensor([t])).logits[0, -1], ids) for t in TEXTS])
    np.testing.assert_allclose(llm_jax.classify(llm_jax.load(tmp_path).as_classifier(ids), TEXTS).probs, expected,
                               atol=1e-5)
    quantized = llm_jax.load(tmp_path, quantize=llm_jax.Quantization(bits=8, embedding=True)).as_classifier(ids)
    np.testing.assert_allclose(llm_jax.classify(quantized, TEXTS).probs, expected, atol=0.02)


def build_lm(family: str, folder) -> None:
    """``family``'s tiny random language model, saved to ``folder``."""
    spec = FAMILIES[family]
    config = spec.config_class(**{**COMMON, **spec.fields})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def test_bad_classifier_tokens_are_refused(stories, tmp_path):
    with pytest.raises(ValueError, match="'dog' is 2 tokens"):
        stories.as_classifier(["dog"])
    with pytest.raises(ValueError, match="distinct tokens"):
        stories.as_classifier([5, 5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        stories.as_classifier([10**6])
    gemma2 = tmp_path / "gemma2"
    build_lm("gemma2_softcap_local_global", gemma2)
    with pytest.raises(ValueError, match="final_logit_softcap"):
        llm_jax.load(gemma2).as_classifier([1, 2])


# --- a reward model fine-tuned with LoRA (PEFT's SEQ_CLS task: the head trained whole, modules_to_save) ---------


def test_a_seq_cls_lora_adapter_merges_with_its_trained_head(story_reward, stories, tmp_path):
    import peft

    folder, _ = story_reward
    torch.manual_seed(3)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    tuned = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn_like(param) * (0.5 if "lora_B" in name else 1.0))
    tuned.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"]
    texts = ["Once upon a time, there was a cat.", "The dog ran"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    expected = reference_logits(tuned.eval(), [tokenizer(t)["input_ids"] for t in texts])
    plain = llm_jax.classify(llm_jax.load(folder), texts).logits
    assert np.abs(expected - plain).max() > 0.1  # the adapter and its head change the scores
    adapter = tmp_path / "adapter"
    for model in (llm_jax.load(folder, lora=adapter), llm_jax.load(folder).with_lora(adapter)):
        np.testing.assert_allclose(llm_jax.classify(model, texts).logits, expected, atol=ATOL)
    with pytest.raises(ValueError, match="replaces the classifier's head"):
        llm_jax.classify(llm_jax.load(folder), texts, lora=tmp_path / "adapter")
    with pytest.raises(ValueError, match="trains a classifier's head"):
        stories.with_lora(tmp_path / "adapter")
