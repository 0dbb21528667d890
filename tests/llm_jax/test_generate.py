"""generate / generate_stream end to end: stories260K against transformers, batching, streaming, errors;
generation controls (processors, logprobs, hidden states, n samples, stop strings) against transformers."""

import importlib

import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ModelConfig
from llm_jax.model import init_params
from tests.hf_models import save_tiny_llama

PROMPTS = ["Once upon a time", "The little dog wanted to", "Tom and Sue went to the park. They",
           "One day, a big bird"]


@pytest.fixture(scope="module")
def stories_bin(stories260k_dir):
    return llm_jax.load(stories260k_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def stories_hf(stories260k_dir):
    return llm_jax.load(stories260k_dir / "hf")


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    return transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf").eval()


def hf_greedy(reference, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("source", ["stories_bin", "stories_hf"])
def test_stories260k_greedy_200_tokens_equal_transformers(source, reference, request):
    model = request.getfixturevalue(source)
    results = llm_jax.generate(model, PROMPTS, max_new_tokens=200, ignore_eos=True)
    for result in results:
        assert result.finish_reason == "length"
        assert result.output_ids == hf_greedy(reference, result.prompt_ids, 200), result.prompt


def test_batch_gives_each_prompt_what_it_gets_alone(stories_bin):
    batch = llm_jax.generate(stories_bin, PROMPTS, max_new_tokens=40)
    for prompt, together in zip(PROMPTS, batch):
        alone = llm_jax.generate(stories_bin, [prompt], max_new_tokens=40)[0]
        assert together.output_ids == alone.output_ids
        assert together.text == alone.text


def test_stream_pieces_concatenate_to_the_result(stories_bin):
    stream = llm_jax.generate_stream(stories_bin, PROMPTS[:2], max_new_tokens=50, chunk_steps=7,
                                     sampling=llm_jax.Sampling(temperature=0.9, top_p=0.95, seed=11))
    events = list(stream)
    for i, result in enumerate(stream.results):
        mine = [e for e in events if e.index == i]
        assert "".join(e.text for e in mine) == result.text
        assert [t for e in mine for t in e.token_ids] == result.output_ids
        assert mine[-1].finish_reason == result.finish_reason and all(e.finish_reason is None for e in mine[:-1])
        # The text is what the generated tokens add after the prompt.
        tok = stories_bin.tokenizer
        assert tok.decode(result.prompt_ids + result.output_ids) == tok.decode(result.prompt_ids) + result.text
    m = stream.metrics
    assert m.ttft_s > 0 and m.decode_s > 0 and m.decode_tokens_per_s > 0
    assert m.itl_p50_s <= m.itl_p90_s and m.generated_tokens == sum(len(r.output_ids) for r in stream.results)


def test_llama2c_story_ends_at_bos(stories_bin):
    """llama2.c models end a story with BOS; generation stops there (finish_reason 'stop')."""
    result = llm_jax.generate(stories_bin, ["Once upon a time"], max_new_tokens=400)[0]
    assert result.finish_reason == "stop"
    assert result.output_ids[-1] == stories_bin.tokenizer.bos_id
    assert stories_bin.tokenizer.bos_id not in result.output_ids[:-1]


def test_token_id_prompts_are_used_exactly(stories_bin):
    ids = [403, 407]  # no BOS
    result = llm_jax.generate(stories_bin, [ids], max_new_tokens=5)[0]
    assert result.prompt_ids == ids and result.prompt is None
    with_bos = llm_jax.generate(stories_bin, [[1] + ids], max_new_tokens=5)[0]
    assert with_bos.prompt_ids == [1] + ids


def test_stop_strings_cut_the_text(stories_bin):
    free = llm_jax.generate(stories_bin, ["Once upon a time"], max_new_tokens=60)[0]
    stop = free.text[20:26]  # a stop string that starts inside the text, likely mid-token
    cut = llm_jax.generate(stories_bin, ["Once upon a time"], max_new_tokens=60, stop=[stop])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert free.output_ids[: len(cut.output_ids)] == cut.output_ids


def test_sampled_generation_is_reproducible(stories_bin):
    sampling = llm_jax.Sampling(temperature=1.0, top_k=40, seed=5)
    a = llm_jax.generate(stories_bin, PROMPTS[:2], max_new_tokens=30, sampling=sampling)
    b = llm_jax.generate(stories_bin, PROMPTS[:2], max_new_tokens=30, sampling=sampling)
    c = llm_jax.generate(stories_bin, PROMPTS[:2], max_new_tokens=30,
                         sampling=llm_jax.Sampling(temperature=1.0, top_k=40, seed=6))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in c]


def test_input_errors(stories_bin):
    with pytest.raises(llm_jax.PromptTooLongError, match="context of 512 tokens"):
        llm_jax.generate(stories_bin, [[5] * 600], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_jax.generate(stories_bin, [[5, 9000]], max_new_tokens=4)
    with pytest.raises(TypeError, match="list of strings"):
        llm_jax.generate(stories_bin, "Once upon a time", max_new_tokens=4)
    config = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
                         max_seq_len=32)
    bare = llm_jax.Model(config=config, params=init_params(config), tokenizer=None, eos_ids=())
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm_jax.generate(bare, ["text"], max_new_tokens=4)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm_jax.generate(bare, [[1, 2]], max_new_tokens=4, stop=["x"])
    result = llm_jax.generate(bare, [[1, 2]], max_new_tokens=4)[0]
    assert result.text is None and len(result.output_ids) == 4


# Generation controls on a tiny random Llama, against transformers.

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_controls")
    reference = save_tiny_llama(folder, seed=5)
    return llm_jax.load(folder), reference


def test_greedy_with_processors_equals_transformers(tiny):
    """Two rows with different processors in one batch, each against transformers.generate alone."""
    model, reference = tiny
    prompts = [[1, 5, 17, 33, 8, 5, 17], [1, 40, 2, 9]]
    rows = [(llm_jax.Sampling(repetition_penalty=1.3, no_repeat_ngram_size=2, logit_bias={21: 1.5}), 4),
            (llm_jax.Sampling(repetition_penalty=0.8, bad_words_ids=((33,), (87, 33))), 6)]
    results = llm_jax.generate(model, prompts, sampling=[r for r, _ in rows], min_new_tokens=[m for _, m in rows],
                               max_new_tokens=12, chunk_steps=12)
    for prompt, (row, minimum), result in zip(prompts, rows, results):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=minimum, eos_token_id=2,
                pad_token_id=2, repetition_penalty=row.repetition_penalty,
                no_repeat_ngram_size=row.no_repeat_ngram_size or None,
                bad_words_ids=[list(w) for w in row.bad_words_ids] or None,
                sequence_bias=[[[t], b] for t, b in row.logit_bias.items()] or None)
        expected = out[0, len(prompt):].tolist()
        with torch.no_grad():
            plain = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=2,
                                       pad_token_id=2)[0, len(prompt):].tolist()
        assert plain != expected, "the processors changed nothing; the test would prove little"
        assert result.output_ids == expected[: len(result.output_ids)]
        assert expected[len(result.output_ids):] == [2] * (len(expected) - len(result.output_ids))


