"""Speculative decoding: propose k tokens cheaply, verify them with one target pass, keep what is exact.

A step, for every running row, entirely on device inside a loop (no host round trip per step):

1. **Propose** k tokens. :attr:`Method.NGRAM` (prompt lookup): the last n tokens (n from
   ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked for earlier in the sequence, and the
   tokens that followed the most recent match are proposed (periodically continued when the match is
   closer than k tokens). :attr:`Method.DRAFT`: a smaller model sharing the vocabulary runs k decode steps
   over its own KV cache.
2. **Verify**: the target scores the latest token and the k proposals in one ``forward_extend`` call
   (T = k + 1 over the cache). Position by position, with the logits processors applied to the history
   as it stands there (exactly as plain decoding applies them): a greedy row accepts while the proposal
   is the argmax and then adds the argmax; a sampling row accepts proposal x with probability
   min(1, p(x) / q(x)) and at the first rejection draws from norm(max(0, p - q)) (Leviathan et al. 2023,
   §2.3; Chen et al. 2023, Algorithm 2) — the n-gram proposer's q is one-hot — and a position with no
   proposal (the bonus after k acceptances) draws from p. Every emitted token goes through the same stop
   checks as in plain decoding (``decoding.advance``), so EOS, stop ids and stop strings end a row at
   exactly the accepted token that completes them.
3. **Roll back** by setting each row's cache length to what it accepted: the slots of rejected tokens
   are masked as stale and overwritten by the next step.

A prompt-lookup step in which no row has a proposal runs the target over one token per row, as plain
decoding does (a conditional inside the step), so a chunk pays for verification only where something
matched. Speculation backs off when it does not pay, a chunk of steps at a time (the host sees tokens
once per chunk anyway; :class:`Backoff` is its plan): after a speculative chunk that accepted fewer than
``min_accepted`` tokens per step, the next 1, 2, 4, ... (up to ``max_backoff``) chunks are plain
decoding's own program (:func:`llm_jax.decoding.decode`), after which :func:`catch_up` brings the
sequences and the draft's cache up to date; an accepting chunk resets that. A failing chunk does not run
to its end: it stops once ``PROBE_STEPS`` steps or more have accepted too little, so a try costs a few
steps, not a chunk.

:func:`verify` is the pure acceptance rule on target scores [B, k + 1, V] for callers with their own
loop (the serving engine).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llm_jax import kv_cache as kvc
from llm_jax.backends import Backend, Xla
from llm_jax.config import ModelConfig
from llm_jax.decoding import PAD_ID, DecodeControls, DecodeState, Emitted, advance, argmax_only, nothing_emitted
from llm_jax.kv_cache import KVCache
from llm_jax.model import Params, forward_extend, greedy_tokens, resolve_backend, unembed
from llm_jax.logprobs import chosen_and_top
from llm_jax.sampling import SamplingParams, filter_logits, process_logits, row_keys, sample
from llm_jax.sharding import constrain_cache, constrain_replicated


# A speculative chunk that has accepted too little after this many steps ends early (the host backs off).
PROBE_STEPS = 4


class Method(enum.Enum):
    NGRAM = "ngram"  # prompt lookup in the sequence so far
    DRAFT = "draft"  # a smaller model with the same vocabulary


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculative:
    """Speculative decoding settings for :func:`llm_jax.generate`: ``method`` (a :class:`Method` or its
    name), ``num_tokens`` proposed per step (k), the ``draft_model`` (an :class:`llm_jax.Model` with the
    target's vocabulary; method "draft"), the n-gram sizes the prompt lookup tries
    (``prompt_lookup_max`` down to ``prompt_lookup_min``; method "ngram"). Speculation fails in a chunk of
    steps that accepts fewer than ``min_accepted`` proposals per verification step; ``max_backoff`` is
    the most plain chunks decoded after failures before it is tried again. ``max_batch``: the serving engine
    proposes only while at most this many requests run (a full batch already reads each weight once for
    many tokens; None: always)."""

    method: Method | str = Method.NGRAM
    num_tokens: int = 4
    draft_model: object | None = None  # llm_jax.Model (not imported here: loading imports the backends)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    min_accepted: float = 1.0
    max_backoff: int = 16
    max_batch: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of "
                             f"{', '.join(repr(m.value) for m in Method)}") from None
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_tokens (k) must be in [1, 64], got {self.num_tokens}")
        if self.method is Method.DRAFT and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs a draft_model")
        if self.method is Method.NGRAM and self.draft_model is not None:
            raise ValueError("a draft_model is given but the speculative method is 'ngram'; use method='draft'")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {self.max_batch}")
        if self.max_backoff < 0:
            raise ValueError(f"max_backoff must be >= 0, got {self.max_backoff}")
        if not 0 <= self.min_accepted <= self.num_tokens:
            raise ValueError(f"min_accepted must be in [0, num_tokens={self.num_tokens}], got {self.min_accepted}")

    @property
    def plan(self) -> "Plan":
        return Plan(method=self.method, k=self.num_tokens, lookup_min=self.prompt_lookup_min,
                    lookup_max=self.prompt_lookup_max, min_accepted=self.min_accepted if self.max_backoff else 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The static part of :class:`Speculative` (what the compiled program depends on)."""

    method: Method
    k: int
    lookup_min: int
    lookup_max: int
    min_accepted: float  # a chunk ends early below this (0: never; backing off is off)


@dataclasses.dataclass(frozen=True)
class Backoff:
    """The host's plan of which chunks speculate: ``skip`` plain chunks come next; the next failure
    costs ``next`` of them."""

    skip: int = 0
    next: int = 1

    @property
    def speculate(self) -> bool:
        return self.skip == 0

    def after_plain(self) -> "Backoff":
        return dataclasses.replace(self, skip=max(self.skip - 1, 0))

    def after_speculation(self, accepted: int, steps: int, speculative: Speculative) -> "Backoff":
        """The plan after a speculative chunk that accepted ``accepted`` proposals in ``steps`` steps of
        its rows. Steps without a proposal count too: they decode one token each, but inside the
        speculative program, whose conditionals copy the KV cache, so a chunk that rarely matches backs
        off to plain decoding's own program."""
        if steps == 0 or accepted >= speculative.min_accepted * steps:
            return Backoff()
        return Backoff(skip=min(self.next, speculative.max_backoff), next=min(2 * self.next, speculative.max_backoff))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecState:
    """What speculation carries from step to step besides the decode state."""

    seq_BS: jax.Array  # int32: prompt and output tokens at slot = position, the latest token included
    draft_cache: KVCache | None  # the draft's cache; valid at least up to the target's length - 1
    proposed_B: jax.Array  # int32: proposals verified per row
    accepted_B: jax.Array  # int32: proposals accepted per row
    steps_B: jax.Array  # int32: verification steps per row (steps in which it had proposals)


def init_state(prompts_BT: jax.Array, lengths_B: jax.Array, first_B: jax.Array, *, capacity: int,
               draft_cache: KVCache | None = None) -> SpecState:
    """The state after prefill: right-padded ``prompts_BT`` of ``lengths_B`` tokens, then each row's first
    generated token; ``capacity`` slots (the cache's, plus room for a step's proposals)."""
    B, T = prompts_BT.shape
    seq_BS = jnp.zeros((B, capacity), jnp.int32).at[:, :T].set(jnp.asarray(prompts_BT, jnp.int32))
    seq_BS = seq_BS.at[jnp.arange(B), jnp.asarray(lengths_B)].set(jnp.asarray(first_B, jnp.int32))
    def zeros():  # one buffer each: they are donated
        return jnp.zeros((B,), jnp.int32)

    return SpecState(seq_BS=seq_BS, draft_cache=draft_cache, proposed_B=zeros(), accepted_B=zeros(),
                     steps_B=zeros())


# Proposers.

def propose_ngram(seq_BS: jax.Array, length_B: jax.Array, *, k: int, lookup_min: int,
                  lookup_max: int) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup: proposals [B, k] and whether each is one [B, k] (a row with no match has none).

    ``seq_BS[b, :length_B[b]]`` is the sequence so far. The longest suffix of n tokens (``lookup_max``
    down to ``lookup_min``) that occurs earlier is matched at its most recent earlier occurrence, and the
    k tokens after that occurrence are proposed; when they would run past the sequence's end, the span
    between the occurrence and the end repeats (a loop continues).
    """
    B, S = seq_BS.shape
    i_S = jnp.arange(S)
    found_B = jnp.zeros((B,), bool)
    start_B = jnp.zeros((B,), jnp.int32)  # where the continuation starts
    for n in range(lookup_max, lookup_min - 1, -1):
        suffix_Bn = jnp.take_along_axis(seq_BS, jnp.clip(length_B[:, None] - n + jnp.arange(n), 0, S - 1), axis=1)
        match_BS = (i_S + n < length_B[:, None]) & (length_B[:, None] >= n)  # an earlier window, followed by a token
        for t in range(n):
            match_BS &= jnp.roll(seq_BS, -t, axis=1) == suffix_Bn[:, t:t + 1]
        any_B = jnp.any(match_BS, axis=1)
        last_B = S - 1 - jnp.argmax(match_BS[:, ::-1], axis=1)  # the most recent window
        take_B = any_B & ~found_B
        start_B = jnp.where(take_B, last_B + n, start_B).astype(jnp.int32)
        found_B |= any_B
    period_B = jnp.maximum(length_B - start_B, 1)
    index_BK = start_B[:, None] + jnp.arange(k) % period_B[:, None]
    proposals_BK = jnp.take_along_axis(seq_BS, jnp.clip(index_BK, 0, S - 1), axis=1)
    return proposals_BK, jnp.broadcast_to(found_B[:, None], (B, k))


def draft_choice(logits_BV: jax.Array, params: SamplingParams, key_step_B: jax.Array,
                  backend: Backend) -> tuple[jax.Array, jax.Array | None]:
    """The draft's token [B] and, for sampling batches, the distribution q [B, V] it was drawn from (the
    target's temperature and filters applied to the draft's logits; greedy rows take the argmax)."""
    greedy_B = backend.argmax(logits_BV)
    if not params.sampled:
        return greedy_B, None
    filtered_BV = filter_logits(logits_BV, params)
    keys_B = jax.vmap(lambda key: jax.random.fold_in(key, 2))(row_keys(params.seed_B, params.sample_B, key_step_B))
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
    sampled_B = params.temperature_B > 0
    return jnp.where(sampled_B, drawn_B, greedy_B), jax.nn.softmax(filtered_BV, axis=-1)


def propose_draft(params: Params, config: ModelConfig, cache: KVCache, seq_BS: jax.Array, length_B: jax.Array,
                  running_B: jax.Array, sampling: SamplingParams, num_generated_B: jax.Array, *, k: int,
                  backend: Backend) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """k tokens from the draft model: proposals [B, k], the distributions they were drawn from [B, k, V]
    (None for greedy batches) and the draft's cache.

    The target holds ``length_B`` tokens and the latest (at position ``length_B``) is not yet in it; the
    draft's cache is valid up to ``length_B - 1`` at least. Its first call feeds positions
    ``length_B - 1`` and ``length_B`` (re-writing one slot, so that after any number of acceptances one
    fixed-shape call catches it up), then k - 1 single-token steps.
    """
    cache = dataclasses.replace(cache, lengths_B=jnp.where(running_B, length_B - 1, cache.lengths_B))
    last_B2 = jnp.take_along_axis(seq_BS, length_B[:, None] - 1 + jnp.arange(2), axis=1)
    x_B2D, cache = forward_extend(params, config, last_B2, cache, running_B, backend=backend)
    token_B, q_BV = draft_choice(unembed(params, config, x_B2D[:, 1:], backend)[:, 0], sampling, num_generated_B,
                                  backend)

    def step(carry, j):
        cache, token_B = carry
        x_B1D, cache = forward_extend(params, config, token_B[:, None], cache, running_B, backend=backend)
        token_B, q_BV = draft_choice(unembed(params, config, x_B1D, backend)[:, 0], sampling, num_generated_B + j,
                                      backend)
        return (cache, token_B), (token_B, q_BV)

    (cache, _), (rest_KB, q_rest) = jax.lax.scan(step, (cache, token_B), jnp.arange(1, k, dtype=jnp.int32))
    proposals_BK = jnp.concatenate([token_B[:, None], rest_KB.T], axis=1)
    q_BKV = None if q_BV is None else jnp.concatenate([q_BV[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
    return proposals_BK, q_BKV, cache


def ngram_proposals(sequence: np.ndarray, *, k: int, lookup_min: int, lookup_max: int) -> np.ndarray:
    """Prompt lookup on the host: :func:`propose_ngram` for one sequence (int32 [≤ k]; empty when its
    last ``lookup_min`` tokens occur nowhere earlier). The serving engine proposes here, between steps."""
    sequence = np.asarray(sequence, np.int32)
    S = len(sequence)
    for n in range(min(lookup_max, S - 1), lookup_min - 1, -1):
        windows_Wn = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)  # each followed by a token
        (starts,) = np.nonzero(np.all(windows_Wn == sequence[S - n:], axis=1))
        if len(starts):
            start = int(starts[-1]) + n  # after the most recent earlier occurrence
            return sequence[start + np.arange(k) % (S - start)]
    return np.zeros((0,), np.int32)


# Verification.

def verify_position(scores_BV: jax.Array, proposal_B: jax.Array, proposed_B: jax.Array, q_BV: jax.Array | None,
                    params: SamplingParams, step_B: jax.Array, *, backend: Backend | None = None,
                    with_scores: bool = False) -> tuple[jax.Array, ...]:
    """One position of verification, on the target's processed scores [B, V] there: the token [B] each
    row emits and whether it is the row's proposal (accepted) [B] bool; ``with_scores`` also returns the
    scores the token's distribution is (filtered and temperature-scaled for sampled rows), as
    :func:`llm_jax.sampling.sample` does, for log-probabilities.

    ``proposed_B``: the row has a proposal ``proposal_B`` here (False at the bonus position); ``q_BV``: the
    distribution it was drawn from (None: one-hot, a deterministic proposer). ``step_B``: the index of
    the token among the row's generated ones (its randomness, as in :func:`llm_jax.sampling.sample`).
    Greedy rows: the argmax, accepted when it is the proposal. Sampling rows: the rejection rule of
    Leviathan et al. (2023, §2.3); without a proposal, exactly plain decoding's draw.
    """
    if not params.sampled:
        plain_B = sample(scores_BV, params, step_B, backend=backend)
        return (plain_B, proposed_B & (plain_B == proposal_B)) + ((scores_BV,) if with_scores else ())
    B, V = scores_BV.shape
    filtered_BV = filter_logits(scores_BV, params)
    keys_B = row_keys(params.seed_B, params.sample_B, step_B)
    # Plain decoding's own draw (llm_jax.sampling.sample: the same key, the same filtered scores).
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
    plain_B = jnp.where(params.temperature_B > 0, drawn_B, (backend or Xla()).argmax(scores_BV))
    p_BV = jax.nn.softmax(filtered_BV, axis=-1)
    x_B1 = jnp.clip(proposal_B, 0, V - 1)[:, None]
    p_x_B = jnp.take_along_axis(p_BV, x_B1, axis=1)[:, 0]
    if q_BV is None:
        q_x_B = jnp.ones((B,), jnp.float32)
        residual_BV = jnp.where(jnp.arange(V) == x_B1, 0.0, p_BV)
    else:
        q_x_B = jnp.take_along_axis(q_BV, x_B1, axis=1)[:, 0]
        residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
    u_B = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0)))(keys_B)
    accept_B = u_B * q_x_B < p_x_B  # u < p/q, with q(x) > 0 as x was drawn from q
    # p == q up to rounding leaves nothing to resample from (and then acceptance is all but certain).
    residual_BV = jnp.where(jnp.sum(residual_BV, axis=-1, keepdims=True) > 0, residual_BV, p_BV)
    redraw_B = jax.vmap(lambda key, r: jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(r)))(
        keys_B, residual_BV).astype(jnp.int32)
    sampled_B = params.temperature_B > 0
    token_B = jnp.where(proposed_B, jnp.where(accept_B, proposal_B, redraw_B), plain_B)
    token_B = jnp.where(sampled_B, token_B, plain_B)
    accepted_B = proposed_B & jnp.where(sampled_B, accept_B, plain_B == proposal_B)
    if with_scores:
        return token_B, accepted_B, jnp.where(sampled_B[:, None], filtered_BV, scores_BV)
    return token_B, accepted_B


def verify(scores_BTV: jax.Array, proposals_BK: jax.Array, params: SamplingParams, step_B: jax.Array, *,
           proposed_BK: jax.Array | None = None, q_BKV: jax.Array | None = None,
           backend: Backend | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The acceptance rule over a whole step, for callers with their own loop (the serving engine).

    ``scores_BTV``: the target's processed scores at the latest token and each of the k proposals
    (T = k + 1; processors that read the history must have seen the proposals before each position);
    ``proposals_BK`` and which of them exist (``proposed_BK``, default all), ``q_BKV`` the distributions they
    were drawn from (None: one-hot), ``step_B`` the index of the first token to emit among the row's
    generated ones. Returns the accepted count [B] (0..k), the token after the accepted ones [B], and
    every emitted token [B, k + 1] (``PAD_ID`` after the first rejection).
    """
    B, T, V = scores_BTV.shape
    proposed_BK = jnp.ones((B, T - 1), bool) if proposed_BK is None else proposed_BK
    accepting_B = jnp.ones((B,), bool)
    count_B = jnp.zeros((B,), jnp.int32)
    next_B = jnp.zeros((B,), jnp.int32)
    emitted = []
    for j in range(T):
        has_B = proposed_BK[:, j] if j < T - 1 else jnp.zeros((B,), bool)
        token_B, accepted_B = verify_position(
            scores_BTV[:, j], proposals_BK[:, j] if j < T - 1 else jnp.zeros((B,), jnp.int32), has_B,
            None if q_BKV is None or j == T - 1 else q_BKV[:, j], params, step_B + j, backend=backend)
        emitted.append(jnp.where(accepting_B, token_B, PAD_ID))
        next_B = jnp.where(accepting_B & ~accepted_B, token_B, next_B)
        count_B += (accepting_B & accepted_B).astype(jnp.int32)
        accepting_B &= accepted_B
    return count_B, next_B, jnp.stack(emitted, axis=1)


