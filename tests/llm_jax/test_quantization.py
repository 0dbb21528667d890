"""Quantized weights (``llm_jax.quantization``): the layout, the accuracy, and every path that takes them.

- the stored layout, read back with plain numpy from the module's description (int8, and int4 pairs
  with input 2j in the low nibble, offset by 8), and the round-trip bound of symmetric rounding;
- llama.cpp's Q8_0 and Q4_0 blocks, made and dequantized by the ``gguf`` package, held as our leaves
  dequantize to the package's floats bit for bit;
- every family's forward with quantized leaves equals the forward of their dequantized floats, on every
  backend (a mixture's experts too, for prefill- and decode-sized batches), and greedy generation through
  the CPU backend equals XLA's;
- perplexity and mean KL of next-token distributions on held-out text, shipped model and stories260K;
- the converter writes quantized checkpoints that load back as the same leaves.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multi_device import PYTHON, REPO, cpu_devices_env

import cpu_kernels
import llm_jax
from llm_jax import LinearRope, ModelConfig, Quantization, QuantScheme, Speculative
from llm_jax.config import Experts
from llm_jax.backends import Pallas
from llm_jax.backends.cpu.quantized import QuantizedPanels
from llm_jax.cli.convert import main as convert_main
from llm_jax.cli.generate import DEFAULT_MODEL
from llm_jax.kv_cache import Int8KV, init_cache
from llm_jax.model import forward, forward_extend, forward_prefill, init_params, unembed
from llm_jax.quantization import (
    QuantizedArray,
    from_gguf_blocks,
    is_quantized,
    quantize,
    quantize_params,
)
from llm_jax.sampling import GREEDY

SCHEMES = {"int8": Quantization(bits=8), "int8+embedding": Quantization(bits=8, embedding=True),
           "int4 g32": Quantization(bits=4, group_size=32), "int4 g64": Quantization(bits=4, group_size=64),
           "int4 g128": Quantization(bits=4, group_size=128),
           "int4 g32 offsets": Quantization(bits=4, group_size=32, offsets=True),
           # a GGUF file's kind of mix: a scheme per projection, one kept in floats, the tables in theirs
           "mixed": Quantization(bits=4, group_size=32, offsets=True, embedding=QuantScheme(
               bits=4, group_size=32, offsets=True), lm_head=QuantScheme(bits=8, group_size=16), projections=(
               ("v_proj", QuantScheme(bits=8, group_size=16)),
               ("o_proj", QuantScheme(bits=8, group_size=32, offsets=True)), ("down_proj", None)))}


def dequantized(params):
    """``params`` with every quantized leaf replaced by the float32 array it stands for."""
    return jax.tree.map(lambda x: x.dequantize() if is_quantized(x) else x, params, is_leaf=is_quantized)


# --- the layout ---------------------------------------------------------------------------------------


def numpy_dequantize(q: QuantizedArray) -> np.ndarray:
    """The module docstring's layout, read with numpy: W[k, n] = s[k // g, n] * q[k, n] (+ o[k // g, n])."""
    values, scales = np.asarray(q.values), np.asarray(q.scales)
    offsets = None if q.offsets is None else np.asarray(q.offsets)
    if q.transposed:
        values, scales = np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)
        offsets = None if offsets is None else np.swapaxes(offsets, -1, -2)
    if q.bits == 4:
        zero = 0 if offsets is not None else 8  # with offsets the nibbles are the integers, unsigned
        ints = np.empty((*values.shape[:-2], 2 * values.shape[-2], values.shape[-1]), np.int32)
        ints[..., 0::2, :] = (values & 0xF).astype(np.int32) - zero
        ints[..., 1::2, :] = (values >> 4).astype(np.int32) - zero
        ints = ints[..., : q.K, :]
    else:
        ints = values.astype(np.int32)
    w = ints.astype(np.float32) * np.repeat(scales, q.group_size, axis=-2)[..., : q.K, :]
    if offsets is not None:
        w = w + np.repeat(offsets, q.group_size, axis=-2)[..., : q.K, :]
    if q.transposed:
        w = np.swapaxes(w, -1, -2)
    return w.reshape(q.shape)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [None, 32, 64, 128, 20])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("offsets", [False, True])
