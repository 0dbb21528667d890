"""The panel layout of the projections (``llm_jax.model.panels``): exact round trips, which weights take
it, the same model output as the plain layout (full forward, prefill, one-token decode steps; the
kernels' products and XLA's), and ``consume``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.config import Activation, MatmulImpl, ModelConfig
from llm_jax.model import fuse_projections, init_params, unfuse_projections
from llm_jax.model import fused
from llm_jax.model import panels as panels_lib
from llm_jax.model.panels import from_panel_layout, has_panels, to_panel_layout
from llm_jax.weights.placement import leaves_by_path
from tests.llm_jax.model.layouts import assert_same_model

# Tied embeddings (vocabulary 96 = 6 panels), GQA with q/k/v biases, q/k norms and GeGLU; d_model 40 is no
# multiple of 16, so o_proj and down_proj stay plain beside the fused q/k/v (80 columns) and gate/up (112).
TIED = ModelConfig(vocab_size=96, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=10, d_ff=56,
                   max_seq_len=64, qkv_bias=True, qk_norm=True, activation=Activation.GELU_TANH,
                   tie_embeddings=True)
# An untied LM head and every projection a multiple of 16 wide (q 4·8, k/v 2·8: separate, in panels each).
UNTIED = ModelConfig(vocab_size=112, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                     max_seq_len=64, tie_embeddings=False)


def random_params(config: ModelConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), init_params(config))


def assert_same_leaves(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for path, x in leaves_by_path(b).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(a)[path]), np.asarray(x), err_msg=str(path))


def test_which_weights_take_panels_and_the_round_trip_is_exact():
    params = random_params(TIED)
    ours = fuse_projections(params, TIED, panels=True)
    layers = ours["layers"]
    assert set(layers["attn"]) >= {"qkv_proj_panels", "o_proj"} and "qkv_proj" not in layers["attn"]
    assert layers["attn"]["qkv_proj_panels"].shape == (3, 80 // 16, 40, 16)
    assert set(layers["mlp"]) == {"gate_up_proj_panels", "down_proj"}
    assert set(ours["embedder"]) == {"embedding_panels"} and ours["embedder"]["embedding_panels"].shape == (6, 40, 16)
    # panel q of the table holds rows 16q ... 16q + 15 of E, transposed: the LM head's columns
    np.testing.assert_array_equal(ours["embedder"]["embedding_panels"][2, :, 5], params["embedder"]["embedding"][37])
    assert has_panels(ours) and not has_panels(params)
    assert_same_leaves(unfuse_projections(ours, TIED), params)

    params = random_params(UNTIED)
    ours = to_panel_layout(params, UNTIED)  # separate q/k/v and gate/up, each in panels
    assert {name for name in ours["layers"]["attn"]} == {"q_proj_panels", "k_proj_panels", "v_proj_panels",
                                                         "o_proj_panels"}
    assert ours["layers"]["attn"]["o_proj_panels"].shape == (2, 3, 32, 16)  # o_proj [N, H, D]: K = N·H
    assert set(ours) >= {"lm_head_panels"} and set(ours["embedder"]) == {"embedding"}  # untied: rows as they are
    assert_same_leaves(from_panel_layout(ours, UNTIED), params)


@pytest.mark.parametrize("config,layout", [(TIED, "fused"), (UNTIED, "separate")])
@pytest.mark.parametrize("impl", [MatmulImpl.AUTO, MatmulImpl.XLA], ids=["kernels", "xla"])
def test_panels_compute_the_same_model(config, layout, impl):
    config = config.replace(matmul_impl=impl)
    params = random_params(config, seed=1)
    ours = fuse_projections(params, config, panels=True) if layout == "fused" else to_panel_layout(params, config)
    assert_same_model(ours, params, config)


def test_consume_deletes_only_the_replaced_arrays():
    params = init_params(TIED)
    table, o_proj = params["embedder"]["embedding"], params["layers"]["attn"]["o_proj"]
    ours = fuse_projections(params, TIED, panels=True, consume=True)
    assert table.is_deleted() and params["layers"]["attn"]["q_proj"].is_deleted()
    assert not o_proj.is_deleted() and ours["layers"]["attn"]["o_proj"] is o_proj  # no panels for it: kept
    assert np.isfinite(np.asarray(ours["embedder"]["embedding_panels"])).all()


def test_bfloat16_layouts_move_bits_and_convert_nothing():
    """Fusing and panelling bfloat16 weights moves their bits: XLA:CPU converts a bfloat16 concatenate or
    transpose to float32 and back (the 1B shape's gate/up: 3.9 GB for a moment), so the compiled programs
    must hold neither a conversion nor a float32 array; and the round trip is exact."""
    config = TIED.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = random_params(config)
    gate, up = params["layers"]["mlp"]["gate_proj"], params["layers"]["mlp"]["up_proj"]
    programs = [fused._side_by_side.lower([gate, up]),
                panels_lib._panels.lower(fused._side_by_side([gate, up]), 1, 40, 112),
                panels_lib._table_panels.lower(params["embedder"]["embedding"])]
    for lowered in programs:
        text = lowered.compile().as_text()
        assert "bf16[" in text and " convert(" not in text and "f32[" not in text, text
    assert_same_leaves(unfuse_projections(fuse_projections(params, config, panels=True), config), params)


def test_params_that_do_not_match_the_config_are_a_clear_error():
    params = init_params(UNTIED)
    expected = r"layers/attn/q_proj is \(2, 48, 4, 8\), the config says \[\.\.\., 48, 6, 8\]"
    with pytest.raises(ValueError, match=expected):
        to_panel_layout(params, UNTIED.replace(n_heads=6))
