"""Shared pieces of the kernel tests: cases, inputs, and the comparison with the reference.

Cases are drawn hypothesis-style from a seeded generator (so every run tests the same, bounded set
of shapes, and a failure names its case) next to hand-written cases for each acceptance point.
Shapes are small and odd: interpret mode runs each grid step on the CPU.

The kernels run in Pallas' interpreter unless ``LLM_JAX_PALLAS_INTERPRET=0``: then a variant whose
platform is the backend's (the Triton kernels on a GPU, the Mosaic ones on a TPU) is compiled for
real, and only the other is interpreted (``scripts/gpu_check.sh`` runs the tests so on a GPU).
"""

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def interpret_variant(platform: str) -> bool:
    """Whether the tests interpret the kernels written for ``platform`` ("gpu" or "tpu")."""
    compile_native = os.environ.get("LLM_JAX_PALLAS_INTERPRET", "1") == "0"
    return not (compile_native and jax.default_backend() == platform)


GPU_INTERPRET = interpret_variant("gpu")
TPU_INTERPRET = interpret_variant("tpu")
# For the public entry points: None lets them compile the native variant, True interprets.
DISPATCH_INTERPRET = None if os.environ.get("LLM_JAX_PALLAS_INTERPRET", "1") == "0" else True

# Largest allowed max |out - ref| / max |ref| per dtype (the acceptance bounds).
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One attention call: sizes in the dimension key, lengths, options and block sizes."""

    B: int = 1
    T: int = 1  # 1 for decode
    S: int
    N: int
    K: int
    H: int
    lengths: tuple[int, ...]
    dtype: str = "float32"
    sliding_window: int | None = None
    logit_softcap: float | None = None
    block_q: int | None = None
    block_k: int | None = None
    num_splits: int | None = None

    def __post_init__(self):
        assert len(self.lengths) == self.B and self.N % self.K == 0, self

    def __str__(self):
        fields = [f"B{self.B}T{self.T}S{self.S}N{self.N}K{self.K}H{self.H}", self.dtype,
                  "L" + "-".join(map(str, self.lengths))]
        for name in ("sliding_window", "logit_softcap", "block_q", "block_k", "num_splits"):
            if (value := getattr(self, name)) is not None:
                fields.append(f"{name}={value}")
        return ",".join(fields)

    @property
    def sm_scale(self) -> float:
        return self.H ** -0.5

    @property
    def options(self) -> dict:
        return dict(sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                    logit_softcap=self.logit_softcap)


def prefill_inputs(case: Case, seed: int = 0):
    """q_BTNH, k_BSKH, v_BSKH, lengths_B: standard normal in the case's dtype."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.standard_normal((case.B, case.T, case.N, case.H)), dtype)
    k = jnp.asarray(rng.standard_normal((case.B, case.S, case.K, case.H)), dtype)
    v = jnp.asarray(rng.standard_normal((case.B, case.S, case.K, case.H)), dtype)
    return q, k, v, jnp.asarray(case.lengths, jnp.int32)


def decode_inputs(case: Case, seed: int = 0):
    """q_BNH, k_BSKH, v_BSKH, lengths_B."""
    q, k, v, lengths = prefill_inputs(case, seed)
    return q[:, 0], k, v, lengths