# The decode loop.

def _laid_out(cache: KVCache, state: DecodeState, spec: SpecState, mesh: Mesh | None):
    """(cache, (state, spec)) laid out as plain decoding lays its own out: the caches (the target's and the
    draft's) by ``llm_jax.sharding``'s table, the rest whole on every device."""
    draft_cache = None if spec.draft_cache is None else constrain_cache(spec.draft_cache, mesh)
    state, spec = constrain_replicated((state, dataclasses.replace(spec, draft_cache=None)), mesh)
    return constrain_cache(cache, mesh), (state, dataclasses.replace(spec, draft_cache=draft_cache))


def _padded(emitted: Emitted, k: int) -> Emitted:
    """``emitted`` [B, S(, N)] followed by k steps that emitted nothing (``PAD_ID`` tokens, zeros)."""
    def pad(name, x):
        return None if x is None else jnp.pad(x, [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2),
                                              constant_values=PAD_ID if name == "tokens_BS" else 0)

    return Emitted(**{f.name: pad(f.name, getattr(emitted, f.name)) for f in dataclasses.fields(emitted)})


def _speculate(params, config, cache, state, spec, controls, draft_params, draft_config, *, plan: Plan,
               mesh, backend, draft_backend):
    """One speculative step of the running rows: (cache, state, spec, what it emitted [B, k + 1])."""
    k, B = plan.k, cache.batch_size
    running_B = ~state.done_B
    q_BKV = None
    draft_cache = spec.draft_cache
    if plan.method is Method.NGRAM:
        proposals_BK, proposed_BK = propose_ngram(spec.seq_BS, cache.lengths_B + 1, k=k, lookup_min=plan.lookup_min,
                                                  lookup_max=plan.lookup_max)
    else:
        proposals_BK, q_BKV, draft_cache = propose_draft(
            draft_params, draft_config, draft_cache, spec.seq_BS, cache.lengths_B, running_B, controls.sampling,
            state.num_generated_B, k=k, backend=draft_backend)
        proposed_BK = jnp.ones((B, k), bool)
    proposed_BK &= running_B[:, None]
    verify_step = functools.partial(_verify, params, config, controls=controls, draft_cache=draft_cache, mesh=mesh,
                                    backend=backend)
    if plan.method is Method.DRAFT or mesh is not None:  # (under a mesh: no branch on values, see below)
        return verify_step(cache, state, spec, proposals_BK, proposed_BK, q_BKV)

    # A step in which no row has a proposal runs as plain decoding's step: one token per row, not k + 1.
    def plain(cache, state, spec):
        cache, state, spec, emitted = verify_step(cache, state, spec, proposals_BK[:, :0], proposed_BK[:, :0], None)
        return cache, state, spec, _padded(emitted, k)

    def verified(cache, state, spec):
        return verify_step(cache, state, spec, proposals_BK, proposed_BK, None)

    return jax.lax.cond(jnp.any(proposed_BK), verified, plain, cache, state, spec)