def steered(reference, steering_LD):
    """transformers' model with ``steering_LD[l]`` added to decoder layer l's output (a forward hook)."""
    def adder(vector):
        def hook(module, inputs, output):
            return (output[0] + vector, *output[1:]) if isinstance(output, tuple) else output + vector
        return hook

    return [layer.register_forward_hook(adder(torch.tensor(steering_LD[l])))
            for l, layer in enumerate(reference.model.layers)]


def test_research_outputs_equal_transformers(tiny):
    """Token and prompt logprobs, hidden states of chosen layers, steering vectors, the final KV cache."""
    model, reference = tiny
    prompts = [[1, 5, 17, 33, 8], [1, 40, 2, 9, 64, 3]]
    steering = np.random.default_rng(6).normal(0, 0.3, (2, model.config.n_layers, model.config.d_model))
    steering[1] = 0.0  # the second prompt is not steered
    stream = llm_jax.generate_stream(model, prompts, max_new_tokens=7, ignore_eos=True, logprobs=3,
                                     prompt_logprobs=2, hidden_layers=(0, 1), steering=steering.astype(np.float32),
                                     return_kv_cache=True, chunk_steps=4)
    list(stream)
    for row, (prompt, result) in enumerate(zip(prompts, stream.results)):
        sequence = prompt + result.output_ids
        handles = steered(reference, steering[row].astype(np.float32))
        try:
            with torch.no_grad():
                out = reference(torch.tensor([sequence[:-1]]), output_hidden_states=True)
        finally:
            for handle in handles:
                handle.remove()
        logp = torch.log_softmax(out.logits[0], -1).numpy()
        positions = np.arange(len(prompt) - 1, len(sequence) - 1)
        np.testing.assert_allclose(result.logprobs, logp[positions, result.output_ids], atol=1e-4, rtol=0)
        for step, top in zip(positions, result.top_logprobs):
            assert list(top) == np.argsort(-logp[step])[:3].tolist()
            np.testing.assert_allclose(list(top.values()), np.sort(logp[step])[::-1][:3], atol=1e-4, rtol=0)
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
        np.testing.assert_allclose(result.prompt_logprobs[1:], logp[np.arange(len(prompt) - 1), prompt[1:]],
                                   atol=1e-4, rtol=0)
        assert [len(t) for t in result.prompt_top_logprobs[1:]] == [2] * (len(prompt) - 1)
        # Every position the model processed: the prompt, then each output token but the last.
        assert result.hidden_states.shape == (len(sequence) - 1, 2, model.config.d_model)
        for i, layer in enumerate((0, 1)):
            np.testing.assert_allclose(result.hidden_states[:, i], out.hidden_states[layer + 1][0].numpy(),
                                       atol=1e-4, rtol=0)
        assert int(stream.kv_cache.lengths_B[row]) == len(sequence) - 1


