"""llama2.c checkpoints (``.bin``) → llm_jax config and params.

Two float32 formats are read: the legacy (version 0) export — 7 int32 header fields, then the weights,
a negative ``vocab_size`` meaning a separate classifier at the end — and version 1 (magic ``ak42``,
256-byte header with a ``shared_classifier`` flag). llama2.c rotates adjacent pairs in RoPE; the
q/k rows are permuted here into the rotate-halves layout the model uses.
"""

from __future__ import annotations

import pathlib
import struct
from typing import Any, Callable

import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.weights.layout import (TensorSpec, WeightsError, assemble, heads_in, heads_out, interleaved_to_halves,
                                    transpose)

MAGIC = 0x616B3432  # "ak42"
_V1_HEADER_BYTES = 256


def _read_header(data: bytes, where: str) -> tuple[int, dict[str, int], bool, int]:
    """(version, shape fields, shared classifier, offset of the first weight)."""
    if len(data) < 28:
        raise WeightsError(f"{where}: {len(data)} bytes is too short for a llama2.c header")
    (magic,) = struct.unpack_from("<I", data, 0)
    if magic == MAGIC:
        (version,) = struct.unpack_from("<i", data, 4)
        if version != 1:
            raise WeightsError(f"{where}: llama2.c format version {version} is not supported "
                               "(supported: legacy float32 and version 1; version 2 is int8-quantised)")
        fields = struct.unpack_from("<7i", data, 8)
        shared = bool(data[36])
        offset = _V1_HEADER_BYTES
    else:
        version, fields, offset = 0, struct.unpack_from("<7i", data, 0), 28
        shared = fields[5] > 0
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    header = dict(zip(names, fields))
    header["vocab_size"] = abs(header["vocab_size"])
    if any(v <= 0 for v in header.values()) or header["dim"] % header["n_heads"]:
        raise WeightsError(f"{where}: implausible llama2.c header {header}; not a llama2.c checkpoint?")
    return version, header, shared, offset


def config_from_header(header: dict[str, int], shared: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=header["vocab_size"], d_model=header["dim"], n_layers=header["n_layers"],
        n_heads=header["n_heads"], n_kv_heads=header["n_kv_heads"], head_dim=header["dim"] // header["n_heads"],
        d_ff=header["hidden_dim"], max_seq_len=header["seq_len"], norm_eps=1e-5, rope_theta=10_000.0,
        tie_embeddings=shared)


def _tensor_order(config: ModelConfig, version: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every float32 array in file order."""
    D, F, V, L, H = config.d_model, config.d_ff, config.vocab_size, config.n_layers, config.head_dim
    NH, KH = config.n_heads * H, config.n_kv_heads * H
    embed = [("token_embedding", (V, D))]
    norms = [("rms_att", (L, D)), ("rms_ffn", (L, D)), ("rms_final", (D,))]
    attn = [("wq", (L, NH, D)), ("wk", (L, KH, D)), ("wv", (L, KH, D)), ("wo", (L, D, NH))]
    mlp = [("w1", (L, F, D)), ("w2", (L, D, F)), ("w3", (L, F, D))]
    head = [] if config.tie_embeddings else [("wcls", (V, D))]
    if version == 0:
        rope = [("freq_cis_real", (config.max_seq_len, H // 2)), ("freq_cis_imag", (config.max_seq_len, H // 2))]
        return (embed + [norms[0]] + attn + [norms[1]] + mlp + [norms[2]] + rope + head)
    return norms + embed + attn + mlp + head


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    D, F, V, N, K, H = (config.d_model, config.d_ff, config.vocab_size, config.n_heads, config.n_kv_heads,
                        config.head_dim)
    specs = [
        TensorSpec(("embedder", "embedding"), "token_embedding", (V, D)),
        TensorSpec(("layers", "attn_norm", "scale"), "rms_att[{layer}]", (D,)),
        TensorSpec(("layers", "attn", "q_proj"), "wq[{layer}]", (N * H, D), interleaved_to_halves(N, H)),
        TensorSpec(("layers", "attn", "k_proj"), "wk[{layer}]", (K * H, D), interleaved_to_halves(K, H)),
        TensorSpec(("layers", "attn", "v_proj"), "wv[{layer}]", (K * H, D), heads_in(K, H)),
        TensorSpec(("layers", "attn", "o_proj"), "wo[{layer}]", (D, N * H), heads_out(N, H)),
        TensorSpec(("layers", "mlp_norm", "scale"), "rms_ffn[{layer}]", (D,)),
        TensorSpec(("layers", "mlp", "gate_proj"), "w1[{layer}]", (F, D), transpose),
        TensorSpec(("layers", "mlp", "down_proj"), "w2[{layer}]", (D, F), transpose),
        TensorSpec(("layers", "mlp", "up_proj"), "w3[{layer}]", (F, D), transpose),
        TensorSpec(("final_norm", "scale"), "rms_final", (D,)),
    ]
    if not config.tie_embeddings:
        specs.append(TensorSpec(("lm_head",), "wcls", (V, D), transpose))
    return specs


def read_llama2c_config(path: str | pathlib.Path) -> ModelConfig:
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        head = f.read(_V1_HEADER_BYTES)
    _, header, shared, _ = _read_header(head, str(path))
    return config_from_header(header, shared)


def load_llama2c(path: str | pathlib.Path, *, dtype=np.float32, progress: Callable[[str], None] | None = None,
                 place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None) -> tuple[ModelConfig, dict]:
    """Config and params from a llama2.c ``.bin``, cast to ``dtype`` (``place``: see ``layout.assemble``)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    version, header, shared, offset = _read_header(bytes(data[:_V1_HEADER_BYTES]), str(path))
    config = config_from_header(header, shared)
    arrays: dict[str, np.ndarray] = {}
    for name, shape in _tensor_order(config, version):
        count = int(np.prod(shape))
        end = offset + 4 * count
        if end > data.size:
            raise WeightsError(f"{path}: truncated llama2.c file: tensor {name!r} {shape} needs bytes "
                               f"[{offset}, {end}) but the file has {data.size} bytes")
        arrays[name] = np.frombuffer(data, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset = end
    if offset != data.size:
        raise WeightsError(f"{path}: {data.size - offset} unexpected trailing bytes after the last tensor; "
                           f"the header {header} does not describe this file")

    def read(name: str) -> np.ndarray:
        base, _, layer = name.partition("[")
        return arrays[base][int(layer[:-1])] if layer else arrays[base]

    available = {spec.source.format(layer=l) for spec in tensor_specs(config)
                 for l in (range(config.n_layers) if spec.per_layer else [0])}
    params = assemble(tensor_specs(config), config, read, available, where=str(path), dtype=dtype,
                      progress=progress, place=place)
    return config, params
