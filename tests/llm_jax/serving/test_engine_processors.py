"""The caller's logits processors in the serving engine (``Engine(logits_processors=[...])``): every request
gets ``generate``'s tokens with the same processors (which ``test_custom_logits_processors`` holds to
``transformers``), greedy and seeded sampling mixed in the same steps, and nothing compiles after warm-up."""

import pytest
from test_guided import run

import llm_jax
from llm_jax.serving.engine import Engine
from llm_jax.serving.step import step
from tests.llm_jax.test_custom_logits_processors import green_list, no_token_twice

PROMPTS = ["Once upon a time", "The little dog ran to the park", "Lily and Ben", "One day, a cat"]
SAMPLINGS = [llm_jax.GREEDY, llm_jax.Sampling(temperature=0.9, seed=3), llm_jax.GREEDY,
             llm_jax.Sampling(temperature=1.2, top_k=20, seed=5)]


def test_requests_get_generates_tokens_with_the_same_processors(stories):
    processors = [green_list, no_token_twice]
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=128,
                    logits_processors=processors)
    engine.warm_up()
    programs = step._cache_size()
    requests = {f"r{i}": (p, dict(sampling=s, max_new_tokens=20, ignore_eos=True))
                for i, (p, s) in enumerate(zip(PROMPTS, SAMPLINGS))}
    outputs = run(engine, requests)  # two at a time: later requests join running ones
    for i, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        expected = llm_jax.generate(stories, [prompt], max_new_tokens=20, sampling=sampling, ignore_eos=True,
                                    logits_processors=processors)[0]
        assert outputs[f"r{i}"][0] == expected.output_ids, i
        assert len(set(expected.output_ids)) == len(expected.output_ids)  # the processors did run
    assert step._cache_size() == programs


def test_processors_are_checked(stories):
    with pytest.raises(ValueError, match="do not combine with speculative decoding"):
        Engine(stories, logits_processors=[green_list], speculative=llm_jax.Speculative(method="ngram"))
    with pytest.raises(TypeError, match="not callable"):
        Engine(stories, logits_processors=["green"])