def _verify(params, config, cache, state, spec, proposals_BK, proposed_BK, q_BKV, *, controls, draft_cache, mesh,
            backend):
    """The target's pass over each row's latest token and its proposals [B, k] (k may be 0), the tokens
    it accepts and the one of its own after them: (cache, state, spec, what it emitted, [B, k + 1]: the
    tokens, and their log-probabilities when ``controls.logprobs`` asks, as plain decoding reports them)."""
    B, k = proposals_BK.shape
    running_B = ~state.done_B
    length_B = cache.lengths_B
    fed_BT = jnp.concatenate([state.tokens_B[:, None], jnp.where(proposed_BK, proposals_BK, 0)], axis=1)
    x_BTD, cache, *hidden = forward_extend(params, config, fed_BT, cache, running_B, mesh, hooks=controls.hooks,
                                           lora=controls.lora_batch(fed_BT.shape[1]),
                                           backend=backend)
    T = k + 1
    # Greedy without processors: the backend's argmax of each position, as plain decoding takes it.
    chosen_BT = None
    if argmax_only(controls):
        chosen_BT = greedy_tokens(params, config, x_BTD.reshape(B * T, -1), backend)
        chosen_BT = None if chosen_BT is None else chosen_BT.reshape(B, T)
    logits_TBV = None if chosen_BT is not None else jnp.swapaxes(unembed(params, config, x_BTD, backend), 0, 1)
    minimum = controls.min_new_tokens_B
    report = controls.logprobs

    def position(carry, xs):
        state, accepting_B, count_B, emitted_B = carry
        j, proposal_B, proposed_B = xs["j"], xs["proposal"], xs["proposed"]
        active_B = accepting_B & ~state.done_B
        out = {}
        if chosen_BT is not None:
            token_B = xs["chosen"]
            accepted_B = proposed_B & (token_B == proposal_B)
        else:
            scores_BV = process_logits(xs["logits"], controls.sampling, state.history,
                                       num_generated_B=state.num_generated_B,
                                       end_ids_BE=None if minimum is None else controls.end_ids_BE,
                                       min_new_tokens_B=minimum)
            token_B, accepted_B, chosen_from_BV = verify_position(
                scores_BV, proposal_B, proposed_B, xs.get("q"), controls.sampling, state.num_generated_B,
                backend=backend, with_scores=True)
            if report is not None:  # as decoding.choose reports them
                out["logprobs_BS"], out["top_ids_BSN"], out["top_logprobs_BSN"] = chosen_and_top(
                    xs["logits"] if report.raw else chosen_from_BV, token_B, report.top_n)
        advanced = advance(token_B, active_B, state, controls, length_B + j + 1, cache.max_len)
        # A row past its first rejection keeps its latest token (advance pads rows it does not run).
        state = dataclasses.replace(advanced, tokens_B=jnp.where(active_B, advanced.tokens_B, state.tokens_B))
        emitted_B += active_B.astype(jnp.int32)
        count_B += (active_B & accepted_B).astype(jnp.int32)
        out["tokens_BS"] = jnp.where(active_B, token_B, PAD_ID)
        if "hidden" in xs:  # the recorded layers at the token fed here, as a plain step reports them
            out["hidden_BSRD"] = xs["hidden"]
        return (state, active_B & accepted_B, count_B, emitted_B), {name: v for name, v in out.items()
                                                                    if v is not None}

    none_B = jnp.zeros((B, 1), bool)
    xs = dict(j=jnp.arange(T, dtype=jnp.int32),
              proposal=jnp.concatenate([proposals_BK, jnp.zeros((B, 1), jnp.int32)], axis=1).T,
              proposed=jnp.concatenate([proposed_BK, none_B], axis=1).T)
    if chosen_BT is not None:
        xs["chosen"] = chosen_BT.T
    else:
        xs["logits"] = logits_TBV
    if q_BKV is not None:
        xs["q"] = jnp.swapaxes(jnp.concatenate([q_BKV, q_BKV[:, :1]], axis=1), 0, 1)
    if hidden and hidden[0] is not None:
        xs["hidden"] = jnp.swapaxes(hidden[0], 0, 1)  # [T, B, R, D]
    zeros_B = jnp.zeros((B,), jnp.int32)
    (state, _, accepted_B, emitted_B), out_T = jax.lax.scan(position, (state, running_B, zeros_B, zeros_B), xs)
    emitted = Emitted(**{name: jnp.swapaxes(x, 0, 1) for name, x in out_T.items()})  # [B, T(, N)]
    tokens_BT = emitted.tokens_BS
    # Roll back: each row keeps the tokens it fed and accepted; the rest of the slots are stale.
    cache = dataclasses.replace(cache, lengths_B=length_B + emitted_B)
    seq_BS = spec.seq_BS.at[jnp.arange(B)[:, None], length_B[:, None] + 1 + jnp.arange(T)].set(
        jnp.where(tokens_BT == PAD_ID, 0, tokens_BT), mode="drop")
    verified_B = running_B & jnp.any(proposed_BK, axis=1)  # a verification step: the row had proposals
    spec = dataclasses.replace(spec, seq_BS=seq_BS, draft_cache=draft_cache,
                               proposed_B=spec.proposed_B + jnp.sum(proposed_BK, axis=1, dtype=jnp.int32),
                               accepted_B=spec.accepted_B + accepted_B,
                               steps_B=spec.steps_B + verified_B.astype(jnp.int32))
    return cache, state, spec, emitted


