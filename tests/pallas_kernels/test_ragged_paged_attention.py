"""Ragged paged attention (a serving step over a paged KV cache): the oracle anchored to dense
attention over each sequence's contiguous keys, both kernel variants interpreted on the CPU against
it, the stacked pages read in place for a traced layer, int8 pages (pairs of values and scales)
dequantized as they are read, the Pallas backend over an int8 cache against XLA's, their
lowering, tiles and argument errors.

Every case mixes sequences in one call: decode tokens and prefill chunks, placed in q in shuffled
order with padding rows between them, pages assigned from a shuffled pool (block tables out of
order, last pages partial), and padding sequences (no tokens, length 0). Tolerances are
``attention_testing.TOLERANCE``: max |out - ref| <= 1e-5 max |ref| in float32, 2e-2 in bfloat16.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from attention_testing import (
    DISPATCH_INTERPRET, MOSAIC_CALL, as_bits, assert_matches_reference, calls_triton,
)
from llm_jax.kv_cache import dequantize_kv
from paged_testing import (
    PagedCase, assert_padding_rows_zero, dequantized, int8_cache_step, int8_inputs, paged_inputs,
    random_cases, reference, run_gpu, run_tpu, stale_pages,
)
from pallas_kernels import Platform, gpu_tiles, ragged_paged_attention, ragged_paging, shapes
from pallas_kernels import ragged_paged_attention_gpu as gpu_module
from pallas_kernels import ragged_paged_attention_tpu as tpu_module
from pallas_kernels import tpu_tiles
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu
from pallas_kernels.reference import attention_reference, ragged_paged_attention_reference


# The oracle, anchored.

ANCHOR_CASES = [
    PagedCase(seqs=((1, 23), (11, 11), (0, 0), (6, 30), (1, 1)), T=22, N=6, K=2, H=8, Z=5),
    PagedCase(seqs=((1, 40), (9, 33), (13, 13), (1, 14)), T=26, N=4, K=1, H=8, Z=7,
              sliding_window=9, logit_softcap=5.0),
    PagedCase(seqs=((4, 4), (1, 16), (1, 17)), T=6, N=3, K=3, H=16, Z=16, sliding_window=2),
]


@pytest.mark.parametrize("case", ANCHOR_CASES, ids=str)
def test_reference_is_dense_attention_over_each_sequences_contiguous_keys(case: PagedCase):
    """Each sequence's keys copied out of the pages in order (numpy loops), then the dense causal
    attention of ``attention_reference`` (itself checked against PyTorch) with its queries at
    positions seq_len - num_tokens + i; padding rows 0."""
    inputs = paged_inputs(case, seed=5)
    out = np.asarray(reference(case, inputs))
    k_pages, v_pages = np.asarray(inputs.k_pages), np.asarray(inputs.v_pages)
    tables = np.asarray(inputs.block_tables_BX)
    for b, (n, length) in enumerate(case.seqs):
        if n == 0:
            continue
        k_SKH = np.stack([k_pages[tables[b, s // case.Z], s % case.Z] for s in range(length)])
        v_SKH = np.stack([v_pages[tables[b, s // case.Z], s % case.Z] for s in range(length)])
        start = int(inputs.query_start_B[b])
        q_1TNH = inputs.q_TNH[None, start:start + n]
        dense = attention_reference(q_1TNH, k_SKH[None], v_SKH[None], jnp.array([length]),
                                    q_offset=length - n, **case.options)[0]
        np.testing.assert_allclose(out[start:start + n], np.asarray(dense), atol=2e-6, rtol=0)
    assert_padding_rows_zero(out, inputs)


# The Triton kernel.

GPU_CASES = [
    # GQA 3; pages of 5 (not a power of two) in shuffled order, block_k 16 spans pages; decode at a
    # page's first row (length 1 and 11 = 2 * 5 + 1); a whole prompt; a padding sequence
    PagedCase(seqs=((1, 23), (11, 11), (0, 0), (6, 30), (1, 1), (1, 11)), T=24, N=6, K=2, H=24,
              Z=5, block_q=4, block_k=16),
    # MQA; H 40 -> 64; a sliding window across page boundaries; 3 key splits
    PagedCase(seqs=((1, 40), (9, 33), (13, 13)), T=25, N=4, K=1, H=40, Z=7, sliding_window=9,
              block_q=3, block_k=16, num_splits=3),
    # MHA; soft-cap; bfloat16; a chunk of 20 after 30 cached tokens, in 3 tiles whose last
    # queries stop short of the sequence's end
    PagedCase(seqs=((1, 70), (20, 50), (1, 17)), T=23, N=3, K=3, H=16, Z=16,
              logit_softcap=5.0, dtype="bfloat16", block_q=8, block_k=32),
    # G 8 with a window of 1 (each query sees only itself); pages of 4
    PagedCase(seqs=((5, 5), (1, 9)), T=7, N=8, K=1, H=32, Z=4, sliding_window=1, block_q=2,
              block_k=16, num_splits=2),
    # the default tiles and splits
    PagedCase(seqs=((1, 100), (37, 60), (0, 0), (1, 33)), T=41, N=8, K=2, H=64, Z=16),
    # nothing to attend: only padding sequences and rows
    PagedCase(seqs=((0, 0), (0, 0)), T=3, N=2, K=1, H=16, Z=4, block_q=2, num_splits=2),
]


@pytest.mark.parametrize("case", GPU_CASES + random_cases(6, seed=44), ids=str)
def test_gpu_matches_reference_and_writes_every_row(case: PagedCase):
    inputs = paged_inputs(case)
    out = run_gpu(case, inputs)
    assert_matches_reference(out, reference(case, inputs))
    assert_padding_rows_zero(out, inputs)


def test_gpu_split_count_does_not_change_the_result():
    """Flash-Decoding's combine is exact up to rounding: 1 split and 4 agree to float32 eps."""
    case = GPU_CASES[1]
    inputs = paged_inputs(case, seed=2)
    one, four = (run_gpu(dataclasses.replace(case, num_splits=c), inputs) for c in (1, 4))
    np.testing.assert_allclose(np.asarray(one), np.asarray(four), atol=2e-6, rtol=0)