def test_n_samples_share_one_prefill(tiny, monkeypatch):
    model, _ = tiny
    prompts = [[1, 5, 17], [1, 40, 2, 9]]
    sampling = llm_jax.Sampling(temperature=1.0, seed=3)
    calls = []
    generate_module = importlib.import_module("llm_jax.generation")
    real_prefill = generate_module._prefill
    monkeypatch.setattr(generate_module, "_prefill", lambda params, config, tokens, *rest, **kw: calls.append(
        tokens.shape) or real_prefill(params, config, tokens, *rest, **kw))
    results = llm_jax.generate(model, prompts, n=3, sampling=sampling, max_new_tokens=10, ignore_eos=True)
    assert calls == [(2, 16)]  # one prefill of the two prompts, not six
    assert [(r.prompt_ids, r.sample) for r in results] == [(p, i) for p in prompts for i in range(3)]
    for p in range(2):
        assert len({tuple(r.output_ids) for r in results[3 * p:3 * p + 3]}) == 3  # each sample its own draws


def test_stop_string_across_tokens_ends_generation_without_extra_syncs(stories_bin, reference):
    tok = stories_bin.tokenizer
    prompt = "Once upon a time"
    prompt_ids = tok.encode(prompt)
    free_ids = hf_greedy(reference, prompt_ids, 48)  # ours is equal (test_stories260k_greedy_...)
    free_text = tok.decode(prompt_ids + free_ids)[len(tok.decode(prompt_ids)):]
    ends = [len(tok.decode(prompt_ids + free_ids[:i + 1])) - len(tok.decode(prompt_ids)) for i in range(48)]
    # Two characters on each side of a token boundary, at a place the stop string first occurs.
    i = next(i for i in range(10, 40) if ends[i] - ends[i - 1] >= 2 and ends[i + 1] - ends[i] >= 2
             and free_text.find(free_text[ends[i] - 2:ends[i] + 2]) == ends[i] - 2)
    stop = free_text[ends[i] - 2:ends[i] + 2]
    stream = llm_jax.generate_stream(stories_bin, [prompt], max_new_tokens=48, ignore_eos=True, chunk_steps=48,
                                     stop=[stop])
    list(stream)
    result = stream.results[0]
    assert result.finish_reason == "stop" and result.text == free_text[: ends[i] - 2]
    assert result.output_ids == free_ids[: i + 2]
    # The first token, then one chunk in which the device stopped the row: no per-step round trips.
    assert stream.metrics.host_syncs == 2
