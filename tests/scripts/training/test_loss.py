import jax
import numpy as np
import pytest

from llm_jax.config import ModelConfig
from llm_jax.model import forward, init_params
from training import loss

# Jitted once each: op-by-op dispatch of a whole model is slow.
token_losses = jax.jit(loss.token_losses, static_argnums=1)
mean_loss = jax.jit(loss.mean_loss, static_argnums=1)
target_mask = loss.target_mask

CONFIG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                     max_seq_len=64, tie_embeddings=True)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=0)


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens_BT = rng.integers(1, CONFIG.vocab_size, (3, 12)).astype(np.int32)
    lengths_B = np.array([12, 7, 0], np.int32)  # full, right-padded, empty
    return tokens_BT, lengths_B


def reference_losses(params, tokens_BT, lengths_B):
    """Cross-entropy from the model's logits in float64, position by position."""
    logits_BTV = jax.jit(forward, static_argnums=1)(params, CONFIG, tokens_BT[:, :-1], lengths_B)
    logits = np.asarray(logits_BTV, np.float64)
    out = np.zeros(logits.shape[:2])
    for b in range(logits.shape[0]):
        for t in range(int(lengths_B[b]) - 1):
            row = logits[b, t]
            log_z = np.log(np.exp(row - row.max()).sum()) + row.max()
            out[b, t] = log_z - row[tokens_BT[b, t + 1]]
    return out


def test_target_mask_counts_real_targets():
    np.testing.assert_array_equal(target_mask(np.array([3, 1, 0]), 4),
                                  [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


def test_token_losses_match_a_float64_reference(params):
    tokens_BT, lengths_B = batch()
    losses_BT, mask_BT = token_losses(params, CONFIG, tokens_BT, lengths_B)
    expected = reference_losses(params, tokens_BT, lengths_B)
    np.testing.assert_allclose(np.asarray(losses_BT), expected, atol=2e-6, rtol=2e-6)
    assert int(mask_BT.sum()) == 11 + 6
    np.testing.assert_allclose(float(mean_loss(params, CONFIG, tokens_BT, lengths_B)),
                               expected.sum() / 17, rtol=2e-6)


def test_padding_does_not_change_the_loss(params):
    tokens_BT, lengths_B = batch()
    other = tokens_BT.copy()
    other[1, 7:] = (other[1, 7:] + 13) % CONFIG.vocab_size  # rewrite row 1's padding and row 2 entirely
    other[2] = 5
    a = mean_loss(params, CONFIG, tokens_BT, lengths_B)
    b = mean_loss(params, CONFIG, other, lengths_B)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)


def test_an_all_padding_batch_gives_zero_not_nan(params):
    tokens_BT, _ = batch()
    assert float(mean_loss(params, CONFIG, tokens_BT, np.zeros(3, np.int32))) == 0.0
