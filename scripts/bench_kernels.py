"""Benchmark the pallas_kernels attention on a GPU against XLA, cuDNN and JAX's own Pallas ops.

    python scripts/bench_kernels.py            # on a GPU: about 4 minutes, a table at the end
    python scripts/bench_kernels.py --dry-run  # anywhere: trace and check every case, no timing

(with the project installed, ``pip install -e .``, or its root on PYTHONPATH).

Prefill is causal self-attention (S = T, 1k to 16k tokens, head dim 64 and 128); decode is one query
per sequence against a full KV cache (batch 1 to 64, context 1k to 32k). Each case reports time,
TFLOP/s (causal pairs only), GB/s (the bytes that must cross HBM: q, k, v and o once) and the
fraction of the chip's peak measured here with a large bf16 matmul and a large copy: of FLOP/s for
prefill, which is compute bound, and of bandwidth for decode, which is memory bound. ``max|Δ|`` is
the largest difference from the XLA implementation, a check that the kernel is right on this GPU.
JAX's Pallas prefill op has no grouped-query support, so it gets K/V repeated to N heads (outside
the timed call).
"""

import argparse
import dataclasses
import enum
import math
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as upstream_attention
from jax.experimental.pallas.ops.gpu import decode_attention as upstream_decode

from pallas_kernels.decode_attention_gpu import decode_attention_gpu
from pallas_kernels.flash_attention_gpu import flash_attention_gpu

DTYPE = jnp.dtype(jnp.bfloat16)


class Kind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Impl(enum.Enum):
    OURS = "pallas_kernels"
    XLA = "xla"
    CUDNN = "cudnn"
    UPSTREAM = "jax pallas op"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One attention call: prefill (T = S queries) or decode (T = 1) over S keys."""

    kind: Kind
    B: int
    S: int
    N: int
    K: int
    H: int

    @property
    def T(self) -> int:
        return self.S if self.kind is Kind.PREFILL else 1

    @property
    def sm_scale(self) -> float:
        return self.H ** -0.5

    @property
    def flops(self) -> float:
        """4 H flops (q·k and p·v) per visible (query, key) pair."""
        pairs = self.T * (self.T + 1) / 2 if self.kind is Kind.PREFILL else self.S
        return 4.0 * self.H * pairs * self.B * self.N

    @property
    def bytes(self) -> float:
        q_and_o = 2 * self.B * self.T * self.N * self.H
        k_and_v = 2 * self.B * self.S * self.K * self.H
        return float(q_and_o + k_and_v) * DTYPE.itemsize

    def abstract_inputs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """q (q_BTNH for prefill, q_BNH for decode), k_BSKH, v_BSKH, lengths_B."""
        q_shape = (self.B, self.T, self.N, self.H) if self.kind is Kind.PREFILL else (
            self.B, self.N, self.H)
        kv = jax.ShapeDtypeStruct((self.B, self.S, self.K, self.H), DTYPE)
        return (jax.ShapeDtypeStruct(q_shape, DTYPE), kv, kv,
                jax.ShapeDtypeStruct((self.B,), jnp.int32))

    def inputs(self, seed: int = 0) -> tuple[jax.Array, ...]:
        """Standard normal q, k, v on the device, every sequence at full length."""
        keys = jax.random.split(jax.random.key(seed), 3)
        q, k, v, lengths = self.abstract_inputs()
        return (*(jax.random.normal(key, x.shape, x.dtype) for key, x in zip(keys, (q, k, v))),
                jnp.full(lengths.shape, self.S, jnp.int32))

    def __str__(self):
        return f"B={self.B} {'T=S' if self.kind is Kind.PREFILL else 'S'}={self.S} " \
               f"N={self.N} K={self.K} H={self.H}"


PREFILL = [Workload(kind=Kind.PREFILL, B=16 * 1024 // S, S=S, N=N, K=K, H=H)
           for H, N, K in ((128, 32, 8), (64, 16, 16)) for S in (1024, 4096, 16384)]
DECODE = [Workload(kind=Kind.DECODE, B=B, S=S, N=32, K=8, H=128)
          for B in (1, 8, 64) for S in (1024, 8192, 32768)]
WORKLOADS = PREFILL + DECODE


def attention_fn(impl: Impl, w: Workload, *, interpret: bool = False) -> Callable:
    """fn(q, k, v, lengths) -> o for one implementation; inputs as ``Workload.inputs``.
    ``interpret`` runs our kernels in Pallas' interpreter (for runs without a GPU)."""
    scale = w.sm_scale
    if w.kind is Kind.PREFILL:
        match impl:
            case Impl.OURS:
                return lambda q, k, v, lengths: flash_attention_gpu(
                    q, k, v, lengths, sm_scale=scale, interpret=interpret)
            case Impl.XLA | Impl.CUDNN:
                return lambda q, k, v, lengths: jax.nn.dot_product_attention(
                    q, k, v, scale=scale, is_causal=True, implementation=impl.value)
            case Impl.UPSTREAM:  # takes k, v already repeated to N heads (see prepare_inputs)
                return lambda q, k, v, lengths: upstream_attention.mha(
                    q, k, v, None, sm_scale=scale, causal=True)
    match impl:
        case Impl.OURS:
            return lambda q, k, v, lengths: decode_attention_gpu(q, k, v, lengths, sm_scale=scale,
                                                                 interpret=interpret)
        case Impl.XLA | Impl.CUDNN:
            return lambda q, k, v, lengths: jax.nn.dot_product_attention(
                q[:, None], k, v, scale=scale, key_value_seq_lengths=lengths,
                implementation=impl.value)[:, 0]
        case Impl.UPSTREAM:
            return lambda q, k, v, lengths: upstream_decode.gqa(
                q, k, v, kv_seq_len=lengths, sm_scale=scale)