def stacked_decode_inputs(case: Case, num_layers: int, seed: int = 0):
    """q_BNH, k_LBSKH, v_LBSKH, lengths_B: every layer's cache different."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.standard_normal((case.B, case.N, case.H)), dtype)
    shape = (num_layers, case.B, case.S, case.K, case.H)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    return q, k, v, jnp.asarray(case.lengths, jnp.int32)


def as_bits(x: jax.Array) -> jax.Array:
    """bfloat16 values as their bits (uint16), the form of llm_jax's bfloat16 CPU cache."""
    assert x.dtype == jnp.bfloat16, x.dtype
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def stale_past_lengths(x_BSKH: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """x with NaN at every cache position at or past its sequence's length (a stale cache)."""
    stale_BS11 = jnp.arange(x_BSKH.shape[1])[None, :, None, None] >= lengths_B[:, None, None, None]
    return jnp.where(stale_BS11, jnp.nan, x_BSKH)


def lower(attention: Callable, platform: str, q_shape: tuple, kv_shape: tuple, dtype: str) -> str:
    """StableHLO text of ``attention(q, k, v, lengths)`` lowered for ``platform`` ("cuda" runs the
    Triton lowering, "tpu" the Mosaic one) from abstract inputs: needs no accelerator."""
    q = jax.ShapeDtypeStruct(q_shape, jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.dtype(dtype))
    lengths = jax.ShapeDtypeStruct(q_shape[:1], jnp.int32)
    traced = jax.jit(attention).trace(q, kv, kv, lengths)
    return traced.lower(lowering_platforms=(platform,)).as_text()


# The custom call a Triton kernel lowers to: up to jaxlib 0.10.2 Triton IR for XLA to compile; later
# the PTX compiled while lowering, called through an FFI handler.
TRITON_CALLS = ("@__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
MOSAIC_CALL = "tpu_custom_call"


def calls_triton(lowered_text: str) -> bool:
    return any(call in lowered_text for call in TRITON_CALLS)


def relative_error(out: jax.Array, ref: jax.Array) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def assert_matches_reference(out: jax.Array, ref: jax.Array) -> None:
    """Every element written (no NaN from the poisoned output) and within the dtype's tolerance."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape)
    out_np, ref_np = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    unwritten = np.sum(~np.isfinite(out_np))
    assert not unwritten, f"{unwritten} elements are NaN or inf: never written by the kernel?"
    tol = TOLERANCE[jnp.dtype(ref.dtype)]
    scale = max(float(np.max(np.abs(ref_np))), 1e-30)
    # rtol=0: the bound is on max |Δ| / max |ref|, which near-zero outputs cannot inflate.
    np.testing.assert_allclose(out_np, ref_np, atol=tol * scale, rtol=0)


def random_prefill_cases(count: int, seed: int) -> list[Case]:
    """Odd shapes, every option, Triton-sized blocks (powers of two) so tiles straddle tails."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        B, K, G = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 4, 8]))
        T = 1 if rng.random() < 0.15 else int(rng.integers(2, 90))
        S = T + int(rng.choice([0, 0, int(rng.integers(1, 20))]))
        lengths = tuple(int(rng.choice([0, 1, T, S, int(rng.integers(0, S + 1))]))
                        for _ in range(B))
        cases.append(Case(
            B=B, T=T, S=S, N=K * G, K=K, H=int(rng.choice([16, 24, 32, 40, 64, 80])),
            lengths=lengths, dtype=str(rng.choice(["float32", "bfloat16"])),
            sliding_window=rng.choice([None, int(rng.integers(1, T + 8))]),
            logit_softcap=rng.choice([None, 5.0, 50.0]),
            block_q=int(rng.choice([16, 32])), block_k=int(rng.choice([16, 32])),
        ))
    return cases


def random_decode_cases(count: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        B, K, G = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 4, 8]))
        S = int(rng.integers(1, 200))
        lengths = tuple(int(rng.choice([0, 1, S, int(rng.integers(0, S + 1))])) for _ in range(B))
        cases.append(Case(
            B=B, S=S, N=K * G, K=K, H=int(rng.choice([16, 24, 32, 64, 80])), lengths=lengths,
            dtype=str(rng.choice(["float32", "bfloat16"])),
            sliding_window=rng.choice([None, int(rng.integers(1, S + 8))]),
            logit_softcap=rng.choice([None, 5.0, 50.0]),
            block_k=int(rng.choice([16, 32, 64])), num_splits=int(rng.choice([1, 2, 3, 5])),
        ))
    return cases