# The Mosaic kernel (slower to interpret: fewer, smaller cases).

TPU_CASES = [
    # H 128: pages read in place; GQA 4; two pages per step; mixed decode / chunk / prompt /
    # padding sequence
    PagedCase(seqs=((1, 19), (7, 7), (0, 0), (5, 21), (1, 9)), T=17, N=8, K=2, H=128, Z=8,
              block_q=3, pages_per_step=2),
    # H 24 (the layer's pages transposed first); MQA; window across pages of 5; soft-cap; bfloat16
    PagedCase(seqs=((1, 26), (9, 22), (1, 3)), T=12, N=2, K=1, H=24, Z=5, sliding_window=8,
              logit_softcap=5.0, dtype="bfloat16", block_q=4, pages_per_step=3),
    # the default tiles
    PagedCase(seqs=((1, 30), (12, 12)), T=14, N=4, K=2, H=16, Z=4),
]


@pytest.mark.parametrize("case", TPU_CASES, ids=str)
def test_tpu_matches_reference_and_writes_every_row(case: PagedCase):
    inputs = paged_inputs(case)
    out = run_tpu(case, inputs)
    assert_matches_reference(out, reference(case, inputs))
    assert_padding_rows_zero(out, inputs)


@pytest.mark.parametrize("case", TPU_CASES[:1], ids=str)
def test_tpu_matches_reference_in_the_tpu_interpreter(case: PagedCase):
    """Pallas' TPU interpreter simulates the DMAs the index maps ask for and raises on one outside
    the pages."""
    inputs = paged_inputs(case, seed=1)
    assert_matches_reference(run_tpu(case, inputs, poison_output=False), reference(case, inputs))


# Both variants: stale pages, stacked layers, bfloat16 bits.

VARIANTS = {"gpu": (run_gpu, GPU_CASES[0]), "tpu": (run_tpu, TPU_CASES[0])}


@pytest.mark.parametrize("variant", VARIANTS)
def test_ignores_page_rows_no_sequence_holds(variant):
    """NaN in unused pages and past each sequence's length changes nothing."""
    run, case = VARIANTS[variant]
    inputs = paged_inputs(case, seed=3)
    stale = inputs.replace(k_pages=stale_pages(inputs.k_pages, inputs, case.Z),
                           v_pages=stale_pages(inputs.v_pages, inputs, case.Z))
    assert_matches_reference(run(case, stale), reference(case, inputs))


L = 3


def scanned_layers(run, case, inputs) -> jax.Array:
    """``run`` over each layer of stacked pages inside one jitted ``lax.scan``, the layer traced: o [L, T, N, H]."""

    @jax.jit
    def scan_layers():
        def step(carry, layer):
            return carry, run(case, inputs, layer=layer)

        return lax.scan(step, None, jnp.arange(L, dtype=jnp.int32))[1]

    return scan_layers()


