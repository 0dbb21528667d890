"""Timing llm_jax's own stages — ``prefill`` → ``start`` → ``decode`` in chunks — on one workload.

The stages are called directly, as ``generate`` calls them, on one backend's prepared weights and
without tokenizer or detokenizer: the numbers are the model's. Compilation is measured on the first run
and excluded from the timed runs.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from llm_jax import buckets
from llm_jax.backends import Backend
from llm_jax.backends.cpu.greedy_head import SCREEN, screen_for
from llm_jax.compile_stats import measure_compilation
from llm_jax.config import ModelConfig
from llm_jax.decoding import PAD_ID, DecodeControls, argmax_only, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.model import Params
from llm_jax.prefilling import prefill
from llm_jax.sampling import GREEDY


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    batch: int
    prompt_len: int
    new_tokens: int  # generated tokens per sequence, the first (from prefill) included
    chunk_steps: int = 16  # decode steps per device call (the host sees tokens once per chunk)

    @property
    def decode_steps(self) -> int:
        """Decode steps actually run: ``new_tokens - 1`` rounded up to whole chunks."""
        return self.chunk_steps * math.ceil((self.new_tokens - 1) / self.chunk_steps)

    def prompts(self, vocab_size: int, seed: int = 0) -> np.ndarray:
        """Random prompt ids [B, prompt_len] (every row the same length: no padding)."""
        return np.random.default_rng(seed).integers(0, vocab_size, (self.batch, self.prompt_len), dtype=np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One timed generation."""

    ttft_s: float  # prompt in → first tokens on the host
    decode_s: float
    step_s: tuple[float, ...]  # per-step latency of each decode chunk (chunk time ÷ steps)
    decode_tokens: int  # tokens produced by decode steps, all rows
    tokens: np.ndarray  # [B, 1 + decode steps] generated ids (the first from prefill)
    # [B, 1 + decode steps]: the engine's second choice at each step — the token its argmax did not take
    # among its two best logits — and how far its logit lies below the best (0: a tie, broken by the lower
    # id); None where the engine does not say (llm_jax)
    runner_up: np.ndarray | None = None
    runner_up_gap: np.ndarray | None = None


