"""cpu_kernels.paged_attention(_append): a serving step's ragged tokens over a paged KV cache, against the
plain-jnp oracle in the same module (paged_attention_xla), itself anchored against a dense masked attention
over each sequence's contiguous keys computed here with NumPy in float64. Odd shapes: decode tokens and
prefill chunks in one step, partial last pages, block tables out of order, GQA / MQA / MHA, sliding windows
across page boundaries, soft-capping, padding sequences and rows, stacked layers, float32 / bfloat16 /
bfloat16-as-bits pages, and int8 pages with a scale per slot and kv head (as the serving engine's int8
cache holds them). Slots no sequence may read hold NaN: a kernel that reads them fails."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from cpu_kernels.paged_attention import paged_attention_append_xla, paged_attention_xla
from llm_jax.kv_cache import quantize_kv

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernels are not built "
                                "(test_matmul's first test checks that a compiler, where present, builds them)")

# The kernel widens bfloat16 exactly and keeps probabilities in float32, as the oracle does: whatever the
# pages' dtype only the order of the sums differs.
TOL = 1e-5
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16"),
          pytest.param(jnp.uint16, id="bits")]


@dataclasses.dataclass
class Step:
    """A step's inputs and, per sequence, its keys and values by position: seq_k[b] [L, seq_len, K, H]."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    tables: np.ndarray
    starts: np.ndarray
    num_tokens: np.ndarray
    seq_lens: np.ndarray
    seq_k: list
    seq_v: list
    Z: int

    def args(self):
        return self.tables, self.starts, self.num_tokens, self.seq_lens

    def slot(self, b: int, position: int) -> int:
        return int(self.tables[b, position // self.Z]) * self.Z + position % self.Z


def _rounded(x, dtype):
    """x as the pages hold it (bfloat16 bits for uint16) and as float64 values."""
    values = jnp.bfloat16 if dtype == jnp.uint16 else dtype
    stored = jnp.asarray(x, values)
    as_f64 = np.asarray(stored.astype(jnp.float32), np.float64)
    return (jax.lax.bitcast_convert_type(stored, jnp.uint16) if dtype == jnp.uint16 else stored), as_f64


def _step(seed, seqs, *, L, P, Z, K, G, H, dtype, gap=1, pad_rows=2) -> Step:
    """Sequences (num_tokens, seq_len) with their q rows one after another, ``gap`` rows of padding after
    each and ``pad_rows`` at the end; pages drawn from a shuffled pool (page 0 never), one padding column
    in every block table; every slot no sequence holds is NaN."""
    rng = np.random.default_rng(seed)
    B = len(seqs)
    X = max(math.ceil(s / Z) for _, s in seqs) + 1
    pool = rng.permutation(np.arange(1, P))
    assert sum(math.ceil(s / Z) for _, s in seqs) <= len(pool), "pool too small for the step"
    k_pages, v_pages = (np.full((L, P, Z, K, H), np.nan) for _ in range(2))
    tables = np.zeros((B, X), np.int32)
    starts, seq_k, seq_v = np.zeros(B, np.int32), [], []
    row = used = 0
    for b, (n, s) in enumerate(seqs):
        m = math.ceil(s / Z)
        tables[b, :m] = pool[used:used + m]
        used += m
        keys, values = (_rounded(rng.normal(size=(L, s, K, H)), dtype)[1] for _ in range(2))
        seq_k.append(keys)
        seq_v.append(values)
        for p in range(s):
            k_pages[:, tables[b, p // Z], p % Z] = keys[:, p]
            v_pages[:, tables[b, p // Z], p % Z] = values[:, p]
        starts[b] = row if n else 0  # a padding sequence's start may point anywhere
        row += n + gap if n else 0
    q = jnp.asarray(rng.normal(size=(row + pad_rows, K * G, H)), jnp.float32)
    return Step(q, _rounded(k_pages, dtype)[0], _rounded(v_pages, dtype)[0], tables, starts,
                np.array([n for n, _ in seqs], np.int32), np.array([s for _, s in seqs], np.int32), seq_k, seq_v, Z)


def _dense(step: Step, layer: int, *, scale, window, softcap) -> np.ndarray:
    """Each query over its sequence's contiguous keys, masked, in float64: o [T, N, H]."""
    q = np.asarray(step.q, np.float64)
    T, N, H = q.shape
    G = N // step.k.shape[3]
    o = np.zeros((T, N, H))
    for b, (n, s) in enumerate(zip(step.num_tokens, step.seq_lens)):
        for i in range(n):
            t, p = step.starts[b] + i, s - n + i
            visible = np.arange(0 if window is None else max(0, p - window + 1), p + 1)
            if visible.size == 0:
                continue
            for head in range(N):
                keys, values = step.seq_k[b][layer, visible, head // G], step.seq_v[b][layer, visible, head // G]
                scores = keys @ q[t, head] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                e = np.exp(scores - scores.max())
                o[t, head] = e / e.sum() @ values
    return o


# (L, P, Z, K, G, H, sequences (num_tokens, seq_len), window, softcap)
CASES = [
    pytest.param(2, 24, 4, 2, 3, 16, [(1, 7), (5, 13), (0, 0), (3, 3), (1, 1)], None, None,
                 id="gqa-decode-and-chunks-partial-pages"),
    pytest.param(1, 20, 3, 1, 5, 8, [(9, 20), (1, 30), (2, 4)], None, None, id="mqa-chunk-in-several-blocks"),
    pytest.param(2, 40, 5, 3, 1, 44, [(20, 41), (1, 9), (0, 0), (2, 2)], 6, None, id="mha-window-across-pages"),
    pytest.param(1, 24, 7, 2, 2, 33, [(11, 11), (1, 50), (4, 30)], None, 20.0, id="softcap-odd-head-dim"),
    pytest.param(2, 30, 16, 1, 8, 12, [(1, 70), (17, 40), (1, 16)], 19, 5.0, id="window-and-softcap-g8"),
    pytest.param(1, 64, 1, 2, 2, 8, [(3, 10), (1, 5), (6, 6)], 4, None, id="one-token-pages"),
    pytest.param(1, 12, 8, 1, 20, 8, [(2, 9), (1, 17)], None, None, id="g20-query-heads-over-two-blocks"),
    # Enough units to split among threads: a chunk of 70 tokens in 9 blocks of 16 rows, six decode tokens,
    # and a lone decode token whose 6 kv heads split in groups.
    pytest.param(1, 120, 8, 6, 2, 16, [(70, 150), *[(1, 60 + 13 * i) for i in range(6)]], None, None,
                 id="many-units"),
    pytest.param(1, 40, 16, 6, 1, 64, [(1, 300)], None, None, id="one-decode-token-kv-head-groups"),
]


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")])
@pytest.mark.parametrize("L,P,Z,K,G,H,seqs,window,softcap", CASES)
def test_oracle_matches_dense_attention(L, P, Z, K, G, H, seqs, window, softcap, dtype):
    """The oracle (pages gathered, masked, softmax) equals attention over each sequence's contiguous keys."""
    step = _step(1, seqs, L=L, P=P, Z=Z, K=K, G=G, H=H, dtype=dtype)
    layer = L - 1
    ours = paged_attention_xla(step.q, step.k, step.v, layer, *step.args(), scale=0.3,
                               window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(ours), _dense(step, layer, scale=0.3, window=window, softcap=softcap),
                               atol=TOL, rtol=TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,P,Z,K,G,H,seqs,window,softcap", CASES)
def test_matches_the_oracle(L, P, Z, K, G, H, seqs, window, softcap, dtype):
    step = _step(2, seqs, L=L, P=P, Z=Z, K=K, G=G, H=H, dtype=dtype)
    f = jax.jit(lambda q, k, v, layer: cpu_kernels.paged_attention(q, k, v, layer, *step.args(), scale=0.3,
                                                                   window=window, softcap=softcap))
    for layer in range(L):
        expected = paged_attention_xla(step.q, step.k, step.v, layer, *step.args(), scale=0.3,
                                       window=window, softcap=softcap)
        ours = f(step.q, step.k, step.v, layer)
        assert ours.dtype == jnp.float32 and ours.shape == step.q.shape
        np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), atol=TOL, rtol=TOL)


def test_padding_rows_and_sequences_without_keys_give_zero():
    """Rows no sequence owns, a sequence with no tokens, and queries that see no key (a sequence claiming
    more tokens than its length) are 0; sequences' rows may be in any order."""
    L, P, Z, K, G, H = 1, 8, 4, 1, 2, 8
    k = v = jnp.ones((L, P, Z, K, H))
    q = jnp.ones((9, K * G, H))
    tables = jnp.array([[1, 2], [3, 0], [4, 0]], jnp.int32)
    starts = jnp.array([5, 0, 2], jnp.int32)
    num_tokens = jnp.array([2, 0, 2], jnp.int32)
    seq_lens = jnp.array([6, 3, 1], jnp.int32)  # sequence 2: positions -1 and 0
    o = np.asarray(cpu_kernels.paged_attention(q, k, v, 0, tables, starts, num_tokens, seq_lens, scale=1.0,
                                               window=None, softcap=None))
    np.testing.assert_allclose(o[[3, 5, 6]], 1.0, rtol=1e-6)
    np.testing.assert_array_equal(o[[0, 1, 2, 4, 7, 8]], 0.0)


def test_large_scores_do_not_overflow():
    """Scores far beyond exp's range: the softmax subtracts each row's maximum first."""
    step = _step(3, [(6, 10), (1, 12)], L=1, P=10, Z=4, K=1, G=2, H=8, dtype=jnp.float32)
    o = cpu_kernels.paged_attention(step.q * 300, step.k, step.v, 0, *step.args(), scale=1.0, window=None,
                                    softcap=None)
    expected = paged_attention_xla(step.q * 300, step.k, step.v, 0, *step.args(), scale=1.0,
                                   window=None, softcap=None)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(np.asarray(o), np.asarray(expected), atol=1e-4, rtol=1e-4)


def _step_slots(step: Step, P: int) -> np.ndarray:
    """Each step token's slot: its position's in its sequence's pages. Padding rows: the pool's last slot,
    a slot of page 0 (where the engine sends them), then slots outside the pool (below and past it)."""
    T = step.q.shape[0]
    slots = np.full(T, -1, np.int32)
    for b, (n, s) in enumerate(zip(step.num_tokens, step.seq_lens)):
        for i in range(n):
            slots[step.starts[b] + i] = step.slot(b, s - n + i)
    padding = [t for t in range(T) if t not in {step.starts[b] + i for b, n in enumerate(step.num_tokens)
                                                for i in range(n)}]
    for t, slot in zip(padding, [P * step.Z - 1, 1, -1, P * step.Z, 2 ** 31 - 1] * T):
        slots[t] = slot
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,P,Z,K,G,H,seqs,window,softcap", CASES[:4])
def test_append_writes_exactly_the_slots_then_attends(L, P, Z, K, G, H, seqs, window, softcap, dtype):
    """The step's keys and values land at their slots of the layer and nowhere else (nothing for a slot
    outside the pool); then the attention is paged_attention's over the written pages."""
    step = _step(4, seqs, L=L, P=P, Z=Z, K=K, G=G, H=H, dtype=dtype)
    T = step.q.shape[0]
    rng = np.random.default_rng(5)
    k_new, v_new = (_rounded(rng.normal(size=(T, K, H)), dtype)[0] for _ in range(2))
    slots = _step_slots(step, P)
    layer = L - 1
    f = jax.jit(lambda q, kn, vn, k, v: cpu_kernels.paged_attention_append(
        q, kn, vn, k, v, layer, slots, *step.args(), scale=0.3, window=window, softcap=softcap))
    o, k_out, v_out = f(step.q, k_new, v_new, step.k, step.v)
    for pages, new, out in ((step.k, k_new, k_out), (step.v, v_new, v_out)):
        expected = np.array(pages)
        for t, s in enumerate(slots):
            if 0 <= s < P * Z:
                expected[layer, s // Z, s % Z] = np.asarray(new[t])
        assert out.dtype == pages.dtype
        np.testing.assert_array_equal(np.asarray(out), expected)  # NaNs where they were
    same = cpu_kernels.paged_attention(step.q, k_out, v_out, layer, *step.args(), scale=0.3, window=window,
                                       softcap=softcap)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(same))
    o_xla, k_xla, v_xla = paged_attention_append_xla(step.q, k_new, v_new, step.k, step.v, layer, slots,
                                                     *step.args(), scale=0.3, window=window,
                                                     softcap=softcap)
    np.testing.assert_array_equal(np.asarray(k_xla), np.asarray(k_out))
    np.testing.assert_array_equal(np.asarray(v_xla), np.asarray(v_out))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_xla), atol=TOL, rtol=TOL)


def test_append_updates_donated_pages_in_place():
    """Donated pages come back in the same buffers, and the compiled step copies and scatters nothing: one
    call writes and attends."""
    step = _step(6, [(3, 9), (1, 6)], L=2, P=8, Z=4, K=2, G=2, H=8, dtype=jnp.float32)
    T, _, H = step.q.shape
    new = jnp.full((T, 2, H), 7.0)
    slots = _step_slots(step, 8)

    def append(k, v, layer):
        return cpu_kernels.paged_attention_append(step.q, new, new, k, v, layer, slots, *step.args(), scale=1.0,
                                                  window=None, softcap=None)

    f = jax.jit(append, donate_argnums=(0, 1))
    hlo = f.lower(step.k, step.v, 1).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="llm_jax_paged_attention_append_f32"' in line]
    assert len(calls) == 1 and "output_to_operand_aliasing={{1}: (4, {}), {2}: (5, {})}" in calls[0], hlo
    assert not any(op in hlo for op in (" copy(", " copy-start(", " scatter(", " dynamic-update-slice(")), hlo
    pointers = step.k.unsafe_buffer_pointer(), step.v.unsafe_buffer_pointer()
    _, k_out, v_out = f(step.k, step.v, 1)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    written = [s for s in slots if 0 <= s < 8 * 4]
    np.testing.assert_array_equal(np.asarray(k_out)[1].reshape(-1, 2, H)[written], 7.0)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.uint16, id="bits")])
def test_stacked_layers_with_a_traced_layer_in_a_scan(dtype):
    """A step's layers as a lax.scan carrying the pages, the layer index traced: every layer appends its
    keys and values and attends, as the XLA form does."""
    L, P, Z, K, G, H = 3, 30, 4, 2, 2, 16
    step = _step(7, [(1, 11), (6, 6), (0, 0), (4, 17)], L=L, P=P, Z=Z, K=K, G=G, H=H, dtype=dtype)
    T = step.q.shape[0]
    rng = np.random.default_rng(8)
    q_L = jnp.asarray(rng.normal(size=(L, T, K * G, H)), jnp.float32)
    k_new, v_new = (_rounded(rng.normal(size=(L, T, K, H)), dtype)[0] for _ in range(2))
    slots = _step_slots(step, P)

    def layers(append):
        def body(pages, xs):
            layer, q, kn, vn = xs
            o, k, v = append(q, kn, vn, *pages, layer, slots, *step.args(), scale=0.25, window=5, softcap=None)
            return (k, v), o
        return jax.jit(lambda k, v: jax.lax.scan(body, (k, v), (jnp.arange(L), q_L, k_new, v_new)))

    (k_ours, v_ours), o_ours = layers(cpu_kernels.paged_attention_append)(step.k, step.v)
    (k_xla, v_xla), o_xla = layers(paged_attention_append_xla)(step.k, step.v)
    np.testing.assert_array_equal(np.asarray(k_ours), np.asarray(k_xla))
    np.testing.assert_array_equal(np.asarray(v_ours), np.asarray(v_xla))
    np.testing.assert_allclose(np.asarray(o_ours), np.asarray(o_xla), atol=TOL, rtol=TOL)


def test_bad_inputs_are_named():
    k = jnp.ones((1, 6, 4, 2, 8))
    tables, starts = jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32)
    q = jnp.ones((5, 4, 8))

    def call(q=q, k=k, v=k, tables=tables, starts=starts, lens=starts, layer=0, window=None, softcap=None):
        return cpu_kernels.paged_attention(q, k, v, layer, tables, starts, starts, lens, scale=1.0, window=window,
                                           softcap=softcap)

    with pytest.raises(ValueError, match=r"N a multiple of K = 2 and H = 8 .* got q \(5, 3, 8\)"):
        call(q=jnp.ones((5, 3, 8)))
    with pytest.raises(ValueError, match=r"pages k and v \[L, P, Z, K, H\] alike, got k \(6, 4, 2, 8\)"):
        call(k=k[0])
    with pytest.raises(ValueError, match=r"v \(1, 6, 4, 2, 8\) bfloat16"):
        call(v=k.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="float16"):
        call(k=k.astype(jnp.float16), v=k.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"block_tables must be \[B, X\], got \(2,\)"):
        call(tables=starts)
    with pytest.raises(ValueError, match=r"seq_lens must be \[B\] = \(2,\) like block_tables \(2, 3\), got \(3,\)"):
        call(lens=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"query_start must be integers, got float32"):
        call(starts=jnp.zeros(2))
    with pytest.raises(ValueError, match="window must be None or >= 1, got 0"):
        call(window=0)
    with pytest.raises(ValueError, match="softcap must be None or > 0, got -1.0"):
        call(softcap=-1.0)
    with pytest.raises(Exception, match="layer index outside the cache"):
        call(layer=1).block_until_ready()
    with pytest.raises(ValueError, match=r"k_new must be \[T, K, H\] = \(5, 2, 8\) of the pages' dtype float32, "
                                         r"got \(5, 8\) float32"):
        cpu_kernels.paged_attention_append(q, jnp.ones((5, 8)), jnp.ones((5, 2, 8)), k, k, 0, jnp.zeros(5, jnp.int32),
                                           tables, starts, starts, starts, scale=1.0, window=None, softcap=None)
    with pytest.raises(ValueError, match=r"slots must be \[T\] = \(5,\), got \(4,\)"):
        cpu_kernels.paged_attention_append(q, jnp.ones((5, 2, 8)), jnp.ones((5, 2, 8)), k, k, 0,
                                           jnp.zeros(4, jnp.int32), tables, starts, starts, starts, scale=1.0,
                                           window=None, softcap=None)


