"""From the scheduler's plan to the device step's inputs: a step padded to one of a few shapes, each
compiled once, and every sequence's settings as arrays (host plans, device computes).

A step of decode tokens only is padded by sequences (B, a power of two up to ``max_num_seqs``; with
proposals to verify, k + 1 tokens each); a step with prompt chunks by tokens (T, a power of two up to
``max_num_batched_tokens``). Its kind is the most any of its sequences asks for: "greedy" < "sample" <
"logprobs" < "prompt" (see :class:`llm_jax.serving.step.Shape`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.decoding import PAD_ID
from llm_jax.guided import all_allowed
from llm_jax.kv_cache import PagedBatch
from llm_jax.sampling import GREEDY
from llm_jax.serving.blocks import NULL_BLOCK
from llm_jax.serving.live import LiveRequest
from llm_jax.serving.scheduler import StepPlan
from llm_jax.serving.step import Draft, Shape, StepInputs, abstract_inputs, step_controls

BIAS_WIDTH = 300  # logit_bias entries per request at most (the OpenAI API's limit)
END_WIDTH = 32  # end-of-sequence and stop ids per request at most
MIN_TOKEN_BUCKET = 16  # the smallest token count a step with prefill chunks is padded to
KINDS = ("greedy", "sample", "logprobs", "prompt")  # each computes what the one before does, and more


def buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit``."""
    sizes = [s for s in (2 ** i for i in range(32)) if smallest <= s < limit]
    return (*sizes, limit)


