"""A running request's host state beside the scheduler's: how it samples, what ends it, its text, its
constraint and the log-probabilities it asked for. What a step gave it becomes a :class:`RequestOutput`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llm_jax.guided import Matcher
from llm_jax.sampling import GREEDY, Sampling
from llm_jax.serving.scheduler import FinishReason, Request
from llm_jax.speculative import Backoff
from llm_jax.stop_strings import SequenceText


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens (none for a prompt chunk that does not end the prompt)
    text: str  # new text, safe to show (held back where it could be the start of a stop string)
    finish_reason: str | None = None  # "eos", "stop", "length" when the request ended with this step
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: tuple[float, ...] | None = None  # the new tokens' log-probabilities, when asked for
    top_logprobs: tuple[dict[int, float], ...] | None = None
    # With the first token, when asked for: each prompt token's log-probability under the model (None for
    # the first, which nothing predicts) and the most likely tokens at its position.
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[dict[int, float] | None, ...] | None = None
    prompt_ranks: tuple[int | None, ...] | None = None  # each prompt token's rank (1: the most likely)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # after this step


@dataclasses.dataclass(eq=False)
class LiveRequest:
    """Host state of one request beside the scheduler's (``request``)."""

    request: Request
    sampling: Sampling
    end_ids: tuple[int, ...]  # EOS then stop ids, banned before min_new_tokens
    eos_ids: frozenset[int]
    stop_ids: frozenset[int]
    min_new_tokens: int
    logprobs: int | None
    sample_index: int
    text: SequenceText
    prompt_logprobs: int | None = None
    # By position: each prompt token's log-probability, rank and top tokens.
    prompt_scores: dict[int, tuple[float, int, dict[int, float]]] = dataclasses.field(default_factory=dict)
    backoff: Backoff = Backoff()  # speculative decoding: steps it proposes nothing after failures
    matcher: Matcher | None = None  # guided decoding: where the request stands in its constraint
    guided_after: int | None = None  # the token the constraint starts after (a reasoning's end), until it comes
    lora: str | None = None  # its LoRA adapter's name
    lora_slot: int = -1  # and its slot (-1: the base model)
    processor_args: dict[str, float] | None = None  # the arguments it gives the engine's logits processors

    @property
    def scores_prompt(self) -> bool:
        """Whether its steps compute prompt log-probabilities: asked for, and its prompt not yet done."""
        return self.prompt_logprobs is not None and self.request.num_output_tokens == 0

    @property
    def kind(self) -> str:
        """The least a step must compute for it (:class:`llm_jax.serving.step.Shape`'s kinds)."""
        if self.scores_prompt:
            return "prompt"
        if self.logprobs is not None:
            return "logprobs"
        greedy = dataclasses.replace(self.sampling, seed=0) == GREEDY
        return "greedy" if greedy and self.min_new_tokens == 0 and self.matcher is None else "sample"

    # Guided decoding.
    def guided_prefix(self, proposals: Sequence[int]) -> int:
        """How many of ``proposals``, from the first, its constraint allows (all before it starts)."""
        free = self._free(proposals)
        if self.matcher is None or free >= len(proposals):
            return len(proposals)
        return free + self.matcher.valid_prefix(proposals[free:])

    def fill_masks(self, rows_JW: np.ndarray, proposals: Sequence[int]) -> None:
        """Into row j of ``rows_JW`` (all ones; one more row than ``proposals``) what may follow
        ``proposals[:j]``: left all ones while its constraint has not started, then as
        :meth:`Matcher.fill_ahead` fills them."""
        free = self._free(proposals)
        if free < len(rows_JW):
            self.matcher.fill_ahead(rows_JW[free:], proposals[free:])

    def _free(self, proposals: Sequence[int]) -> int:
        """How many of ``proposals`` come before its constraint starts: none once started; up to its start
        token (included), or all, while that token has not come."""
        if self.guided_after is None:
            return 0
        proposals = list(proposals)
        return proposals.index(self.guided_after) + 1 if self.guided_after in proposals else len(proposals) + 1

    # What a step gave it.
    def keep_prompt_scores(self, positions_S, logprobs_S, ranks_S, top_ids_SN, top_logprobs_SN) -> None:
        """The log-probabilities a step computed for its prompt tokens at ``positions_S`` (those of the
        tokens after them, which they score)."""
        n, num_prompt = self.prompt_logprobs, len(self.request.prompt_token_ids)
        for s, position in enumerate(np.asarray(positions_S) + 1):
            if position < num_prompt:
                top = {} if not n else {int(i): float(p) for i, p in zip(top_ids_SN[s, :n], top_logprobs_SN[s, :n])}
                self.prompt_scores[int(position)] = (float(logprobs_S[s]), int(ranks_S[s]), top)

    def output(self, tokens: list[int], logprobs_J, top_ids_JN, top_logprobs_JN, *, max_model_len: int
               ) -> tuple[RequestOutput, FinishReason | None]:
        """Its output for ``tokens``, new from a step (with their log-probabilities), cut after the first
        that ends it (an end id, a stop string, its length limit, its constraint complete), and the reason
        it ended, if it did. Its text and constraint move past the tokens kept."""
        prompt_scores = {}
        if self.scores_prompt:  # its prompt is done: its scores go out with its first token
            prompt_scores = self._prompt_scores()
            self.request.use_prefix_cache = True  # recomputed after a preemption, it may start from the cache
        tokens, reason, stop_reason, length = self._end(tokens, max_model_len)
        kept, text, hit_stop = self.text.push(tokens, last=reason is not None or length)
        if hit_stop:
            reason, stop_reason = FinishReason.STOP, self.text.matcher.stop
        logprobs = top = None
        if self.logprobs is not None:
            n, j = self.logprobs, range(len(kept))
            logprobs = tuple(float(logprobs_J[i]) for i in j)
            top = tuple({} if not n else {int(t): float(p) for t, p in zip(top_ids_JN[i, :n], top_logprobs_JN[i, :n])}
                        for i in j)
        request = self.request
        return RequestOutput(request_id=request.request_id, token_ids=tuple(kept), text=text,
                             stop_reason=stop_reason, logprobs=logprobs, top_logprobs=top,
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_output_tokens=request.num_output_tokens + len(kept), **prompt_scores), reason

    def _end(self, tokens: list[int], max_model_len: int) -> tuple[list[int], FinishReason | None, int | None, bool]:
        """Its new tokens up to the first that ends it — an end id, the length limit, or its constraint
        complete (its matcher consumes them one by one) — the reason, the stop id, and whether it reached
        the length limit."""
        request = self.request
        for i, token in enumerate(tokens):
            reason = stop_reason = None
            if token in self.eos_ids:
                reason = FinishReason.EOS
            elif token in self.stop_ids:
                reason, stop_reason = FinishReason.STOP, token
            length = (request.num_output_tokens + i + 1 >= request.max_new_tokens
                      or request.num_tokens + i + 1 >= max_model_len)
            if self.matcher is not None and reason is None and not length:
                if self.guided_after is not None:  # free until its token, constrained after it
                    if token == self.guided_after:
                        self.guided_after = None
                # Its constraint complete (or, which the masks rule out, broken): nothing may follow.
                elif not self.matcher.consume([token]) or self.matcher.done:
                    reason = FinishReason.STOP
            if reason is not None or length:
                return tokens[:i + 1], reason, stop_reason, length
        return tokens, None, None, False

    def _prompt_scores(self) -> dict:
        """Its prompt's log-probabilities, as :class:`RequestOutput` gives them."""
        scores = [self.prompt_scores[p] for p in range(1, len(self.request.prompt_token_ids))]
        return dict(prompt_logprobs=(None, *(lp for lp, _, _ in scores)),
                    prompt_ranks=(None, *(rank for _, rank, _ in scores)),
                    prompt_top_logprobs=(None, *(top for _, _, top in scores)))
