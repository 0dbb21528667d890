"""The serving engine's device step: a flat, ragged batch of tokens from many sequences → their next tokens.

One jitted, pure function of (weights, paged cache, step inputs): the model runs every token of the step
(decode tokens and prefill chunks together, ``llm_jax.model.forward_paged``), each sequence's last token
gives its logits, and :func:`llm_jax.decoding.choose` — the same processors and sampling as ``generate`` —
picks its next token. With speculative decoding a sequence's last tokens may be proposals: the step then
verifies them (:func:`verify_proposals`) and emits the accepted ones and the model's own next token. A
draft model draws its proposals inside the step, or, where the host must see them before the step (to
mask a guided request's verified positions), in a program of its own (:func:`draft_step`). The caches
are donated. Inputs are padded to a few shapes (:class:`Shape`), and the
settings of every request travel as arrays of fixed shape, so any mix of requests runs one of a few
programs, compiled once (``Engine.warm_up``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llm_jax.backends import Backend
from llm_jax.config import ModelConfig
from llm_jax.decoding import (PAD_ID, DecodeControls, DecodeState, Emitted, Logprobs, argmax_only, choose,
                              processor_arg_rows)
from llm_jax.guided import all_allowed, apply_bitmask
from llm_jax.kv_cache import PagedBatch, PagedKVCache
from llm_jax.logits_processors import History
from llm_jax.logprobs import TokenLogprobs, chosen_and_top, token_logprobs
from llm_jax.lora import LoraBatch, LoraWeights
from llm_jax.model import Params, forward_paged, greedy_tokens, unembed
from llm_jax.sampling import process_logits
from llm_jax.sharding import constrain_cache, constrain_replicated
from llm_jax.speculative import verify_position


@dataclasses.dataclass(frozen=True)
class Shape:
    """A step program's static shape: T tokens, B sequences, X blocks per sequence, Q tokens per sequence
    at most (1 for a step of decode tokens only), and what it computes: ``kind`` "greedy" (every row the
    argmax of its logits: through the backend's fastest way), "sample" (the processors and sampling, any
    mix of settings), "logprobs" (that, and ``top_n`` log-probabilities per row) or "prompt" (that, and
    the log-probabilities of every prompt token the step computes, with their ``top_n``); ``K`` proposals
    per sequence at most to verify (speculative decoding; 0: none); ``drafted``: the draft model drew them
    before the step (:func:`draft_step`), which then runs without it."""

    T: int
    B: int
    X: int
    Q: int
    kind: str = "greedy"
    top_n: int = 0
    K: int = 0
    drafted: bool = False


# The engine's fixed tables: banned sequences (suppressed tokens and bad words) per request and tokens per
# banned sequence; the largest no-repeat n-gram.
BANNED = (128, 8)
MAX_NGRAM = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInputs:
    """A step's tokens and each sequence's settings, padded to a :class:`Shape`."""

    tokens_T: jax.Array  # int32
    positions_T: jax.Array  # int32
    batch: PagedBatch
    controls: DecodeControls  # the sequences' sampling settings and end ids (min_new_tokens bans them)
    num_generated_B: jax.Array  # int32: tokens each sequence has generated (its sampling step)
    # "sample" and "logprobs" steps: each sequence's tokens (prompt, then output; the penalties read them),
    # its prompt length and its length.
    tokens_BS: jax.Array | None = None
    prompt_lens_B: jax.Array | None = None
    lengths_B: jax.Array | None = None
    # "prompt" steps: the prompt token after each of the step's tokens, whose log-probability its logits
    # give (-1 where there is none: a prompt's last token, decode tokens, padding).
    prompt_targets_T: jax.Array | None = None
    # Steps that verify proposals: each sequence's proposals (its last num_proposals_B tokens), padded.
    # With a draft model they are placeholders, drawn by the draft in the step (:func:`draft_proposals`).
    proposals_BK: jax.Array | None = None  # int32
    num_proposals_B: jax.Array | None = None  # int32
    # Steps that verify proposals, but "greedy" ones: the tokens each sequence may choose at each verified
    # position j = 0..K (guided decoding: what may follow its first j proposals), int32 [B, K + 1, ⌈V / 32⌉],
    # all ones for other sequences and for positions after a proposal its constraint forbids.
    allowed_BJW: jax.Array | None = None
    # Proposals a draft drew before the step (:func:`draft_step`): the distributions they were drawn
    # from, [B, K, V] (None for "greedy" steps).
    q_BKV: jax.Array | None = None
    # With a draft model: the tokens it runs first, every step (its cache follows the model's): each
    # sequence's known tokens of the step, after the token before them for a sequence with proposals.
    draft: Draft | None = None
    # With LoRA adapters: each token's adapter slot (-1: the base model), ``llm_jax.lora.LoraBatch``.
    lora_slots_T: jax.Array | None = None  # int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Draft:
    """The draft model's own first pass of a step, padded as the step's tokens (T)."""

    tokens_T: jax.Array  # int32
    positions_T: jax.Array  # int32
    batch: PagedBatch


def history(tokens_BS: jax.Array, prompt_lens_B: jax.Array, lengths_B: jax.Array, V: int) -> History:
    """What the processors read from each sequence's tokens: the tokens themselves (n-grams and banned
    sequences), seen (prompt and output) and counts (output)."""
    B, S = tokens_BS.shape
    s_S = jnp.arange(S)
    valid_BS = s_S < lengths_B[:, None]
    output_BS = valid_BS & (s_S >= prompt_lens_B[:, None])
    rows_B1 = jnp.arange(B)[:, None]
    ids_BS = jnp.clip(tokens_BS, 0, V - 1)
    seen_BV = jnp.zeros((B, V), bool).at[rows_B1, jnp.where(valid_BS, ids_BS, V)].set(True, mode="drop")
    counts_BV = jnp.zeros((B, V), jnp.int32).at[rows_B1, jnp.where(output_BS, ids_BS, V)].add(1, mode="drop")
    return History(length_B=lengths_B.astype(jnp.int32), tokens_BS=tokens_BS.astype(jnp.int32), seen_BV=seen_BV,
                   counts_BV=counts_BV)


@functools.partial(jax.jit, static_argnames=("config", "backend", "mesh", "draft_config", "draft_backend"),
                   donate_argnames=("cache", "draft_cache"))
def step(weights: Params, config: ModelConfig, cache: PagedKVCache, inputs: StepInputs, *, backend: Backend,
         mesh: Mesh | None = None, lora_weights: LoraWeights | None = None,
         draft_weights: Params | None = None, draft_cache: PagedKVCache | None = None,
         draft_config: ModelConfig | None = None, draft_backend: Backend | None = None
         ) -> tuple[PagedKVCache, Emitted, TokenLogprobs | None, PagedKVCache | None]:
    """Run the step's tokens and choose each sequence's next token: the cache, what each sequence
    emitted ([B] arrays, or [B, K + 1] when verifying proposals: the accepted ones, the model's own token,
    then ``PAD_ID``; rows of padding sequences and of chunks that do not end their prompt are meaningless)
    and, for a "prompt" step, the log-probabilities of ``inputs.prompt_targets_T`` ([1, T] arrays, the
    model's own, before any processor); last, the draft model's cache (None without). ``cache`` and
    ``draft_cache`` are donated. ``lora_weights``: the adapters ``inputs.lora_slots_T`` choose from (the
    draft model proposes without them; verification is exact all the same)."""
    batch, tokens_T, q_BKV = inputs.batch, inputs.tokens_T, inputs.q_BKV
    if inputs.draft is not None:
        proposals_BK, q_BKV, draft_cache = draft_proposals(draft_weights, draft_config, draft_cache, inputs,
                                                           draft_backend)
        if proposals_BK is not None:  # in the rows of the placeholders
            K = proposals_BK.shape[1]
            num_B = inputs.num_proposals_B
            rows_BK = (batch.query_start_B + batch.num_tokens_B - num_B)[:, None] + jnp.arange(K)
            rows_BK = jnp.where(jnp.arange(K) < num_B[:, None], rows_BK, tokens_T.shape[0])
            tokens_T = tokens_T.at[rows_BK].set(proposals_BK, mode="drop")
            inputs = dataclasses.replace(inputs, proposals_BK=proposals_BK)
    lora = None if inputs.lora_slots_T is None else LoraBatch.of_slots(lora_weights, inputs.lora_slots_T[None])
    x_TD, cache = forward_paged(weights, config, tokens_T, inputs.positions_T, constrain_cache(cache, mesh),
                                batch, mesh, backend=backend, lora=lora)
    cache = constrain_cache(cache, mesh)
    prompt = None
    if inputs.prompt_targets_T is not None:
        prompt = token_logprobs(weights, config, x_TD[None], inputs.prompt_targets_T[None],
                                top_n=inputs.controls.logprobs.top_n, backend=backend)
        prompt = constrain_replicated(prompt, mesh)
    controls = inputs.controls
    if inputs.proposals_BK is not None:
        emitted = verify_proposals(weights, config, x_TD, inputs, backend, q_BKV=q_BKV)
        return cache, constrain_replicated(emitted, mesh), prompt, draft_cache
    x_BD = x_TD[batch.query_start_B + jnp.maximum(batch.num_tokens_B - 1, 0)]  # each sequence's last token
    if argmax_only(controls):
        token_B = greedy_tokens(weights, config, x_BD, backend)
        if token_B is not None:
            return cache, constrain_replicated(Emitted(tokens_BS=token_B), mesh), prompt, draft_cache
    logits_BV = unembed(weights, config, x_BD[:, None], backend)[:, 0]
    B, V = logits_BV.shape
    past = (None if inputs.tokens_BS is None else
            history(inputs.tokens_BS, inputs.prompt_lens_B, inputs.lengths_B, V))
    zeros_B = jnp.zeros((B,), jnp.int32)
    state = DecodeState(tokens_B=zeros_B, num_generated_B=inputs.num_generated_B, finish_reason_B=zeros_B,
                        history=past or History(length_B=zeros_B))
    _, emitted = choose(logits_BV, state, controls, backend)
    return cache, constrain_replicated(emitted, mesh), prompt, draft_cache


def draft_proposals(weights: Params, config: ModelConfig, cache: PagedKVCache, inputs: StepInputs,
                    backend: Backend) -> tuple[jax.Array | None, jax.Array | None, PagedKVCache]:
    """The draft model's part of a step: its first pass over ``inputs.draft`` (every known token of the
    step, so its cache, which shares the model's block tables, holds what the model's holds), then for the
    sequences with proposals, the proposals one by one: [B, K] tokens and, for sampling steps, the
    distributions they were drawn from [B, K, V] (the model's temperature and filters on the draft's
    logits); None, None without proposals. The token before a sequence's latest is fed again: after a step
    that accepted every proposal its last one never went through the draft."""
    from llm_jax.speculative import draft_choice

    draft, controls = inputs.draft, inputs.controls
    x_TD, cache = forward_paged(weights, config, draft.tokens_T, draft.positions_T, cache, draft.batch,
                                backend=backend)
    if inputs.proposals_BK is None:
        return None, None, cache
    B, K = inputs.proposals_BK.shape
    num_B = inputs.num_proposals_B
    table_BX, Z = draft.batch.block_tables_BX, cache.page_size
    greedy = argmax_only(controls)

    def choose_next(x_BD, j):
        if greedy:
            token_B = greedy_tokens(weights, config, x_BD, backend)
            if token_B is not None:
                return token_B, None
        logits_BV = unembed(weights, config, x_BD[:, None], backend)[:, 0]
        return draft_choice(logits_BV, controls.sampling, inputs.num_generated_B + j, backend)

    last_B = draft.batch.query_start_B + jnp.maximum(draft.batch.num_tokens_B - 1, 0)
    token_B, q_BV = choose_next(x_TD[last_B], 0)
    latest_B = draft.batch.seq_lens_B - 1  # the position of each sequence's latest token

    def propose(carry, j):  # feed proposal j (at latest + j), draw proposal j + 1
        cache, token_B = carry
        active_B = j < num_B
        position_B = latest_B + j
        page_B = jnp.take_along_axis(table_BX, jnp.clip(position_B // Z, 0, table_BX.shape[1] - 1)[:, None], 1)[:, 0]
        batch = PagedBatch(slots_T=jnp.where(active_B, page_B * Z + position_B % Z, 0), block_tables_BX=table_BX,
                           query_start_B=jnp.arange(B, dtype=jnp.int32), num_tokens_B=active_B.astype(jnp.int32),
                           seq_lens_B=jnp.where(active_B, position_B + 1, 0), max_query_len=1)
        x_BD, cache = forward_paged(weights, config, token_B, position_B, cache, batch, backend=backend)
        next_B, q_BV = choose_next(x_BD, j)
        return (cache, next_B), (next_B, q_BV)

    (cache, _), (rest_JB, q_JBV) = jax.lax.scan(propose, (cache, token_B), jnp.arange(1, K, dtype=jnp.int32))
    proposals_BK = jnp.concatenate([token_B[:, None], rest_JB.T], axis=1)
    q_BKV = None if q_BV is None else jnp.concatenate([q_BV[:, None], jnp.swapaxes(q_JBV, 0, 1)], axis=1)
    return proposals_BK, q_BKV, cache


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("cache",))
def draft_step(weights: Params, config: ModelConfig, cache: PagedKVCache, inputs: StepInputs, *,
               backend: Backend) -> tuple[PagedKVCache, jax.Array, jax.Array | None]:
    """:func:`draft_proposals` as a program of its own, for a step whose proposals the host must see
    before it verifies them (a guided request's masks follow its proposals): the draft's cache, the
    proposals [B, K] and the distributions they were drawn from [B, K, V] (None for "greedy" steps).
    ``cache`` is donated."""
    proposals_BK, q_BKV, cache = draft_proposals(weights, config, cache, inputs, backend)
    return cache, proposals_BK, q_BKV


def verify_proposals(weights: Params, config: ModelConfig, x_TD: jax.Array, inputs: StepInputs,
                     backend: Backend, *, q_BKV: jax.Array | None = None) -> Emitted:
    """Each sequence's tokens from its last known token and its proposals (``inputs.num_proposals_B`` of
    ``inputs.proposals_BK``, the last tokens it fed; ``q_BKV`` the distributions a draft drew them from,
    None for one-hot ones): position by position, the processors applied to the history as it stands
    there and the proposal accepted by :func:`llm_jax.speculative.verify_position` (greedy: while it is
    the argmax; sampling: Leviathan et al.'s rule, exact); then the model's own token
    at the first rejection, or after the last proposal. [B, K + 1] arrays, ``PAD_ID`` after that token;
    without proposals a row is plain decoding's step."""
    batch, controls = inputs.batch, inputs.controls
    proposals_BK, num_proposals_B = inputs.proposals_BK, inputs.num_proposals_B
    B, K = proposals_BK.shape
    j_J = jnp.arange(K + 1)
    first_B = batch.query_start_B + jnp.maximum(batch.num_tokens_B - 1 - num_proposals_B, 0)
    x_BJD = x_TD[first_B[:, None] + jnp.minimum(j_J, num_proposals_B[:, None])]
    proposed_BJ = j_J < num_proposals_B[:, None]  # a proposal follows column j (none after the last)
    proposals_BJ = jnp.concatenate([proposals_BK, jnp.zeros((B, 1), jnp.int32)], axis=1)
    if argmax_only(controls):
        tokens_BJ = greedy_tokens(weights, config, x_BJD.reshape(B * (K + 1), -1), backend)
        if tokens_BJ is None:
            tokens_BJ = backend.argmax(unembed(weights, config, x_BJD.reshape(B * (K + 1), 1, -1), backend)[:, 0])
        tokens_BJ = tokens_BJ.reshape(B, K + 1)
        accepted_BJ = proposed_BJ & (tokens_BJ == proposals_BJ)
        kept_B = jnp.sum(jnp.cumprod(accepted_BJ, axis=1), axis=1)
        return Emitted(tokens_BS=jnp.where(j_J <= kept_B[:, None], tokens_BJ, PAD_ID).astype(jnp.int32))
    logits_BJV = unembed(weights, config, x_BJD, backend)
    if inputs.allowed_BJW is not None:  # guided sequences: each position under its own mask
        logits_BJV = apply_bitmask(logits_BJV, inputs.allowed_BJW)
    V = logits_BJV.shape[-1]
    params = controls.sampling
    history_ = (History(length_B=jnp.zeros((B,), jnp.int32)) if inputs.tokens_BS is None else
                history(inputs.tokens_BS, inputs.prompt_lens_B, inputs.lengths_B, V))
    minimum = controls.min_new_tokens_B
    accepting_B = jnp.ones((B,), bool)
    columns = []
    for j in range(K + 1):
        step_B = inputs.num_generated_B + j
        scores_BV = process_logits(logits_BJV[:, j], params, history_, num_generated_B=step_B,
                                   end_ids_BE=None if minimum is None else controls.end_ids_BE,
                                   min_new_tokens_B=minimum)
        q_BV = None if q_BKV is None else q_BKV[:, min(j, K - 1)]  # (unread at the last column)
        token_B, accepted_B, chosen_from_BV = verify_position(scores_BV, proposals_BJ[:, j], proposed_BJ[:, j], q_BV,
                                                              params, step_B, backend=backend, with_scores=True)
        column = dict(tokens_BS=jnp.where(accepting_B, token_B, PAD_ID))
        if controls.logprobs is not None:
            column["logprobs_BS"], column["top_ids_BSN"], column["top_logprobs_BSN"] = chosen_and_top(
                logits_BJV[:, j] if controls.logprobs.raw else chosen_from_BV, token_B, controls.logprobs.top_n)
        columns.append(column)
        history_ = history_.append(proposals_BJ[:, j], proposed_BJ[:, j])  # read only once it is accepted
        accepting_B &= accepted_B
    stacked = {name: jnp.stack([c[name] for c in columns], axis=1)
               for name in columns[0] if columns[0][name] is not None}
    return Emitted(**stacked)


def abstract_inputs(shape: Shape, config: ModelConfig, *, bias_width: int, end_width: int,
                    max_model_len: int, draft: bool = False, lora: bool = False,
                    processors: tuple = ()) -> StepInputs:
    """Zero :class:`StepInputs` of ``shape`` (``draft``: with a draft model's pass; ``lora``: with LoRA
    adapters; ``processors``: the engine's logits processors): a step of padding only, which compiles its
    program."""
    from llm_jax.sampling import GREEDY

    T, B, X = shape.T, shape.B, shape.X
    zeros_T, zeros_B = np.zeros((T,), np.int32), np.zeros((B,), np.int32)
    batch = PagedBatch(slots_T=zeros_T, block_tables_BX=np.zeros((B, X), np.int32), query_start_B=zeros_B,
                       num_tokens_B=zeros_B, seq_lens_B=zeros_B, max_query_len=shape.Q)
    controls = step_controls(shape, [GREEDY] * B, np.full((B, end_width), -1, np.int32), zeros_B,
                             bias_width=bias_width, processors=processors)
    masks = {}
    if shape.kind != "greedy" and shape.K:  # each verified position's mask
        masks = dict(allowed_BJW=all_allowed(B * (shape.K + 1), config.vocab_size).reshape(B, shape.K + 1, -1))
    elif shape.kind != "greedy":
        controls = dataclasses.replace(controls, allowed_BW=all_allowed(B, config.vocab_size))
    return StepInputs(tokens_T=zeros_T, positions_T=zeros_T, batch=batch, controls=controls,
                      num_generated_B=zeros_B,
                      **({} if shape.kind == "greedy" else dict(tokens_BS=np.zeros((B, max_model_len), np.int32),
                                                                 prompt_lens_B=zeros_B, lengths_B=zeros_B)),
                      **(dict(prompt_targets_T=np.full((T,), -1, np.int32)) if shape.kind == "prompt" else {}),
                      **(dict(proposals_BK=np.zeros((B, shape.K), np.int32), num_proposals_B=zeros_B)
                         if shape.K else {}),
                      draft=Draft(tokens_T=zeros_T, positions_T=zeros_T, batch=batch) if draft else None,
                      lora_slots_T=np.full((T,), -1, np.int32) if lora else None, **masks)


def step_controls(shape: Shape, sampling, end_ids_BE: np.ndarray, min_new_tokens_B: np.ndarray, *,
                  bias_width: int, processors: tuple = (), processor_args: list[dict] | None = None) -> DecodeControls:
    """The controls of a step of ``shape``'s kind for ``sampling`` (one :class:`~llm_jax.Sampling` per row):
    a "greedy" step holds no settings at all; the others hold every setting, in fixed shapes, and the
    engine's logits ``processors`` with each row's ``processor_args`` (None: the defaults)."""
    from llm_jax.sampling import SamplingParams

    B = len(sampling)
    none_BE = np.zeros((B, 0), np.int32)
    if shape.kind == "greedy":
        return DecodeControls(sampling=SamplingParams.stack(sampling), eos_ids_BE=none_BE, stop_ids_BX=none_BE,
                              max_new_tokens_B=np.zeros((B,), np.int32))
    return DecodeControls(sampling=SamplingParams.stack_fixed(sampling, bias_width=bias_width, banned=BANNED,
                                                              max_ngram_size=MAX_NGRAM),
                          eos_ids_BE=end_ids_BE, stop_ids_BX=none_BE, max_new_tokens_B=np.zeros((B,), np.int32),
                          min_new_tokens_B=min_new_tokens_B,
                          logprobs=Logprobs(top_n=shape.top_n) if shape.kind in ("logprobs", "prompt") else None,
                          processors=processors,
                          processor_args=processor_arg_rows(processors, processor_args or [None] * B))