@pytest.mark.parametrize("variant", VARIANTS)
def test_reads_the_given_layer_of_stacked_pages_in_a_scan(variant):
    """Every layer's pages differ; the layer is traced (a lax.scan over layers). Out-of-range
    layers are read as lax.dynamic_index_in_dim reads them."""
    run, case = VARIANTS[variant]
    inputs = paged_inputs(case, seed=4, num_layers=L)
    o_LTNH = scanned_layers(run, case, inputs)
    for layer in range(L):
        assert_matches_reference(o_LTNH[layer], reference(case, inputs, layer=layer))
    one_layer = jax.jit(lambda layer: run(case, inputs, layer=layer))
    for layer, read in ((L + 2, L - 1), (-1, L - 1)):
        assert_matches_reference(one_layer(jnp.int32(layer)), reference(case, inputs, layer=read))


@pytest.mark.parametrize("variant", VARIANTS)
def test_reads_bfloat16_bits_as_bfloat16(variant):
    """Pages of uint16 bits give exactly what the bfloat16 pages give."""
    run, case = VARIANTS[variant]
    case = dataclasses.replace(case, dtype="bfloat16")
    inputs = paged_inputs(case, seed=6, num_layers=2)
    layer = jnp.int32(1)
    out = run(case, inputs, layer=layer)
    bits = run(case, inputs.replace(k_pages=as_bits(inputs.k_pages),
                                    v_pages=as_bits(inputs.v_pages)), layer=layer)
    np.testing.assert_array_equal(np.asarray(bits, np.float32), np.asarray(out, np.float32))
    assert_matches_reference(bits, reference(case, inputs, layer=1))


