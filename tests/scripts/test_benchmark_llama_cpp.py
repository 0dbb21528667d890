"""``benchmark.py --compare llama.cpp``: the GGUF file of each row's weights, and the lines under the table.

llama.cpp itself (``llama-cpp-python``) is a benchmark dependency only: every test here runs without it,
but the last, which runs it where it is installed.
"""

import json
import sys
import types

import numpy as np
import pytest

import llm_jax
from llm_jax.cli.common import CliError
from llm_jax.model import init_params
from llm_jax.quantization import parse_quantization
from llm_jax.weights.placement import leaves_by_path

from benchmarking import llama_cpp
from benchmarking.cli import main as benchmark_main, quantized_ratios
from benchmarking.shapes import shape_config
from benchmarking.suite import ModelSource


def test_without_llama_cpp_the_comparison_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(CliError, match="pip install llama-cpp-python"):
        benchmark_main(["--model", "260K", "--compare", "llama.cpp"])


def test_llama_cpp_runs_batch_1_only(monkeypatch):
    monkeypatch.setattr(llama_cpp, "require", lambda: None)
    with pytest.raises(ValueError, match="batch 1 decode only"):
        benchmark_main(["--model", "15M", "--compare", "llama.cpp", "--batch", "1", "8"])


def test_each_rows_weights_have_their_gguf_type():
    assert [llama_cpp.gguf_type(d) for d in ("float32", "bfloat16", "float32+int8", "bfloat16+int4")] == [
        "F32", "BF16", "Q8_0", "Q4_0"]


def test_a_shape_without_the_llama2_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocabulary of 512"):
        ModelSource("260K", need_hf=False, workdir=tmp_path).gguf_file("float32")


def test_a_named_shape_is_written_with_its_random_weights_and_the_llama2_tokenizer(tmp_path, llama2_tokenizer_path):
    path = ModelSource("15M", need_hf=False, workdir=tmp_path).gguf_file("float32+int8")
    model = llm_jax.load(path, backend="xla")
    q = model.config.quantization  # Q8_0 blocks, kept as they are, the table's too
    assert q.plain == parse_quantization("int8", 32).plain and q.embedding == q.plain and not q.projections
    expected = np.asarray(init_params(shape_config("15M", dtype="float32"))["embedder"]["embedding"])
    written = np.asarray(model.params["embedder"]["embedding"].dequantize())
    assert np.abs(written - expected).max() <= np.abs(expected).max() / 127
    assert model.tokenizer.encode("Once upon a time") == [1, 9038, 2501, 263, 931]


def test_a_checkpoint_is_written_with_its_own_tokenizer(tmp_path, stories260k_dir):
    source = stories260k_dir / "hf"
    written = llm_jax.load(ModelSource(str(source), need_hf=False, workdir=tmp_path).gguf_file("float32"),
                           backend="xla")
    original = llm_jax.load(source, dtype="float32", backend="xla")
    for key, leaf in leaves_by_path(original.params).items():
        np.testing.assert_array_equal(np.asarray(leaves_by_path(written.params)[key]), np.asarray(leaf), err_msg=str(key))
    text = "Once upon a time, a little dog"
    assert written.tokenizer.encode(text) == original.tokenizer.encode(text)


def test_quantized_rows_are_paired_with_their_float_rows():
    def row(dtype, engine, runs):
        return types.SimpleNamespace(shape="110M", engine=engine, batch=1, dtype=dtype, repeats=len(runs),
                                     decode_tokens_per_s_runs=runs)

    rows = [row("bfloat16", "llm_jax", (10.0, 20.0)), row("bfloat16+int8", "llm_jax", (30.0, 20.0)),
            row("bfloat16+int8", "llama.cpp[Q8_0]", (5.0, 5.0))]
    (key, ratio), = quantized_ratios(rows).items()
    assert key == ("110M", "llm_jax", 1, "bfloat16+int8", "bfloat16")
    assert (ratio.median, ratio.min, ratio.max) == (2.0, 1.0, 3.0)


def test_llama_cpp_runs_the_file_as_llm_jax_does(tmp_path, llama2_tokenizer_path, capsys):
    """Where llama-cpp-python is installed: the same greedy tokens from the float32 file, and a ratio line
    for every llm_jax row."""
    pytest.importorskip("llama_cpp")
    path = tmp_path / "bench.json"
    assert benchmark_main(["--model", "15M", "--quantize", "int8", "--compare", "llama.cpp", "--new-tokens", "9",
                           "--chunk-steps", "4", "--repeats", "1", "--bandwidth", "10", "--peak-gflops", "100",
                           "--json", str(path)]) == 0
    report = {(x["dtype"], x["engine"]): x for x in json.loads(path.read_text())["llama_cpp"]}
    assert set(report) == {("float32", "llm_jax"), ("float32+int8", "llm_jax"),
                           ("float32+int8", "llm_jax[Q8_0 file]")}
    float32 = report["float32", "llm_jax"]  # the same until a near-tie, if any: sums in another order
    assert float32["greedy_agreement"] == 1.0 or float32["first_differences"][0]["gap"] < 1e-3
    assert all(x["ratio"] > 0 for x in report.values())
    assert "decode llm_jax[Q8_0 file] ÷ llama.cpp[Q8_0] 15M float32+int8" in capsys.readouterr().out
