"""Decode attention over layer ``layer`` of the stacked caches [L, B, S, K, H], read in place.

Both variants against the reference over that layer (first, middle and last; the layer a traced
value inside ``lax.scan`` and ``lax.fori_loop``), caches of bfloat16 bits, and the proof that no
copy of a layer is made outside the kernel: no operation outside a ``pallas_call`` produces an
array as large as one layer's cache, nor slices or bitcasts the cache in the lowered module.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from attention_testing import (
    DISPATCH_INTERPRET, GPU_INTERPRET, MOSAIC_CALL, TPU_INTERPRET, Case, as_bits,
    assert_matches_reference, calls_triton, stacked_decode_inputs,
)
from pallas_kernels import Platform, decode_attention
from pallas_kernels.decode_attention_gpu import decode_attention_gpu
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from pallas_kernels.reference import decode_attention_reference

L = 5

GPU_CASES = [
    # GQA 3; S and H off the tiles (H 24 -> 32); lengths off the block grid
    Case(B=2, S=45, N=6, K=2, H=24, lengths=(45, 17), block_k=16, num_splits=2),
    # MQA with a sliding window across blocks; an empty sequence; H 80 -> 128
    Case(B=3, S=70, N=4, K=1, H=80, lengths=(70, 1, 0), sliding_window=19, block_k=32,
         num_splits=3),
    # MHA with a soft-cap, bfloat16
    Case(B=1, S=33, N=3, K=3, H=16, lengths=(31,), logit_softcap=5.0, dtype="bfloat16",
         block_k=16),
]
TPU_CASES = [
    # H % 128 == 0: read in place through the index maps; GQA 4; two splits
    Case(B=2, S=260, N=8, K=2, H=128, lengths=(260, 100), block_k=128, num_splits=2),
    # H = 24: the layer is sliced out and transposed (the layout Mosaic can tile); MQA, window,
    # soft-cap, bfloat16
    Case(B=2, S=37, N=2, K=1, H=24, lengths=(37, 5), sliding_window=9, logit_softcap=5.0,
         dtype="bfloat16"),
]
VARIANTS = [(decode_attention_gpu, GPU_INTERPRET, case) for case in GPU_CASES] + [
    (decode_attention_tpu, TPU_INTERPRET, case) for case in TPU_CASES]
LAYERS = (0, L // 2, L - 1)


def _attention(kernel, interpret: bool, case: Case):
    """Jitted kernel(q, k_LBSKH, v_LBSKH, lengths, layer) with the case's options. The Triton kernel
    starts its outputs as NaN (``poison``); the Mosaic one runs in the TPU interpreter, which raises
    on a DMA outside the cache (the prefetched layer steers its index maps)."""
    poison_output = kernel is decode_attention_gpu
    return jax.jit(lambda q, k, v, lengths, layer: kernel(
        q, k, v, lengths, layer=layer, **case.options, block_k=case.block_k,
        num_splits=case.num_splits, interpret=interpret, poison_output=poison_output))


def _reference(case: Case, q, k, v, lengths, layer: int):
    return decode_attention_reference(q, k[layer], v[layer], lengths, **case.options)


def _variant_id(value):
    if isinstance(value, Case):
        return str(value)
    return getattr(value, "__name__", None) or ("interpret" if value else "compiled")


@pytest.mark.parametrize("kernel,interpret,case", VARIANTS, ids=_variant_id)
def test_reads_the_given_layer(kernel, interpret, case: Case):
    """Every layer's cache differs, so reading any other layer than the one asked fails."""
    q, k, v, lengths = stacked_decode_inputs(case, L)
    attention = _attention(kernel, interpret, case)
    for layer in LAYERS:
        out = attention(q, k, v, lengths, jnp.int32(layer))
        assert_matches_reference(out, _reference(case, q, k, v, lengths, layer))


@pytest.mark.parametrize("kernel,interpret,case", [VARIANTS[2], VARIANTS[-1]], ids=_variant_id)
def test_reads_bfloat16_bits_as_bfloat16(kernel, interpret, case: Case):
    """A cache of uint16 bits gives exactly what the bfloat16 cache gives."""
    assert case.dtype == "bfloat16"
    q, k, v, lengths = stacked_decode_inputs(case, L, seed=3)
    attention = _attention(kernel, interpret, case)
    layer = jnp.int32(L - 1)
    out_bits = attention(q, as_bits(k), as_bits(v), lengths, layer)
    np.testing.assert_array_equal(np.asarray(out_bits, np.float32),
                                  np.asarray(attention(q, k, v, lengths, layer), np.float32))
    assert_matches_reference(out_bits, _reference(case, q, k, v, lengths, L - 1))


