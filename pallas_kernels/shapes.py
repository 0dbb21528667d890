"""Validation of the attention arguments, shared by every kernel's public wrapper.

Shapes are static under ``jit``, so every mistake is reported at trace time with the values that
caused it. ``lengths_B`` is traced, so its values cannot be checked here: each must be in [0, S].
"""

import dataclasses

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionDims:
    """The sizes of one attention call, in the letters of the dimension key."""

    B: int  # batch
    T: int  # queries per sequence (1 for decode)
    S: int  # keys per sequence (cache capacity)
    N: int  # query heads
    K: int  # kv heads
    H: int  # head dim

    @property
    def G(self) -> int:
        """Query heads per kv head."""
        return self.N // self.K


def check_prefill(q_BTNH, k_BSKH, v_BSKH, lengths_B, *, sliding_window, logit_softcap
                  ) -> AttentionDims:
    """Dimensions of a prefill call, or a ValueError naming the offending tensor and values."""
    if q_BTNH.ndim != 4:
        raise ValueError(f"q_BTNH must be [B, T, N, H], got shape {q_BTNH.shape}")
    dims = _check_kv(q_BTNH.shape[0], q_BTNH.shape[2], q_BTNH.shape[3], q_BTNH.dtype,
                     k_BSKH, v_BSKH, lengths_B, T=q_BTNH.shape[1])
    if dims.S < dims.T:
        raise ValueError(f"prefill needs a key for every query: S={dims.S} < T={dims.T} "
                         f"(q_BTNH {q_BTNH.shape}, k_BSKH {k_BSKH.shape})")
    _check_options(sliding_window, logit_softcap)
    return dims


def check_decode(q_BNH, k_BSKH, v_BSKH, lengths_B, *, sliding_window, logit_softcap
                 ) -> AttentionDims:
    """Dimensions of a decode call (T = 1), or a ValueError naming the offending values."""
    if q_BNH.ndim != 3:
        raise ValueError(f"q_BNH must be [B, N, H], got shape {q_BNH.shape}")
    dims = _check_kv(q_BNH.shape[0], q_BNH.shape[1], q_BNH.shape[2], q_BNH.dtype,
                     k_BSKH, v_BSKH, lengths_B, T=1)
    _check_options(sliding_window, logit_softcap)
    return dims


def check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _check_kv(B, N, H, q_dtype, k_BSKH, v_BSKH, lengths_B, *, T) -> AttentionDims:
    if k_BSKH.ndim != 4:
        raise ValueError(f"k_BSKH must be [B, S, K, H], got shape {k_BSKH.shape}")
    if v_BSKH.shape != k_BSKH.shape:
        raise ValueError(f"v_BSKH shape {v_BSKH.shape} != k_BSKH shape {k_BSKH.shape}")
    kB, S, K, kH = k_BSKH.shape
    if kB != B:
        raise ValueError(f"batch of k_BSKH ({kB}) != batch of the queries ({B})")
    if kH != H:
        raise ValueError(f"head dim of k_BSKH ({kH}) != head dim of the queries ({H})")
    if K < 1 or N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    for name, dtype in (("q", q_dtype), ("k", k_BSKH.dtype), ("v", v_BSKH.dtype)):
        if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {dtype} is not one of "
                             f"{[str(d) for d in SUPPORTED_DTYPES]}")
    if not (jnp.dtype(q_dtype) == k_BSKH.dtype == v_BSKH.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q_dtype}, {k_BSKH.dtype}, {v_BSKH.dtype}")
    if jnp.shape(lengths_B) != (B,) or not jnp.issubdtype(jnp.result_type(lengths_B), jnp.integer):
        raise ValueError(f"lengths_B must be integers of shape ({B},), got shape "
                         f"{jnp.shape(lengths_B)} dtype {jnp.result_type(lengths_B)}")
    if min(B, T, S, N, H) < 1:
        raise ValueError(f"empty attention: B={B}, T={T}, S={S}, N={N}, H={H}")
    return AttentionDims(B=B, T=T, S=S, N=N, K=K, H=H)


def _check_options(sliding_window, logit_softcap) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap!r}")


def as_lengths(lengths_B) -> jax.Array:
    """lengths as int32, the index type of every kernel."""
    return jnp.asarray(lengths_B).astype(jnp.int32)
