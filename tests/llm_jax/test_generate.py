"""generate / generate_stream end to end: stories260K against transformers, batching, streaming, errors."""

import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ModelConfig
from llm_jax.model import init_params

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
