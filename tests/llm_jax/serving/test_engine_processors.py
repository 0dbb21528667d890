"""The caller's logits processors in the serving engine (``Engine(logits_processors=[...])``): every request
gets ``generate``'s tokens with the same processors (which ``test_custom_logits_processors`` holds to
``transformers``) and its own values of their arguments, greedy and seeded sampling mixed in the same
steps, and nothing compiles after warm-up."""

import pytest
from test_guided import run

import llm_jax
from llm_jax.serving.engine import Engine
from llm_jax.serving.step import step
from tests.llm_jax.test_custom_logits_processors import WATERMARK, green_list, no_token_twice

PROMPTS = ["Once upon a time", "The little dog ran to the park", "Lily and Ben", "One day, a cat"]
SAMPLINGS = [llm_jax.GREEDY, llm_jax.Sampling(temperature=0.9, seed=3), llm_jax.GREEDY,
             llm_jax.Sampling(temperature=1.2, top_k=20, seed=5)]
ARGS = [{"delta": 4.0}, None, {"delta": 0.0}, {"delta": 8.0}]  # the watermark's strength (default 0: off)


def test_requests_get_generates_tokens_with_the_same_processors(stories):
    processors = [WATERMARK, no_token_twice]
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=128,
                    logits_processors=processors)
    engine.warm_up()
    programs = step._cache_size()
    requests = {f"r{i}": (p, dict(sampling=s, max_new_tokens=20, ignore_eos=True, processor_args=a))
                for i, (p, s, a) in enumerate(zip(PROMPTS, SAMPLINGS, ARGS))}
    outputs = run(engine, requests)  # two at a time: later requests join running ones
    for i, (prompt, sampling, args) in enumerate(zip(PROMPTS, SAMPLINGS, ARGS)):
        expected = llm_jax.generate(stories, [prompt], max_new_tokens=20, sampling=sampling, ignore_eos=True,
                                    logits_processors=processors, processor_args=args)[0]
        assert outputs[f"r{i}"][0] == expected.output_ids, i
        assert len(set(expected.output_ids)) == len(expected.output_ids)  # the processors did run
    # The argument matters: the first request without its watermark decodes otherwise.
    unmarked = llm_jax.generate(stories, [PROMPTS[0]], max_new_tokens=20, ignore_eos=True,
                                logits_processors=processors)[0]
    assert outputs["r0"][0] != unmarked.output_ids
    assert step._cache_size() == programs


def test_processors_are_checked(stories):
    with pytest.raises(ValueError, match="do not combine with speculative decoding"):
        Engine(stories, logits_processors=[green_list], speculative=llm_jax.Speculative(method="ngram"))
    with pytest.raises(TypeError, match="not callable"):
        Engine(stories, logits_processors=["green"])
    engine = Engine(stories, max_num_seqs=2, max_model_len=64, logits_processors=[WATERMARK])
    with pytest.raises(ValueError, match=r"names 'strength', which no logits processor reads"):
        engine.add_request("a", "Hi", processor_args={"strength": 2.0})
    with pytest.raises(ValueError, match=r"processor_args\['delta'\] must be a finite number"):
        engine.add_request("b", "Hi", processor_args={"delta": "2"})
    assert not engine.has_unfinished
