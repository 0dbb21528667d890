"""A request's choices on the engine: one engine request per choice, their outputs merged as they come.

A completion of ``p`` prompts with ``n`` samples each has ``p * n`` choices, choice ``i * n + j`` being
sample ``j`` of prompt ``i`` (as vLLM numbers them). Each is an engine request of its own — the same
seed for all, ``sample_index=j`` — run concurrently with every other request of the server; their
outputs reach :meth:`Run.deltas` in the order the engine produces them. Leaving that iterator early (a
client gone, an error) aborts the choices still running, which frees their KV-cache blocks at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

from llm_jax.loading import Model
from llm_jax.server.fields import ApiError
from llm_jax.server.metrics import ServerMetrics
from llm_jax.server.protocol import Generation
from llm_jax.serving.async_engine import AsyncEngine
from llm_jax.serving.live import RequestOutput
from llm_jax.tokenizer import Tokenizer

# The engine's finish reasons as OpenAI's API names them.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
CONTEXT_TOKENS = 4  # tokens decoded before a token, for its text (its leading space)
MIN_LOGPROB = -9999.0  # what a filtered-out token's -inf reads as (JSON has no infinities; vLLM's value)
_END = object()


class Top(NamedTuple):
    """One of the most likely tokens at a step."""

    token_id: int
    token: str  # its text where it stands
    logprob: float


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token's text and log-probability, and the most likely tokens at its step."""

    token_id: int
    token: str
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    top: tuple[Top, ...]  # most likely first
    rank: int | None = None  # a prompt token's: 1 + how many tokens are more likely; None where not known


@dataclasses.dataclass(eq=False, kw_only=True)
class Choice:
    """One choice of a response and what it has produced so far."""

    index: int
    prompt_index: int
    sample: int  # which of its prompt's n samples
    prompt_ids: tuple[int, ...]
    max_tokens: int
    engine_id: str
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when the engine scores it
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it (None for EOS)
    num_output_tokens: int = 0
    last_token_at: float | None = None


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one engine step added to one choice."""

    choice: Choice
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with a choice's first delta, when asked for


def token_text(tokenizer: Tokenizer | None, context: Sequence[int], token: int) -> str:
    """A token's text where it stands (after ``context``): "▁the" reads " the" mid-sentence."""
    if tokenizer is None:
        return f"token_id:{token}"
    if token in tokenizer.special_ids:
        return tokenizer.id_to_piece(token)
    context = list(context[-CONTEXT_TOKENS:])
    return tokenizer.decode([*context, token])[len(tokenizer.decode(context)):]


