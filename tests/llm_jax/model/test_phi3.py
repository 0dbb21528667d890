"""Phi-3, Phi-3.5 and Phi-4 (``Phi3ForCausalLM``) beyond the family parity tests (``test_families.py``): the
fused qkv_proj and gate_up_proj split at load; LongRoPE on both sides of its original context (short factors,
long factors, and a cached decode that crosses from one to the other, as transformers' forward with a cache
crosses it); partial rotary embeddings; both backends; the serving engine; int8 weights; the classifier; and
the refusals. Expected values come from ``transformers`` (float32, eager attention).

Two tiny checkpoints: "mini" as Phi-3-mini-4k (a sliding window, plain RoPE; 6 query heads over 3 kv heads,
3 layers) and "long" as Phi-3.5-mini / Phi-4-mini (LongRoPE from an original context of 16 to 64, 3/4 of each
head rotating, tied embeddings; 6 query heads over 2 kv heads)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ConfigError, LongRope, ModelConfig
from llm_jax.model import forward
from llm_jax.quantization import is_quantized
from llm_jax.serving.engine import Engine
from llm_jax.weights.hf_config import config_from_hf
from tests.hf_models import save_random_model
from tests.llm_jax.model.test_families import ATOL, greedy_decode

ORIG = 16  # the long checkpoint's original_max_position_embeddings
SHORT = [1.05, 0.9, 1.3]  # one factor per rotary frequency: 6 rotating dimensions of 8
LONG = [2.2, 6.5, 17.0]
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=72, num_attention_heads=6, max_position_embeddings=64,
              rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CHECKPOINTS = {
    "mini": dict(num_hidden_layers=3, num_key_value_heads=3, sliding_window=7, tie_word_embeddings=False),
    "long": dict(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True, partial_rotary_factor=0.75,
                 original_max_position_embeddings=ORIG,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                      short_factor=SHORT, long_factor=LONG)),
}
BACKENDS = ["cpu", "xla"]


def build(folder, fields: dict, cls=transformers.Phi3ForCausalLM, seed: int = 0, **extra):
    """A random Phi-3 checkpoint saved to ``folder``; its norms perturbed away from 1."""
    return save_random_model(folder, transformers.Phi3Config(**{**COMMON, **fields, **extra}), make=cls, seed=seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name → (folder, torch model)."""
    out = {}
    for name, fields in CHECKPOINTS.items():
        folder = tmp_path_factory.mktemp(f"phi3_{name}")
        out[name] = folder, build(folder, fields)
    return out


def tokens(seed: int, length: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], size=(rows, length))


def max_delta(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - np.asarray(theirs)).max())


