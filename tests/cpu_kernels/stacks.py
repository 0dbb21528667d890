"""Shared by the product tests: a jitted product reads its stacks of weights in place."""

import jax.numpy as jnp

import cpu_kernels


def assert_one_call_on_whole_stacks(lowered, target: str, dtype, L: int, stacks: int) -> None:
    """The compiled program makes one call of ``target`` whose operands include ``stacks`` whole stacks [L, ...]
    of ``dtype`` weights, and slices none out of them (L must be unlike every other leading dimension)."""
    if not cpu_kernels.available():
        return
    hlo = lowered.compile().as_text()
    calls = [line for line in hlo.splitlines() if f'custom_call_target="{target}' in line]
    stack = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.int8): "s8"}.get(jnp.dtype(dtype), "f32") + f"[{L},"
    assert len(calls) == 1 and calls[0].count(stack) == stacks and "dynamic-slice" not in hlo, hlo
