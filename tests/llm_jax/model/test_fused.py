"""The fused layout of q/k/v and gate/up (``llm_jax.model.fused``): exact round trips, the same model output
as the separate layout (full forward, prefill and one-token decode steps), the fusion plan, and which
layout ``load``, ``save_checkpoint`` and ``Model.shard`` use."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
import llm_jax
from llm_jax.benchmark.shapes import shape_config
from llm_jax.config import Activation, ModelConfig
from llm_jax.model import (for_inference, forward, fuse_projections, init_params, is_fused, param_shapes,
                           unfuse_projections)
from llm_jax.model.fused import FUSED_ROW_BYTES, fusion_plan, kernels_prefer_fused
from llm_jax.model.layers import GLU_KERNEL_MIN_ROWS
from llm_jax.sharding import make_mesh
from llm_jax.weights.checkpoint import load_checkpoint, save_checkpoint
from llm_jax.weights.placement import leaves_by_path
from tests.llm_jax.model.layouts import assert_same_model

# Grouped-query attention with q/k/v biases, q/k norms and GeGLU: every part of the layout in play.
CONFIG = ModelConfig(vocab_size=96, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=10, d_ff=56,
                     max_seq_len=64, qkv_bias=True, qk_norm=True, activation=Activation.GELU_TANH)


def random_params(config: ModelConfig, seed: int = 0):
    """init_params with every leaf drawn (its norms and biases are constants that could hide a mix-up)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), init_params(config))


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG)


def test_fuse_then_unfuse_is_exact(params):
    fused = fuse_projections(params, CONFIG)
    L, D, N, K, H, F = 3, 40, 4, 2, 10, 56
    assert fused["layers"]["attn"]["qkv_proj"].shape == (L, D, (N + 2 * K) * H)
    assert fused["layers"]["mlp"]["gate_up_proj"].shape == (L, D, 2 * F)
    assert not {"q_proj", "k_proj", "v_proj"} & set(fused["layers"]["attn"])
    assert not {"gate_proj", "up_proj"} & set(fused["layers"]["mlp"])
    # q's columns first, then k's, then v's; gate then up
    np.testing.assert_array_equal(fused["layers"]["attn"]["qkv_proj"][:, :, N * H:(N + K) * H],
                                  params["layers"]["attn"]["k_proj"].reshape(L, D, K * H))
    np.testing.assert_array_equal(fused["layers"]["mlp"]["gate_up_proj"][..., F:], params["layers"]["mlp"]["up_proj"])
    assert is_fused(fused) and not is_fused(params)
    back = unfuse_projections(fused, CONFIG)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for path, x in leaves_by_path(params).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(back)[path]), np.asarray(x), err_msg=str(path))
    assert unfuse_projections(params, CONFIG) is params  # nothing to undo
    again = fuse_projections(fused, CONFIG)  # fusing fused params changes nothing
    assert jax.tree.structure(again) == jax.tree.structure(fused)


def test_consume_deletes_only_the_replaced_arrays():
    params = init_params(CONFIG)
    q, down = params["layers"]["attn"]["q_proj"], params["layers"]["mlp"]["down_proj"]
    fuse_projections(params, CONFIG)
    assert not q.is_deleted()  # by default the caller's arrays stay usable
    fused = fuse_projections(params, CONFIG, consume=True)
    assert q.is_deleted() and params["layers"]["mlp"]["up_proj"].is_deleted()
    assert not down.is_deleted() and fused["layers"]["mlp"]["down_proj"] is down
    assert np.isfinite(np.asarray(fused["layers"]["attn"]["qkv_proj"])).all()


def test_fused_layout_computes_the_same_model(params):
    assert_same_model(fuse_projections(params, CONFIG), params, CONFIG)


def test_the_gated_activation_runs_the_kernel_from_8_rows(params):
    """In the fused layout act(gate) · up is cpu_kernels.glu from GLU_KERNEL_MIN_ROWS rows on (the
    test above compares its logits with the separate layout's, XLA's activation, at 26 rows), XLA's below."""
    fused = fuse_projections(params, CONFIG)
    for rows in (GLU_KERNEL_MIN_ROWS - 1, GLU_KERNEL_MIN_ROWS):
        tokens_BT = jnp.zeros((1, rows), jnp.int32)
        hlo = jax.jit(forward, static_argnums=1).lower(fused, CONFIG, tokens_BT).as_text()
        assert ("llm_jax_glu_gelu_tanh_f32" in hlo) == (rows >= GLU_KERNEL_MIN_ROWS and cpu_kernels.available())
        assert "llm_jax_glu" not in jax.jit(forward, static_argnums=1).lower(params, CONFIG, tokens_BT).as_text()


def test_fusion_plan_follows_the_kernels_whole_row_limit():
    source = (pathlib.Path(cpu_kernels.__file__).parent / "matmul.cc").read_text()
    assert re.search(r"kFullRowBytes = (\d+);", source).group(1) == str(FUSED_ROW_BYTES)
    assert fusion_plan(shape_config("110M", dtype="float32")) == (True, True)  # 9 KiB and 16 KiB rows
    assert fusion_plan(shape_config("15M", dtype="bfloat16")) == (True, True)
    # TinyLlama bfloat16: q/k/v 5 KiB rows fuse; gate/up would be 22 KiB rows, read slower as column tiles
    one_b = shape_config("1B", dtype="bfloat16")
    assert 2 * one_b.d_ff * 2 > FUSED_ROW_BYTES and fusion_plan(one_b) == (True, False)
    small = one_b.replace(n_layers=1, vocab_size=8)
    fused = jax.eval_shape(lambda p: fuse_projections(p, small), param_shapes(small))
    assert set(fused["layers"]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    assert "qkv_proj" in fused["layers"]["attn"]
    # for_inference fuses exactly where the CPU kernels run the products
    assert is_fused(for_inference(init_params(CONFIG), CONFIG)) == kernels_prefer_fused()


def test_load_fuses_where_the_kernels_run_and_save_keeps_the_separate_layout(stories260k_dir, tmp_path):
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    separate = llm_jax.load(stories260k_dir / "stories260K.bin", fuse=False)
    assert is_fused(model.params) == kernels_prefer_fused() and not is_fused(separate.params)
    assert is_fused(llm_jax.load(stories260k_dir / "stories260K.bin", fuse=True).params)
    save_checkpoint(tmp_path / "ckpt", config=model.config, params=model.params)
    _, restored, _ = load_checkpoint(tmp_path / "ckpt")
    assert not is_fused(restored)
    for path, x in leaves_by_path(separate.params).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(restored)[path]), np.asarray(x), err_msg=str(path))
    mesh = make_mesh("data=1,model=1")
    inference = fuse_projections(separate.params, model.config, panels=True)
    sharded = llm_jax.Model(config=model.config, params=inference,
                            tokenizer=None, eos_ids=()).shard(mesh)
    assert not is_fused(sharded.params) and sharded.mesh is mesh
    with pytest.raises(ValueError, match="fused layout is for one device"):
        llm_jax.load(stories260k_dir / "stories260K.bin", fuse=True, mesh="data=1")