def runner_up(logits_BV: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, of the two best tokens the one argmax does not take (on a tie, the higher id: argmax takes
    the lower), and how far its logit lies below the best (0.0 on a tie): ids [B] and gaps [B], as
    :attr:`Run.runner_up` and :attr:`Run.runner_up_gap` hold them."""
    logits_BV = np.asarray(logits_BV, np.float32)
    two_B2 = np.argpartition(-logits_BV, 1, axis=-1)[:, :2]
    values_B2 = np.take_along_axis(logits_BV, two_B2, axis=-1)
    first = (values_B2[:, 0] > values_B2[:, 1]) | ((values_B2[:, 0] == values_B2[:, 1]) & (two_B2[:, 0] < two_B2[:, 1]))
    best, other = np.where(first, 0, 1), np.where(first, 1, 0)
    rows = np.arange(len(logits_BV))
    gap = values_B2[rows, best] - values_B2[rows, other]
    return two_B2[rows, other], gap.astype(np.float64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeMemory:
    """XLA's buffer assignment of the compiled decode chunk: proof that the cache is updated in place."""

    cache_bytes: int
    aliased_bytes: int  # inputs whose buffers the outputs reuse (the donated cache and state)
    temp_bytes: int  # scratch the step needs besides its inputs and outputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compiled:
    prefill_s: float  # tracing + lowering + compiling prefill and start
    decode_s: float
    first_ttft_s: float  # time to first token of the very first call, compilation included
    decode_memory: DecodeMemory | None = None


class EagerEngine:
    """An engine that runs a step at a time as it is called (transformers, llama.cpp): nothing to compile,
    but the first call pays one-off costs, so :meth:`compile` is a warm-up. Subclasses set ``workload`` and
    give ``_generate(steps)``, the prompt then ``steps`` greedy decode steps."""

    workload: Workload

    def compile(self) -> Compiled:
        t0 = time.perf_counter()
        self._generate(steps=1)
        return Compiled(prefill_s=0.0, decode_s=0.0, first_ttft_s=time.perf_counter() - t0)

    def run(self) -> Run:
        return self._generate(steps=self.workload.decode_steps)

    def _generate(self, steps: int) -> Run:
        raise NotImplementedError


class LlmJaxEngine:
    """Runs a :class:`Workload` on ``backend`` against ``weights``, the params as ``backend.prepare`` gives
    them, over a KV cache of ``kv_cache_dtype``; call :meth:`compile` once, then :meth:`run`. ``name``
    labels its rows."""

    def __init__(self, weights: Params, config: ModelConfig, workload: Workload, *, backend: Backend,
                 name: str = "llm_jax", kv_cache_dtype: str | None = None):
        self.weights, self.config, self.workload, self.backend, self.name = weights, config, workload, backend, name
        self.kv_cache_dtype = kv_cache_dtype  # what the KV cache holds (None: the compute dtype)
        context = config.max_seq_len
        self.block_len = buckets.prompt_bucket(workload.prompt_len, context=context)
        self.cache_len = buckets.cache_bucket(workload.prompt_len, 1 + workload.decode_steps, context=context)
        if workload.prompt_len + workload.decode_steps > self.cache_len:
            raise ValueError(f"a prompt of {workload.prompt_len} tokens and {workload.decode_steps} decode steps "
                             f"exceed the model's context of {context} tokens")
        B = workload.batch
        prompts = workload.prompts(config.vocab_size)
        self.tokens_BT = np.zeros((B, self.block_len), np.int32)
        self.tokens_BT[:, : workload.prompt_len] = prompts
        self.lengths_B = np.full((B,), workload.prompt_len, np.int32)
        self.controls = DecodeControls.create([GREEDY] * B, eos_ids=[()] * B, stop_ids=[()] * B,
                                              max_new_tokens=[1 + workload.decode_steps] * B)
        # Greedy, nothing read from the logits but their argmax: the LM head through its screen, where the
        # prepared weights hold one (the CPU kernels') and one serves B rows.
        screen = weights.get(SCREEN) if argmax_only(self.controls) else None
        self.screen = None if screen is None else screen_for(screen, B, int8_dot=getattr(backend, "int8_dot", True))

    def compile(self) -> Compiled:
        t0 = time.perf_counter()
        with measure_compilation() as first:
            cache, state = self._prefill()
            np.asarray(state.tokens_B)
        first_ttft = time.perf_counter() - t0
        with measure_compilation() as second:  # the AOT compile below is the one the first call reuses
            memory = self._decode_memory(cache, state)
            cache, state, emitted = self._decode(cache, state)
            np.asarray(emitted.tokens_BS)
        return Compiled(prefill_s=first.seconds, decode_s=second.seconds, first_ttft_s=first_ttft,
                        decode_memory=memory)

    def _decode_memory(self, cache, state) -> DecodeMemory:
        compiled = self._compiled_decode(cache, state)
        stats = compiled.memory_analysis()
        return DecodeMemory(cache_bytes=cache.nbytes, aliased_bytes=stats.alias_size_in_bytes,
                            temp_bytes=stats.temp_size_in_bytes)

    def _compiled_decode(self, cache, state):
        return decode.lower(self.weights, self.config, cache, state, self.controls,
                            num_steps=self.workload.chunk_steps, backend=self.backend).compile()

    def decode_program_text(self) -> str:
        """The compiled decode chunk's program (HLO text): what :mod:`benchmarking.step_profile` names its
        ops from."""
        cache, state = self._prefill()
        return self._compiled_decode(cache, state).as_text()

    def run(self) -> Run:
        t0 = time.perf_counter()
        cache, state = self._prefill()
        first_BS = np.asarray(state.tokens_B)[:, None]
        ttft = time.perf_counter() - t0
        chunks, step_s = [first_BS], []
        for _ in range(self.workload.decode_steps // self.workload.chunk_steps):
            t_chunk = time.perf_counter()
            cache, state, emitted = self._decode(cache, state)
            chunks.append(np.asarray(emitted.tokens_BS))
            step_s.append((time.perf_counter() - t_chunk) / self.workload.chunk_steps)
        decode_s = time.perf_counter() - t0 - ttft
        tokens_BS = np.concatenate(chunks, axis=1)
        return Run(ttft_s=ttft, decode_s=decode_s, step_s=tuple(step_s),
                   decode_tokens=int((tokens_BS[:, 1:] != PAD_ID).sum()), tokens=tokens_BS)

    def _prefill(self):
        cache = init_cache(self.config, self.workload.batch, self.cache_len, self.kv_cache_dtype)
        logits_BV, cache = prefill(self.weights, self.config, self.tokens_BT, self.lengths_B, cache,
                                   backend=self.backend)
        state, _ = start(logits_BV, self.tokens_BT, cache, self.controls, backend=self.backend)
        return cache, state

    def _decode(self, cache, state):
        return decode(self.weights, self.config, cache, state, self.controls, num_steps=self.workload.chunk_steps,
                      backend=self.backend)