def test_round_trip_within_half_a_step(bits, group_size, transposed, offsets):
    rng = np.random.default_rng(bits * 1000 + (group_size or 0))
    K, N = 172, 24  # stories260K's MLP width: a group size that does not divide K leaves a short last group
    w_KN = rng.standard_t(df=4, size=(2, K, N)).astype(np.float32)  # heavy tails, as real weights have
    w = np.swapaxes(w_KN, -1, -2) if transposed else w_KN
    q = quantize(jnp.asarray(w), bits, group_size, transposed=transposed, offsets=offsets)
    g = group_size or K
    assert q.shape == w.shape and q.group_size == g and q.scales.dtype == jnp.float32
    assert q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    back = np.asarray(q.dequantize())
    np.testing.assert_array_equal(back, numpy_dequantize(q))  # the layout as documented
    back_KN = np.swapaxes(back, -1, -2) if transposed else back
    scales = np.asarray(q.scales if not transposed else np.swapaxes(q.scales, -1, -2))
    step = np.abs(np.repeat(scales, g, axis=-2)[:, :K])
    ints = np.asarray(q.ints())
    ints_KN = np.swapaxes(ints, -1, -2) if transposed else ints
    error = np.abs(w_KN - back_KN)
    if offsets:  # each group's range in equal steps: every value within half a step, its ends reached
        assert (q.offsets is not None and q.offsets.shape == q.scales.shape and np.all(scales >= 0))
        assert np.all(error <= step * (0.5 + 1e-5) + 1e-6 * np.abs(w_KN))
        low, high = (-127, 127) if bits == 8 else (0, 15)
        assert ints_KN.min() == low and ints_KN.max() == high
        return
    # |w - sq| <= |s| / 2 (rounding to nearest), with room for float32 rounding of w / s and s·q; 4 bits
    # clip at 7: a value near the group's largest magnitude but of the other sign is up to one step off.
    clipped = ints_KN == 7 if bits == 4 else np.zeros_like(ints_KN, bool)
    assert np.all(error[~clipped] <= step[~clipped] * (0.5 + 1e-5))
    assert np.all(error[clipped] <= step[clipped] * (1 + 1e-5))
    # Each group's largest |w| is represented exactly as the end of the range: 127 steps, or -8 steps.
    assert np.abs(ints_KN).max() == (127 if bits == 8 else 8)
    assert bits == 8 or ints_KN.min() == -8 and ints_KN.max() <= 7


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_quantize_makes_llama_cpps_integers(kind):
    """Groups of 32 quantized as the ``gguf`` package quantizes Q8_0 / Q4_0 blocks (bit-exact with
    llama.cpp's reference): the same integers, and scales that round to its float16 ``d``."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    bits = 8 if kind == "Q8_0" else 4
    rng = np.random.default_rng(7)
    N, K = 24, 96
    w_NK = rng.standard_t(df=4, size=(N, K)).astype(np.float32)
    w_NK[3, 32:64] = 0  # an all-zero block
    w_NK[5, :32] = np.linspace(-1, 1, 32)  # largest magnitudes of both signs: the first is kept
    leaf = quantize(jnp.asarray(w_NK.T), bits, 32)
    blocks = gguf.quants.quantize(w_NK, qtype).reshape(N, K // 32, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # [N, K/32]
    if bits == 8:
        ints = blocks[..., 2:].view(np.int8).astype(np.int32)
    else:
        qs = blocks[..., 2:]
        ints = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int32) - 8
    np.testing.assert_array_equal(np.asarray(leaf.ints()).T, ints.reshape(N, K))
    np.testing.assert_array_equal(np.asarray(leaf.scales).T.astype(np.float16), d)


def test_int4_nibble_order():
    # q = -8 ... 7 down one column: byte j holds input 2j (low nibble) and 2j + 1 (high), offset by 8.
    q_K = np.arange(-8, 8, dtype=np.int8)
    leaf = quantize(jnp.asarray(q_K.astype(np.float32)[:, None]), 4)  # scale 8/7: not exact, so set it
    values = ((q_K[0::2] + 8) | ((q_K[1::2] + 8) << 4)).astype(np.uint8)[:, None]
    leaf = dataclasses.replace(leaf, values=jnp.asarray(values), scales=jnp.ones((1, 1), jnp.float32))
    np.testing.assert_array_equal(np.asarray(leaf.ints())[:, 0], q_K)
    np.testing.assert_array_equal(np.asarray(leaf.dequantize())[:, 0], q_K.astype(np.float32))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(jnp.ones((4, 4)), 3)
    with pytest.raises(ValueError, match=r"not \[\.\.\., 4, 6\]"):
        quantize(jnp.ones((4, 5)), 8, in_shape=(4,), out_shape=(6,))
    with pytest.raises(llm_jax.ConfigError, match="bits must be 8 or 4"):
        Quantization(bits=2)
    with pytest.raises(llm_jax.ConfigError, match="group_size"):
        Quantization(bits=4, group_size=0)
    with pytest.raises(llm_jax.ConfigError, match="offsets must be true or false"):
        Quantization(bits=4, offsets="yes")
    with pytest.raises(llm_jax.ConfigError, match=r"projections must name each of .* at most once, got \['x_proj'\]"):
        Quantization(bits=4, projections=(("x_proj", None),))
    with pytest.raises(llm_jax.ConfigError, match="invalid quantization"):
        ModelConfig.from_dict({**ModelConfig(**BASE).to_dict(), "quantization": {
            "bits": 4, "projections": [["v_proj", {"bits": 5}]]}})


# --- GGUF's Q8_0 and Q4_0 -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_gguf_blocks_are_held_exactly(kind):
    """llama.cpp's blocks (made by the ``gguf`` package) as our leaves: the same floats, bit for bit."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    rng = np.random.default_rng(1)
    R, K = 12, 96  # R output rows of K inputs: GGUF's [out, in] layout
    w = rng.normal(size=(R, K)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # uint8 [R, K / 32 · block bytes]
    expected = gguf.quants.dequantize(raw, qtype)
    blocks = raw.reshape(R, K // 32, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(R, K)
        bits = 8
    else:  # qs[i]: input i (low nibble) and input i + 16 (high nibble) of the block
        qs = blocks[..., 2:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(R, K)
        bits = 4
    values, scales = from_gguf_blocks(q, d, bits)
    leaf = QuantizedArray(jnp.asarray(values), jnp.asarray(scales), (K,), (R,), bits, 32, transposed=True)
    np.testing.assert_array_equal(np.asarray(leaf.dequantize()), expected)
    # The same leaf as a weight [in, out] (transposed arrays, not transposed flag): the same matrix.
    as_in_out = QuantizedArray(jnp.asarray(values.T), jnp.asarray(scales.T), (K,), (R,), bits, 32)
    np.testing.assert_array_equal(np.asarray(as_in_out.dequantize()), expected.T)


# --- the model on quantized leaves --------------------------------------------------------------------------

BASE = {"vocab_size": 96, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 96,
        "max_seq_len": 64}
FAMILIES = {
    "llama_gqa": {},
    "tied_mqa": {"tie_embeddings": True, "n_kv_heads": 1},
    "qwen2_bias": {"qkv_bias": True},
    "qwen3_qk_norm": {"qk_norm": True},
    "gemma2": {"activation": "gelu_tanh", "norm_weight_offset": 1.0, "embed_scale": True, "sandwich_norm": True,
               "tie_embeddings": True, "attn_logit_softcap": 20.0, "final_logit_softcap": 15.0, "sliding_window": 5,
               "sliding_layers": (True, False), "query_pre_attn_scalar": 16.0},
    "gemma3": {"activation": "gelu_tanh", "norm_weight_offset": 1.0, "embed_scale": True, "sandwich_norm": True,
               "qk_norm": True, "tie_embeddings": True, "sliding_window": 5, "sliding_layers": (True, False),
               "sliding_rope_theta": 100.0, "rope_scaling": LinearRope(factor=8.0), "query_pre_attn_scalar": 16.0},
}


# Gemma 3's layers are Gemma 2's and Qwen 3's but for their RoPE: one mix of int8 and int4 schemes suffices.
QUANTIZED_CASES = [(scheme, family) for scheme in ("int8+embedding", "int4 g32", "mixed") for family in FAMILIES
                   if family != "gemma3" or scheme == "mixed"]


@pytest.mark.parametrize("scheme, family", QUANTIZED_CASES)
def test_forward_on_quantized_leaves_is_the_dequantized_forward(family, scheme):
    config = ModelConfig(**{**BASE, **FAMILIES[family]})
    params = init_params(config, seed=3)
    qconfig, qparams = quantize_params(params, config, SCHEMES[scheme])
    quantized = [k for k, leaf in jax.tree_util.tree_flatten_with_path(qparams, is_leaf=is_quantized)[0]
                 if is_quantized(leaf)]
    q = SCHEMES[scheme]
    floats = sum(s is None for _, s in q.projections)
    assert len(quantized) == 7 - floats + (q.embedding is not None) + (
        not config.tie_embeddings and q.lm_head is not None)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 11)), jnp.int32)
    expected = forward(dequantized(qparams), config, tokens, backend="xla")
    for backend in ("xla", "cpu"):
        got = forward(qparams, qconfig, tokens, backend=backend)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)
    # The CPU kernels' form (int8 panels scaled after the product): the same function, summed in another order.
    weights = llm_jax.CpuKernels().prepare(qparams, qconfig)
    if SCHEMES[scheme].bits == 8:
        assert isinstance(weights["layers"]["mlp"]["down_proj"], QuantizedPanels)
    got = forward(weights, qconfig, tokens, backend="cpu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4, rtol=0)


MOE_FAMILIES = {"mixtral": {"experts": Experts(num_experts=4, top_k=2)},
                # a shared expert, and experts whose width (24) takes no panels: a mix of forms on the CPU kernels
                "qwen2_moe": {"experts": Experts(num_experts=4, top_k=2, shared_d_ff=40), "d_ff": 24, "qkv_bias": True}}
# Per-channel int8 (the int8 panel product); int4 with offsets (quant_matmul) beside leaves that take no panels;
# int4 experts beside float ones (a mix keeps down_proj in floats).
MOE_CASES = [("int8", "mixtral"), ("int4 g32 offsets", "qwen2_moe"), ("mixed", "mixtral")]


@pytest.mark.parametrize("scheme, family", MOE_CASES)
def test_moe_forward_on_quantized_leaves_is_the_dequantized_forward(family, scheme):
    """A mixture's experts [L, E, D, F] quantized expert by expert, the router kept in floats (a shared
    expert's projections as the dense MLP's): a prefill (many (token, expert) pairs: ragged_dot on the layer's
    dequantized experts) and a decode-sized batch (few: each pair's expert gathered as integers, or read in the
    stack by the CPU kernels) give the dequantized floats' forward on every backend and form."""
    config = ModelConfig(**{**BASE, **MOE_FAMILIES[family]})
    params = init_params(config, seed=3)
    qconfig, qparams = quantize_params(params, config, SCHEMES[scheme])
    moe, L, E = qparams["layers"]["moe"], config.n_layers, config.experts.num_experts
    floats = {name for name, s in SCHEMES[scheme].projections if s is None}
    assert isinstance(moe["router"], jax.Array) and not is_quantized(moe["router"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert is_quantized(moe[name]) == (name not in floats), name
        assert not is_quantized(moe[name]) or (moe[name].lead, moe[name].shape) == ((L, E), params["layers"]["moe"][
            name].shape)
        if config.experts.shared_d_ff is not None:
            assert is_quantized(moe[f"shared_{name}"]) == (name not in floats), name
    weights = llm_jax.CpuKernels().prepare(qparams, qconfig)
    assert isinstance(weights["layers"]["moe"]["up_proj"], QuantizedPanels) == (config.d_ff % 16 == 0)
    for shape in ((2, 11), (1, 2)):  # 44 pairs of 4 experts, then 4
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, shape), jnp.int32)
        expected = forward(dequantized(qparams), config, tokens, backend="xla")
        for backend in ("xla", "cpu"):
            got = forward(qparams, qconfig, tokens, backend=backend)
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)
        got = forward(weights, qconfig, tokens, backend="cpu")
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4, rtol=0)
        program = str(jax.make_jaxpr(lambda w, t: forward(w, qconfig, t, backend="cpu"))(weights, tokens))
        assert ("ragged_dot" in program) == (shape == (2, 11))
        if shape == (1, 2) and cpu_kernels.available():  # the chosen experts' integers read by the kernels
            assert "llm_jax_quant_matmul" in program or "llm_jax_matmul" in program