def _large_ops_outside_kernels(closed_jaxpr, min_elements: int) -> list[str]:
    """Operations outside any pallas_call (in every nested jaxpr) whose result has at least
    ``min_elements`` elements: each would be a copy of a layer's pages. Reshapes are views."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("pallas_call", "reshape"):
                continue
            found.extend(f"{eqn.primitive.name} -> {out.aval.str_short()}" for out in eqn.outvars
                         if math.prod(getattr(out.aval, "shape", ())) >= min_elements)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        visit(sub.jaxpr)

    visit(closed_jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("kernel", [ragged_paged_attention_gpu, ragged_paged_attention_tpu],
                         ids=["gpu", "tpu"])
def test_no_copy_of_a_layers_pages_outside_the_kernel(kernel):
    """A scan over 4 layers of bfloat16-bit pages (TinyLlama-like pool, H 128) makes no array as
    large as one layer's pages outside the kernel; the control, slicing the layer out first,
    does."""
    shape_LPZKH, T, B, X, N = (4, 512, 16, 8, 128), 64, 8, 64, 32
    S = jax.ShapeDtypeStruct
    pages = S(shape_LPZKH, jnp.uint16)
    args = (S((T, N, 128), jnp.bfloat16), pages, pages, S((B, X), jnp.int32),
            *[S((B,), jnp.int32)] * 3)

    def scan_layers(sliced):
        def fn(q, k, v, *rest):
            def step(carry, layer):
                if sliced:
                    kl, vl = (lax.bitcast_convert_type(lax.dynamic_index_in_dim(
                        c, layer, keepdims=False), jnp.bfloat16) for c in (k, v))
                    return carry, kernel(q, kl, vl, *rest, sm_scale=0.1, interpret=True)
                return carry, kernel(q, k, v, *rest, sm_scale=0.1, layer=layer, interpret=True)

            return lax.scan(step, None, jnp.arange(shape_LPZKH[0], dtype=jnp.int32))[1]

        return fn

    layer_elements = math.prod(shape_LPZKH[1:])
    assert not _large_ops_outside_kernels(jax.make_jaxpr(scan_layers(False))(*args),
                                          layer_elements)
    assert _large_ops_outside_kernels(jax.make_jaxpr(scan_layers(True))(*args), layer_elements)


@pytest.mark.parametrize("kernel", [ragged_paged_attention_gpu, ragged_paged_attention_tpu],
                         ids=["gpu", "tpu"])
def test_no_copy_of_a_layers_int8_pages_or_scales_outside_the_kernel(kernel):
    """A scan over 4 layers of int8 pages and scales (H 128) makes no array as large as one layer's
    pages outside the kernel, nor one of a layer's scales' shape; the control, H 64 on the TPU
    (whose layer is sliced out and transposed), does."""
    L_, P, Z, K, T, B, X, N = 4, 512, 16, 8, 64, 8, 64, 32
    S = jax.ShapeDtypeStruct

    def copies(H):
        pages = (S((L_, P, Z, K, H), jnp.int8), S((L_, P, Z, K), jnp.float32))
        args = (S((T, N, H), jnp.bfloat16), pages, pages, S((B, X), jnp.int32),
                *[S((B,), jnp.int32)] * 3)

        def fn(q, k, v, *rest):
            def step(carry, layer):
                return carry, kernel(q, k, v, *rest, sm_scale=0.1, layer=layer, interpret=True)

            return lax.scan(step, None, jnp.arange(L_, dtype=jnp.int32))[1]

        def elements(op: str) -> int:  # of "name -> dtype[d0,d1,...]"
            return math.prod(int(n) for n in op.split("[")[-1].rstrip("]").split(",") if n)

        found = _large_ops_outside_kernels(jax.make_jaxpr(fn)(*args), P * Z * K)
        return [op for op in found if f"{P},{Z},{K}]" in op or elements(op) >= P * Z * K * H]

    assert not copies(128)
    if kernel is ragged_paged_attention_tpu:
        assert copies(64)


@pytest.mark.parametrize("platform", [None, Platform.TPU])
def test_entry_point(platform):
    case = PagedCase(seqs=((1, 12), (6, 9), (0, 0)), T=8, N=4, K=2, H=16, Z=4,
                     sliding_window=5, logit_softcap=20.0)
    inputs = paged_inputs(case, seed=7)
    out = ragged_paged_attention(*inputs.args, **case.options, platform=platform,
                                 interpret=DISPATCH_INTERPRET)
    assert_matches_reference(out, reference(case, inputs))


# Int8 pages: each of k and v a pair (int8 values, float32 scales [..., Z, K]), quantized from
# random floats by llm_jax's quantize_kv, every slot's scale different; the kernels dequantize each
# tile as they load it and must give the reference's attention over the same pairs.

INT8_CASES = {
    "gpu": [
        # GQA 3; pages of 5 (not a power of two), shuffled, partial last pages, block_k 16 spans
        # them; H 24 -> 32 (masked columns); a window across pages; soft-cap; a padding sequence
        PagedCase(seqs=((1, 23), (11, 11), (0, 0), (6, 30), (1, 11)), T=21, N=6, K=2, H=24, Z=5,
                  sliding_window=9, logit_softcap=5.0, block_q=4, block_k=16),
        # MQA; pages of 7; 3 key splits
        PagedCase(seqs=((1, 40), (9, 33), (13, 13)), T=25, N=4, K=1, H=40, Z=7, block_q=3,
                  block_k=16, num_splits=3),
        # a bfloat16 q: tiles dequantized in float32, then bfloat16 for the products
        PagedCase(seqs=((1, 30), (8, 20)), T=10, N=4, K=2, H=16, Z=6, dtype="bfloat16",
                  logit_softcap=5.0, block_q=4, block_k=16),
    ],
    "tpu": [
        # H 128: pages and scales read in place; GQA 4; two pages per step; a padding sequence
        PagedCase(seqs=((1, 19), (7, 7), (0, 0), (5, 21), (1, 9)), T=17, N=8, K=2, H=128, Z=8,
                  block_q=3, pages_per_step=2),
        # H 24 (the layer's pages transposed); GQA 3; pages of 5; a window; soft-cap
        PagedCase(seqs=((1, 26), (9, 22), (1, 3)), T=12, N=6, K=2, H=24, Z=5, sliding_window=8,
                  logit_softcap=5.0, block_q=4, pages_per_step=3),
        # a bfloat16 q; the default tiles; pages of 6
        PagedCase(seqs=((1, 30), (12, 12)), T=14, N=4, K=2, H=16, Z=6, dtype="bfloat16"),
    ],
}
RUNS = {"gpu": run_gpu, "tpu": run_tpu}


@pytest.mark.parametrize("variant,case", [(variant, case) for variant, cases in INT8_CASES.items()
                                          for case in cases], ids=str)
def test_int8_pages_match_the_reference_on_the_same_pages(variant, case):
    inputs = int8_inputs(paged_inputs(case, seed=8), seed=1)
    out = RUNS[variant](case, inputs)
    assert_matches_reference(out, reference(case, inputs))
    assert_padding_rows_zero(out, inputs)


@pytest.mark.parametrize("case", INT8_CASES["tpu"][:2], ids=str)
def test_int8_pages_in_the_tpu_interpreter(case):
    """The TPU interpreter simulates the scales' DMAs too, and raises on one outside them."""
    inputs = int8_inputs(paged_inputs(case, seed=9), seed=2)
    assert_matches_reference(run_tpu(case, inputs, poison_output=False), reference(case, inputs))


