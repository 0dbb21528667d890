"""Matrix products through the backends, and the CPU kernels' execution form of the weights
(``llm_jax.backends.cpu.forms``): every route computes the same einsum, the prepared form keeps every
path and computes the same model, and it is built by moving bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from llm_jax.backends import CpuKernels, Xla
from llm_jax.backends.cpu import GLU_KERNEL_MIN_ROWS, forms
from llm_jax.backends.cpu.forms import Fused, FusedPart, Panels
from llm_jax.config import Activation, ModelConfig
from llm_jax.model import forward, init_params
from llm_jax.weights.placement import leaves_by_path
from tests.llm_jax.backends.layouts import assert_same_model, random_params

KERNEL_TARGET = "llm_jax_matmul"
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels did not build here")
BACKENDS = {"xla": Xla(), "cpu": CpuKernels()}

# (equation, x shape, w shape): the model's products — leading and trailing contracted weight axes, two
# contracted axes (o_proj), and one the kernels do not take (a contracted axis in the middle of x).
CASES = [("BTD,DNH->BTNH", (2, 3, 16), (16, 4, 8)), ("BTNH,NHD->BTD", (1, 1, 4, 8), (4, 8, 16)),
         ("BTD,VD->BTV", (1, 2, 16), (40, 16)), ("BDT,DF->BTF", (1, 16, 2), (16, 24))]

# Tied embeddings (vocabulary 96 = 6 panels), GQA with q/k/v biases, q/k norms and GeGLU; d_model 40 is no
# multiple of 16, so o_proj and down_proj stay plain beside the fused q/k/v (80 columns) and gate/up (112).
TIED = ModelConfig(vocab_size=96, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=10, d_ff=56,
                   max_seq_len=64, qkv_bias=True, qk_norm=True, activation=Activation.GELU_TANH,
                   tie_embeddings=True)
# An untied LM head and every projection a multiple of 16 wide.
UNTIED = ModelConfig(vocab_size=112, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                     max_seq_len=64, tie_embeddings=False)


def _bf16_values(rng, shape) -> jnp.ndarray:
    """float32 inputs that bfloat16 holds exactly: the kernels read x in float32, XLA's route casts it to
    the weights' dtype; on such inputs both compute the same products."""
    return jnp.asarray(rng.normal(size=shape), jnp.bfloat16).astype(jnp.float32)