@functools.partial(jax.jit, static_argnames=("draft_config", "draft_backend"), donate_argnames=("spec",))
def catch_up(spec: SpecState, tokens_BS: jax.Array, lengths_before_B: jax.Array, lengths_B: jax.Array,
             draft_params: Params | None = None, *, draft_config: ModelConfig | None = None,
             draft_backend: Backend | str | None = None) -> SpecState:
    """``spec`` after a chunk of plain decoding (:func:`llm_jax.decoding.decode`) that emitted
    ``tokens_BS`` (``PAD_ID`` after a row finished) and took the target's cache from ``lengths_before_B``
    to ``lengths_B`` tokens: the sequences hold the new tokens, and the draft's cache the positions it
    will not re-feed (one call over the chunk's S tokens, whose slots past the new length are stale)."""
    B, S = tokens_BS.shape
    positions_BS = lengths_before_B[:, None] + 1 + jnp.arange(S)
    seq_BS = spec.seq_BS.at[jnp.arange(B)[:, None], jnp.where(tokens_BS == PAD_ID, spec.seq_BS.shape[1],
                                                               positions_BS)].set(tokens_BS, mode="drop")
    draft_cache = spec.draft_cache
    if draft_cache is not None:
        grew_B = lengths_B > lengths_before_B
        draft_cache = dataclasses.replace(draft_cache, lengths_B=jnp.where(grew_B, lengths_before_B - 1,
                                                                           draft_cache.lengths_B))
        fed_BS = jnp.take_along_axis(seq_BS, jnp.clip(lengths_before_B[:, None] - 1 + jnp.arange(S), 0,
                                                      seq_BS.shape[1] - 1), axis=1)
        dtype = draft_cache.k_LBSKH.dtype
        _, draft_cache = forward_extend(draft_params, draft_config, fed_BS, kvc.as_bits(draft_cache), grew_B,
                                        backend=resolve_backend(draft_backend))
        draft_cache = dataclasses.replace(kvc.from_bits(draft_cache, dtype),
                                          lengths_B=jnp.where(grew_B, lengths_B - 1, spec.draft_cache.lengths_B))
    return dataclasses.replace(spec, seq_BS=seq_BS, draft_cache=draft_cache)