@pytest.mark.parametrize("variant", RUNS)
def test_int8_pages_ignore_rows_no_sequence_holds(variant):
    """NaN scales in unused pages and past each sequence's length change nothing."""
    case = INT8_CASES[variant][0]
    inputs = int8_inputs(paged_inputs(case, seed=10), seed=3)

    def stale(pair):
        values, scales = pair
        return values, stale_pages(scales[..., None], inputs, case.Z)[..., 0]

    out = RUNS[variant](case, inputs.replace(k_pages=stale(inputs.k_pages),
                                             v_pages=stale(inputs.v_pages)))
    assert_matches_reference(out, reference(case, inputs))


@pytest.mark.parametrize("variant", RUNS)
def test_int8_pages_read_the_given_layer_in_a_scan(variant):
    """Stacked int8 pages and scales [L, P, Z, K(, H)], each layer different, the layer traced;
    the TPU case's H 24 slices the layer's scales out with its pages, the GPU's reads in place."""
    case = INT8_CASES[variant][1 if variant == "tpu" else 0]
    inputs = int8_inputs(paged_inputs(case, seed=11, num_layers=L), seed=4)
    o_LTNH = scanned_layers(RUNS[variant], case, inputs)
    for layer in range(L):
        assert_matches_reference(o_LTNH[layer], reference(case, inputs, layer=layer))
    assert_matches_reference(RUNS[variant](case, inputs, layer=jnp.int32(-1)),
                             reference(case, inputs, layer=L - 1))


@pytest.mark.parametrize("layer", [None, 1])
def test_reference_reads_int8_pairs_as_their_dequantized_pages(layer):
    """The oracle over pairs is the oracle over the pages ``dequantize_kv`` gives, exactly."""
    case = ANCHOR_CASES[1]  # MQA, pages of 7, a window, soft-cap
    inputs = int8_inputs(paged_inputs(case, seed=12, num_layers=None if layer is None else 2))
    np.testing.assert_array_equal(np.asarray(reference(case, inputs, layer=layer)),
                                  np.asarray(reference(case, dequantized(inputs), layer=layer)))