def _lowered(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("equation,x_shape,w_shape", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_route_is_the_einsum(equation, x_shape, w_shape, name):
    rng = np.random.default_rng(0)
    x = _bf16_values(rng, x_shape)
    w = jnp.asarray(rng.normal(size=w_shape), jnp.bfloat16)
    f = lambda x, w: BACKENDS[name].dense(equation, x, w, jnp.float32)
    expected = np.einsum(equation, np.asarray(x.astype(jnp.bfloat16), np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w)), expected, rtol=1e-5, atol=1e-4)
    kernel = name == "cpu" and not equation.startswith("BDT") and cpu_kernels.available()
    assert (KERNEL_TARGET in _lowered(f, x, w)) == kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_decode_and_prefill_products_use_the_kernels(dtype):
    """One row (decode), batched decode and a long prompt all run the kernels (streaming or tiled, chosen
    inside by the number of rows), for both weight dtypes; a float16 weight goes to XLA."""
    f = lambda x, w: CpuKernels().dense("BTD,DF->BTF", x, w, jnp.float32)
    w = jnp.ones((16, 24), dtype)
    for x_shape in [(1, 1, 16), (64, 1, 16), (1, 300, 16)]:
        assert (KERNEL_TARGET in _lowered(f, jnp.ones(x_shape), w)) == cpu_kernels.available()
    assert KERNEL_TARGET not in _lowered(f, jnp.ones((1, 1, 16)), jnp.ones((16, 24), jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_layer_of_stacked_weights(dtype, name):
    """With ``layer``, every route computes the einsum with that layer of the stack [L, ...]; the kernels
    get the whole stack (no dynamic slice of the weights in the program)."""
    backend = BACKENDS[name]
    rng = np.random.default_rng(2)
    x = _bf16_values(rng, (1, 1, 16))
    ws = [jnp.asarray(rng.normal(size=(3, 16, 4, 8)), dtype), jnp.asarray(rng.normal(size=(3, 4, 8, 16)), dtype)]
    equations = ["BTD,DNH->BTNH", "BTNH,NHD->BTD"]
    xs = [x, x.reshape(1, 1, 4, 4).repeat(2, -1)]
    f = jax.jit(lambda xs, ws, layer: [backend.dense(eq, xi, w, jnp.float32, layer)
                                       for eq, xi, w in zip(equations, xs, ws)])
    for layer in (0, 2):
        for y, eq, xi, w in zip(f(xs, ws, jnp.int32(layer)), equations, xs, ws):
            expected = np.einsum(eq, np.asarray(xi.astype(dtype), np.float64), np.asarray(w[layer], np.float64))
            np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4)
    hlo = f.lower(xs, ws, jnp.int32(0)).compile().as_text()
    kernel = name == "cpu" and cpu_kernels.available()
    assert (KERNEL_TARGET in hlo) == kernel
    if kernel:
        assert "dynamic-slice" not in hlo


def test_several_weights_in_one_kernel_call():
    rng = np.random.default_rng(1)
    x = _bf16_values(rng, (1, 1, 16))
    ws = [jnp.asarray(rng.normal(size=(16, n, 8)), jnp.bfloat16) for n in (4, 2, 2)]
    equations = ["BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTD,DKH->BTKH"]
    f = lambda x, ws: CpuKernels().dense_many(equations, x, ws, jnp.float32)
    assert _lowered(f, x, ws).count(KERNEL_TARGET) == (1 if cpu_kernels.available() else 0)
    for y, eq, w in zip(jax.jit(f)(x, ws), equations, ws):
        np.testing.assert_allclose(np.asarray(y), np.asarray(Xla().dense(eq, x, w, jnp.float32)), rtol=1e-5, atol=1e-4)


def test_the_prepared_form_keeps_every_path_and_round_trips_exactly():
    params = random_params(TIED)
    ours = forms.prepare(params, TIED)
    assert jax.tree.structure(params).num_leaves > 0
    layers, L, D, N, K, H, F = ours["layers"], 3, 40, 4, 2, 10, 56
    assert set(layers["attn"]) == set(params["layers"]["attn"]) and set(layers["mlp"]) == set(params["layers"]["mlp"])
    qkv = layers["attn"]["q_proj"]
    assert isinstance(qkv, Fused) and qkv.out_shapes == ((N, H), (K, H), (K, H))
    assert layers["attn"]["k_proj"] == FusedPart(1) and layers["attn"]["v_proj"] == FusedPart(2)
    assert isinstance(qkv.data, Panels) and qkv.data.data.shape == (L, (N + 2 * K) * H // 16, D, 16)
    # q's columns first, then k's, then v's; gate then up
    fused = qkv.data.unpacked()
    np.testing.assert_array_equal(fused[:, :, N * H:(N + K) * H], params["layers"]["attn"]["k_proj"].reshape(L, D, K * H))
    gate_up = layers["mlp"]["gate_proj"].data.unpacked()
    np.testing.assert_array_equal(gate_up[..., F:], params["layers"]["mlp"]["up_proj"])
    assert layers["attn"]["o_proj"] is params["layers"]["attn"]["o_proj"]  # D = 40: no whole panels
    table = ours["embedder"]["embedding"]
    assert isinstance(table, Panels) and table.transposed and table.data.shape == (6, 40, 16)
    np.testing.assert_array_equal(table.data[2, :, 5], params["embedder"]["embedding"][37])  # panel 2, lane 5
    np.testing.assert_array_equal(table.unpacked(), params["embedder"]["embedding"])
    assert table.shape == (96, 40)

    params = random_params(UNTIED)
    ours = forms.prepare(params, UNTIED)
    o_proj = ours["layers"]["attn"]["o_proj"]
    assert isinstance(o_proj, Panels) and o_proj.data.shape == (2, 3, 32, 16) and o_proj.shape == (2, 4, 8, 48)
    np.testing.assert_array_equal(o_proj.unpacked(), params["layers"]["attn"]["o_proj"])
    assert isinstance(ours["lm_head"], Panels) and isinstance(ours["embedder"]["embedding"], jax.Array)


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prepared_form_computes_the_same_model(config, dtype):
    config = config.replace(param_dtype=dtype, compute_dtype=dtype)
    params = random_params(config, seed=1)
    atol = 1e-5 if dtype == "float32" else 5e-2
    weights = CpuKernels(greedy_screen=False).prepare(params, config)
    assert_same_model((weights, CpuKernels()), (params, CpuKernels()), config, atol=atol)
    assert_same_model((params, CpuKernels()), (params, Xla()), config, atol=atol)


@needs_kernels
def test_the_gated_activation_runs_the_kernel_from_8_rows():
    """On a fused gate/up, act(gate) · up is cpu_kernels.glu from GLU_KERNEL_MIN_ROWS rows on, XLA's below
    (the test above compares the logits of both forms at 26 rows)."""
    params = random_params(TIED)
    weights = forms.prepare(params, TIED)
    f = jax.jit(forward, static_argnums=1, static_argnames="backend")
    for rows in (GLU_KERNEL_MIN_ROWS - 1, GLU_KERNEL_MIN_ROWS):
        tokens_BT = jnp.zeros((1, rows), jnp.int32)
        assert ("llm_jax_glu_gelu_tanh_f32" in f.lower(weights, TIED, tokens_BT, backend=CpuKernels()).as_text()) \
            == (rows >= GLU_KERNEL_MIN_ROWS)
        assert "llm_jax_glu" not in f.lower(params, TIED, tokens_BT, backend=CpuKernels()).as_text()


def test_bfloat16_forms_move_bits_and_convert_nothing():
    """Fusing and panelling bfloat16 weights moves their bits: XLA:CPU converts a bfloat16 concatenate or
    transpose to float32 and back, so the compiled programs must hold neither a conversion nor a float32
    array; and the form holds exactly the weights."""
    config = TIED.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = random_params(config)
    gate, up = params["layers"]["mlp"]["gate_proj"], params["layers"]["mlp"]["up_proj"]
    programs = [forms._fused_panels.lower([gate, up]), forms._side_by_side.lower([gate, up]),
                forms._panels.lower(forms._side_by_side([params["layers"]["attn"][n] for n in ("q_proj", "k_proj",
                                                                                                 "v_proj")]), 1, 40, 80),
                forms._table_panels.lower(params["embedder"]["embedding"])]
    for lowered in programs:
        text = lowered.compile().as_text()
        assert "bf16[" in text and " convert(" not in text and "f32[" not in text, text
    weights = forms.prepare(params, config)
    np.testing.assert_array_equal(weights["embedder"]["embedding"].unpacked(), params["embedder"]["embedding"])


def test_weights_of_another_backend_and_mismatched_configs_are_clear_errors():
    params = init_params(UNTIED)
    with pytest.raises(ValueError, match=r"params/layers/attn/q_proj is \(2, 48, 4, 8\); the config says \[2, 48, 6, 8\]"):
        forms.prepare(params, UNTIED.replace(n_heads=6))
    weights = forms.prepare(params, UNTIED)
    with pytest.raises(TypeError, match="the xla backend got a weight of type (Panels|Fused)"):
        forward(weights, UNTIED, jnp.zeros((1, 3), jnp.int32), backend="xla")
    plain = jax.tree.leaves(params)
    assert all(isinstance(x, jax.Array) for x in plain)
    assert set(leaves_by_path(params)) == set(leaves_by_path(init_params(UNTIED)))
