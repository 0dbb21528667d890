"""The serving engine's device step: a flat, ragged batch of tokens from many sequences → their next tokens.

One jitted, pure function of (weights, paged cache, step inputs): the model runs every token of the step
(decode tokens and prefill chunks together, ``llm_jax.model.forward_paged``), each sequence's last token
gives its logits, and :func:`llm_jax.decoding.choose` — the same processors and sampling as ``generate`` —
picks its next token. The cache is donated. Inputs are padded to a few shapes (:class:`Shape`), and the
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
from llm_jax.decoding import DecodeControls, DecodeState, Emitted, Logprobs, argmax_only, choose
from llm_jax.kv_cache import PagedBatch, PagedKVCache
from llm_jax.logits_processors import History
from llm_jax.logprobs import TokenLogprobs, token_logprobs
from llm_jax.model import Params, forward_paged, greedy_tokens, unembed
from llm_jax.sharding import constrain_cache, constrain_replicated


@dataclasses.dataclass(frozen=True)
class Shape:
    """A step program's static shape: T tokens, B sequences, X blocks per sequence, Q tokens per sequence
    at most (1 for a step of decode tokens only), and what it computes: ``kind`` "greedy" (every row the
    argmax of its logits: through the backend's fastest way), "sample" (the processors and sampling, any
    mix of settings), "logprobs" (that, and ``top_n`` log-probabilities per row) or "prompt" (that, and
    the log-probabilities of every prompt token the step computes, with their ``top_n``)."""

    T: int
    B: int
    X: int
    Q: int
    kind: str = "greedy"
    top_n: int = 0


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


def history(tokens_BS: jax.Array, prompt_lens_B: jax.Array, lengths_B: jax.Array, V: int) -> History:
    """What the penalties read from each sequence's tokens: seen (prompt and output) and counts (output)."""
    B, S = tokens_BS.shape
    s_S = jnp.arange(S)
    valid_BS = s_S < lengths_B[:, None]
    output_BS = valid_BS & (s_S >= prompt_lens_B[:, None])
    rows_B1 = jnp.arange(B)[:, None]
    ids_BS = jnp.clip(tokens_BS, 0, V - 1)
    seen_BV = jnp.zeros((B, V), bool).at[rows_B1, jnp.where(valid_BS, ids_BS, V)].set(True, mode="drop")
    counts_BV = jnp.zeros((B, V), jnp.int32).at[rows_B1, jnp.where(output_BS, ids_BS, V)].add(1, mode="drop")
    return History(length_B=lengths_B.astype(jnp.int32), seen_BV=seen_BV, counts_BV=counts_BV)


@functools.partial(jax.jit, static_argnames=("config", "backend", "mesh"), donate_argnames=("cache",))
def step(weights: Params, config: ModelConfig, cache: PagedKVCache, inputs: StepInputs, *, backend: Backend,
         mesh: Mesh | None = None) -> tuple[PagedKVCache, Emitted, TokenLogprobs | None]:
    """Run the step's tokens and choose each sequence's next token: the cache, what each sequence
    emitted ([B] arrays; rows of padding sequences and of chunks that do not end their prompt are
    meaningless) and, for a "prompt" step, the log-probabilities of ``inputs.prompt_targets_T`` ([1, T]
    arrays, the model's own, before any processor). ``cache`` is donated."""
    batch = inputs.batch
    x_TD, cache = forward_paged(weights, config, inputs.tokens_T, inputs.positions_T, constrain_cache(cache, mesh),
                                batch, mesh, backend=backend)
    cache = constrain_cache(cache, mesh)
    prompt = None
    if inputs.prompt_targets_T is not None:
        prompt = token_logprobs(weights, config, x_TD[None], inputs.prompt_targets_T[None],
                                top_n=inputs.controls.logprobs.top_n, backend=backend)
        prompt = constrain_replicated(prompt, mesh)
    x_BD = x_TD[batch.query_start_B + jnp.maximum(batch.num_tokens_B - 1, 0)]  # each sequence's last token
    controls = inputs.controls
    if argmax_only(controls):
        token_B = greedy_tokens(weights, config, x_BD, backend)
        if token_B is not None:
            return cache, constrain_replicated(Emitted(tokens_BS=token_B), mesh), prompt
    logits_BV = unembed(weights, config, x_BD[:, None], backend)[:, 0]
    B, V = logits_BV.shape
    past = (None if inputs.tokens_BS is None else
            history(inputs.tokens_BS, inputs.prompt_lens_B, inputs.lengths_B, V))
    zeros_B = jnp.zeros((B,), jnp.int32)
    state = DecodeState(tokens_B=zeros_B, num_generated_B=inputs.num_generated_B, finish_reason_B=zeros_B,
                        history=past or History(length_B=zeros_B))
    _, emitted = choose(logits_BV, state, controls, backend)
    return cache, constrain_replicated(emitted, mesh), prompt


def abstract_inputs(shape: Shape, config: ModelConfig, *, bias_width: int, end_width: int,
                    max_model_len: int) -> StepInputs:
    """Zero :class:`StepInputs` of ``shape``: a step of padding only, which compiles its program."""
    from llm_jax.sampling import GREEDY

    T, B, X = shape.T, shape.B, shape.X
    zeros_T, zeros_B = np.zeros((T,), np.int32), np.zeros((B,), np.int32)
    batch = PagedBatch(slots_T=zeros_T, block_tables_BX=np.zeros((B, X), np.int32), query_start_B=zeros_B,
                       num_tokens_B=zeros_B, seq_lens_B=zeros_B, max_query_len=shape.Q)
    return StepInputs(tokens_T=zeros_T, positions_T=zeros_T, batch=batch,
                      controls=step_controls(shape, [GREEDY] * B, np.full((B, end_width), -1, np.int32),
                                             zeros_B, bias_width=bias_width),
                      num_generated_B=zeros_B,
                      **({} if shape.kind == "greedy" else dict(tokens_BS=np.zeros((B, max_model_len), np.int32),
                                                                 prompt_lens_B=zeros_B, lengths_B=zeros_B)),
                      **(dict(prompt_targets_T=np.full((T,), -1, np.int32)) if shape.kind == "prompt" else {}))


def step_controls(shape: Shape, sampling, end_ids_BE: np.ndarray, min_new_tokens_B: np.ndarray, *,
                  bias_width: int) -> DecodeControls:
    """The controls of a step of ``shape``'s kind for ``sampling`` (one :class:`~llm_jax.Sampling` per row):
    a "greedy" step holds no settings at all; the others hold every setting, in fixed shapes."""
    from llm_jax.sampling import SamplingParams

    B = len(sampling)
    none_BE = np.zeros((B, 0), np.int32)
    if shape.kind == "greedy":
        return DecodeControls(sampling=SamplingParams.stack(sampling), eos_ids_BE=none_BE, stop_ids_BX=none_BE,
                              max_new_tokens_B=np.zeros((B,), np.int32))
    return DecodeControls(sampling=SamplingParams.stack_fixed(sampling, bias_width=bias_width),
                          eos_ids_BE=end_ids_BE, stop_ids_BX=none_BE, max_new_tokens_B=np.zeros((B,), np.int32),
                          min_new_tokens_B=min_new_tokens_B,
                          logprobs=Logprobs(top_n=shape.top_n) if shape.kind in ("logprobs", "prompt") else None)