def test_quantizing_twice_or_wrong_params_is_an_error():
    config = ModelConfig(**BASE)
    qconfig, qparams = quantize_params(init_params(config), config, SCHEMES["int8"])
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(qparams, qconfig, SCHEMES["int8"])
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(qparams, config, SCHEMES["int8"])
    small = ModelConfig(**{**BASE, "d_ff": 32})
    with pytest.raises(ValueError, match=r"params/layers/mlp/gate_proj is \(2, 64, 96\); the config says"):
        quantize_params(init_params(config), small, SCHEMES["int8"])


@pytest.mark.parametrize("scheme", ["int8+embedding", "int4 g32", "mixed"])
def test_greedy_generation_on_the_cpu_backend_equals_xla(scheme):
    model = llm_jax.load(DEFAULT_MODEL, quantize=SCHEMES[scheme])
    prompts = ["Once upon a time", "The little dog"]
    outputs = {backend: llm_jax.generate(model.with_backend(backend), prompts, max_new_tokens=24, sampling=GREEDY)
               for backend in ("xla", "cpu")}
    assert [r.output_ids for r in outputs["xla"]] == [r.output_ids for r in outputs["cpu"]]


# --- accuracy on held-out text ----------------------------------------------------------------------------


def held_out_stories(count: int) -> list[str]:
    """Stories from the generator's held-out stream (one the shipped model's training never drew from)."""
    from training.recipe import STORIES
    from training.stories import stories

    return list(itertools.islice(stories(STORIES.val_seed), count))


