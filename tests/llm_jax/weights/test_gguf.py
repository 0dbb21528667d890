"""GGUF import against its references: ``transformers`` logits and greedy ids, ``gguf.quants.dequantize``.

The GGUF files are written here with the ``gguf`` package's writer, the way llama.cpp's
``convert_hf_to_gguf.py`` writes them (our own code, following its rules): metadata from config.json,
``llama`` q/k rows permuted into Meta's interleaved RoPE layout, Gemma norms stored as ``1 + w``, Llama 3
RoPE scaling as a ``rope_freqs`` tensor, tied heads omitted; tensors encoded and the vocabulary written by
``llm_jax.weights.to_gguf``'s ``encode`` and ``add_tokenizer``. The tensors are taken from the Hugging Face
files, not through llm_jax's own writer (``to_gguf.save_gguf``), so that these files are a reference
independent of it (``test_to_gguf.py`` compares the two). Loading must undo all of it.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import llm_jax
from llm_jax.config import ConfigError
from llm_jax.model import forward
from llm_jax.model.rope import inverse_frequencies
from llm_jax.weights.checkpoint import load_checkpoint
from llm_jax.weights.convert import convert
from llm_jax.backends.cpu.quantized import QuantizedPanels
from llm_jax.quantization import is_quantized
from llm_jax.weights import from_gguf, gguf_blocks
from llm_jax.weights.from_gguf import dequantize_rows, load_gguf, open_gguf
from llm_jax.weights.layout import WeightsError
from llm_jax.weights.placement import leaves_by_path
from llm_jax.weights.to_gguf import add_tokenizer, encode
from tests.llm_jax.model.test_families import (FAMILIES, GEMMA3_ROPE, Family, build, greedy_decode, tokens,
                                               torch_greedy)

ATOL = 1e-4  # float32 max |Δlogit| against transformers
Q = gguf.GGMLQuantizationType

# HF tensor name (after "model.layers.{i}.") → GGUF name (after "blk.{i}.")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


def meta_interleave(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-halves rows → Meta's interleaved rows, per head (what convert_hf_to_gguf's permute does):
    row j * H/2 + i of a head moves to row 2i + j."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if arch in ("gemma2", "gemma3"):  # Gemma 2's and 3's sandwich norms
        rest = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}.get(rest, rest)
    rest = {"post_attention_layernorm.weight": "ffn_norm.weight"}.get(rest, rest)
    return f"blk.{layer}.{LAYER_NAMES.get(rest, rest)}"


def llama3_rope_freqs(hf: dict) -> np.ndarray:
    """The per-frequency factors convert_hf_to_gguf stores for Llama 3 RoPE scaling."""
    rope = hf["rope_parameters"]
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    orig, lo, hi, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                            rope["high_freq_factor"], rope["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / hi:
            out.append(1.0)
        elif wavelen > orig / lo:
            out.append(factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: pathlib.Path, hf_folder: pathlib.Path, qtype=Q.F32, *, vocab: pathlib.Path | None = None,
               pre: str = "gpt-2", arch: str | None = None, rope_dims: int | None = None,
               extra=None, replace: dict | None = None) -> pathlib.Path:
    """A GGUF of the Hugging Face folder, its matrices stored as ``qtype`` (F16 where a row is not whole
    blocks, as llama.cpp falls back), norms and biases F32."""
    hf = json.loads((hf_folder / "config.json").read_text())
    arch = arch or ARCH[hf["architectures"][0]]
    n_heads, n_kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dims or head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers' (llama.cpp fixes the local ones')
    w.add_rope_freq_base(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        w.add_sliding_window(hf["sliding_window"])
    if arch == "gemma3":  # no attention soft-cap; the window unless every layer is global
        if any(t == "sliding_attention" for t in hf["layer_types"]):
            w.add_sliding_window(hf["sliding_window"])
        if hf.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if extra is not None:
        extra(w)
    if vocab is not None:
        add_tokenizer(w, vocab, pre)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(hf))
    tensors = load_file(hf_folder / "model.safetensors")
    for name, x in tensors.items():
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        x = x.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            x = meta_interleave(x, n_heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            x = meta_interleave(x, n_kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + 1  # llama.cpp's RMSNorm multiplies by the weight alone
        if replace and gguf_name(name, arch) in replace:  # raw blocks given by the test
            blocks, raw = replace[gguf_name(name, arch)]
            w.add_tensor(gguf_name(name, arch), blocks, raw_dtype=raw)
            continue
        data, raw = encode(x, qtype.name if x.ndim == 2 else "F32")
        w.add_tensor(gguf_name(name, arch), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


jit_forward = jax.jit(forward, static_argnums=1)

# Families as llama.cpp describes them. Mistral's window has no GGUF key (llama.cpp runs it as llama without
# one); Gemma 2's query_pre_attn_scalar neither (llama.cpp uses head_dim), so the file's model uses head_dim.
GGUF_FAMILIES = {
    "llama2_mha": FAMILIES["llama2_mha"],
    "llama3_gqa_rope_scaling": FAMILIES["llama3_gqa_rope_scaling"],
    "llama32_mqa_tied": FAMILIES["llama32_mqa_tied"],
    "qwen2_bias_tied": FAMILIES["qwen2_bias_tied"],
    "qwen3_qk_norm": FAMILIES["qwen3_qk_norm"],
    "gemma_mqa": FAMILIES["gemma_mqa"],
    "gemma2_softcap_local_global": Family(
        transformers.Gemma2Config,
        dict(FAMILIES["gemma2_softcap_local_global"].fields, query_pre_attn_scalar=16), {}),
    # Gemma 3 as llama.cpp runs it: every 6th layer global, the local layers' RoPE plain of base 10000, the
    # attention scaled by head_dim; the global layers' RoPE linearly scaled, as in the 4B-27B models.
    "gemma3_six_layers": Family(
        transformers.Gemma3TextConfig,
        dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
             sliding_window=6, rope_parameters=dict(GEMMA3_ROPE, sliding_attention=dict(rope_type="default",
                                                                                          rope_theta=10000.0))),
        dict(sliding_window=6, sliding_layers=(True,) * 5 + (False,), sliding_rope_theta=10000.0, qk_norm=True,
             rope_theta=50000.0, rope_scaling=llm_jax.LinearRope(factor=8.0), query_pre_attn_scalar=16.0)),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name)``: (name, folder, torch model) of a family's tiny model, saved in ``folder / "hf"`` once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = name, folder, build(GGUF_FAMILIES[name], folder / "hf")
        return cache[name]

    return get


@pytest.fixture(scope="module", params=sorted(GGUF_FAMILIES))
def family(request, built):
    return built(request.param)


def test_float_gguf_logits_and_greedy_match_transformers(family):
    name, folder, torch_model = family
    model = llm_jax.load(write_gguf(folder / "f32.gguf", folder / "hf"))
    reference = llm_jax.load(folder / "hf", dtype="float32")
    for field, value in GGUF_FAMILIES[name].expect.items():
        if field == "rope_scaling":  # from rope_freqs: the same frequencies (lo, hi, orig are not stored)
            c = model.config
            np.testing.assert_allclose(inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling),
                                       inverse_frequencies(c.head_dim, c.rope_theta, value), rtol=1e-6, atol=0)
        elif field != "norm_weight_offset":  # GGUF stores Gemma's 1 + w: offset 0 (checked by the logits)
            assert getattr(model.config, field) == value, field
    assert model.config.param_dtype == "float32"
    ids = tokens(model.config.vocab_size, 0, 40)
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
    delta = float(np.abs(ours - torch_logits(torch_model, ids)).max())
    print(f"{name}: F32 GGUF max |Δlogit| {delta:.2e}")
    assert delta <= ATOL
    prompts = tokens(model.config.vocab_size, 1, 12)
    greedy, _ = greedy_decode(model.params, model.config, jnp.asarray(prompts), 32)
    np.testing.assert_array_equal(np.asarray(greedy), torch_greedy(torch_model, prompts))
    # Against the source loaded directly: the same params but for Gemma's norms, stored as 1 + w.
    if not name.startswith("gemma"):
        for path, x in leaves_by_path(reference.params).items():
            np.testing.assert_array_equal(np.asarray(leaves_by_path(model.params)[path]), np.asarray(x), err_msg=path)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
@pytest.mark.parametrize("name", ["llama2_mha", "qwen2_bias_tied"])
def test_half_precision_gguf_equals_the_rounded_source(built, name, qtype):
    """F16 / BF16 tensors are read exactly: the logits equal transformers' on the same rounded weights."""
    name, folder, source = built(name)
    model = llm_jax.load(write_gguf(folder / f"{qtype.name}.gguf", folder / "hf", qtype), dtype="float32")
    rounded = {torch.float16: Q.F16, torch.bfloat16: Q.BF16}
    torch_dtype = next(k for k, v in rounded.items() if v == qtype)
    reference = copy.deepcopy(source)
    with torch.no_grad():
        for p in reference.parameters():
            if p.ndim == 2:
                p.copy_(p.to(torch_dtype).float())
    ids = tokens(model.config.vocab_size, 0, 40)
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
    assert float(np.abs(ours - torch_logits(reference, ids)).max()) <= ATOL