@pytest.mark.parametrize("kernel,interpret,case", [VARIANTS[0], VARIANTS[3]], ids=_variant_id)
def test_layer_traced_in_scan_and_fori_loop(kernel, interpret, case: Case):
    q, k, v, lengths = stacked_decode_inputs(case, L, seed=1)
    attend = functools.partial(kernel, **case.options, block_k=case.block_k,
                               num_splits=case.num_splits, interpret=interpret)

    @jax.jit
    def scan_layers(q, k, v, lengths):
        def step(carry, layer):
            return carry, attend(q, k, v, lengths, layer=layer)

        return lax.scan(step, None, jnp.arange(L, dtype=jnp.int32))[1]

    @jax.jit
    def fori_layers(q, k, v, lengths):
        def body(layer, o_LBNH):
            return o_LBNH.at[layer].set(attend(q, k, v, lengths, layer=layer))

        return lax.fori_loop(0, L, body, jnp.zeros((L, *q.shape), q.dtype))

    for all_layers in (scan_layers, fori_layers):
        o_LBNH = all_layers(q, k, v, lengths)
        for layer in range(L):
            assert_matches_reference(o_LBNH[layer], _reference(case, q, k, v, lengths, layer))


def test_indexes_the_layer_as_dynamic_index_in_dim():
    """Negative layers count from the end; out-of-range ones are clamped, never read past."""
    case = GPU_CASES[0]
    q, k, v, lengths = stacked_decode_inputs(case, L, seed=2)
    attention = _attention(decode_attention_gpu, GPU_INTERPRET, case)
    for layer, read in ((L + 3, L - 1), (-1, L - 1), (-L - 5, 0)):
        assert_matches_reference(attention(q, k, v, lengths, jnp.int32(layer)),
                                 _reference(case, q, k, v, lengths, read))


@pytest.mark.parametrize("platform", [None, Platform.TPU])
def test_entry_point_passes_the_layer(platform):
    case = Case(B=2, S=40, N=4, K=2, H=16, lengths=(40, 9), logit_softcap=20.0)
    q, k, v, lengths = stacked_decode_inputs(case, L, seed=4)
    out = decode_attention(q, k, v, lengths, layer=jnp.int32(2), **case.options, num_splits=2,
                           platform=platform, interpret=DISPATCH_INTERPRET)
    assert_matches_reference(out, _reference(case, q, k, v, lengths, 2))


# No copy of the layer outside the kernel.

def _layer_sized_ops(closed_jaxpr, layer_elements: int) -> list[str]:
    """Operations outside any pallas_call (in every nested jaxpr: jit, scan, loops) whose result
    has at least ``layer_elements`` elements: each would be a copy of at least a layer. Reshapes
    are views of row-major arrays (the TPU variant views [..., K, H] as [..., K*H])."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("pallas_call", "reshape"):
                continue
            found.extend(f"{eqn.primitive.name} -> {out.aval.str_short()}" for out in eqn.outvars
                         if math.prod(getattr(out.aval, "shape", ())) >= layer_elements)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        visit(sub.jaxpr)

    visit(closed_jaxpr.jaxpr)
    return found


_COPYING_OPS = ("dynamic_slice", "stablehlo.slice", "gather", "transpose", "bitcast_convert",
                "stablehlo.copy")


def _layer_sized_copies_in_hlo(text: str, layer_elements: int) -> list[str]:
    """Lines of the lowered module that slice, gather, transpose or bitcast an array of at least a
    layer's elements."""
    copies = []
    for line in text.splitlines():
        if "custom_call" in line or not any(op in line for op in _COPYING_OPS):
            continue
        sizes = [math.prod(int(d) for d in dims.split("x")[:-1] if d)
                 for dims in re.findall(r"tensor<([0-9x]+x?\w+)>", line)]
        if sizes and max(sizes) >= layer_elements:
            copies.append(line.strip()[:160])
    return copies


def _scan_over_layers(attend, shape_LBSKH, N):
    """fn(q, k, v, lengths) attending every layer in a scan, and its abstract bfloat16 arguments
    (the caches as bits)."""
    num_layers, B, _, _, H = shape_LBSKH

    def scan_layers(q, k, v, lengths):
        def step(carry, layer):
            return carry, attend(q, k, v, lengths, layer)

        return lax.scan(step, None, jnp.arange(num_layers, dtype=jnp.int32))[1]

    kv = jax.ShapeDtypeStruct(shape_LBSKH, jnp.uint16)
    return scan_layers, (jax.ShapeDtypeStruct((B, N, H), jnp.bfloat16), kv, kv,
                         jax.ShapeDtypeStruct((B,), jnp.int32))