# Not in TinyStories (written for this test): held-out text for stories260K.
TINY_STORY = (
    "One morning, a small brown dog named Pip found a red ball under the old tree in the park. He pushed it with "
    "his nose and it rolled down the hill. Pip ran after it, barking happily. At the bottom of the hill sat a girl "
    "called Mia. She picked up the ball and smiled. \"Is this yours?\" she asked. Pip wagged his tail. Mia threw the "
    "ball far away, and Pip ran to get it. They played all day until the sun went down. When it was time to go "
    "home, Mia gave Pip a hug. \"See you tomorrow,\" she said. Pip was very happy. The next day, it rained. Mia "
    "looked out of the window and felt sad. Her mom said, \"Let's bake cookies.\" They mixed the flour and the "
    "sugar and put the cookies in the oven. The kitchen smelled sweet and warm.")

# Targets of issue 47: perplexity within 1% (int8) and 5% (int4, groups of 32) of the float model's.
TARGETS = {"int8": 0.01, "int8+embedding": 0.01, "int4 g32": 0.05, "int4 g32 offsets": 0.05}


def perplexity_and_kl(model, texts: list[str]) -> dict[str, tuple[float, float]]:
    """{scheme: (perplexity / float perplexity - 1, mean KL(float ‖ quantized) in nats)} over ``texts``,
    each a document of its own (right-padded into one batch; every next token of every text counted)."""
    ids = [model.tokenizer.encode(text) for text in texts]
    T = max(map(len, ids))
    tokens = jnp.asarray([row + [0] * (T - len(row)) for row in ids], jnp.int32)
    lengths = jnp.asarray([len(row) for row in ids], jnp.int32)
    valid = (jnp.arange(T - 1)[None, :] < lengths[:, None] - 1)[..., None]  # [B, T - 1, 1]: targets that exist

    def log_probs(params, config):
        return jax.nn.log_softmax(forward(params, config, tokens, lengths, backend="xla")[:, :-1], axis=-1)

    def mean(values):
        return float(jnp.sum(jnp.where(valid, values, 0)) / jnp.sum(valid))

    def perplexity(lp):
        return float(np.exp(-mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))))

    lp0 = log_probs(model.params, model.config)
    out = {}
    for name, scheme in SCHEMES.items():
        lp = log_probs(*reversed(quantize_params(model.params, model.config, scheme)))
        kl = mean((jnp.exp(lp0) * (lp0 - lp)).sum(-1, keepdims=True))
        out[name] = (perplexity(lp) / perplexity(lp0) - 1, kl)
    print(f"\n{model.path}: {int(valid.sum())} predicted tokens, perplexity {perplexity(lp0):.4f}")
    for name, (delta, kl) in out.items():
        print(f"  {name:15s} Δppl {100 * delta:+.2f}%  mean KL {kl:.5f}")
    return out