def padded(a: np.ndarray, size: int, fill=0) -> np.ndarray:
    """``a`` extended along its first axis to ``size`` with ``fill``."""
    a = np.asarray(a)
    out = np.full((size, *a.shape[1:]), fill, a.dtype)
    out[:len(a)] = a
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBuilder:
    """The step programs of an engine (``shapes``) and the inputs of each planned step.

    ``num_speculative``: the proposals a sequence verifies per step at most (0: no speculative decoding);
    ``draft``: a draft model draws them; ``lora``: the engine has LoRA slots; ``processors``: the caller's
    logits processors (every step then samples)."""

    config: ModelConfig
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    max_logprobs: int
    num_speculative: int = 0
    draft: bool = False
    lora: bool = False
    processors: tuple = ()

    @property
    def X(self) -> int:
        """Blocks per sequence at most: a block table's width."""
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        return buckets(self.max_num_seqs)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return buckets(self.max_num_batched_tokens, min(MIN_TOKEN_BUCKET, self.max_num_batched_tokens))

    def shapes(self) -> list[Shape]:
        """Every step program: decode-only steps by sequences, mixed steps by tokens (and steps scoring
        prompts, always mixed); with speculative decoding, those verifying proposals too, and with a draft
        the ones drafted first (for guided requests, whose masks follow the proposals)."""
        kinds = [("greedy", 0)] * (not self.processors) + [("sample", 0), ("logprobs", self.max_logprobs)]
        decode = [(B, B, 1) for B in self.seq_buckets]
        mixed = [(T, self.max_num_seqs, T) for T in self.token_buckets]
        shapes = ([Shape(T=T, B=B, X=self.X, Q=Q, kind=kind, top_n=top_n)
                   for (kind, top_n), (T, B, Q) in itertools.product(kinds, decode + mixed)]
                  + [Shape(T=T, B=B, X=self.X, Q=Q, kind="prompt", top_n=self.max_logprobs) for T, B, Q in mixed])
        if not self.num_speculative:
            return shapes
        K = self.num_speculative  # decode steps verify k + 1 tokens per sequence; mixed steps are by tokens
        verifying = [dataclasses.replace(s, T=s.B * (K + 1) if s.Q == 1 else s.T, Q=K + 1 if s.Q == 1 else s.Q, K=K)
                     for s in shapes]
        drafted = [dataclasses.replace(s, drafted=True) for s in verifying if s.kind != "greedy"]
        return shapes + verifying + (drafted if self.draft else [])

    def abstract(self, shape: Shape) -> StepInputs:
        """A step of padding only, of ``shape``: running it compiles its program."""
        return abstract_inputs(shape, self.config, bias_width=BIAS_WIDTH, end_width=END_WIDTH,
                               max_model_len=self.max_model_len, draft=self.draft, lora=self.lora,
                               processors=self.processors)

    def shape(self, plan: StepPlan, lives: list[LiveRequest]) -> Shape:
        """The shape ``plan`` runs in: the smallest that holds it, of the kind its sequences need."""
        kind = max((live.kind for live in lives), key=KINDS.index)
        kind = "sample" if kind == "greedy" and self.processors else kind  # the processors run in every step
        top_n = self.max_logprobs if kind in ("logprobs", "prompt") else 0
        K = self.num_speculative if plan.num_proposals_B.any() else 0
        # A draft's proposals that guided requests' masks follow: the host must see them first.
        drafted = self.draft and any(n and live.matcher is not None for n, live in zip(plan.num_proposals_B, lives))
        T = next(t for t in self.token_buckets if t >= plan.num_tokens)
        if (plan.num_tokens_B - plan.num_proposals_B == 1).all() and kind != "prompt":
            B = next(b for b in self.seq_buckets if b >= plan.num_seqs)
            # Verifying, the mixed step of fewer tokens, where some sequences propose less than k.
            if not K or T >= B * (K + 1):
                return Shape(T=B * (K + 1), B=B, X=self.X, Q=K + 1, kind=kind, top_n=top_n, K=K, drafted=drafted)
        return Shape(T=T, B=self.max_num_seqs, X=self.X, Q=T, kind=kind, top_n=top_n, K=K, drafted=drafted)

    def inputs(self, plan: StepPlan, shape: Shape, lives: list[LiveRequest]) -> StepInputs:
        """``plan``'s tokens and its sequences' settings, padded to ``shape`` (a drafted step's masks come
        after its proposals: :meth:`allowed`)."""
        n, B = plan.num_seqs, shape.B
        tables = np.full((B, self.X), NULL_BLOCK, np.int32)
        tables[:n, :plan.block_tables_BX.shape[1]] = plan.block_tables_BX
        query_start_B = padded(plan.query_start_B, B, plan.num_tokens)  # padding sequences: after the real ones
        batch = PagedBatch(slots_T=padded(plan.slots_T, shape.T, NULL_BLOCK), block_tables_BX=tables,
                           query_start_B=query_start_B, num_tokens_B=padded(plan.num_tokens_B, B),
                           seq_lens_B=padded(plan.seq_lens_B, B), max_query_len=shape.Q)
        sampling = [live.sampling for live in lives] + [GREEDY] * (B - n)
        end_ids_BE = np.full((B, END_WIDTH), PAD_ID, np.int32)
        for b, live in enumerate(lives):
            end_ids_BE[b, :len(live.end_ids)] = live.end_ids
        min_new_B = padded(np.array([live.min_new_tokens for live in lives], np.int32), B)
        controls = step_controls(shape, sampling, end_ids_BE, min_new_B, bias_width=BIAS_WIDTH,
                                 processors=self.processors,
                                 processor_args=[live.processor_args for live in lives] + [None] * (B - n))
        samples = padded(np.array([live.sample_index for live in lives], np.int32), B)
        controls = dataclasses.replace(controls, sampling=dataclasses.replace(controls.sampling, sample_B=samples))
        generated_B = padded(np.array([live.request.num_output_tokens for live in lives], np.int32), B)
        extra = {}
        if shape.kind != "greedy":  # each sequence's tokens, for the penalties
            tokens_BS = np.zeros((B, self.max_model_len), np.int32)
            for b, live in enumerate(lives):
                tokens_BS[b, :live.request.num_tokens] = live.request.token_ids
            prompt_lens = [len(live.request.prompt_token_ids) for live in lives]
            extra = dict(tokens_BS=tokens_BS, prompt_lens_B=padded(np.array(prompt_lens, np.int32), B),
                         lengths_B=padded(np.array([live.request.num_tokens for live in lives], np.int32), B))
        if shape.kind == "prompt":  # the prompt token after each token, where a scored prompt has one
            targets_T = np.full((shape.T,), -1, np.int32)
            for b, live in enumerate(lives):
                if live.scores_prompt:
                    prompt = np.asarray(live.request.prompt_token_ids, np.int32)
                    span = slice(plan.query_start_B[b], plan.query_start_B[b] + plan.num_tokens_B[b])
                    next_S = plan.positions_T[span] + 1
                    targets_T[span] = np.where(next_S < len(prompt), prompt[np.minimum(next_S, len(prompt) - 1)], -1)
            extra["prompt_targets_T"] = targets_T
        if shape.K:  # each sequence's proposals: its last tokens
            proposals_BK = np.zeros((B, shape.K), np.int32)
            for b in np.flatnonzero(plan.num_proposals_B):
                end = plan.query_start_B[b] + plan.num_tokens_B[b]
                proposals_BK[b, :plan.num_proposals_B[b]] = plan.token_ids_T[end - plan.num_proposals_B[b]:end]
            extra.update(proposals_BK=proposals_BK, num_proposals_B=padded(plan.num_proposals_B, B))
        if shape.kind != "greedy":  # what each sequence may choose (a draft's proposals' masks come after it)
            allowed_BJW = (all_allowed(B * (shape.K + 1), self.config.vocab_size).reshape(B, shape.K + 1, -1)
                           if shape.drafted else self.allowed(plan, shape, lives, extra.get("proposals_BK")))
            if shape.K:
                extra["allowed_BJW"] = allowed_BJW
            else:
                controls = dataclasses.replace(controls, allowed_BW=allowed_BJW[:, 0])
        if self.draft:
            extra["draft"] = self._draft_inputs(plan, shape, lives, tables)
        if self.lora:  # each token's adapter slot
            slots_T = np.full((shape.T,), -1, np.int32)
            for b, live in enumerate(lives):
                slots_T[plan.query_start_B[b]:plan.query_start_B[b] + plan.num_tokens_B[b]] = live.lora_slot
            extra["lora_slots_T"] = slots_T
        return StepInputs(tokens_T=padded(plan.token_ids_T, shape.T), positions_T=padded(plan.positions_T, shape.T),
                          batch=batch, controls=controls, num_generated_B=generated_B, **extra)

    def allowed(self, plan: StepPlan, shape: Shape, lives: list[LiveRequest], proposals_BK: np.ndarray | None
                ) -> np.ndarray:
        """What each sequence may choose at each position it verifies [B, K + 1, words] (guided ones: what
        their constraint allows after their proposals before it), all ones for the others."""
        J = shape.K + 1
        allowed_BJW = all_allowed(shape.B * J, self.config.vocab_size).reshape(shape.B, J, -1)
        for b, live in enumerate(lives):
            if live.matcher is not None and plan.samples_B[b]:
                n = int(plan.num_proposals_B[b])
                live.fill_masks(allowed_BJW[b, :n + 1], [] if not n else proposals_BK[b, :n].tolist())
        return allowed_BJW

    def _draft_inputs(self, plan: StepPlan, shape: Shape, lives: list[LiveRequest], tables_BX: np.ndarray) -> Draft:
        """The draft's first pass: each sequence's known tokens of the step (not its proposals), after the
        token before them where it has proposals; padded as the step."""
        n, B, Z = plan.num_seqs, shape.B, self.block_size
        again_B = (plan.num_proposals_B > 0).astype(np.int32)  # the token before the latest, fed again
        known_B = plan.num_tokens_B - plan.num_proposals_B
        num_B = known_B + again_B
        start_B = (np.cumsum(num_B) - num_B).astype(np.int32)
        first_B = plan.seq_lens_B - plan.num_tokens_B - again_B  # the position each one's tokens start at
        seq_B = np.repeat(np.arange(n), num_B)
        positions_T = (np.arange(len(seq_B)) - start_B[seq_B] + first_B[seq_B]).astype(np.int32)
        tokens_T = np.empty_like(positions_T)
        for b, live in enumerate(lives):
            tokens_T[start_B[b]:start_B[b] + num_B[b]] = live.request.token_ids[first_B[b]:first_B[b] + num_B[b]]
        slots_T = tables_BX[seq_B, positions_T // Z] * Z + positions_T % Z
        batch = PagedBatch(slots_T=padded(slots_T, shape.T, NULL_BLOCK), block_tables_BX=tables_BX,
                           query_start_B=padded(start_B, B, len(seq_B)), num_tokens_B=padded(num_B, B),
                           seq_lens_B=padded(first_B + num_B, B), max_query_len=shape.Q)
        return Draft(tokens_T=padded(tokens_T, shape.T), positions_T=padded(positions_T, shape.T), batch=batch)