def prepare_inputs(impl: Impl, w: Workload, inputs: tuple) -> tuple:
    """The upstream Pallas prefill op needs as many K/V heads as query heads."""
    if impl is Impl.UPSTREAM and w.kind is Kind.PREFILL and w.K != w.N:
        q, k, v, lengths = inputs
        return q, jnp.repeat(k, w.N // w.K, axis=2), jnp.repeat(v, w.N // w.K, axis=2), lengths
    return inputs


def seconds_per_call(fn: Callable, args: tuple, *, min_seconds: float = 0.15) -> float:
    """Best of three timed loops of at least three calls each, after a compiling warm-up call."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - start < min_seconds / 3:
            out = fn(*args)
            calls += 1
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peak:
    tflops: float  # bf16 dense matmul
    gbps: float  # HBM copy, bytes read + written


def _matmul(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _copy(x):
    return x + jnp.ones((), x.dtype)


PEAK_MATMUL = jax.ShapeDtypeStruct((8192, 8192), DTYPE)
PEAK_COPY = jax.ShapeDtypeStruct((1 << 30,), DTYPE)  # 2 GiB read, 2 GiB written


def measure_peak() -> Peak:
    a = jax.random.normal(jax.random.key(1), PEAK_MATMUL.shape, DTYPE)
    t = seconds_per_call(jax.jit(_matmul), (a, a))
    tflops = 2 * PEAK_MATMUL.shape[0] ** 3 / t / 1e12
    del a
    x = jnp.zeros(PEAK_COPY.shape, DTYPE)
    t = seconds_per_call(jax.jit(_copy), (x,))
    return Peak(tflops=tflops, gbps=2 * x.nbytes / t / 1e9)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    workload: Workload
    impl: Impl
    seconds: float | None = None
    max_error: float | None = None
    note: str = ""

    def cells(self, peak: Peak | None) -> list[str]:
        w = self.workload
        cells = [w.kind.value, str(w), self.impl.value]
        if self.seconds is None:
            return cells + ["-"] * 5 + [self.note]
        tflops, gbps = w.flops / self.seconds / 1e12, w.bytes / self.seconds / 1e9
        fraction = "-"
        if peak is not None:
            fraction = f"{tflops / peak.tflops:.0%}" if w.kind is Kind.PREFILL else \
                f"{gbps / peak.gbps:.0%}"
        error = "-" if self.max_error is None else f"{self.max_error:.1e}"
        return cells + [f"{self.seconds * 1e3:.3f}", f"{tflops:.1f}", f"{gbps:.0f}", fraction,
                        error, self.note]


HEADER = ["kind", "shape", "implementation", "ms", "TFLOP/s", "GB/s", "of peak", "max|Δ|", "note"]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for r in [HEADER, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def expected_output_shape(w: Workload) -> tuple[int, ...]:
    return (w.B, w.T, w.N, w.H) if w.kind is Kind.PREFILL else (w.B, w.N, w.H)


def dry_run() -> int:
    """Trace every case abstractly (``jax.eval_shape``), check its output shape, and lower it for
    CUDA (for the Pallas kernels that runs the Triton lowering, which checks every tile). cuDNN
    cannot be traced without a GPU; the XLA implementation, which takes the same arguments, stands
    in for it."""
    rows, failures = [], 0
    for w in WORKLOADS:
        for impl in Impl:
            traced = Impl.XLA if impl is Impl.CUDNN else impl
            abstract = w.abstract_inputs()
            if traced is Impl.UPSTREAM and w.kind is Kind.PREFILL:
                abstract = (abstract[0], abstract[0], abstract[0], abstract[3])
            fn = attention_fn(traced, w)
            try:
                out = jax.eval_shape(fn, *abstract)
                if out.shape != expected_output_shape(w):
                    raise ValueError(f"output shape {out.shape} != {expected_output_shape(w)}")
                jax.jit(fn).trace(*abstract).lower(lowering_platforms=("cuda",))
                note = "ok" if traced is impl else f"ok (as {traced.value})"
            except Exception as e:  # report every broken case, not just the first
                failures += 1
                note = f"{type(e).__name__}: {e}"
            rows.append([w.kind.value, str(w), impl.value, f"{w.flops / 1e9:.4g} GFLOP",
                         f"{w.bytes / 1e9:.3g} GB", note])
    for fn, args in ((_matmul, (PEAK_MATMUL, PEAK_MATMUL)), (_copy, (PEAK_COPY,))):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip())
    print(f"dry run: {len(rows)} cases, {failures} failed")
    return 1 if failures else 0


def benchmark(budget_seconds: float) -> int:
    if jax.default_backend() != "gpu":
        print(f"needs a GPU (backend is {jax.default_backend()!r}); use --dry-run elsewhere")
        return 2
    start = time.perf_counter()
    peak = measure_peak()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: measured peak "
          f"{peak.tflops:.0f} TFLOP/s (bf16 matmul), {peak.gbps:.0f} GB/s (copy)", flush=True)
    rows = []
    for w in WORKLOADS:
        inputs = w.inputs()
        reference = None
        for impl in (Impl.XLA, Impl.OURS, Impl.CUDNN, Impl.UPSTREAM):
            if time.perf_counter() - start > budget_seconds:
                rows.append(Row(workload=w, impl=impl, note="skipped: time budget"))
                continue
            try:
                fn = jax.jit(attention_fn(impl, w))
                args = prepare_inputs(impl, w, inputs)
                out = fn(*args).astype(jnp.float32)
                if impl is Impl.XLA:
                    reference = out
                error = None if reference is None else float(jnp.max(jnp.abs(out - reference)))
                rows.append(Row(workload=w, impl=impl, seconds=seconds_per_call(fn, args),
                                max_error=error))
                del out, args
            except Exception as e:  # an implementation that rejects a shape or runs out of memory
                rows.append(Row(workload=w, impl=impl, note=f"failed: {type(e).__name__}: "
                                                            f"{str(e).splitlines()[0][:80]}"))
            print(" ".join(rows[-1].cells(peak)), flush=True)
        del inputs, reference
    print()
    print_table([r.cells(peak) for r in rows])
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="trace and shape-check every case without a GPU, no timing")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no new case after this many seconds (default 240)")
    args = parser.parse_args(argv)
    return dry_run() if args.dry_run else benchmark(args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