def test_bf16_gguf_loads_as_bfloat16(built):
    _, folder, _ = built("llama2_mha")
    model = llm_jax.load(write_gguf(folder / "bf16.gguf", folder / "hf", Q.BF16))
    assert model.config.param_dtype == "bfloat16"


# --- quantized tensors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_block_dequantization_is_bit_exact(tmp_path, qtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    x[3, :32] = 0  # an all-zero block: scale 0
    x[5, 40] = 1e4  # an outlier
    w = gguf.GGUFWriter(tmp_path / "q.gguf", "llama")
    w.add_tensor("t", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.add_tensor("stack", gguf.quants.quantize(x.reshape(2, 24, 96), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = open_gguf(tmp_path / "q.gguf")
    for name in ("t", "stack"):
        tensor = f.tensors[name]
        ours = dequantize_rows(tensor)
        theirs = gguf.quants.dequantize(tensor.data, qtype)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape == tensor.shape
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


# Byte offsets of each block type's float16 scales (ggml's block structs; IQ1_M spreads its one scale over
# the top nibbles of four uint16s from byte 48, see random_blocks).
SCALE_OFFSETS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q2_K: [80, 82],
                 Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ1_S: [0], Q.IQ1_M: [],
                 Q.IQ2_XXS: [0], Q.IQ2_XS: [0], Q.IQ2_S: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0], Q.IQ4_NL: [0],
                 Q.IQ4_XS: [0]}
LEAF_TYPES = [Q[name] for name in from_gguf.BLOCK_TYPES]


def random_blocks(rng, qtype, rows: int, cols: int, scale: float = 0.05) -> np.ndarray:
    """Arbitrary blocks of ``qtype`` (every bit pattern is a valid block once its float16 scales are finite):
    the scales drawn from N(0, scale²)."""
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        d = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:  # float16 bits h: nibble i of h is the top nibble of uint16 i of the scales
        h = (rng.standard_normal(len(blocks)) * scale).astype(np.float16).view(np.uint16)[:, None]
        words = np.ascontiguousarray(blocks[:, 48:56]).view(np.uint16)
        nibbles = (h >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)
        blocks[:, 48:56] = ((words & np.uint16(0x0FFF)) | (nibbles << np.uint16(12))).view(np.uint8)
    return blocks.reshape(rows, cols // per_block * block_bytes)


@pytest.mark.parametrize("qtype", LEAF_TYPES, ids=lambda q: q.name)
def test_random_blocks_dequantize_bit_exactly(tmp_path, qtype, monkeypatch):
    """Every bit pattern of every block type we read, K- and i-quants included (the gguf package cannot
    quantize those; it dequantizes them), over several chunks of rows."""
    monkeypatch.setattr(from_gguf, "_ROWS_PER_CHUNK", 4)
    blocks = random_blocks(np.random.default_rng(1), qtype, 6, 512)
    w = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    w.add_tensor("t", blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensor = open_gguf(tmp_path / "k.gguf").tensors["t"]
    assert tensor.shape == (6, 512)
    theirs = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32)
    assert np.isfinite(theirs).all()
    np.testing.assert_array_equal(dequantize_rows(tensor).view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", LEAF_TYPES, ids=lambda q: q.name)
def test_integer_blocks_are_quantized_leaves_value_for_value(qtype):
    """Every integer block type, every bit pattern: the leaf of its own scheme stands for gguf's
    dequantization bit for bit, and so (value for value) does the leaf of every wider scheme a projection
    mixing it with another type gets; the integers lie in the scheme's range."""
    from llm_jax.quantization import QuantizedArray

    rows, cols = 6, 512
    raw = random_blocks(np.random.default_rng(4), qtype, rows, cols)
    theirs = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    own = gguf_blocks.decode(qtype.name, raw, cols)
    assert own.scheme == gguf_blocks.SCHEMES[qtype.name]
    for other in LEAF_TYPES:
        scheme = gguf_blocks.common_scheme([own.scheme, gguf_blocks.SCHEMES[other.name]])
        blocks = gguf_blocks.widen(own, scheme)
        low, high = {(8, False): (-128, 127), (8, True): (-128, 127), (4, False): (-8, 7), (4, True): (0, 15)}[
            (scheme.bits, scheme.offsets)]
        assert low <= blocks.q.min() and blocks.q.max() <= high
        values, scales, offsets = gguf_blocks.leaf_arrays(blocks)
        leaf = QuantizedArray(jnp.asarray(values), jnp.asarray(scales), (cols,), (rows,), scheme.bits,
                              scheme.group_size, offsets=None if offsets is None else jnp.asarray(offsets))
        assert leaf.scheme == scheme
        ours = np.asarray(leaf.dequantize()).T
        if scheme == own.scheme:  # bit for bit; a widened leaf adds an offset of 0 to -0.0
            ours, theirs_as = ours.view(np.uint32), theirs.view(np.uint32)
        else:
            theirs_as = theirs
        np.testing.assert_array_equal(ours, theirs_as)


def test_q4_0_file_with_a_q6_k_head_loads(tmp_path):
    """What llama.cpp's Q4_0 files look like: Q4_0 projections and embedding, the head in Q6_K: quantized leaves
    of their schemes."""
    wide = Family(transformers.LlamaConfig, dict(FAMILIES["llama2_mha"].fields, hidden_size=256), {})
    build(wide, tmp_path / "hf")  # d_model 256: one Q6_K super-block per row of the head
    vocab_size = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    head = random_blocks(np.random.default_rng(2), Q.Q6_K, vocab_size, 256)
    path = write_gguf(tmp_path / "q6k.gguf", tmp_path / "hf", Q.Q4_0, replace={"output.weight": (head, Q.Q6_K)})
    model = llm_jax.load(path)
    q4 = gguf_blocks.SCHEMES["Q4_0"]
    assert model.config.quantization == llm_jax.Quantization(bits=4, group_size=32, embedding=q4,
                                                             lm_head=gguf_blocks.SCHEMES["Q6_K"])
    expected = gguf.quants.dequantize(head, Q.Q6_K).astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(model.params["lm_head"].dequantize()), expected)
    f = open_gguf(path)
    table = gguf.quants.dequantize(f.tensors["token_embd.weight"].data, Q.Q4_0).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.params["embedder"]["embedding"].dequantize()), table)