# int8 pages: pairs (int8 [L, P, Z, K, H], float32 scales [L, P, Z, K]) as llm_jax.kv_cache.Int8KV holds them.
def _int8(x):
    """Keys or values quantized per slot (or row) and kv head as the serving engine writes them
    (``quantize_kv``): an int8 pair; where x holds NaN (slots no sequence may read) the scale is NaN."""
    q, s = quantize_kv(jnp.nan_to_num(x))
    return q, jnp.where(jnp.isnan(x).any(-1), jnp.nan, s)


@pytest.mark.parametrize("L,P,Z,K,G,H,seqs,window,softcap", CASES)
def test_int8_pages_match_the_oracle(L, P, Z, K, G, H, seqs, window, softcap):
    """The kernel dequantizes int8 pages (q · s, exactly as the oracle does) and attends as over float32
    pages; the oracle over the pairs is the oracle over the dequantized pages."""
    step = _step(9, seqs, L=L, P=P, Z=Z, K=K, G=G, H=H, dtype=jnp.float32)
    k, v = _int8(step.k), _int8(step.v)
    f = jax.jit(lambda q, k, v, layer: cpu_kernels.paged_attention(q, k, v, layer, *step.args(), scale=0.3,
                                                                   window=window, softcap=softcap))
    for layer in range(L):
        expected = paged_attention_xla(step.q, k, v, layer, *step.args(), scale=0.3, window=window, softcap=softcap)
        dequantized = paged_attention_xla(step.q, *(q.astype(jnp.float32) * s[..., None] for q, s in (k, v)), layer,
                                          *step.args(), scale=0.3, window=window, softcap=softcap)
        np.testing.assert_allclose(np.asarray(expected), np.asarray(dequantized), atol=1e-6, rtol=1e-6)
        ours = f(step.q, k, v, layer)
        assert ours.dtype == jnp.float32 and ours.shape == step.q.shape
        np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("L,P,Z,K,G,H,seqs,window,softcap", CASES[:4])
