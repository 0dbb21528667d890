"""The instruction paths the product and greedy-head tests run: every choice of the kernels' options (``amx``,
``bf16_dot``, ``int8_dot``: keyword arguments of the ``cpu_kernels`` functions) that takes a path of its own
on this CPU, by what ``cpu_kernels.build`` says the CPU and the build have. All on is every CPU's first
path (the only one where the CPU has none of AMX, AVX512_BF16 and VNNI); then, for bfloat16 products of many
rows, the dot products without AMX where both run, and the float32 tiles without either where one runs; and
the LM head's screens without the int8 quads where VNNI runs."""

import jax.numpy as jnp
import pytest

from cpu_kernels import build

ON = dict(amx=True, bf16_dot=True, int8_dot=True)
DOT_PRODUCTS = dict(ON, amx=False)  # bfloat16 products on AVX-512's dot products
FLOAT32_TILES = dict(ON, amx=False, bf16_dot=False)  # bfloat16 products on the float32 register tiles
NO_INT8_DOT = dict(ON, int8_dot=False)  # the LM head's screens without the int8 quads


def bfloat16_paths() -> list[tuple[str, dict]]:
    """(name, options) of the paths bfloat16 products on panels take here: "" (all on) first."""
    paths = [("", ON)]
    if build.amx() and build.bf16_dot():
        paths.append(("dot-products", DOT_PRODUCTS))
    if build.amx() or build.bf16_dot():
        paths.append(("float32-tiles", FLOAT32_TILES))
    return paths


def paths(*, int8: bool = False) -> list:
    """pytest params of the options for each bfloat16 path here (ids "all-on", "dot-products",
    "float32-tiles") and, with ``int8``, "no-int8-dot" where VNNI runs."""
    params = [pytest.param(options, id=name or "all-on") for name, options in bfloat16_paths()]
    if int8 and build.int8_dot():
        params.append(pytest.param(NO_INT8_DOT, id="no-int8-dot"))
    return params


def int8_paths() -> list:
    """pytest params of the options for the products on quads: all on, and without VNNI where it runs."""
    return [pytest.param(ON, id="all-on")] + (
        [pytest.param(NO_INT8_DOT, id="no-int8-dot")] if build.int8_dot() else [])


def panel_dtypes() -> list:
    """pytest params (dtype, options) of products on panels: float32, one path ("f32"), and bfloat16 on each
    of its paths here ("bf16", "bf16-dot-products", "bf16-float32-tiles")."""
    return [pytest.param(jnp.float32, ON, id="f32")] + [
        pytest.param(jnp.bfloat16, options, id="-".join(filter(None, ["bf16", name])))
        for name, options in bfloat16_paths()]


def other_paths(*, int8: bool = True) -> list:
    """pytest params of every path here but all on (with ``int8``, the one without the quads too); where the
    CPU has none, one skipped param that says so."""
    params = [p for p in paths(int8=int8) if p.values[0] is not ON]
    return params or [pytest.param(None, id="none-here", marks=pytest.mark.skip(
        reason="this CPU has no other path (none of AMX, AVX512_BF16" + (", VNNI)" if int8 else ")")))]