def expected_logits(path: pathlib.Path, folder: pathlib.Path, source, config, ids: np.ndarray) -> np.ndarray:
    """transformers' logits with every weight replaced by gguf's own dequantization of its file tensor,
    undone exactly as the float test proves right."""
    f = open_gguf(path)
    expected_hf = {}
    hf_names = load_file(folder / "hf" / "model.safetensors")
    for hf_name in hf_names:
        gname = gguf_name(hf_name, f.architecture)
        if gname not in f.tensors:
            continue
        t = f.tensors[gname]
        value = (np.asarray(t.data, np.float32) if t.type_name in ("F32", "F16")
                 else gguf.quants.dequantize(t.data, Q[t.type_name]))
        heads = {"q_proj.weight": config.n_heads, "k_proj.weight": config.n_kv_heads}.get(hf_name[-13:])
        if f.architecture == "llama" and heads:  # back to HF's rows: the inverse of meta_interleave
            rows = value.shape[0]
            value = value.reshape(heads, config.head_dim // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
        expected_hf[hf_name] = value.astype(np.float32)
    torch_model = copy.deepcopy(source)
    with torch.no_grad():
        for pname, p in torch_model.named_parameters():
            if pname in expected_hf:
                p.copy_(torch.from_numpy(expected_hf[pname]))
            elif pname == "lm_head.weight":  # tied
                p.copy_(torch.from_numpy(expected_hf["model.embed_tokens.weight"]))
    return torch_logits(torch_model, ids)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama3_gqa_rope_scaling", "qwen2_bias_tied"])  # q/k permuted and not
def test_dequantized_gguf_params_are_the_gguf_dequantization(built, name, qtype):
    """With ``dequantize``, every param is gguf's own dequantization of its tensor moved into our layout:
    logits equal transformers' with those values as weights. Without it the projections are leaves of the
    type's scheme."""
    name, folder, source = built(name)
    path = write_gguf(folder / f"{qtype.name}.gguf", folder / "hf", qtype)
    config, params = load_gguf(path, dequantize=True)
    ids = tokens(config.vocab_size, 0, 40)
    ours = np.asarray(jit_forward(jax.tree.map(jnp.asarray, params), config, jnp.asarray(ids)))
    assert float(np.abs(ours - expected_logits(path, folder, source, config, ids)).max()) <= ATOL
    assert config.quantization is None
    assert load_gguf(path)[0].quantization.plain == gguf_blocks.SCHEMES[qtype.name]


WIDE_LLAMA = Family(transformers.LlamaConfig, dict(FAMILIES["llama2_mha"].fields, hidden_size=256,
                                                   intermediate_size=256), {})


def test_k_and_i_quant_projections_are_their_dequantization(tmp_path):
    """A file of llama.cpp's super-block types (the K-quants and the i-quants; rows of whole super-blocks:
    d_model and d_ff 256), one type per projection and layer, q and k rows in the interleaved layout, the
    embedding in Q4_K and the head in Q6_K: the logits are transformers' with gguf's dequantization of
    every tensor as the weights. The projections load as quantized leaves, each in the scheme its layers'
    types share, and so do the tables; the CPU kernels' products give the same logits."""
    source = build(WIDE_LLAMA, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    rng = np.random.default_rng(3)
    super_block = [q for q in LEAF_TYPES if gguf.GGML_QUANT_SIZES[q][0] == 256]
    names = [f"blk.{layer}.{n}" for layer in range(hf["num_hidden_layers"]) for n in (
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight")]
    replace = {}
    for i, name in enumerate(names):
        qtype = super_block[i % len(super_block)]
        # scales small enough that the weights are of the usual size (the largest codes are ~64 · 16 steps)
        replace[name] = (random_blocks(rng, qtype, 256, 256, scale=2e-4), qtype)
    assert {qtype for _, qtype in replace.values()} == set(super_block)
    V = hf["vocab_size"]  # the tables as llama.cpp's Q4_K_M files hold them
    replace["token_embd.weight"] = (random_blocks(rng, Q.Q4_K, V, 256, scale=2e-4), Q.Q4_K)
    replace["output.weight"] = (random_blocks(rng, Q.Q6_K, V, 256, scale=2e-4), Q.Q6_K)
    path = write_gguf(tmp_path / "k.gguf", tmp_path / "hf", replace=replace)
    model = llm_jax.load(path, dtype="float32")
    ids = tokens(model.config.vocab_size, 0, 40)
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
    expected = expected_logits(path, tmp_path, source, model.config, ids)
    assert float(np.abs(expected).max()) > 0.1, "degenerate weights; the test would prove little"
    assert float(np.abs(ours - expected).max()) <= ATOL
    quantization = model.config.quantization
    for module, group in model.params["layers"].items():
        for name in group if module in ("attn", "mlp") else ():
            layer_types = {t for n, (_, t) in replace.items() if n.endswith(PROJECTION_SOURCES[name])}
            expected_scheme = gguf_blocks.common_scheme(gguf_blocks.SCHEMES[t.name] for t in layer_types)
            assert quantization.scheme(name) == expected_scheme == group[name].scheme, name
    assert {s.offsets for _, s in quantization.projections} | {quantization.offsets} == {False, True}
    assert (quantization.embedding, quantization.lm_head) == (gguf_blocks.SCHEMES["Q4_K"], gguf_blocks.SCHEMES["Q6_K"])
    weights = llm_jax.CpuKernels().prepare(model.params, model.config)
    assert all(isinstance(w, QuantizedPanels) for w in weights["layers"]["attn"].values())
    assert isinstance(weights["lm_head"], QuantizedPanels)
    kernels = np.asarray(jax.jit(forward, static_argnums=1, static_argnames="backend")(
        weights, model.config, jnp.asarray(ids), backend="cpu"))
    assert float(np.abs(kernels - ours).max()) <= ATOL


# Our projection → its tensor's name in a layer of the file.
PROJECTION_SOURCES = {"q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
                      "o_proj": "attn_output.weight", "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
                      "down_proj": "ffn_down.weight"}


# --- stories260K: a real model and its sentencepiece vocabulary ------------------------------------------


@pytest.fixture(scope="module")
def stories_gguf(stories260k_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stories_gguf")
    return write_gguf(folder / "stories260K.gguf", stories260k_dir / "hf", vocab=stories260k_dir / "hf")


def test_stories260k_gguf_generates_as_the_source(stories_gguf, stories260k_dir):
    model = llm_jax.load(stories_gguf)
    source = llm_jax.load(stories260k_dir / "hf", dtype="float32")
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf").eval()
    ids = np.asarray([model.tokenizer.encode("Once upon a time, there was a little girl named Lily.")])
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
    assert float(np.abs(ours - torch_logits(torch_model, ids)).max()) <= ATOL
    prompt = "Once upon a time"
    ours = llm_jax.generate(model, [prompt], max_new_tokens=40)[0]
    theirs = llm_jax.generate(source, [prompt], max_new_tokens=40)[0]
    assert ours.output_ids == theirs.output_ids and ours.text == theirs.text
    assert model.eos_ids == (2,) and model.tokenizer.bos_id == 1 and model.tokenizer.add_bos_by_default


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q3_K_M", "IQ4_NL"])
def test_stories260k_as_llama_cpp_quantizes_it_runs_as_llama_cpp_runs_it(stories_gguf, tmp_path, ftype):
    """A file quantized by llama.cpp itself (``llama-cpp-python``, a benchmark dependency: skipped without
    it). stories260K's width of 64 is not whole super-blocks, so llama.cpp falls back to Q5_0, Q5_1, Q4_0 and
    Q8_0 as its users' files of such models hold (IQ4_NL's blocks are 32 wide). Our logits on a prompt
    against llama.cpp's: the greedy token at every position the same, and within 0.5 (llama.cpp rounds
    activations to 8 bits in its products; measured 0.16–0.24); greedy generation on the CPU kernels equals
    XLA's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(stories_gguf).encode(), str(path).encode(), params) == 0
    types = {t.type_name for t in open_gguf(path).tensors.values()}
    assert types - {"F32", "F16", "Q8_0", "Q4_0"}, types  # types beyond Q8_0 and Q4_0
    model = llm_jax.load(path)
    # ffn_down's rows (d_ff 172) are not whole blocks: llama.cpp keeps them in F16, and so do we.
    assert model.config.quantization is not None and model.config.quantization.scheme("down_proj") is None
    ids = model.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray([ids])))[0]
    llm = llama_cpp.Llama(str(path), logits_all=True, verbose=False, n_ctx=128, n_threads=2)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[:len(ids)])
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert float(np.abs(ours - theirs).max()) <= 0.5
    greedy = {backend: llm_jax.generate(model.with_backend(backend), ["Once upon a time"], max_new_tokens=32,
                                        sampling=llm_jax.GREEDY)[0].output_ids for backend in ("xla", "cpu")}
    assert greedy["xla"] == greedy["cpu"]


def test_convert_gguf_writes_a_checkpoint_with_its_tokenizer(stories_gguf, tmp_path):
    dest = convert(stories_gguf, tmp_path / "ckpt")
    config, params, meta = load_checkpoint(dest)
    model = llm_jax.load(stories_gguf)
    assert config == model.config
    for path, x in leaves_by_path(model.params).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(params)[path]), np.asarray(x))
    loaded = llm_jax.load(dest)
    text = "Lily and Ben went to the park.  They saw a big dog!"
    assert loaded.tokenizer.encode(text) == model.tokenizer.encode(text)
    assert loaded.eos_ids == model.eos_ids == meta.eos_ids


def test_convert_script_takes_a_gguf(stories_gguf, tmp_path):
    from llm_jax.cli.convert import main

    assert main([str(stories_gguf), str(tmp_path / "out"), "--quiet"]) == 0
    assert llm_jax.is_checkpoint(tmp_path / "out")


# --- what is refused -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build(FAMILIES["llama2_mha"], folder)
    return folder


def test_unsupported_architecture_is_named(tiny_hf, tmp_path):
    path = write_gguf(tmp_path / "falcon.gguf", tiny_hf, arch="falcon")
    with pytest.raises(ConfigError, match=r"unsupported GGUF architecture 'falcon'; supported: \['gemma', 'gemma2', "
                                          r"'gemma3', 'llama', 'qwen2', 'qwen3', 'qwen3moe'\]"):
        llm_jax.load(path)


def test_unsupported_tensor_type_is_named(tiny_hf, tmp_path):
    path = write_gguf(tmp_path / "fp4.gguf", tiny_hf, Q.MXFP4)  # gpt-oss's type, for an architecture we do not run
    with pytest.raises(WeightsError, match=r"unsupported GGUF tensor types \['MXFP4'\] in \d+ tensors: "
                                           r"blk.0.attn_k.weight \(MXFP4\).*supported: F32, F16, BF16, Q8_0, Q4_0, "
                                           r"Q4_1, Q5_0, Q5_1, Q2_K, .*, IQ1_S, IQ1_M$"):
        llm_jax.load(path)


def test_unsupported_metadata_is_named(tiny_hf, tmp_path):
    longrope = write_gguf(tmp_path / "longrope.gguf", tiny_hf, extra=lambda w: (
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), w.add_rope_scaling_factor(4.0)))
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'longrope'; supported: none, linear, yarn"):
        llm_jax.load(longrope)
    partial = write_gguf(tmp_path / "partial.gguf", tiny_hf, rope_dims=4)
    with pytest.raises(ConfigError, match="partial rotary"):
        llm_jax.load(partial)


def test_split_gguf_is_refused(tiny_hf, tmp_path):
    path = write_gguf(tmp_path / "m-00001-of-00002.gguf", tiny_hf, extra=lambda w: (
        w.add_uint16("split.no", 0), w.add_uint16("split.count", 2)))
    with pytest.raises(WeightsError, match=r"shard 1 of a GGUF split into 2 files; merge them first"):
        llm_jax.load(path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(WeightsError, match="bad.gguf: not a readable GGUF file"):
        llm_jax.load(bad)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama3_gqa_rope_scaling", "qwen3_qk_norm"])  # q/k permuted and not
def test_block_tensors_become_quantized_leaves_holding_the_same_values(built, name, qtype):
    """Projections, the embedding table and an untied head of the types the gguf package writes load as
    QuantizedArray leaves of the type's scheme (Q8_0 / Q5_0 int8, Q4_0 int4, Q4_1 int4 with offsets, Q5_1
    int8 with offsets; groups of 32) whose dequantize() equals the float path's exact dequantization bit
    for bit; the logits are the float path's, on XLA and on the CPU kernels."""
    from llm_jax.quantization import QuantizedArray

    _, folder, _ = built(name)
    path = write_gguf(folder / f"{qtype.name}.gguf", folder / "hf", qtype)
    model = llm_jax.load(path)
    scheme = gguf_blocks.SCHEMES[qtype.name]
    bits = scheme.bits
    tied = model.config.tie_embeddings
    assert model.config.quantization == llm_jax.Quantization(bits=bits, group_size=32, offsets=scheme.offsets,
                                                             embedding=scheme, lm_head=None if tied else scheme)
    float_config, float_params = load_gguf(path, dequantize=True)
    assert float_config.quantization is None
    np.testing.assert_array_equal(np.asarray(model.params["embedder"]["embedding"].dequantize()),
                                  float_params["embedder"]["embedding"])
    if not tied:
        np.testing.assert_array_equal(np.asarray(model.params["lm_head"].dequantize()), float_params["lm_head"])
    for module, names in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj",
                                                                                       "down_proj"))):
        for proj in names:
            leaf = model.params["layers"][module][proj]
            assert isinstance(leaf, QuantizedArray) and leaf.bits == bits
            np.testing.assert_array_equal(np.asarray(leaf.dequantize()), float_params["layers"][module][proj])
    ids = tokens(model.config.vocab_size, 0, 40)
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
    dequantized = np.asarray(jit_forward(jax.tree.map(jnp.asarray, float_params), float_config, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, dequantized, atol=ATOL, rtol=0)
    weights = llm_jax.CpuKernels().prepare(model.params, model.config)
    head = weights["embedder"]["embedding"] if tied else weights["lm_head"]
    assert isinstance(head, QuantizedPanels)
    kernels = np.asarray(jax.jit(forward, static_argnums=1, static_argnames="backend")(
        weights, model.config, jnp.asarray(ids), backend="cpu"))
    np.testing.assert_allclose(kernels, dequantized, atol=ATOL, rtol=0)


def test_dequantize_and_quantize_give_float_leaves_first(built, tmp_path):
    _, folder, _ = built("qwen3_qk_norm")
    path = write_gguf(folder / "Q8_0.gguf", folder / "hf", Q.Q8_0)
    float_config, float_params = load_gguf(path, dequantize=True)
    model = llm_jax.load(path, dequantize=True)
    assert model.config == float_config
    for p, x in leaves_by_path(float_params).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(model.params)[p]), x)
    requantized = llm_jax.load(path, quantize="int4")  # from the dequantized floats, not the blocks
    assert requantized.config.quantization.bits == 4
    from llm_jax.cli.convert import main

    assert main([str(path), str(tmp_path / "float"), "--dequantize", "--quiet"]) == 0
    assert llm_jax.load(tmp_path / "float").config == float_config


