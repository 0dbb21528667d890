"""llama2.c ``.bin`` files: both export versions read alike, and broken files are named, never misread."""

import shutil
import struct

import numpy as np
import pytest

from llm_jax.weights.from_llama2c import MAGIC, load_llama2c
from llm_jax.weights.layout import WeightsError
from llm_jax.weights.placement import leaves_by_path


@pytest.fixture
def bin_copy(stories260k_dir, tmp_path):
    return shutil.copyfile(stories260k_dir / "stories260K.bin", tmp_path / "model.bin")


def legacy_to_v1(legacy: bytes) -> bytes:
    """Re-export a legacy (version 0) file as version 1, as llama2.c's export.py ``version2=False`` does:
    256-byte header with magic and a shared-classifier flag, norms first, no RoPE tables."""
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", legacy)
    L, kv_dim = n_layers, dim * n_kv // n_heads
    floats = np.frombuffer(legacy, "<f4", offset=28)
    sizes = dict(token_embedding=vocab * dim, rms_att=L * dim, wq=L * dim * dim, wk=L * kv_dim * dim,
                 wv=L * kv_dim * dim, wo=L * dim * dim, rms_ffn=L * dim, w1=L * hidden * dim, w2=L * dim * hidden,
                 w3=L * hidden * dim, rms_final=dim, rope=seq_len * (dim // n_heads))
    arrays, offset = {}, 0
    for name, size in sizes.items():
        arrays[name], offset = floats[offset:offset + size], offset + size
    header = struct.pack("<Ii7iB", MAGIC, 1, dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len, 1).ljust(256, b"\0")
    order = ("rms_att", "rms_ffn", "rms_final", "token_embedding", "wq", "wk", "wv", "wo", "w1", "w2", "w3")
    return header + b"".join(arrays[name].tobytes() for name in order)


def test_version1_export_reads_like_the_legacy_file(stories260k_dir, tmp_path):
    legacy_path = stories260k_dir / "stories260K.bin"
    (tmp_path / "v1.bin").write_bytes(legacy_to_v1(legacy_path.read_bytes()))
    config0, params0 = load_llama2c(legacy_path)
    config1, params1 = load_llama2c(tmp_path / "v1.bin")
    assert config0 == config1
    for path, x in leaves_by_path(params0).items():
        np.testing.assert_array_equal(leaves_by_path(params1)[path], x, err_msg=str(path))


def test_truncated_file(bin_copy):
    bin_copy.write_bytes(bin_copy.read_bytes()[:600_000])
    with pytest.raises(WeightsError, match=r"model.bin: truncated llama2.c file: tensor 'w[0-9a-z]+' .* needs bytes"):
        load_llama2c(bin_copy)


def test_trailing_bytes(bin_copy):
    bin_copy.write_bytes(bin_copy.read_bytes() + b"\0" * 64)
    with pytest.raises(WeightsError, match="model.bin: 64 unexpected trailing bytes .* does not describe this file"):
        load_llama2c(bin_copy)


def test_header_that_contradicts_the_weights(bin_copy):
    raw = bytearray(bin_copy.read_bytes())
    struct.pack_into("<i", raw, 4, 180)  # hidden_dim 172 → 180
    bin_copy.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="model.bin: truncated llama2.c file"):
        load_llama2c(bin_copy)


def test_not_a_llama2c_file(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"this is not a checkpoint at all, just some text" * 4)
    with pytest.raises(WeightsError, match="notes.bin: implausible llama2.c header"):
        load_llama2c(tmp_path / "notes.bin")
    (tmp_path / "tiny.bin").write_bytes(b"\1\2\3")
    with pytest.raises(WeightsError, match="tiny.bin: 3 bytes is too short"):
        load_llama2c(tmp_path / "tiny.bin")