@functools.partial(jax.jit, static_argnames=("config", "plan", "draft_config", "num_steps", "mesh", "backend",
                                             "draft_backend"),
                   donate_argnames=("cache", "state", "spec"))
def speculative_decode(params: Params, config: ModelConfig, cache: KVCache, state: DecodeState, spec: SpecState,
                       controls: DecodeControls, draft_params: Params | None = None, *, plan: Plan,
                       draft_config: ModelConfig | None = None, num_steps: int, mesh: Mesh | None = None,
                       backend: Backend | str | None = None, draft_backend: Backend | str | None = None
                       ) -> tuple[KVCache, DecodeState, SpecState, Emitted]:
    """Up to ``num_steps`` speculative steps (:func:`llm_jax.decoding.decode` with k + 1 tokens per step at
    most): the new cache, decode state and speculation state, and the tokens each row emitted,
    [B, num_steps · (k + 1)] with ``PAD_ID`` where a step emitted fewer. The chunk ends early once every row
    has finished, or after ``PROBE_STEPS`` steps or more that accepted fewer than ``plan.min_accepted``
    tokens per step (the host then backs off). ``cache``, ``state`` and ``spec`` are donated."""
    backend = resolve_backend(backend)
    draft_backend = resolve_backend(draft_backend)
    kw = dict(plan=plan, mesh=mesh, backend=backend, draft_backend=draft_backend)
    B, T = cache.batch_size, plan.k + 1

    def going_on(carry):
        i, _, state, _, _, accepted, emitted = carry
        if mesh is not None:
            # Every device runs the loop itself: a branch on computed values (tokens, from logits all-reduced
            # across devices, which need not round alike everywhere) could take devices different ways, each
            # then waiting in a different collective. So a fixed number of steps: finished rows emit nothing.
            return i < num_steps
        failing = (i >= PROBE_STEPS) & (accepted < plan.min_accepted * (emitted - accepted))
        return (i < num_steps) & ~jnp.all(state.done_B) & ~failing

    def step(carry):
        i, cache, state, spec, out_S, accepted, emitted = carry
        before = jnp.sum(spec.accepted_B)
        cache, state, spec, out = _speculate(params, config, cache, state, spec, controls, draft_params,
                                             draft_config, **kw)
        out_S = jax.tree.map(lambda all_S, x: jax.lax.dynamic_update_index_in_dim(all_S, x, i, axis=0), out_S, out)
        accepted += jnp.sum(spec.accepted_B) - before
        emitted += jnp.sum(out.tokens_BS != PAD_ID, dtype=jnp.int32)
        # Every device decides whether to go on from the same values: what the loop carries is laid out
        # as plain decoding's (the host-read values whole on every device).
        cache, (state, spec), (out_S, accepted, emitted) = (*_laid_out(cache, state, spec, mesh),
                                                            constrain_replicated((out_S, accepted, emitted), mesh))
        return i + 1, cache, state, spec, out_S, accepted, emitted

    dtype = cache.k_LBSKH.dtype
    draft_dtype = None if spec.draft_cache is None else spec.draft_cache.k_LBSKH.dtype
    if spec.draft_cache is not None:
        spec = dataclasses.replace(spec, draft_cache=kvc.as_bits(spec.draft_cache))
    zero = jnp.zeros((), jnp.int32)
    # Every step's emissions [num_steps, B, T(, N)]: steps the loop does not run emit nothing.
    nothing = nothing_emitted(jnp.full((B,), PAD_ID, jnp.int32), controls, config)
    unused_S = jax.tree.map(lambda x: jnp.broadcast_to(x[None, :, None], (num_steps, B, T, *x.shape[1:])), nothing)
    cache, (state, spec) = _laid_out(kvc.as_bits(cache), state, spec, mesh)
    _, cache, state, spec, out_S, _, _ = jax.lax.while_loop(
        going_on, step, (zero, cache, state, spec, constrain_replicated(unused_S, mesh), zero, zero))
    if spec.draft_cache is not None:
        spec = dataclasses.replace(spec, draft_cache=kvc.from_bits(spec.draft_cache, draft_dtype))
    # [S, B, T, ...] → [B, S · T, ...]: a row's emissions in order.
    emitted = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(B, num_steps * T, *x.shape[3:]), out_S)
    cache, (state, spec) = _laid_out(kvc.from_bits(cache, dtype), state, spec, mesh)
    return cache, state, spec, constrain_replicated(emitted, mesh)