@pytest.mark.parametrize("mix", [False, True])
def test_quantized_gguf_converts_to_a_quantized_checkpoint(built, tmp_path, mix):
    """Q4_0 projections; or Q4_1 ones but v_proj of Q5_1 and Q8_0 layers (int8 with offsets), ffn_down Q5_0
    (int8) and o_proj with an F16 layer (floats): the checkpoint records each projection's scheme, and
    holds the offsets."""
    _, folder, _ = built("qwen3_qk_norm")
    replace = None
    if mix:
        tensors = {n: t for n, t in open_gguf(write_gguf(folder / "f32.gguf", folder / "hf")).tensors.items()}

        def stored(name, qtype):
            return gguf.quants.quantize(np.asarray(tensors[name].data, np.float32), qtype), qtype

        replace = {"blk.0.attn_v.weight": stored("blk.0.attn_v.weight", Q.Q5_1),
                   "blk.1.attn_v.weight": stored("blk.1.attn_v.weight", Q.Q8_0),
                   "blk.1.attn_output.weight": stored("blk.1.attn_output.weight", Q.F16),
                   **{f"blk.{i}.ffn_down.weight": stored(f"blk.{i}.ffn_down.weight", Q.Q5_0) for i in range(2)}}
    path = write_gguf(folder / f"mix{mix}.gguf", folder / "hf", Q.Q4_1 if mix else Q.Q4_0, replace=replace)
    model = llm_jax.load(path)
    if mix:
        q = model.config.quantization
        assert q.plain == gguf_blocks.SCHEMES["Q4_1"] and dict(q.projections) == {
            "v_proj": llm_jax.QuantScheme(bits=8, group_size=32, offsets=True), "o_proj": None,
            "down_proj": gguf_blocks.SCHEMES["Q5_0"]}
        assert not is_quantized(model.params["layers"]["attn"]["o_proj"])
    loaded = llm_jax.load(convert(path, tmp_path / "ckpt"))
    assert loaded.config == model.config
    for p, x in leaves_by_path(model.params).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(loaded.params)[p]), np.asarray(x))