def check_targets(results: dict[str, tuple[float, float]], targets: dict[str, float]) -> None:
    for name, limit in targets.items():
        assert results[name][0] <= limit, f"{name}: Δ perplexity {100 * results[name][0]:+.2f}% > {100 * limit}%"
    for name, (_, kl) in results.items():
        assert 0 <= kl < (0.01 if name.startswith("int8") else 0.5), f"{name}: mean KL {kl}"


def test_accuracy_on_the_shipped_model():
    check_targets(perplexity_and_kl(llm_jax.load(DEFAULT_MODEL), held_out_stories(16)), TARGETS)


def test_accuracy_on_stories260k(stories260k_dir):
    results = perplexity_and_kl(llm_jax.load(stories260k_dir / "stories260K.bin"), [TINY_STORY])
    check_targets(results, STORIES260K_TARGETS)


# stories260K (dim 64) loses more to symmetric 4 bits than the targets allow (docs/quantization.md); with an
# offset per group (llama.cpp's Q4_1 rule) it is within them on this story (+4.7%; +6.5% over 16 stories).
STORIES260K_TARGETS = {"int8": 0.01, "int8+embedding": 0.01, "int4 g32 offsets": 0.05}


# --- checkpoints ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--quantize", "int8", "--quantize-embedding"], ["--quantize", "int4"],
                                   ["--quantize", "int4", "--group-size", "64"], ["--quantize", "int4-asym"]])
