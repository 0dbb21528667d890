"""Beam search as ``transformers`` defines it (``GenerationMixin._beam_search``), in one jitted
``lax.while_loop`` on device.

Each prompt keeps W running beams in a cache of B·W rows. A step scores every beam's continuations
(log-softmax, then the logits processors, as ``transformers`` applies them to log-probabilities), keeps
the C best of the W·V candidates per prompt, moves the ones ending in an end id (or at the token budget)
into the prompt's W finished hypotheses (score: sum of log-probabilities / generated length **
``length_penalty``), continues with the W best unfinished ones — gathering their cache rows and
histories on the batch axis — and stops, per ``early_stopping``, when no running beam can still beat a
finished one.

Letters here, beside the package's: W beams per prompt, C candidates kept per step, M token budget.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from llm_jax import kv_cache as kvc
from llm_jax.config import ModelConfig
from llm_jax.decoding import DecodeControls, take_cache_rows
from llm_jax.kv_cache import KVCache
from llm_jax.logits_processors import PAD_ID
from llm_jax.backends import Backend
from llm_jax.model import Params, forward_extend, resolve_backend, unembed
from llm_jax.sampling import process_logits
from llm_jax.sharding import constrain_replicated

_NEG = -1.0e9  # transformers' "very large negative" score for excluded candidates


class EarlyStopping(enum.Enum):
    """When a prompt's search ends (``transformers``' ``early_stopping``)."""

    HEURISTIC = "heuristic"  # False: when the best running beam, at its current length, cannot win
    FIRST = "first"  # True: as soon as W hypotheses have finished
    NEVER = "never"  # "never": when no running beam could win even at the longest length

    @classmethod
    def parse(cls, value: "EarlyStopping | bool | str") -> "EarlyStopping":
        match value:
            case EarlyStopping():
                return value
            case False:
                return cls.HEURISTIC
            case True:
                return cls.FIRST
            case "never":
                return cls.NEVER
        raise ValueError(f"early_stopping must be True, False or 'never', got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearch:
    """Beam search settings (static: each distinct setting compiles its own loop)."""

    num_beams: int
    length_penalty: float = 1.0  # exponent of the length dividing a finished hypothesis' score
    early_stopping: EarlyStopping = EarlyStopping.HEURISTIC
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "early_stopping", EarlyStopping.parse(self.early_stopping))
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(f"num_return_sequences must be in [1, num_beams={self.num_beams}], "
                             f"got {self.num_return_sequences}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Beams:
    """The best finished hypotheses of each prompt, best first: [B, num_return_sequences, ...]."""

    tokens_BWM: jax.Array  # int32 generated tokens, PAD_ID after each hypothesis' length
    lengths_BW: jax.Array  # int32
    scores_BW: jax.Array  # float32: summed log-probabilities / length ** length_penalty


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Search:
    step: jax.Array  # int32 scalar: tokens generated so far
    logits_NV: jax.Array  # next-token logits of the running beams (N = B·W)
    cache: KVCache
    history: object  # logits_processors.History of the running beams
    running_BWM: jax.Array  # running beams' tokens
    running_scores_BW: jax.Array
    finished_BWM: jax.Array  # finished hypotheses' tokens
    finished_lengths_BW: jax.Array
    finished_scores_BW: jax.Array
    is_finished_BW: jax.Array  # bool: the slot holds a finished hypothesis
    improvable_B: jax.Array  # bool: a running beam may still beat a finished hypothesis
    all_stopped: jax.Array  # bool scalar: every candidate of the last step hit a stop


def _gather(x_BW_, index_BW):
    return jnp.take_along_axis(x_BW_, index_BW.reshape(*index_BW.shape, *([1] * (x_BW_.ndim - 2))), axis=1)


@functools.partial(jax.jit, static_argnames=("config", "search", "max_new_tokens", "mesh", "backend"))
def beam_search(params: Params, config: ModelConfig, last_logits_BV: jax.Array, prompts_BT: jax.Array,
                cache: KVCache, controls: DecodeControls, *, search: BeamSearch, max_new_tokens: int,
                mesh: Mesh | None = None, backend: Backend | str | None = None) -> Beams:
    """Beam search from prefilled prompts: ``last_logits_BV`` and ``cache`` come from ``prefill`` (B rows,
    copied to B·W), ``controls`` has one row per prompt (greedy settings; its processors, end ids and budgets
    apply per beam). ``max_new_tokens`` (static) bounds every row's budget. ``mesh``: the mesh params and
    cache are laid out on (``llm_jax.sharding``); the beams come back whole on every device."""
    backend = resolve_backend(backend)
    B, V = last_logits_BV.shape
    W, M = search.num_beams, max_new_tokens
    end_ids_BE, budget_B1 = controls.end_ids_BE, jnp.asarray(controls.max_new_tokens_B)[:, None]
    C = max(2, 1 + end_ids_BE.shape[1]) * W  # enough candidates that W of them are still running
    rows_N = jnp.repeat(jnp.arange(B), W)
    controls = controls.take_rows(rows_N)
    cache = take_cache_rows(cache, rows_N)
    history = controls.sampling.new_history(prompts_BT[rows_N], cache.lengths_B, V=V, capacity=cache.max_len + 1)
    first_beam_W = jnp.arange(W) == 0

    def step(s: _Search) -> _Search:
        # Score every continuation of every running beam: processors act on log-probabilities.
        logp_NV = jax.nn.log_softmax(s.logits_NV.astype(jnp.float32), axis=-1)
        logp_NV = process_logits(logp_NV, controls.sampling, s.history, num_generated_B=jnp.full((B * W,), s.step),
                                 end_ids_BE=None if controls.min_new_tokens_B is None else controls.end_ids_BE,
                                 min_new_tokens_B=controls.min_new_tokens_B)
        total_BWV = logp_NV.reshape(B, W, V) + s.running_scores_BW[:, :, None]
        top_scores_BC, top_BC = jax.lax.top_k(total_BWV.reshape(B, W * V), C)
        beam_BC, token_BC = top_BC // V, (top_BC % V).astype(jnp.int32)
        candidates_BCM = _gather(s.running_BWM, beam_BC).at[:, :, s.step].set(token_BC)
        hits_BC = jnp.any(token_BC[..., None] == end_ids_BE[:, None, :], axis=-1) | (s.step + 1 >= budget_B1)

        # The W best candidates that did not stop keep running.
        running_scores_BC = top_scores_BC + hits_BC * _NEG
        running_scores_BW, keep_BW = jax.lax.top_k(running_scores_BC, W)
        running_BWM = _gather(candidates_BCM, keep_BW)
        source_N = (jnp.arange(B)[:, None] * W + _gather(beam_BC, keep_BW)).reshape(-1)

        # Candidates among the first W that stopped may enter the finished hypotheses.
        scores_BC = top_scores_BC / ((s.step + 1).astype(jnp.float32) ** search.length_penalty)
        full_B1 = jnp.all(s.is_finished_BW, axis=-1, keepdims=True) & (search.early_stopping is EarlyStopping.FIRST)
        finishing_BC = hits_BC & (jnp.arange(C) < W)
        scores_BC += full_B1 * _NEG + (~s.improvable_B[:, None]) * _NEG + (~finishing_BC) * _NEG
        merged_scores_BX = jnp.concatenate([s.finished_scores_BW, scores_BC], axis=1)
        finished_scores_BW, best_BW = jax.lax.top_k(merged_scores_BX, W)
        finished_BWM = _gather(jnp.concatenate([s.finished_BWM, candidates_BCM], axis=1), best_BW)
        lengths_BX = jnp.concatenate([s.finished_lengths_BW, jnp.full((B, C), s.step + 1)], axis=1)
        is_finished_BW = _gather(jnp.concatenate([s.is_finished_BW, finishing_BC], axis=1), best_BW)

        # Could a running beam still beat the worst finished hypothesis?
        if search.early_stopping is EarlyStopping.NEVER and search.length_penalty > 0:
            best_length_B1 = budget_B1.astype(jnp.float32)
        else:
            best_length_B1 = jnp.full((B, 1), s.step + 1, jnp.float32)
        best_running_B1 = running_scores_BW[:, :1] / best_length_B1 ** search.length_penalty
        worst_BW = jnp.where(is_finished_BW, jnp.min(finished_scores_BW, axis=1, keepdims=True), _NEG)
        improvable_B = s.improvable_B & jnp.any(best_running_B1 > worst_BW, axis=-1)

        # Continue the running beams: reorder their cache rows and histories, feed their new tokens.
        new_N = running_BWM[:, :, s.step].reshape(-1)
        active_N = jnp.ones((B * W,), bool)
        cache = take_cache_rows(s.cache, source_N)
        history = jax.tree.map(lambda a: a[source_N], s.history).append(new_N, active_N)
        x_N1D, cache = forward_extend(params, config, new_N[:, None], cache, active_N, mesh, hooks=controls.hooks,
                                      lora=controls.lora_batch(1),
                                      backend=backend)[:2]
        return _Search(step=s.step + 1, logits_NV=unembed(params, config, x_N1D, backend)[:, 0], cache=cache,
                       history=history, running_BWM=running_BWM, running_scores_BW=running_scores_BW,
                       finished_BWM=finished_BWM, finished_lengths_BW=_gather(lengths_BX, best_BW),
                       finished_scores_BW=finished_scores_BW, is_finished_BW=is_finished_BW,
                       improvable_B=improvable_B, all_stopped=jnp.all(hits_BC))

    def searching(s: _Search) -> jax.Array:
        beams_open = ~(jnp.all(s.is_finished_BW) & (search.early_stopping is EarlyStopping.FIRST))
        return (s.step < M) & jnp.any(s.improvable_B) & beams_open & ~s.all_stopped

    # The loop carries a bfloat16 cache as its bits, which XLA:CPU reorders and updates without
    # converting it (see kv_cache.as_bits).
    cache = kvc.as_bits(cache)
    empty_BWM = jnp.full((B, W, M), PAD_ID, jnp.int32)
    # Only the first beam starts "alive", so the first step does not pick W copies of one continuation.
    s = _Search(step=jnp.zeros((), jnp.int32), logits_NV=last_logits_BV[rows_N], cache=cache, history=history,
                running_BWM=empty_BWM, running_scores_BW=jnp.where(first_beam_W, 0.0, _NEG)[None].repeat(B, 0),
                finished_BWM=empty_BWM, finished_lengths_BW=jnp.zeros((B, W), jnp.int32),
                finished_scores_BW=jnp.full((B, W), _NEG), is_finished_BW=jnp.zeros((B, W), bool),
                improvable_B=jnp.ones((B,), bool), all_stopped=jnp.zeros((), bool))
    s = jax.lax.while_loop(searching, step, s)
    R = search.num_return_sequences
    lengths_BR = s.finished_lengths_BW[:, :R]
    tokens_BRM = jnp.where(jnp.arange(M) < lengths_BR[..., None], s.finished_BWM[:, :R], PAD_ID)
    return constrain_replicated(Beams(tokens_BWM=tokens_BRM, lengths_BW=lengths_BR,
                                      scores_BW=s.finished_scores_BW[:, :R]), mesh)
