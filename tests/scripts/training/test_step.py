import jax
import numpy as np
import pytest

from llm_jax.config import ModelConfig
from llm_jax.model import init_params
from training.loss import mean_loss
from training.step import (OptimizerConfig, _decay_mask, init_state, make_eval_step, make_optimizer,
                                   make_train_step)

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                     max_seq_len=32)


def params(seed: int):
    return init_params(CONFIG, seed=seed)


def test_schedule_warms_up_then_decays_to_its_floor():
    opt = OptimizerConfig(peak_lr=1e-2, final_lr_ratio=0.1, warmup_steps=10, total_steps=100)
    lr = opt.schedule()
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose(float(lr(5)), 5e-3, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1e-2, rtol=1e-6)
    np.testing.assert_allclose(float(lr(100)), 1e-3, rtol=1e-6)
    assert float(lr(10)) > float(lr(50)) > float(lr(90))


def test_weight_decay_skips_norm_scales_only():
    mask = _decay_mask(params(0))
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert not flat["final_norm/scale"] and not flat["layers/attn_norm/scale"]
    assert not flat["layers/mlp_norm/scale"]
    assert flat["embedder/embedding"] and flat["layers/attn/q_proj"] and flat["lm_head"]
    assert sum(not v for v in flat.values()) == 3


def test_train_step_fits_a_repeated_batch_and_eval_agrees():
    rng = np.random.default_rng(0)
    tokens_BT = rng.integers(1, CONFIG.vocab_size, (4, 17)).astype(np.int32)
    lengths_B = np.array([17, 17, 10, 4], np.int32)
    opt = make_optimizer(OptimizerConfig(peak_lr=1e-2, warmup_steps=2, total_steps=30))
    state = init_state(params(1), opt)
    step = make_train_step(CONFIG, opt)
    losses = []
    for _ in range(30):
        state, metrics = step(state, tokens_BT, lengths_B)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"]))
    assert int(state.step) == 30
    assert losses[0] == pytest.approx(np.log(CONFIG.vocab_size), abs=0.3)  # uniform at init
    assert losses[-1] < 0.5 * losses[0]
    # The eval step's sum / count is the mean loss the train step would report now.
    total, count = make_eval_step(CONFIG)(state.params, tokens_BT, lengths_B)
    assert int(count) == 16 + 16 + 9 + 3
    mean = jax.jit(mean_loss, static_argnums=1)(state.params, CONFIG, tokens_BT, lengths_B)
    np.testing.assert_allclose(float(total) / int(count), float(mean), rtol=1e-5)