def test_the_pallas_backend_attends_over_an_int8_cache_as_xla():
    """``Pallas.paged_attention`` over an ``Int8KV`` cache (the kernel reading int8 pages with
    their scales) writes the same pages as XLA's reference, bit for bit, and attends alike."""
    from llm_jax.backends import Xla
    from llm_jax.backends.pallas import Pallas

    backends = (Pallas(interpret=DISPATCH_INTERPRET), Xla())
    (o, *pages), (o_xla, *pages_xla) = (int8_cache_step(backend) for backend in backends)
    assert all(type(p).__name__ == "Int8KV" for p in pages)
    for ours, theirs in zip(jax.tree.leaves(pages), jax.tree.leaves(pages_xla)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert np.abs(np.asarray(o_xla)[:7]).min() > 0  # every owned row attends
    assert_matches_reference(o, o_xla)


SHARDED_STEP = """
import sys
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from llm_jax.backends import Xla
from llm_jax.backends.pallas import Pallas
from llm_jax.sharding import make_mesh
from paged_testing import int8_cache_step
o, k, v = int8_cache_step(Pallas(interpret=True), mesh=make_mesh("model=2"))
o_xla, k_xla, v_xla = int8_cache_step(Xla())
for a, b in zip(jax.tree.leaves((k, v)), jax.tree.leaves((k_xla, v_xla))):
    assert np.array_equal(np.asarray(a), np.asarray(b))
print(float(np.max(np.abs(np.asarray(o) - np.asarray(o_xla))) / np.max(np.abs(np.asarray(o_xla)))))
"""


def test_the_pallas_backend_splits_int8_pages_and_scales_by_head_on_a_mesh():
    """On 2 simulated devices (model=2) each shard's kernel reads its K/V head's values and scales
    (``sharding.paged_attention_on_shards``), giving XLA's attention on one device."""
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    path = os.pathsep.join(filter(None, [str(here.parents[1]), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, "-c", SHARDED_STEP, str(here)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) <= 1e-5


INT8_BAD_PAIRS = [
    (lambda i: i.replace(v_pages=dequantize_kv(*i.v_pages)),
     "k_pages is an int8 pair .* but v_pages is not"),
    (lambda i: i.replace(k_pages=dequantize_kv(*i.k_pages)),
     "v_pages is an int8 pair .* but k_pages is not"),
    (lambda i: i.replace(k_pages=(*i.k_pages, i.k_pages[1])),
     r"k_pages must be an array or a pair \(int8 values, float32 scales\), got a tuple of 3"),
    (lambda i: i.replace(v_pages=(i.v_pages[0].astype(jnp.float32), i.v_pages[1])),
     "v_pages values of a pair must be int8, got float32"),
    (lambda i: i.replace(k_pages=(i.k_pages[0], i.k_pages[1].astype(jnp.bfloat16))),
     "k_pages scales must be float32, got bfloat16"),
    (lambda i: i.replace(v_pages=(i.v_pages[0], i.v_pages[1][..., :1])),
     r"v_pages scales shape \(\d+, 5, 1\) must be its values' shape \(\d+, 5, 2, 16\) without "),
]


@pytest.mark.parametrize("variant", ["gpu", "tpu", "reference"])
@pytest.mark.parametrize("make_inputs,message", INT8_BAD_PAIRS)
def test_rejects_bad_int8_pairs(variant, make_inputs, message):
    case = PagedCase(seqs=((1, 9), (4, 4), (0, 0)), T=6, N=4, K=2, H=16, Z=5)
    inputs = make_inputs(int8_inputs(paged_inputs(case)))
    kernel = {"gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
              "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
              "reference": ragged_paged_attention_reference}[variant]
    with pytest.raises(ValueError, match=message):
        kernel(*inputs.args, **case.options)


@pytest.mark.parametrize("kernel", [ragged_paged_attention_gpu, ragged_paged_attention_tpu],
                         ids=["gpu", "tpu"])
def test_rejects_int8_pages_without_their_scales(kernel):
    case = PagedCase(seqs=((1, 9), (4, 4), (0, 0)), T=6, N=4, K=2, H=16, Z=5)
    inputs = int8_inputs(paged_inputs(case))
    inputs = inputs.replace(k_pages=inputs.k_pages[0], v_pages=inputs.v_pages[0])
    with pytest.raises(ValueError, match="k_pages are int8: pass int8 pages as pairs"):
        kernel(*inputs.args, **case.options, interpret=True)


def test_vmem_counts_the_int8_pages_and_their_scales():
    """TPU: int8 pages are int8 blocks, each with its float32 [Z, K] block of scales beside it
    (padded to 128 lanes in VMEM, like every block)."""
    common = dict(rows=128, page_size=16, pages_per_step=8, head_dim=128, dtype=jnp.bfloat16)
    tile, page, scales = ((128, 128), jnp.bfloat16), ((16, 128), jnp.int8), ((16, 8), jnp.float32)
    expected = tpu_tiles.vmem_bytes(blocks=[tile, *[page, scales] * 16, tile],
                                    scratch=[((128, 128), jnp.float32)] * 3)
    assert tpu_module.vmem_bytes(**common, int8_kv_heads=8) == expected


# Lowering, tiles, the work list.

LOWERING_SHAPES = [
    # T, B, X, P, Z, N, K, H, L, window, softcap, dtype
    (512, 64, 128, 4096, 16, 32, 8, 128, None, None, None, "bfloat16"),  # Llama 3 8B-like
    (256, 32, 64, 2048, 16, 16, 8, 256, None, 4096, 50.0, "float32"),  # Gemma 2, float32
    (300, 16, 64, 1024, 16, 28, 4, 80, 6, None, None, "uint16"),  # G 7, H 80, stacked bits
]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=lambda s: f"T{s[0]}H{s[7]}{s[-1]}")
def test_lowers(platform, shape):
    T, B, X, P, Z, N, K, H, num_layers, window, softcap, dtype = shape
    kernel = ragged_paged_attention_gpu if platform == "cuda" else ragged_paged_attention_tpu
    S = jax.ShapeDtypeStruct
    pages = S(((num_layers,) if num_layers else ()) + (P, Z, K, H), jnp.dtype(dtype))
    q = S((T, N, H), jnp.float32 if dtype == "float32" else jnp.bfloat16)
    ints = [S((B, X), jnp.int32)] + [S((B,), jnp.int32)] * 3
    attend = functools.partial(kernel, sm_scale=H ** -0.5, sliding_window=window,
                               logit_softcap=softcap)
    if num_layers:
        fn = jax.jit(lambda *args: attend(*args[:-1], layer=args[-1]))
        traced = fn.trace(q, pages, pages, *ints, S((), jnp.int32))
    else:
        traced = jax.jit(attend).trace(q, pages, pages, *ints)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert calls_triton(text) if platform == "cuda" else MOSAIC_CALL in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("H,dtype", [(128, "bfloat16"), (80, "float32")])
def test_lowers_int8_pages(platform, H, dtype):
    """Stacked int8 pages with their scales, a traced layer: H 128 read in place, H 80 (TPU: the
    layer and its scales sliced out)."""
    T, B, X, P, Z, N, K, num_layers = 300, 16, 64, 1024, 16, 28, 4, 6
    kernel = ragged_paged_attention_gpu if platform == "cuda" else ragged_paged_attention_tpu
    S = jax.ShapeDtypeStruct
    pages = (S((num_layers, P, Z, K, H), jnp.int8), S((num_layers, P, Z, K), jnp.float32))
    ints = [S((B, X), jnp.int32)] + [S((B,), jnp.int32)] * 3
    fn = jax.jit(lambda q, k, v, *args: kernel(q, k, v, *args[:-1], layer=args[-1],
                                               sm_scale=H ** -0.5, sliding_window=512))
    traced = fn.trace(S((T, N, H), jnp.dtype(dtype)), pages, pages, *ints, S((), jnp.int32))
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert calls_triton(text) if platform == "cuda" else MOSAIC_CALL in text


BUDGETS = sorted(set(gpu_tiles.SMEM_PER_BLOCK_BYTES.values()))


@pytest.fixture
def budget(request, monkeypatch):
    monkeypatch.setattr(gpu_tiles, "smem_budget", lambda device=None: gpu_tiles.SmemBudget(
        bytes=request.param, source="test"))
    return request.param


@pytest.mark.parametrize("budget", BUDGETS, indirect=True, ids=lambda b: f"{b // 1024}KiB")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("H", [64, 80, 128, 256])
def test_default_tiles_fit_memory(budget, dtype, H):
    """GPU: shared memory on every GPU in the table, float32 with H 256 included, a tile never
    smaller than one token's G rows. TPU: the default scoped VMEM."""
    for G in (1, 2, 4, 7, 8, 16, 32):
        dims = shapes.PagedDims(T=2048, N=G * 4, K=4, H=H, B=64, X=256, P=8192, Z=16)
        tiles, tokens = gpu_module.choose_tiles(dims, dtype, block_q=None, block_k=None,
                                                num_stages=None)
        assert gpu_tiles.smem_bytes(tiles, dtype) <= budget, (G, tiles)
        assert tiles.head_dim == gpu_tiles.tile_size(H) and tokens >= 1, (G, tiles)
        assert tokens * G <= tiles.block_q, (G, tokens, tiles)
        for Z in (16, 64, 128):
            tpu_rows = max(1, tpu_module.DEFAULT_ROWS // G) * G
            tpu_pages = max(1, tpu_module.DEFAULT_KEYS_PER_STEP // Z)
            assert tpu_module.vmem_bytes(rows=tpu_rows, page_size=Z, pages_per_step=tpu_pages,
                                         head_dim=H, dtype=dtype) <= tpu_tiles.SCOPED_VMEM_BYTES
            assert tpu_module.vmem_bytes(
                rows=tpu_rows, page_size=Z, pages_per_step=tpu_pages, head_dim=H, dtype=dtype,
                int8_kv_heads=dims.K) <= tpu_tiles.SCOPED_VMEM_BYTES  # int8 pages and scales


def test_work_list_covers_every_owned_row_once():
    """Tiles of block_q tokens from each sequence's first row: every owned row in exactly one tile,
    at its position; no idle tile owns a row; the bound on tiles is reached and kept."""
    query_start, num_tokens = np.array([9, 0, 3, 20]), np.array([7, 3, 0, 5])
    seq_lens = np.array([30, 3, 0, 5])
    block_q, T = 3, 26
    size = ragged_paging.max_tiles(T, len(num_tokens), block_q)
    work = ragged_paging.work_list(query_start, num_tokens, seq_lens, block_q=block_q, size=size)
    work = jax.tree.map(np.asarray, work)
    assert size >= (busy := int(np.sum(work.tokens_W > 0))) == 3 + 1 + 0 + 2, (size, busy)
    rows = {}
    for w in range(size):
        for j in range(work.tokens_W[w]):
            token = work.token_W[w] + j
            assert token not in rows, token
            b = work.seq_W[w]
            rows[token] = (b, work.pos_W[w] + j)
            assert work.kv_len_W[w] == seq_lens[b]
    expected = {int(query_start[b] + i): (b, int(seq_lens[b] - num_tokens[b] + i))
                for b in range(4) for i in range(num_tokens[b])}
    assert rows == expected
    tiles = jax.tree.map(np.asarray, ragged_paging.token_tiles(work, num_tokens=T,
                                                               block_q=block_q))
    assert set(np.flatnonzero(tiles.owned_T)) == set(expected)
    for t in expected:
        assert work.token_W[tiles.tile_T[t]] + tiles.row_T[t] == t
    # The worst case for the bound: every sequence one token more than whole tiles.
    assert ragged_paging.max_tiles(4 * 4, 4, 3) == 8 and ragged_paging.max_tiles(5, 9, 4) == 5


# Argument errors.

BAD_ARGUMENTS = [
    (lambda i: i.replace(q_TNH=i.q_TNH[0]), {}, r"q_TNH must be \[T, N, H\], got shape"),
    (lambda i: i.replace(k_pages=i.k_pages[None], v_pages=i.v_pages[None]), {},
     r"are stacked pages \[L, P, Z, K, H\]: pass the layer"),
    (lambda i: i, {"layer": 0}, r"with layer, k_pages must be the stacked pages \[L, P, Z, K, H\]"),
    (lambda i: i.replace(k_pages=i.k_pages[None], v_pages=i.v_pages[None]),
     {"layer": jnp.float32(0)}, "layer must be an integer scalar"),
    (lambda i: i.replace(v_pages=i.v_pages[:-1]), {}, r"v_pages shape \(\d+, 5, 2, 16\) != "),
    (lambda i: i.replace(q_TNH=i.q_TNH[..., :8]), {}, r"head dim of k_pages .* \(16\) != head "),
    (lambda i: i.replace(q_TNH=i.q_TNH[:, :3]), {}, "N=3 must be a multiple of kv heads K=2"),
    (lambda i: i.replace(block_tables_BX=i.block_tables_BX[0]), {},
     r"block_tables_BX must be integers of shape \[B, X\], got shape \(\d+,\)"),
    (lambda i: i.replace(query_start_B=i.query_start_B[:2]), {},
     r"query_start_B must be integers of shape \(3,\) .* got shape \(2,\)"),
    (lambda i: i.replace(seq_lens_B=i.seq_lens_B.astype(jnp.float32)), {},
     r"seq_lens_B must be integers of shape \(3,\)"),
    (lambda i: i.replace(q_TNH=as_bits(i.q_TNH.astype(jnp.bfloat16))), {},
     "q dtype uint16 is not one of"),
    (lambda i: i.replace(k_pages=as_bits(i.k_pages.astype(jnp.bfloat16)),
                         v_pages=as_bits(i.v_pages.astype(jnp.bfloat16))), {}, "dtypes differ"),
    (lambda i: i, {"sliding_window": 0}, "sliding_window must be a positive int or None, got 0"),
    (lambda i: i, {"logit_softcap": -1.0}, "logit_softcap must be positive or None, got -1.0"),
]


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("make_inputs,kwargs,message", BAD_ARGUMENTS)
def test_rejects_bad_arguments(variant, make_inputs, kwargs, message):
    case = PagedCase(seqs=((1, 9), (4, 4), (0, 0)), T=6, N=4, K=2, H=16, Z=5)
    inputs = make_inputs(paged_inputs(case))
    kernel = ragged_paged_attention_gpu if variant == "gpu" else ragged_paged_attention_tpu
    options = {**case.options, **kwargs}
    with pytest.raises(ValueError, match=message):
        kernel(*inputs.args, **options, interpret=True)


@pytest.mark.parametrize("kernel,kwargs,message", [
    (ragged_paged_attention_gpu, dict(block_k=24), "block_k=24 must be a power of two"),
    (ragged_paged_attention_gpu, dict(num_splits=0), "num_splits must be a positive int"),
    (ragged_paged_attention_gpu, dict(block_q=0), "block_q must be a positive int"),
    (ragged_paged_attention_tpu, dict(pages_per_step=0), "pages_per_step must be a positive int"),
    (ragged_paged_attention_tpu, dict(block_q=4096, pages_per_step=64),
     r"ragged_paged_attention_tpu tiles block_q=4096 pages_per_step=\d+ need \d+ bytes of VMEM"),
], ids=["block_k", "num_splits", "block_q", "pages_per_step", "vmem"])
def test_rejects_bad_tiles(kernel, kwargs, message):
    S = jax.ShapeDtypeStruct
    pages = S((700, 16, 1, 256), jnp.float32)
    args = (S((4100, 8, 256), jnp.float32), pages, pages, S((2, 250), jnp.int32),
            *[S((2,), jnp.int32)] * 3)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(functools.partial(kernel, sm_scale=0.0625, interpret=True, **kwargs), *args)