class Run:
    """The engine requests of one HTTP request. ``prompts``: each prompt's token ids and completion budget."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer | None, generation: Generation,
                 prompts: Sequence[tuple[tuple[int, ...], int]], *, stop_ids: Sequence[int], metrics: ServerMetrics,
                 arrival: float):
        self.engine, self.tokenizer, self.generation, self.metrics = engine, tokenizer, generation, metrics
        self.arrival, self.first_token_at = arrival, None
        seed = generation.seed if generation.seed is not None else secrets.randbits(32)
        self.sampling = dataclasses.replace(generation.sampling, seed=seed % 2**32)
        self.stop_ids = frozenset(generation.stop_token_ids) | frozenset(stop_ids)
        tag, n = uuid.uuid4().hex, generation.n
        self.choices = [Choice(index=p * n + j, prompt_index=p, sample=j, prompt_ids=ids, max_tokens=budget,
                               engine_id=f"{tag}-{p * n + j}")
                        for p, (ids, budget) in enumerate(prompts) for j in range(n)]
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas, in the order the engine produces them, until all have finished."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(choice, queue)) for choice in self.choices]
        try:
            pending = len(tasks)
            while pending:
                choice, item = await queue.get()
                if item is _END:
                    pending -= 1
                    if choice.finish_reason is None:  # aborted by the engine (its shutdown)
                        yield self._abort(choice)
                elif isinstance(item, BaseException):
                    raise _api_error(item)
                else:
                    yield self._apply(choice, item)
        finally:  # a choice still running is aborted: its engine stream closes
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for choice in self.choices:
                if choice.finish_reason is None:
                    self.metrics.finished(FINISH_REASONS["abort"])

    async def _pump(self, choice: Choice, queue: asyncio.Queue) -> None:
        g = self.generation
        try:
            async for out in self.engine.generate(
                    choice.engine_id, list(choice.prompt_ids), sampling=self.sampling, max_new_tokens=choice.max_tokens,
                    min_new_tokens=g.min_tokens, stop=g.stop, stop_token_ids=g.stop_token_ids,
                    ignore_eos=g.ignore_eos, logprobs=g.logprobs, prompt_logprobs=g.scored_prompt,
                    sample_index=choice.sample, guided=g.guided, guided_after_token=g.guided_after_token,
                    skip_special_tokens=g.skip_special_tokens, include_stop_str_in_output=g.include_stop_str_in_output,
                    priority=g.priority, lora=g.lora, cache_salt=g.cache_salt, processor_args=g.processor_args):
                queue.put_nowait((choice, out))
        except asyncio.CancelledError:
            # Cancelled before ``generate`` was past adding the request, its stream cannot abort it: do it here.
            self.engine.abort(choice.engine_id)
            raise
        except Exception as error:  # refused, or its step failed: the request ends with it
            queue.put_nowait((choice, error))
        else:
            queue.put_nowait((choice, _END))

    def _apply(self, choice: Choice, out: RequestOutput) -> Delta:
        now = time.monotonic()
        if out.token_ids:
            if choice.last_token_at is None:
                self.metrics.ttft.observe(now - self.arrival)
                self.metrics.prompt_tokens.inc(len(choice.prompt_ids))
                self.first_token_at = min(now, self.first_token_at or now)
            else:
                gap = (now - choice.last_token_at) / len(out.token_ids)
                for _ in out.token_ids:
                    self.metrics.itl.observe(gap)
            self.metrics.generation_tokens.inc(len(out.token_ids))
            choice.last_token_at = now
        logprobs = self._logprobs(choice, out) if self.generation.logprobs is not None else ()
        prompt = self._prompt_logprobs(out) if out.prompt_logprobs is not None else ()
        choice.prompt_logprobs.extend(prompt)
        choice.text += out.text
        choice.token_ids.extend(out.token_ids)
        choice.logprobs.extend(logprobs)
        choice.num_output_tokens = out.num_output_tokens
        finish = None
        if out.finish_reason is not None:
            finish = choice.finish_reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
            choice.stop_reason = out.stop_reason
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.finished(finish)
        return Delta(choice=choice, text=out.text, logprobs=tuple(logprobs), finish_reason=finish,
                     prompt_logprobs=tuple(prompt))

    def _abort(self, choice: Choice) -> Delta:
        choice.finish_reason = FINISH_REASONS["abort"]
        self.metrics.finished(choice.finish_reason)
        return Delta(choice=choice, text="", logprobs=(), finish_reason=choice.finish_reason)

    def _logprobs(self, choice: Choice, out: RequestOutput) -> list[TokenLogprob]:
        entries, context = [], [*choice.prompt_ids[-CONTEXT_TOKENS:], *choice.token_ids[-CONTEXT_TOKENS:]]
        for i, token in enumerate(out.token_ids):
            entries.append(TokenLogprob(token_id=token, token=token_text(self.tokenizer, context, token),
                                        logprob=_finite(out.logprobs[i]),
                                        top=self._top(context, out.top_logprobs[i] if out.top_logprobs else {})))
            context.append(token)
        return entries

    def _prompt_logprobs(self, out: RequestOutput) -> list[TokenLogprob]:
        """The prompt's tokens with their log-probabilities (None for the first), ranks and top tokens."""
        entries, ids = [], self._prompt_ids(out.request_id)
        for i, token in enumerate(ids):
            logprob, top = out.prompt_logprobs[i], out.prompt_top_logprobs[i] or {}
            context = ids[max(i - CONTEXT_TOKENS, 0):i]
            entries.append(TokenLogprob(
                token_id=token, token=token_text(self.tokenizer, context, token),
                logprob=None if logprob is None else _finite(logprob), top=self._top(context, top),
                rank=None if out.prompt_ranks is None else out.prompt_ranks[i]))
        return entries

    def _top(self, context: Sequence[int], top: dict[int, float]) -> tuple[Top, ...]:
        ranked = sorted(top.items(), key=lambda item: -item[1])
        return tuple(Top(t, token_text(self.tokenizer, context, t), _finite(lp)) for t, lp in ranked)

    def _prompt_ids(self, engine_id: str) -> tuple[int, ...]:
        return next(c.prompt_ids for c in self.choices if c.engine_id == engine_id)


class BeamRun(Run):
    """The choices of a beam search (vLLM's ``use_beam_search``): each prompt's n best hypotheses, from
    ``llm_jax.generate(num_beams=n)`` (``transformers``' beam search, ``llm_jax.beams``), computed beside the
    engine's steps, one search at a time (``lock``), and delivered whole (a stream gets each in one chunk).
    A client that leaves does not stop a search under way."""

    def __init__(self, *args, model: Model, lock: asyncio.Lock, **kwargs):
        super().__init__(*args, **kwargs)
        self.model, self.lock = model, lock

    async def deltas(self) -> AsyncIterator[Delta]:
        async with self.lock:
            results = await asyncio.to_thread(self._search)
        now = time.monotonic()
        self.first_token_at = now
        self.metrics.ttft.observe(now - self.arrival)
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        for choice, result in zip(self.choices, results):
            choice.text, choice.token_ids = result.text, list(result.output_ids)
            choice.num_output_tokens = len(result.output_ids)
            choice.finish_reason = FINISH_REASONS[result.finish_reason]
            choice.stop_reason = result.output_ids[-1] if result.finish_reason == "stop" else None
            self.metrics.generation_tokens.inc(choice.num_output_tokens)
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.finished(choice.finish_reason)
            yield Delta(choice=choice, text=choice.text, logprobs=(), finish_reason=choice.finish_reason)

    def _search(self) -> list:
        """Every prompt's n best hypotheses, prompt-major, as the choices are."""
        from llm_jax.generation import generate

        g, n = self.generation, self.generation.n
        firsts = self.choices[::n]
        return generate(self.model, [list(c.prompt_ids) for c in firsts], max_new_tokens=[c.max_tokens for c in firsts],
                        sampling=dataclasses.replace(self.sampling, temperature=0.0), stop_token_ids=g.stop_token_ids,
                        ignore_eos=g.ignore_eos, min_new_tokens=g.min_tokens, num_beams=n, num_return_sequences=n,
                        length_penalty=g.beam_search.length_penalty, early_stopping=g.beam_search.early_stopping)


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN too


def _api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ValueError):  # the engine refused the request
        return ApiError(str(error).strip().splitlines()[0], code="invalid_value")
    if isinstance(error, RuntimeError) and "shutting down" in str(error):
        return ApiError("the server is shutting down", status=503, type="service_unavailable_error",
                        code="shutting_down")
    return ApiError(f"generation failed: {str(error).strip().splitlines()[0] if str(error).strip() else error!r}",
                    status=500, type="internal_error", code="generation_failed")
