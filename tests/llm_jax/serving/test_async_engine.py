"""The engine's loop in a background thread, as a server uses it: concurrent streams get their own tokens,
a closed stream aborts its request, refusals raise in the caller, a failing step ends only its requests,
and shutdown lets the running requests finish."""

import asyncio

import pytest

import llm_jax
from llm_jax.serving.async_engine import AsyncEngine
from llm_jax.serving.engine import Engine

PROMPTS = ["Once upon a time", "The dog ran", "Lily and Tom went to the park and", "One day"]


@pytest.fixture(scope="module")
def model(stories260k_dir):
    return llm_jax.load(stories260k_dir / "stories260K.bin")


def _engine(model, **kwargs):
    return Engine(model, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=256, **kwargs)


async def _collect(engine: AsyncEngine, rid: str, prompt: str, **kwargs) -> list:
    return [out async for out in engine.generate(rid, prompt, **kwargs)]


def test_concurrent_streams_get_their_own_tokens(model):
    expected = [r.output_ids for r in (llm_jax.generate(model, [p], max_new_tokens=30, ignore_eos=True)[0]
                                       for p in PROMPTS)]

    async def main():
        engine = AsyncEngine(_engine(model))
        results = await asyncio.gather(*(_collect(engine, f"r{i}", p, max_new_tokens=30, ignore_eos=True)
                                         for i, p in enumerate(PROMPTS)))
        await engine.shutdown()
        return results

    for outs, tokens in zip(asyncio.run(main()), expected):
        assert [t for o in outs for t in o.token_ids] == tokens
        assert outs[-1].finish_reason == "length"


def test_a_closed_stream_aborts_its_request_and_refusals_raise(model):
    async def main():
        inner = _engine(model)
        engine = AsyncEngine(inner)
        with pytest.raises(ValueError, match="logprobs must be in"):
            await _collect(engine, "bad", "Hi", logprobs=99)
        stream = engine.generate("gone", "Once upon a time", max_new_tokens=200, ignore_eos=True)
        first = await stream.__anext__()
        await stream.aclose()  # the client went away
        other = await _collect(engine, "kept", "The dog ran", max_new_tokens=10, ignore_eos=True)
        await engine.shutdown()
        return first, other, inner

    first, other, inner = asyncio.run(main())
    assert first.token_ids and len(other) == 10
    assert not inner.has_unfinished and inner.stats().blocks_in_use == 0


def test_a_failing_step_ends_its_requests_only(model, monkeypatch):
    inner = _engine(model)
    run = inner._run
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return run(inputs)

    monkeypatch.setattr(inner, "_run", flaky)

    async def main():
        engine = AsyncEngine(inner)
        first = asyncio.ensure_future(_collect(engine, "a", "Once upon a time", max_new_tokens=20, ignore_eos=True))
        await asyncio.sleep(0)
        results = await asyncio.gather(first, return_exceptions=True)
        later = await _collect(engine, "b", "The dog ran", max_new_tokens=5, ignore_eos=True)
        await engine.shutdown()
        return results[0], later

    failed, later = asyncio.run(main())
    assert isinstance(failed, RuntimeError) and "injected" in str(failed)
    assert len(later) == 5 and later[-1].finish_reason == "length"
    assert inner.stats().blocks_in_use == 0