def torch_greedy(torch_model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


run_forward = jax.jit(forward, static_argnums=1, static_argnames="backend")


def test_config_is_read(checkpoints):
    mini = llm_jax.load(checkpoints["mini"][0], dtype="float32").config
    assert (mini.sliding_window, mini.sliding_layers, mini.rotary_dim, mini.rope_dim) == (7, None, None, 8)
    assert (mini.rope_scaling, mini.norm_eps, mini.n_kv_heads, mini.tie_embeddings) == (
        llm_jax.DefaultRope(), 1e-5, 3, False)
    assert "rotary_dim" not in mini.to_dict()  # configs without partial rotary read as before it existed
    long = llm_jax.load(checkpoints["long"][0], dtype="float32").config
    assert (long.rotary_dim, long.rope_dim, long.head_dim, long.tie_embeddings, long.max_seq_len) == (6, 6, 8, True, 64)
    assert long.rope_scaling == LongRope(short_factor=tuple(SHORT), long_factor=tuple(LONG),
                                         original_max_position_embeddings=ORIG,
                                         attention_factor=math.sqrt(1 + math.log(64 / ORIG) / math.log(ORIG)))
    assert ModelConfig.from_dict(json.loads(json.dumps(long.to_dict()))) == long


def test_fused_projections_are_split(checkpoints):
    """qkv_proj's rows are q's N·H, then k's K·H, then v's; gate_up_proj's the gate's F, then up's."""
    folder, torch_model = checkpoints["mini"]
    params = llm_jax.load(folder, dtype="float32", backend="xla").params
    layer = torch_model.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj.weight.detach().numpy(), layer.mlp.gate_up_proj.weight.detach().numpy()
    D, N, K, H, F = 48, 6, 3, 8, 72
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    np.testing.assert_array_equal(np.asarray(attn["q_proj"][1]), qkv[:N * H].T.reshape(D, N, H))
    np.testing.assert_array_equal(np.asarray(attn["k_proj"][1]), qkv[N * H:(N + K) * H].T.reshape(D, K, H))
    np.testing.assert_array_equal(np.asarray(attn["v_proj"][1]), qkv[(N + K) * H:].T.reshape(D, K, H))
    np.testing.assert_array_equal(np.asarray(mlp["gate_proj"][1]), gate_up[:F].T)
    np.testing.assert_array_equal(np.asarray(mlp["up_proj"][1]), gate_up[F:].T)


# (checkpoint, sequence length): the window crossed; LongRoPE's short factors (16 tokens: transformers' rule is
# length > original context) and its long ones.
FORWARDS = [("mini", 30), ("long", ORIG), ("long", 30)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(checkpoints, backend):
    for name, length in FORWARDS:
        folder, torch_model = checkpoints[name]
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        ids = tokens(length, length, rows=2)
        with torch.no_grad():
            theirs = torch_model(torch.tensor(ids)).logits.numpy()
        delta = max_delta(run_forward(model.weights, model.config, jnp.asarray(ids), backend=model.backend), theirs)
        print(f"phi3 {name} {backend} T={length}: max |Δlogit| {delta:.2e} (logits up to {np.abs(theirs).max():.1f})")
        assert delta <= ATOL, (name, length, delta)


def test_both_factor_sets_matter(checkpoints):
    """The short and the long sequences above rotate differently: each forward with the other set's factors
    (or without the attention factor, or rotating every dimension) is far from transformers'."""
    folder, torch_model = checkpoints["long"]
    model = llm_jax.load(folder, dtype="float32", backend="xla")
    rope = model.config.rope_scaling
    wrong = {ORIG: rope.__class__(short_factor=rope.long_factor, long_factor=rope.long_factor,
                                  original_max_position_embeddings=ORIG, attention_factor=rope.attention_factor),
             30: rope.__class__(short_factor=rope.short_factor, long_factor=rope.short_factor,
                                original_max_position_embeddings=ORIG, attention_factor=rope.attention_factor)}
    for length, other in wrong.items():
        ids = jnp.asarray(tokens(length, length, rows=2))
        with torch.no_grad():
            theirs = torch_model(torch.tensor(np.asarray(ids))).logits.numpy()
        for config in (model.config.replace(rope_scaling=other),
                       model.config.replace(rope_scaling=LongRope(short_factor=SHORT, long_factor=LONG,
                                                                  original_max_position_embeddings=ORIG)),
                       model.config.replace(rotary_dim=None, rope_scaling=llm_jax.DefaultRope())):
            assert max_delta(run_forward(model.params, config, ids, backend="xla"), theirs) > 100 * ATOL, length


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_matches_transformers(checkpoints, backend):
    """24 greedy tokens of the Phi-3-mini-4k checkpoint, and of LongRoPE past its original context (a 20-token
    prompt: the long factors throughout) and within it (4 + 12 tokens: the short ones throughout)."""
    runs = [("mini", tokens(1, 12)[0].tolist(), 24), ("long", tokens(2, 20)[0].tolist(), 24),
            ("long", tokens(3, 4)[0].tolist(), ORIG - 4)]
    for name, prompt, new_tokens in runs:
        folder, torch_model = checkpoints[name]
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        ours = llm_jax.generate(model, [prompt], max_new_tokens=new_tokens, ignore_eos=True)[0].output_ids
        assert ours == torch_greedy(torch_model, prompt, new_tokens), (name, len(prompt))


def test_cached_decode_across_the_original_context_is_transformers_forward(checkpoints):
    """A 10-token prompt decoded 14 steps, past the original context of 16: each step rotates its token by the
    factors its sequence length picks (short up to 16 tokens, long beyond), the cached keys keeping theirs, as
    transformers' forward does step by step over its cache. (transformers' ``generate`` instead re-encodes the
    whole sequence when it first crosses; llm_jax never re-encodes a cache.)"""
    folder, torch_model = checkpoints["long"]
    model = llm_jax.load(folder, dtype="float32")
    prompt = tokens(4, 10)
    steps = 14
    ours, step_logits = greedy_decode(model.params, model.config, jnp.asarray(prompt), steps)
    theirs, their_logits = [], []
    with torch.no_grad():
        out = torch_model(torch.tensor(prompt), use_cache=True)
        for _ in range(steps):
            logits = out.logits[0, -1]
            their_logits.append(logits.numpy())
            theirs.append(int(logits.argmax()))
            out = torch_model(torch.tensor([[theirs[-1]]]), cache=out.cache, use_cache=True)
    assert np.asarray(ours)[0].tolist() == theirs
    delta = max_delta(np.asarray(step_logits)[0], np.stack(their_logits))
    print(f"phi3 long decode across the original context: max |Δlogit| {delta:.2e}")
    assert delta <= ATOL


def test_engine_gives_transformers_tokens(checkpoints):
    """Paged attention in blocks of 4: a prompt past the original context (prefilled in one chunk) and one
    within it, in one batch; each request's tokens are transformers'."""
    folder, torch_model = checkpoints["long"]
    model = llm_jax.load(folder, dtype="float32")
    requests = {"past": (tokens(2, 20)[0].tolist(), 24), "within": (tokens(3, 4)[0].tolist(), ORIG - 4)}
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=32, block_size=4, max_model_len=64)
    outputs = {}
    for rid, (prompt, new_tokens) in requests.items():
        engine.add_request(rid, prompt, max_new_tokens=new_tokens)
        outputs[rid] = []
    for _ in range(200):
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        if not engine.has_unfinished:
            break
    for rid, (prompt, new_tokens) in requests.items():
        assert outputs[rid] == torch_greedy(torch_model, prompt, new_tokens), rid


def test_int8_weights_run_the_split_projections(checkpoints):
    """int8 quantization takes our split q/k/v and gate/up params: its forward is the dequantized forward's,
    near transformers' float one."""
    folder, torch_model = checkpoints["long"]
    model = llm_jax.load(folder, dtype="float32", quantize="int8")
    layers = model.params["layers"]
    assert is_quantized(layers["attn"]["k_proj"]) and is_quantized(layers["mlp"]["up_proj"])
    ids = tokens(5, 30, rows=2)
    with torch.no_grad():
        theirs = torch_model(torch.tensor(ids)).logits.numpy()
    delta = max_delta(run_forward(model.weights, model.config, jnp.asarray(ids), backend=model.backend), theirs)
    print(f"phi3 long int8: max |Δlogit| {delta:.2e}")
    assert ATOL < delta < 0.05 * np.abs(theirs).max()


def test_classifier_matches_transformers(tmp_path):
    torch_model = build(tmp_path, CHECKPOINTS["long"], cls=transformers.Phi3ForSequenceClassification, seed=1,
                        num_labels=3)
    with torch.no_grad():
        torch_model.score.weight.normal_()
    torch_model.save_pretrained(tmp_path)
    model = llm_jax.load(tmp_path, dtype="float32")
    assert (model.config.classifier.num_labels, model.config.rotary_dim) == (3, 6)
    texts = [tokens(6, 9)[0].tolist(), tokens(7, 24)[0].tolist()]  # within and past the original context
    with torch.no_grad():
        theirs = np.stack([torch_model(input_ids=torch.tensor([ids])).logits[0].numpy() for ids in texts])
    assert max_delta(llm_jax.classify(model, texts).logits, theirs) <= ATOL


PHI3_JSON = dict(architectures=["Phi3ForCausalLM"], vocab_size=97, hidden_size=48, intermediate_size=72,
                 num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)


def test_older_spellings_are_read():
    """transformers 4's configs: ``rope_scaling`` of type ``su`` (Phi-3-mini-128k's first release) or
    ``longrope``, original_max_position_embeddings and partial_rotary_factor beside it."""
    for kind in ("su", "longrope"):
        config = config_from_hf({**PHI3_JSON, "original_max_position_embeddings": 16, "partial_rotary_factor": 0.75,
                                 "rope_scaling": {"type": kind, "short_factor": SHORT, "long_factor": LONG}})
        assert config.rotary_dim == 6 and config.rope_scaling.original_max_position_embeddings == 16
        assert config.rope_scaling.attention_factor == math.sqrt(1 + math.log(4) / math.log(16))
    plain = config_from_hf(PHI3_JSON)  # Phi-4: no scaling, no window; Phi3Config's norm eps
    assert (plain.rope_scaling, plain.rotary_dim, plain.sliding_window, plain.norm_eps) == (
        llm_jax.DefaultRope(), None, None, 1e-5)


def test_bad_configs_are_refused_by_name():
    base = dict(vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=72, max_seq_len=64)
    with pytest.raises(ConfigError, match="rotary_dim must be an even integer from 2 to head_dim=8"):
        ModelConfig(**base, rotary_dim=5)
    with pytest.raises(ConfigError, match=r"short_factor and long_factor have 3 entries.*rotary dimensions 8 / 2 = 4"):
        ModelConfig(**base, rope_scaling=LongRope(short_factor=SHORT, long_factor=LONG,
                                                  original_max_position_embeddings=16))
    with pytest.raises(ConfigError, match="short_factor has 3 entries but long_factor has 2"):
        LongRope(short_factor=SHORT, long_factor=LONG[:2], original_max_position_embeddings=16)
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.0"):
        config_from_hf({**PHI3_JSON, "partial_rotary_factor": 0.0})
    with pytest.raises(ConfigError, match="short_factor"):
        config_from_hf({**PHI3_JSON, "original_max_position_embeddings": 16,
                        "rope_scaling": {"type": "longrope", "short_factor": SHORT[:2], "long_factor": LONG[:2]}})