def test_converted_checkpoints_load_as_the_same_leaves(stories260k_dir, tmp_path, flags):
    source = stories260k_dir / "stories260K.bin"
    assert convert_main([str(source), str(tmp_path / "q"), "--quiet", *flags]) == 0
    recorded = json.loads((tmp_path / "q" / "checkpoint.json").read_text())["config"]["quantization"]
    model = llm_jax.load(tmp_path / "q")
    float_model = llm_jax.load(source)
    qconfig, qparams = quantize_params(float_model.params, float_model.config, model.config.quantization)
    assert Quantization.from_dict(recorded) == qconfig.quantization
    assert model.config == qconfig
    assert jax.tree.structure(model.params) == jax.tree.structure(qparams)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(qparams)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = jnp.asarray([model.tokenizer.encode(TINY_STORY)[:40]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(forward(model.params, model.config, tokens, backend="xla")),
                                  np.asarray(forward(qparams, qconfig, tokens, backend="xla")))


def test_convert_flags_are_checked(stories260k_dir, tmp_path, capsys):
    source = str(stories260k_dir / "stories260K.bin")
    with pytest.raises(SystemExit):
        convert_main([source, str(tmp_path / "a"), "--group-size", "32"])
    assert "need --quantize" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_main([source, str(tmp_path / "b"), "--quantize", "int3"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- many devices -------------------------------------------------------------------------------------------

SHARDED = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import llm_jax
from llm_jax.model import forward
from llm_jax.sharding import make_mesh
path, scheme, tokens = sys.argv[1], json.loads(sys.argv[2]), jnp.asarray(json.loads(sys.argv[3]), jnp.int32)
single = llm_jax.load(path, backend="xla", quantize=llm_jax.Quantization.from_dict(scheme))
expected = np.asarray(forward(single.params, single.config, tokens, backend="xla"))
out = {}
for spec in ("model=4", "data=2,model=2"):
    model = llm_jax.load(path, mesh=spec, quantize=llm_jax.Quantization.from_dict(scheme))
    q = model.params["layers"]["attn"]["k_proj"]
    got = np.asarray(jax.jit(lambda p, t: forward(p, model.config, t, backend="xla"))(model.params, tokens))
    out[spec] = [float(np.abs(got - expected).max()), str(q.values.sharding.spec), model.config.n_kv_heads,
                 type(q).__name__]
print(json.dumps(out))
"""


@pytest.mark.parametrize("scheme", ["int8+embedding", "mixed"])
def test_sharded_quantized_forward_equals_one_device(scheme):
    """Quantized params laid out by the sharding table (K/V heads repeated on model=4: the shipped model has
    2) give one device's logits."""
    tokens = [[1, 400, 300, 200, 100, 50, 20, 7]] * 2
    done = subprocess.run([PYTHON, "-c", SHARDED, str(DEFAULT_MODEL), json.dumps(dataclasses.asdict(SCHEMES[scheme])),
                           json.dumps(tokens)], env=cpu_devices_env(4), capture_output=True, text=True, timeout=900,
                          cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for spec, (error, k_spec, kv_heads, kind) in results.items():
        assert kind == "QuantizedArray" and error <= 1e-4, (spec, error)
        assert "model" in k_spec, (spec, k_spec)  # split, not whole on every device
    assert results["model=4"][2] == 4  # the K/V heads repeated for the model axis


# --- the command line ---------------------------------------------------------------------------------------


def test_generate_quantizes_on_load(capsys, monkeypatch):
    from llm_jax import loading
    from llm_jax.cli.generate import main as generate_main

    loaded = []
    real_load = loading.load
    monkeypatch.setattr(loading, "load", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    prompt = "Once upon a time"
    assert generate_main(["--quantize", "int4", "--group-size", "64", "--prompt", prompt, "--max-new-tokens", "12",
                          "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert loaded[0].config.quantization == Quantization(bits=4, group_size=64)
    model = llm_jax.load(DEFAULT_MODEL, quantize=Quantization(bits=4, group_size=64))
    expected = llm_jax.generate(model, [prompt], max_new_tokens=12, sampling=GREEDY)[0]
    assert json.dumps(report).count(json.dumps(expected.text)) >= 1
    with pytest.raises(SystemExit):
        generate_main(["--group-size", "32", "--prompt", prompt])
    assert "--group-size needs --quantize" in capsys.readouterr().err


# --- the int8 KV cache --------------------------------------------------------------------------------------


def cached_log_probs(model, ids: list[int], cache_dtype) -> jax.Array:
    """Next-token log-probabilities [T - 1, V] of ``ids`` read through the KV cache: the first token
    prefilled, the rest appended in one call, each attending over keys and values read from the cache."""
    tokens = jnp.asarray([ids], jnp.int32)
    cache = init_cache(model.config, 1, len(ids), cache_dtype)
    x, cache = forward_prefill(model.params, model.config, tokens[:, :1], jnp.asarray([1]), cache, backend="xla")
    rest, cache = forward_extend(model.params, model.config, tokens[:, 1:], cache, jnp.asarray([True]), backend="xla")
    logits = unembed(model.params, model.config, jnp.concatenate([x, rest], axis=1), backend="xla")
    return jax.nn.log_softmax(logits[0, :-1], axis=-1)


@pytest.mark.parametrize("which", ["shipped", "stories260K"])
def test_int8_kv_cache_accuracy(which, stories260k_dir):
    """Perplexity through an int8 KV cache within 0.5% of the float cache's (issue 47's target)."""
    if which == "shipped":
        model, texts = llm_jax.load(DEFAULT_MODEL), held_out_stories(4)
    else:
        model, texts = llm_jax.load(stories260k_dir / "stories260K.bin"), [TINY_STORY]
    nll = {"float": [], "int8": []}
    kls = []
    for text in texts:
        ids = model.tokenizer.encode(text)
        targets = jnp.asarray(ids[1:])[:, None]
        lp = {name: cached_log_probs(model, ids, dtype) for name, dtype in (("float", None), ("int8", "int8"))}
        for name, values in nll.items():
            values.append(-jnp.take_along_axis(lp[name], targets, axis=-1)[:, 0])
        kls.append((jnp.exp(lp["float"]) * (lp["float"] - lp["int8"])).sum(-1))
    ppl = {name: float(np.exp(np.mean(np.concatenate(v)))) for name, v in nll.items()}
    kl = float(np.mean(np.concatenate(kls)))
    print(f"\n{which}: perplexity {ppl['float']:.4f} (float cache), int8 cache Δ {100 * (ppl['int8'] / ppl['float'] - 1):+.3f}%"
          f", mean KL {kl:.6f}")
    assert ppl["int8"] / ppl["float"] - 1 <= 0.005
    assert 0 <= kl < 0.005


def test_generate_with_an_int8_kv_cache():
    model = llm_jax.load(DEFAULT_MODEL)
    stream = llm_jax.generate_stream(model, ["Once upon a time", "The dog"], max_new_tokens=16,
                                     kv_cache_dtype="int8", return_kv_cache=True)
    for _ in stream:
        pass
    results = stream.results
    cache = stream.kv_cache
    assert isinstance(cache.k_LBSKH, Int8KV) and cache.k_LBSKH.q_LBSKH.dtype == jnp.int8
    assert cache.k_LBSKH.s_LBSK.shape == cache.k_LBSKH.shape[:-1]  # a scale per token and head
    assert all(len(r.output_ids) > 0 for r in results)
    with pytest.raises(ValueError, match="a KV cache holds one of int8, bfloat16, float32 .*, got 'int4'"):
        llm_jax.generate(model, ["x"], kv_cache_dtype="int4")


def test_an_int8_kv_cache_gives_the_same_tokens_on_every_backend_and_with_speculation(stories260k_dir):
    """Greedy tokens through an int8 cache: XLA's (write, then the layer dequantized) are the reference; the
    CPU kernels (the paged kernel reading each row as a page, int8 in place) and Pallas give the same, and so
    do speculative decoding (n-gram and a draft model: verification extends the int8 cache by k + 1 tokens,
    rollback lowers its lengths) and beam search (rows reordered)."""
    model = llm_jax.load(stories260k_dir / "stories260K.bin", backend="xla")
    prompts = ["Once upon a time, there was a little girl", "The dog ran and ran and ran and ran"]
    kwargs = dict(max_new_tokens=48, kv_cache_dtype="int8")
    reference = [r.output_ids for r in llm_jax.generate(model, prompts, **kwargs)]
    backends = [Pallas()] + (["cpu"] if cpu_kernels.available() else [])
    for backend in backends:
        on = model.with_backend(backend)
        assert [r.output_ids for r in llm_jax.generate(on, prompts, **kwargs)] == reference, backend
    fastest = model.with_backend(backends[-1])
    for speculative in (Speculative(method="ngram", num_tokens=4),
                        Speculative(method="draft", num_tokens=3, draft_model=fastest)):
        ids = [r.output_ids for r in llm_jax.generate(fastest, prompts, speculative=speculative, **kwargs)]
        assert ids == reference, speculative.method
    # A float32 model over a bfloat16 cache: the CPU kernels read it as XLA does.
    bfloat16 = [[r.output_ids for r in llm_jax.generate(on, prompts, max_new_tokens=48, kv_cache_dtype="bfloat16")]
                for on in (model, fastest)]
    assert bfloat16[1] == bfloat16[0]
    beams = [[r.output_ids for r in llm_jax.generate(on, prompts[:1], num_beams=3, num_return_sequences=3,
                                                      max_new_tokens=16, kv_cache_dtype="int8")]
             for on in (model, fastest)]
    assert beams[1] == beams[0] and len(set(map(tuple, beams[0]))) == 3
