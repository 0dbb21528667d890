"""Decode: generate tokens one step at a time inside a ``lax.scan``, entirely on device.

A step feeds each running sequence its last token, appends its K/V to the cache, runs the logits
processors, samples the next token and checks the stop conditions — EOS and stop ids, stop strings
(:mod:`llm_jax.stop_matching`), the token budget, the cache's room. A finished sequence stops changing:
it writes nothing to the cache and emits ``PAD_ID``. The host sees tokens only once per call (a chunk of
``num_steps`` steps), with their log-probabilities and hidden states when asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llm_jax import kv_cache as kvc
from llm_jax import stop_matching
from llm_jax.guided import apply_bitmask
from llm_jax.config import ModelConfig
from llm_jax.kv_cache import KVCache
from llm_jax.logits_processors import PAD_ID, History
from llm_jax.logprobs import chosen_and_top
from llm_jax.lora import LoraBatch, LoraRows
from llm_jax.backends import Backend
from llm_jax.model import LayerHooks, Params, forward_extend, greedy_tokens, resolve_backend, unembed
from llm_jax.sampling import Sampling, SamplingParams, process_logits, sample
from llm_jax.sharding import constrain_cache, constrain_replicated
from llm_jax.stop_matching import StopTable
from llm_jax.tokenizer import Tokenizer


class FinishReason(enum.IntEnum):
    RUNNING = 0
    EOS = 1  # an end-of-sequence id
    STOP = 2  # a user stop token id or stop string
    LENGTH = 3  # the token budget or the cache is exhausted

    @property
    def label(self) -> str | None:
        return None if self is FinishReason.RUNNING else self.name.lower()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Logprobs:
    """Log-probabilities to report for each generated token: the chosen token's and the ``top_n`` most
    likely tokens'. By default from the distribution the token was chosen from — after the processors,
    temperature and filters, as the OpenAI API reports them; with ``raw``, from the model's logits."""

    top_n: int = 0
    raw: bool = False

    def __post_init__(self) -> None:
        if self.top_n < 0:
            raise ValueError(f"top_n must be >= 0, got {self.top_n}")


@dataclasses.dataclass(frozen=True)
class LogitsProcessor:
    """A logits processor that reads arguments each request sets (vLLM's per-request ``extra_args``):
    ``fn(scores_BV, tokens_BS, lengths_B, args) -> scores_BV``, where ``args[name]`` is a float32 [B] array of
    each row's value of argument ``name`` — its request's, or ``arguments[name]``, the default.

        watermark = LogitsProcessor(green_list, arguments={"delta": 0.0})   # delta 0: off
        llm_jax.generate(model, prompts, logits_processors=[watermark], processor_args=[{"delta": 4.0}, None])
    """

    fn: Callable
    arguments: dict[str, float] | tuple[tuple[str, float], ...]  # name → default; kept as sorted pairs

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"LogitsProcessor.fn must be callable, got {self.fn!r}")
        pairs = tuple(sorted(dict(self.arguments).items()))
        for name, default in pairs:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"logits processor argument names must be identifiers, got {name!r}")
            if isinstance(default, bool) or not isinstance(default, (int, float)) or not math.isfinite(default):
                raise ValueError(f"the default of logits processor argument {name!r} must be a finite number, "
                                 f"got {default!r}")
        object.__setattr__(self, "arguments", tuple((name, float(default)) for name, default in pairs))

    def __call__(self, scores_BV, tokens_BS, lengths_B, args: dict[str, jax.Array]):
        return self.fn(scores_BV, tokens_BS, lengths_B, {name: args[name] for name, _ in self.arguments})


def check_processors(processors: Sequence[Callable]) -> tuple[Callable, ...]:
    """The caller's logits processors, each callable and hashable (a static argument of the jitted steps);
    the arguments of :class:`LogitsProcessor` s, named alike, must share their defaults."""
    processors = tuple(processors)
    for processor in processors:
        if not callable(processor):
            raise TypeError(f"logits_processors holds {processor!r}, which is not callable")
        try:
            hash(processor)
        except TypeError:
            raise TypeError(f"logits processor {processor!r} is not hashable (it is a static argument of the "
                            "jitted steps): use a function, or give its class __hash__") from None
    defaults: dict[str, float] = {}
    for processor in processors:
        for name, default in getattr(processor, "arguments", ()) if isinstance(processor, LogitsProcessor) else ():
            if defaults.setdefault(name, default) != default:
                raise ValueError(f"logits processors give argument {name!r} two defaults: {defaults[name]} and "
                                 f"{default}")
    return processors


