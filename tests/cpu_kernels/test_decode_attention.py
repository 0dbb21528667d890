"""cpu_kernels.decode_attention against llm_jax's pure-JAX attention (xla_attention): odd shapes, grouped
query heads, sliding windows, soft-capping, float32 / bfloat16 / bfloat16-as-bits caches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from llm_jax.backends.base import xla_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernels are not built "
                                "(test_matmul's first test checks that a compiler, where present, builds them)")

# L, B, S, K, G, H, window, softcap
CASES = [(3, 2, 11, 2, 3, 16, None, None), (2, 3, 9, 1, 4, 5, 3, None), (2, 2, 13, 2, 2, 8, None, 5.0),
         (1, 1, 7, 3, 1, 24, 2, 30.0), (2, 4, 33, 4, 2, 64, None, None),
         (2, 1, 10, 5, 2, 8, None, None),  # one row: its 5 kv heads split in uneven groups across threads
         (2, 3, 41, 3, 1, 20, None, None),  # one query head per kv head: bfloat16 read in place, H not a multiple of 8
         # Few rows, hundreds of slots: each row's slots split in chunks across threads.
         (1, 1, 300, 2, 3, 16, None, None), (2, 3, 517, 1, 2, 12, 300, 10.0), (1, 2, 263, 4, 1, 64, None, None)]


def _bits(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("L,B,S,K,G,H,window,softcap", CASES)
def test_matches_xla_attention(L, B, S, K, G, H, window, softcap, dtype):
    rng = np.random.default_rng(S * H + G)
    k, v = (jnp.asarray(rng.normal(size=(L, B, S, K, H)), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, K * G, H)), dtype)
    # Row 0 sees one key (with more rows), the last row every slot.
    positions = jnp.asarray(rng.integers(0, S, B), jnp.int32).at[0].set(0).at[-1].set(S - 1)
    lengths = positions + 1
    f = jax.jit(lambda q, k, v, layer: cpu_kernels.decode_attention(q, k, v, layer, positions, lengths, scale=0.3,
                                                                    window=window, softcap=softcap))
    for layer in range(L):
        expected = xla_attention(q[:, None], k[layer], v[layer], positions[:, None], lengths, scale=0.3,
                                 window=window, softcap=softcap)[:, 0]
        ours = f(q, k, v, layer)
        assert ours.dtype == jnp.float32 and ours.shape == q.shape
        # bfloat16: both round the probabilities to bfloat16; sums in another order may differ by an ulp.
        tol = 1e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(ours.astype(dtype).astype(jnp.float32)),
                                   np.asarray(expected.astype(jnp.float32)), rtol=tol, atol=tol)
        np.testing.assert_array_equal(np.asarray(f(q, _bits(k), _bits(v), layer)), np.asarray(ours))


def test_rows_without_visible_keys_are_zero():
    k = v = jnp.ones((1, 2, 5, 1, 8))
    q = jnp.ones((2, 2, 8))
    o = cpu_kernels.decode_attention(q, k, v, 0, jnp.array([3, 4]), jnp.array([0, 5]), scale=1.0, window=None,
                                     softcap=None)
    np.testing.assert_array_equal(np.asarray(o[0]), 0.0)
    np.testing.assert_allclose(np.asarray(o[1]), 1.0, rtol=1e-6)


def test_bad_inputs_are_named():
    k = jnp.ones((1, 2, 5, 2, 8))
    with pytest.raises(ValueError, match=r"q \(2, 3, 8\)"):
        cpu_kernels.decode_attention(jnp.ones((2, 3, 8)), k, k, 0, jnp.zeros(2), jnp.ones(2), scale=1.0,
                                     window=None, softcap=None)
    with pytest.raises(Exception, match="layer index outside the cache"):
        cpu_kernels.decode_attention(jnp.ones((2, 4, 8)), k, k, 1, jnp.zeros(2), jnp.ones(2), scale=1.0,
                                     window=None, softcap=None).block_until_ready()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint16], ids=["f32", "bf16", "bits"])
@pytest.mark.parametrize("L,B,S,K,G,H,window,softcap", CASES)
def test_append_writes_the_step_then_attends(L, B, S, K, G, H, window, softcap, dtype):
    """decode_attention_append = the step's keys and values written at each row's slot (a slot outside
    the cache writes nothing), then decode_attention; the rest of the caches untouched."""
    rng = np.random.default_rng(S * H + G + 1)
    values = jnp.bfloat16 if dtype == jnp.uint16 else dtype
    k, v = (_bits(jnp.asarray(rng.normal(size=(L, B, S, K, H)), values)) for _ in range(2))
    k_new, v_new = (_bits(jnp.asarray(rng.normal(size=(B, K, H)), values)) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, K * G, H)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, S, B), jnp.int32).at[-1].set(S - 1)
    slots = positions.at[0].set(S) if B > 1 else positions  # with more rows, row 0 has finished: no slot
    layer = L - 1
    f = jax.jit(lambda q, kn, vn, k, v: cpu_kernels.decode_attention_append(
        q, kn, vn, k, v, layer, slots, positions, positions + 1, scale=0.3, window=window, softcap=softcap))
    o, k_out, v_out = f(q, k_new, v_new, k, v)
    rows = jnp.arange(B)
    k_expected = k.at[layer, rows, slots].set(k_new, mode="drop")
    v_expected = v.at[layer, rows, slots].set(v_new, mode="drop")
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_expected))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_expected))
    expected = cpu_kernels.decode_attention(q, k_expected, v_expected, layer, positions, positions + 1, scale=0.3,
                                            window=window, softcap=softcap)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(expected))


def test_append_updates_donated_caches_in_place():
    L, B, S, K, H = 2, 3, 16, 2, 8
    k, v = jnp.zeros((L, B, S, K, H)), jnp.ones((L, B, S, K, H))
    pointers = k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()
    new = jnp.full((B, K, H), 7.0)
    slots = jnp.array([0, 5, 15], jnp.int32)
    q = jnp.ones((B, K, H))

    def append(k, v):
        return cpu_kernels.decode_attention_append(q, new, new, k, v, 1, slots, slots, slots + 1, scale=1.0,
                                                   window=None, softcap=None)[1:]

    f = jax.jit(append, donate_argnums=(0, 1))
    k_out, v_out = f(k, v)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    np.testing.assert_array_equal(np.asarray(k_out[1, jnp.arange(B), slots]), 7.0)


def test_append_checks_the_new_rows():
    k = jnp.ones((1, 2, 5, 2, 8))
    with pytest.raises(ValueError, match=r"k_new must be \[B, K, H\] = \(2, 2, 8\)"):
        cpu_kernels.decode_attention_append(jnp.ones((2, 2, 8)), jnp.ones((2, 8)), jnp.ones((2, 2, 8)), k, k, 0,
                                            jnp.zeros(2, jnp.int32), jnp.zeros(2), jnp.ones(2), scale=1.0, window=None,
                                            softcap=None)
    with pytest.raises(ValueError, match="of the caches' dtype"):
        cpu_kernels.decode_attention_append(jnp.ones((2, 2, 8)), jnp.ones((2, 2, 8), jnp.bfloat16),
                                            jnp.ones((2, 2, 8)), k, k, 0, jnp.zeros(2, jnp.int32), jnp.zeros(2),
                                            jnp.ones(2), scale=1.0, window=None, softcap=None)