def test_int8_append_writes_values_and_scales_then_attends(L, P, Z, K, G, H, seqs, window, softcap):
    """The step's int8 rows and their scales land at their slots (nowhere else), as the oracle's scatter
    puts them, in the donated buffers, in one call; then the attention is the oracle's."""
    step = _step(10, seqs, L=L, P=P, Z=Z, K=K, G=G, H=H, dtype=jnp.float32)
    T = step.q.shape[0]
    rng = np.random.default_rng(11)
    k_new, v_new = (_int8(jnp.asarray(rng.normal(size=(T, K, H)), jnp.float32)) for _ in range(2))
    slots = _step_slots(step, P)
    layer = L - 1

    def append(k, v):
        return cpu_kernels.paged_attention_append(step.q, k_new, v_new, k, v, layer, slots, *step.args(), scale=0.3,
                                                  window=window, softcap=softcap)

    k, v = _int8(step.k), _int8(step.v)
    o_xla, k_xla, v_xla = paged_attention_append_xla(step.q, k_new, v_new, k, v, layer, slots, *step.args(),
                                                     scale=0.3, window=window, softcap=softcap)
    f = jax.jit(append, donate_argnums=(0, 1))
    hlo = f.lower(k, v).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="llm_jax_paged_attention_append_i8"' in line]
    assert len(calls) == 1 and ("output_to_operand_aliasing={{1}: (6, {}), {2}: (7, {}), {3}: (8, {}), {4}: (9, {})}"
                                in calls[0]), hlo
    assert not any(op in hlo for op in (" copy(", " copy-start(", " scatter(", " dynamic-update-slice(")), hlo
    pointers = [a.unsafe_buffer_pointer() for a in (*k, *v)]
    o, k_out, v_out = f(k, v)
    assert [a.unsafe_buffer_pointer() for a in (*k_out, *v_out)] == pointers
    for ours, theirs in zip((*k_out, *v_out), (*k_xla, *v_xla)):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))  # NaN scales where they were
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_xla), atol=TOL, rtol=TOL)