def processor_defaults(processors: Sequence[Callable]) -> dict[str, float]:
    """The arguments ``processors`` read (:class:`LogitsProcessor`), with their defaults."""
    return {name: default for p in processors if isinstance(p, LogitsProcessor) for name, default in p.arguments}


def processor_arg_rows(processors: Sequence[Callable], rows: Sequence[Mapping[str, float] | None]
                   ) -> dict[str, np.ndarray] | None:
    """Each argument ``processors`` read, as a float32 [B] array of the ``rows``' values (a row's own, or the
    default); None when they read none. Refuses names they do not read and values that are not finite
    numbers, naming them."""
    defaults = processor_defaults(processors)
    for row in rows:
        for name, value in (row or {}).items():
            if name not in defaults:
                raise ValueError(f"processor_args names {name!r}, which no logits processor reads"
                                 + (f" (they read {sorted(defaults)})" if defaults else ""))
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"processor_args[{name!r}] must be a finite number, got {value!r}")
    if not defaults:
        return None
    return {name: np.array([(row or {}).get(name, default) for row in rows], np.float32)
            for name, default in defaults.items()}


def _padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    out = np.full((len(rows), max(1, max((len(r) for r in rows), default=0))), PAD_ID, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeControls:
    """What each sequence stops on, how it samples and what it reports (fixed for a whole generation).

    Every array except ``stop_table``'s has the batch first; None fields are features no row uses.
    """

    sampling: SamplingParams
    eos_ids_BE: jax.Array  # int32, padded with PAD_ID
    stop_ids_BX: jax.Array  # int32, padded with PAD_ID
    max_new_tokens_B: jax.Array  # int32
    # int32: EOS and stop ids are banned before; stop strings are looked for in the text after them.
    min_new_tokens_B: jax.Array | None = None
    stop_strings_BQ: jax.Array | None = None  # bool: which of stop_table's strings each row stops on
    stop_table: StopTable | None = None  # shared by the batch
    hooks: LayerHooks | None = None  # steering vectors, layers whose hidden states to report
    # Guided decoding: the tokens each row may choose next, a bit each (int32 [B, ⌈V / 32⌉], all ones for
    # rows without a constraint; ``llm_jax.guided``). The host sets it before each call; its shape is fixed.
    allowed_BW: jax.Array | None = None
    lora: LoraRows | None = None  # each row's LoRA adapter (``llm_jax.lora``)
    logprobs: Logprobs | None = dataclasses.field(default=None, metadata=dict(static=True))
    # The caller's logits processors (``generate(logits_processors=...)``), after the built-in ones: each
    # ``processor(scores_BV, tokens_BS, lengths_B) -> scores_BV``, traced into the step; a
    # :class:`LogitsProcessor` also reads ``processor_args`` (each argument's value per row, float32 [B]).
    processors: tuple[Callable, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    processor_args: dict[str, jax.Array] | None = None

    @classmethod
    def create(cls, sampling: Sequence[Sampling], *, eos_ids: Sequence[Sequence[int]],
               stop_ids: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
               min_new_tokens: Sequence[int] | None = None, stop_strings: Sequence[Sequence[str]] | None = None,
               tokenizer: Tokenizer | None = None, vocab_size: int | None = None, logprobs: Logprobs | None = None,
               samples: Sequence[int] | None = None, steering_BLD: np.ndarray | None = None,
               record_layers: Sequence[int] = (), processors: Sequence[Callable] = ()) -> "DecodeControls":
        """Per-row settings from host values; ``stop_strings`` (per row) need the ``tokenizer``; ``samples``
        numbers the rows that are samples of one prompt (their randomness differs)."""
        budgets = np.asarray(max_new_tokens, np.int32)
        if (budgets < 1).any():
            raise ValueError(f"max_new_tokens must be >= 1, got {list(max_new_tokens)}")
        minimum = None
        if min_new_tokens is not None and any(min_new_tokens):
            minimum = np.asarray(min_new_tokens, np.int32)
            if (minimum < 0).any():
                raise ValueError(f"min_new_tokens must be >= 0, got {list(min_new_tokens)}")
        table = active = None
        if stop_strings is not None and any(stop_strings):
            if tokenizer is None:
                raise ValueError("stop strings need a tokenizer (their token forms come from its vocabulary)")
            union = list(dict.fromkeys(s for row in stop_strings for s in row))
            table, active = StopTable.build(tokenizer, union), stop_matching.active_rows(union, stop_strings)
        hooks = None
        if steering_BLD is not None or record_layers:
            hooks = LayerHooks(steering_BLD=None if steering_BLD is None else jnp.asarray(steering_BLD),
                               record_layers=tuple(int(l) for l in record_layers))
        return cls(sampling=SamplingParams.stack(sampling, vocab_size=vocab_size, samples=samples),
                   eos_ids_BE=_padded(eos_ids), stop_ids_BX=_padded(stop_ids), max_new_tokens_B=budgets,
                   min_new_tokens_B=minimum, stop_strings_BQ=active, stop_table=table, hooks=hooks, logprobs=logprobs,
                   processors=tuple(processors))

    def take_rows(self, index_B: jax.Array) -> "DecodeControls":
        """The controls of rows ``index_B`` (n samples of a prompt, beams)."""
        table, lora = self.stop_table, self.lora
        taken = jax.tree.map(lambda a: jnp.asarray(a)[index_B], dataclasses.replace(self, stop_table=None, lora=None))
        return dataclasses.replace(taken, stop_table=table, lora=None if lora is None else lora.take_rows(index_B))

    def lora_batch(self, T: int) -> LoraBatch | None:
        """The rows' adapters for a call over T tokens per row (None without adapters)."""
        return None if self.lora is None else self.lora.batch(T)

    @property
    def end_ids_BE(self) -> jax.Array:
        """Ids that end a sequence (EOS and stop ids)."""
        return jnp.concatenate([jnp.asarray(self.eos_ids_BE), jnp.asarray(self.stop_ids_BX)], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeState:
    tokens_B: jax.Array  # int32: each row's latest token, not yet in the cache
    num_generated_B: jax.Array  # int32: tokens generated so far, the latest included
    finish_reason_B: jax.Array  # int32 FinishReason
    history: History  # prompt and output tokens as the processors need them
    stop_window_BP: jax.Array | None = None  # the last bytes of each output (stop strings)

    @property
    def done_B(self) -> jax.Array:
        return self.finish_reason_B != FinishReason.RUNNING


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Emitted:
    """What a call hands the host per row and step; PAD_ID tokens mark steps after a row finished."""

    tokens_BS: jax.Array  # int32
    logprobs_BS: jax.Array | None = None  # float32: the chosen token's log-probability
    top_ids_BSN: jax.Array | None = None  # int32: the most likely tokens
    top_logprobs_BSN: jax.Array | None = None  # float32
    # Recorded layers at the position fed in this step (the token emitted the step before).
    hidden_BSRD: jax.Array | None = None


def nothing_emitted(pad_B: jax.Array, controls: DecodeControls, config: ModelConfig) -> Emitted:
    """What a step of finished rows emits: PAD_ID tokens, zeros for everything else asked for."""
    B = pad_B.shape[0]
    report, hooks = controls.logprobs, controls.hooks
    top = (B, report.top_n) if report is not None and report.top_n else None
    R = len(hooks.record_layers) if hooks is not None else 0
    return Emitted(tokens_BS=pad_B, logprobs_BS=None if report is None else jnp.zeros((B,), jnp.float32),
                   top_ids_BSN=None if top is None else jnp.zeros(top, jnp.int32),
                   top_logprobs_BSN=None if top is None else jnp.zeros(top, jnp.float32),
                   hidden_BSRD=jnp.zeros((B, R, config.d_model), config.compute_jnp_dtype) if R else None)


def take_cache_rows(cache: KVCache, index_B: jax.Array) -> KVCache:
    """A cache holding rows ``index_B`` of ``cache`` (copies: n samples of a prompt, reordered beams)."""
    return KVCache(k_LBSKH=cache.k_LBSKH[:, index_B], v_LBSKH=cache.v_LBSKH[:, index_B],
                   lengths_B=cache.lengths_B[index_B])


def argmax_only(controls: DecodeControls) -> bool:
    """Whether every step's token is the argmax of the model's logits, nothing else read from them: every
    row greedy, no logits processors, no log-probabilities (all static). Such steps ask the backend for
    the token without the logits (:meth:`llm_jax.backends.Backend.greedy_tokens`)."""
    s = controls.sampling
    processors = (s.bias_ids_BX, s.repetition_penalty_B, s.presence_penalty_B, s.no_repeat_ngram_B, s.banned_BQJ,
                  controls.min_new_tokens_B)
    return (not s.sampled and controls.logprobs is None and controls.allowed_BW is None
            and all(p is None for p in processors) and not controls.processors)


def choose(logits_BV: jax.Array, state: DecodeState, controls: DecodeControls,
           backend: Backend) -> tuple[jax.Array, Emitted]:
    """Process the logits, pick each row's next token, and its log-probabilities when asked (emitted as
    [B] arrays): every way of decoding — ``start``, ``decode``, the serving engine's step — chooses here.
    Tokens ``controls.allowed_BW`` rules out (guided decoding) are gone from the logits first."""
    if controls.allowed_BW is not None:
        logits_BV = apply_bitmask(logits_BV, controls.allowed_BW)
    minimum = controls.min_new_tokens_B
    scores_BV = process_logits(logits_BV, controls.sampling, state.history, num_generated_B=state.num_generated_B,
                               end_ids_BE=None if minimum is None else controls.end_ids_BE, min_new_tokens_B=minimum)
    for processor in controls.processors:  # the caller's, on every token so far (prompt and output)
        args = (controls.processor_args,) if isinstance(processor, LogitsProcessor) else ()
        scores_BV = processor(scores_BV, state.history.tokens_BS, state.history.length_B, *args).astype(jnp.float32)
    if controls.logprobs is None:
        token_B = sample(scores_BV, controls.sampling, state.num_generated_B, backend=backend)
        return token_B, Emitted(tokens_BS=token_B)
    token_B, chosen_from_BV = sample(scores_BV, controls.sampling, state.num_generated_B, with_scores=True,
                                     backend=backend)
    reported_BV = logits_BV if controls.logprobs.raw else chosen_from_BV
    logprob_B, top_ids_BN, top_logprobs_BN = chosen_and_top(reported_BV, token_B, controls.logprobs.top_n)
    return token_B, Emitted(tokens_BS=token_B, logprobs_BS=logprob_B, top_ids_BSN=top_ids_BN,
                            top_logprobs_BSN=top_logprobs_BN)


def advance(token_B: jax.Array, running_B: jax.Array, state: DecodeState, controls: DecodeControls,
             cache_lengths_B: jax.Array, cache_len: int) -> DecodeState:
    """The state after ``running_B`` rows produced ``token_B``: record it, check the stop conditions."""
    num_generated_B = state.num_generated_B + running_B.astype(jnp.int32)
    is_eos_B = jnp.any(token_B[:, None] == controls.eos_ids_BE, axis=-1)
    is_stop_B = jnp.any(token_B[:, None] == controls.stop_ids_BX, axis=-1)
    window_BP = state.stop_window_BP
    if controls.stop_table is not None:
        # The first min_new_tokens tokens are not part of the text stop strings are looked for in.
        counted_B = running_B if controls.min_new_tokens_B is None else (
            running_B & (num_generated_B > controls.min_new_tokens_B))
        window_BP, hit_B = stop_matching.push(window_BP, token_B, counted_B, controls.stop_table,
                                              controls.stop_strings_BQ)
        is_stop_B |= hit_B
    # No room for this token in the cache, or the budget is spent.
    out_of_room_B = (num_generated_B >= controls.max_new_tokens_B) | (cache_lengths_B >= cache_len)
    reason_B = jnp.select([is_eos_B, is_stop_B, out_of_room_B],
                          [FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH], FinishReason.RUNNING)
    return DecodeState(tokens_B=jnp.where(running_B, token_B, PAD_ID).astype(jnp.int32),
                       num_generated_B=num_generated_B,
                       finish_reason_B=jnp.where(running_B, reason_B, state.finish_reason_B).astype(jnp.int32),
                       history=state.history.append(token_B, running_B), stop_window_BP=window_BP)


@functools.partial(jax.jit, static_argnames=("mesh", "backend"))
def start(last_logits_BV: jax.Array, prompts_BT: jax.Array, cache: KVCache, controls: DecodeControls, *,
          mesh: Mesh | None = None, backend: Backend | str | None = None) -> tuple[DecodeState, Emitted]:
    """Choose each sequence's first token from its prefill logits; the state starts from the prompts
    (right-padded ``prompts_BT``, ``cache.lengths_B`` tokens each). The emitted arrays are [B, 1]; they
    and the state come back whole on every device of ``mesh``, for the host to read."""
    backend = resolve_backend(backend)
    B, V = last_logits_BV.shape
    zeros_B = jnp.zeros((B,), jnp.int32)
    history = controls.sampling.new_history(prompts_BT, cache.lengths_B, V=V, capacity=cache.max_len + 1,
                                            tokens=bool(controls.processors))
    window_BP = None if controls.stop_table is None else stop_matching.empty_window(B, controls.stop_table)
    state = DecodeState(tokens_B=zeros_B, num_generated_B=zeros_B, finish_reason_B=zeros_B, history=history,
                        stop_window_BP=window_BP)
    token_B, emitted = choose(last_logits_BV, state, controls, backend)
    state = advance(token_B, jnp.ones((B,), bool), state, controls, cache.lengths_B, cache.max_len)
    emitted = dataclasses.replace(emitted, tokens_BS=state.tokens_B)
    return constrain_replicated((state, jax.tree.map(lambda a: a[:, None], emitted)), mesh)


def decode_step(params: Params, config: ModelConfig, cache: KVCache, state: DecodeState, controls: DecodeControls,
                *, mesh: Mesh | None, backend: Backend) -> tuple[KVCache, DecodeState, Emitted]:
    """One decode step of the running rows (traced inside a loop): feed each its latest token, choose the
    next. What each row emitted is [B] (``PAD_ID`` for finished rows)."""
    running_B = ~state.done_B
    x_B1D, cache, *hidden = forward_extend(params, config, state.tokens_B[:, None], cache, running_B, mesh,
                                           hooks=controls.hooks, backend=backend, lora=controls.lora_batch(1))
    # Only the argmax wanted: without every logit where the backend can (None: it cannot).
    token_B = greedy_tokens(params, config, x_B1D[:, 0], backend) if argmax_only(controls) else None
    if token_B is None:
        token_B, emitted = choose(unembed(params, config, x_B1D, backend)[:, 0], state, controls, backend)
    else:
        emitted = Emitted(tokens_BS=token_B)
    state = advance(token_B, running_B, state, controls, cache.lengths_B, cache.max_len)
    hidden_BRD = hidden[0][:, 0] if hidden and hidden[0] is not None else None
    return cache, state, dataclasses.replace(emitted, tokens_BS=state.tokens_B, hidden_BSRD=hidden_BRD)


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "mesh", "backend"),
                   donate_argnames=("cache", "state"))
def decode(params: Params, config: ModelConfig, cache: KVCache, state: DecodeState, controls: DecodeControls,
           *, num_steps: int, mesh: Mesh | None = None,
           backend: Backend | str | None = None) -> tuple[KVCache, DecodeState, Emitted]:
    """Run ``num_steps`` decode steps: the new cache and state, and what each row emitted per step
    ([B, num_steps, ...]; ``PAD_ID`` tokens for rows that had already finished). ``cache`` and ``state``
    are donated.

    With a ``mesh`` (params and cache laid out by ``llm_jax.sharding``) the cache stays sharded from step
    to step; the state and what was emitted come back whole on every device, for the host to read.
    """
    backend = resolve_backend(backend)
    cache, state = constrain_cache(cache, mesh), constrain_replicated(state, mesh)
    def step(carry, _):
        cache, state = carry

        def run(cache, state):
            return decode_step(params, config, cache, state, controls, mesh=mesh, backend=backend)

        def idle(cache, state):
            state = dataclasses.replace(state, tokens_B=jnp.full_like(state.tokens_B, PAD_ID))
            return cache, state, nothing_emitted(state.tokens_B, controls, config)

        if mesh is not None:
            # Every device runs the loop itself, and a branch on computed values (rows finished by tokens
            # chosen from logits all-reduced across devices, which need not round alike everywhere) could
            # take devices different ways, each then waiting in a different collective: no branch here.
            cache, state, emitted = run(cache, state)
            return (cache, state), emitted
        # Once every row has finished, the remaining steps of the chunk cost nothing.
        cache, state, emitted = jax.lax.cond(jnp.all(state.done_B), idle, run, cache, state)
        return (cache, state), emitted

    # The loop carries a bfloat16 cache as its bits, which XLA:CPU updates in place (kv_cache's docstring);
    # init_cache makes it so, and a cache of bfloat16 arrays is converted here and back.
    dtype = cache.k_LBSKH.dtype
    (cache, state), emitted_S = jax.lax.scan(step, (kvc.as_bits(cache), state), None, length=num_steps)
    cache = kvc.from_bits(cache, dtype)
    emitted = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), emitted_S)
    return constrain_cache(cache, mesh), *constrain_replicated((state, emitted), mesh)
