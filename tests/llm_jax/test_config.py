import pytest

from llm_jax.config import ConfigError, DefaultRope, LinearRope, Llama3Rope, ModelConfig

BASE = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24, max_seq_len=64)


def test_valid_config_derives_values():
    c = ModelConfig(**BASE, query_pre_attn_scalar=16.0)
    assert c.q_per_kv == 2
    assert c.attn_scale == pytest.approx(0.25)
    assert c.layer_windows() == (None, None)
    assert hash(c) == hash(ModelConfig(**BASE, query_pre_attn_scalar=16.0))


@pytest.mark.parametrize("changes, message", [
    (dict(n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(head_dim=5), "head_dim=5 must be even"),
    (dict(d_model=0), "d_model must be a positive integer"),
    (dict(norm_eps=0.0), "norm_eps must be positive"),
    (dict(param_dtype="int8"), "param_dtype must be"),
    (dict(sliding_window=-4), "sliding_window must be positive"),
    (dict(sliding_layers=(True,)), "sliding_layers has 1 entries but n_layers=2"),
    (dict(sliding_layers=(True, False)), "sliding_window is None"),
    (dict(rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                                  original_max_position_embeddings=8192)), "invalid rope_scaling"),
    (dict(attn_logit_softcap=0.0), "attn_logit_softcap must be positive"),
    (dict(sliding_window=8, sliding_rope_theta=0.0), "sliding_rope_theta must be positive"),
    (dict(sliding_rope_theta=100.0), "sliding_rope_theta=100.0 is set but no layer has a sliding window"),
])
def test_invalid_config_is_rejected(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, **changes})


def test_round_trip_through_dict():
    c = ModelConfig(**BASE, rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=32),
                    sliding_window=8, sliding_layers=(True, False), sliding_rope_theta=100.0, param_dtype="bfloat16")
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert c.layer_windows() == (8, None)
    assert (c.layer_rope(True), c.layer_rope(False)) == ((100.0, DefaultRope()), (c.rope_theta, c.rope_scaling))
    assert ModelConfig.from_dict({k: v for k, v in c.to_dict().items() if k != "sliding_rope_theta"}) == c.replace(
        sliding_rope_theta=None)  # a config saved before the field existed
    assert ModelConfig.from_dict(ModelConfig(**BASE, rope_scaling=LinearRope(factor=2.0)).to_dict()).rope_scaling \
        == LinearRope(factor=2.0)
    assert ModelConfig(**BASE).rope_scaling == DefaultRope()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="unknown model config fields \\['n_experts'\\]"):
        ModelConfig.from_dict({**BASE, "n_experts": 8})


def test_num_params_matches_pytree():
    import jax
    from llm_jax.model import init_params

    for tie in (False, True):
        c = ModelConfig(**BASE, tie_embeddings=tie)
        params = init_params(c, seed=0)
        assert c.num_params() == sum(x.size for x in jax.tree.leaves(params))


def test_runtime_choices_are_not_config():
    """How a model runs is its backend's (``llm_jax.backends``): not a config field, never saved; configs
    saved with the runtime fields of earlier versions still load, without them."""
    with pytest.raises(TypeError, match="attention_impl"):
        ModelConfig(**BASE, attention_impl="pallas")
    saved = {**ModelConfig(**BASE).to_dict(), "attention_impl": "pallas", "matmul_impl": "xla"}
    assert ModelConfig.from_dict(saved) == ModelConfig(**BASE)
    assert not {"attention_impl", "matmul_impl"} & set(ModelConfig(**BASE).to_dict())