def test_bad_int8_inputs_are_named():
    pages = _int8(jnp.ones((1, 6, 4, 2, 8)))
    tables, starts = jnp.ones((2, 3), jnp.int32), jnp.zeros(2, jnp.int32)
    q, new = jnp.ones((5, 4, 8)), _int8(jnp.ones((5, 2, 8)))

    def call(k=pages, v=pages, k_new=new):
        return cpu_kernels.paged_attention_append(q, k_new, new, k, v, 0, jnp.zeros(5, jnp.int32), tables, starts,
                                                  starts, starts, scale=1.0, window=None, softcap=None)

    with pytest.raises(ValueError, match=r"int8 pages must be a pair .* got \[\(\(1, 6, 4, 2, 8\), dtype\('int8'\)\), "
                                         r"\(\(1, 6, 3, 2\), dtype\('float32'\)\)\]"):
        call(k=(pages[0], pages[1][:, :, :3]))
    with pytest.raises(ValueError, match="pages k and v alike, got one int8 pair and one array"):
        call(v=pages[0])
    with pytest.raises(ValueError, match="k_new must be an int8 pair exactly when the pages are"):
        call(k_new=new[0])
    with pytest.raises(ValueError, match=r"k_new must be \[T, K, H\] = \(5, 2, 8\) of the pages' dtype int8, got "
                                         r"\(4, 2, 8\) int8"):
        call(k_new=(new[0][:4], new[1][:4]))