# TinyLlama's cache at a 2k context; and H = 128 for the TPU's in-place path.
COPY_SHAPES = [("gpu", (22, 1, 2048, 4, 64), 32), ("tpu", (4, 2, 1024, 8, 128), 32)]


@pytest.mark.parametrize("platform,shape_LBSKH,N", COPY_SHAPES)
@pytest.mark.parametrize("sliced", [False, True], ids=["stacked", "sliced (control)"])
def test_no_copy_of_the_layer_outside_the_kernel(platform, shape_LBSKH, N, sliced):
    """The stacked call makes no layer-sized array outside the kernel, in the jaxpr or the module
    lowered for the variant's platform. The control, slicing the layer out first as the model used
    to, must be caught by the same checks (so they can fail)."""
    kernel = decode_attention_gpu if platform == "gpu" else decode_attention_tpu
    sm_scale = shape_LBSKH[-1] ** -0.5

    def attend(q, k, v, lengths, layer):
        if sliced:
            k, v = (lax.bitcast_convert_type(lax.dynamic_index_in_dim(c, layer, keepdims=False),
                                             jnp.bfloat16) for c in (k, v))
            return kernel(q, k, v, lengths, sm_scale=sm_scale)
        return kernel(q, k, v, lengths, sm_scale=sm_scale, layer=layer)

    fn, args = _scan_over_layers(attend, shape_LBSKH, N)
    layer_elements = math.prod(shape_LBSKH[1:])
    ops = _layer_sized_ops(jax.make_jaxpr(fn)(*args), layer_elements)
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda" if platform == "gpu" else "tpu",)).as_text()
    assert calls_triton(text) if platform == "gpu" else MOSAIC_CALL in text
    copies = _layer_sized_copies_in_hlo(text, layer_elements)
    if sliced:
        assert any("dynamic_slice" in op for op in ops), ops
        assert copies, "the control's dynamic_slice of the cache was not found in the module"
    else:
        assert not ops, f"layer-sized arrays made outside the kernel: {ops}"
        assert not copies, "\n".join(copies)


@pytest.mark.parametrize("dtype", ["uint16", "bfloat16", "float32"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_stacked_decode_lowers(platform, dtype):
    kernel = decode_attention_gpu if platform == "cuda" else decode_attention_tpu
    q_dtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
    q = jax.ShapeDtypeStruct((8, 16, 128), q_dtype)
    kv = jax.ShapeDtypeStruct((6, 8, 4096, 8, 128), jnp.dtype(dtype))
    attend = functools.partial(kernel, sm_scale=128 ** -0.5, sliding_window=1024,
                               logit_softcap=30.0)
    traced = jax.jit(lambda q, k, v, n, layer: attend(q, k, v, n, layer=layer)).trace(
        q, kv, kv, jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert calls_triton(text) if platform == "cuda" else MOSAIC_CALL in text


@pytest.mark.parametrize("make_args,message", [
    (lambda q, k, v: (q, k[0], v[0], jnp.int32(1)), "with layer, k_cache must be the stacked"),
    (lambda q, k, v: (q, k, v, None), r"is a stacked cache \[L, B, S, K, H\]: pass"),
    (lambda q, k, v: (q, k, v, jnp.zeros(2, jnp.int32)), "layer must be an integer scalar"),
    (lambda q, k, v: (q, k, v, jnp.float32(1)), "layer must be an integer scalar"),
    (lambda q, k, v: (q.astype(jnp.float32), as_bits(k), as_bits(v), 0), "dtypes differ"),
    (lambda q, k, v: (as_bits(q), as_bits(k), as_bits(v), 0), "q dtype uint16 is not one of"),
])
def test_rejects_bad_layer_arguments(make_args, message):
    case = Case(B=1, S=20, N=2, K=1, H=16, lengths=(20,), dtype="bfloat16")
    q, k, v, lengths = stacked_decode_inputs(case, 2)
    q, k, v, layer = make_args(q, k, v)
    with pytest.raises(ValueError, match=message):
        decode_attention_gpu(q, k, v, lengths, sm_scale=0.25, layer=layer, interpret=True)
