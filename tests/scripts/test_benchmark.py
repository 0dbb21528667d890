"""The benchmark harness runs end to end and reports well-formed numbers (no timing assertions)."""

import dataclasses
import json
import math
import types

import jax
import numpy as np
import pytest

from cpu_kernels import build
from llm_jax import backends
from llm_jax.backends.cpu import forms
from llm_jax.kv_cache import cache_bytes_per_token
from llm_jax.model import init_params, param_shapes

from benchmarking import machine
from benchmarking.cli import BACKENDS, main as benchmark_main
from benchmarking.compile_study import cli_ttft, compile_vs_depth
from benchmarking.llm_jax_engine import LlmJaxEngine, Workload, runner_up
from benchmarking.product_study import product_shapes, table as product_table, time_products
from benchmarking.results import (Difference, agreement, describe_differences, first_differences,
                                  paired_ratio)
from benchmarking.roofline import (compute_roofline, decode_roofline, head_peak, product_weights,
                                   weight_bytes_per_step)
from benchmarking.shapes import SHAPES, shape_config
from benchmarking.step_profile import OpTime, exclusive_times, op_flops, op_labels

ROW_FIELDS = {"engine": str, "shape": str, "dtype": str, "batch": int, "prompt_len": int, "new_tokens": int,
              "compile_s": float, "ttft_s": float, "decode_tokens_per_s": float, "prefill_tokens_per_s": float,
              "roofline_tokens_per_s": float, "peak_rss_mb": float}


def positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    status = benchmark_main(["--model", "260K", "--compare", "hf", "--new-tokens", "9", "--chunk-steps", "4",
                             "--repeats", "2", "--bandwidth", "10", "--peak-gflops", "100", "300", "--profile",
                             "--json", str(path)])
    assert status == 0
    return json.loads(path.read_text())


def test_json_has_a_row_per_engine_with_every_field(report):
    assert report["machine"]["bandwidth_gbps"] == 10.0
    assert [row["engine"] for row in report["rows"]] == ["llm_jax", "transformers"]
    assert [row["backend"] for row in report["rows"]] == [backends.default().name, None]  # "auto"'s choice
    for row in report["rows"]:
        for field, kind in ROW_FIELDS.items():
            assert isinstance(row[field], kind), (field, row[field])
        assert (row["shape"], row["dtype"], row["batch"], row["prompt_len"]) == ("260K", "float32", 1, 16)
        assert row["new_tokens"] == 9  # 8 decode steps: two chunks of 4, plus the first token


def test_the_compute_roofline_is_the_steps_flops_at_the_given_peak(report):
    """260K float32 at batch 1: products and attention at the float32 peak (the second figure of
    --peak-gflops is bfloat16's, and int8's by default; where the kernels run, the LM head's int8 screen is
    widened to float32 too)."""
    config = shape_config("260K", dtype="float32")
    assert (report["machine"]["peak_gflops"], report["machine"]["peak_gflops_bf16"],
            report["machine"]["peak_gops_int8"]) == (100.0, 300.0, 300.0)
    for row in report["rows"]:
        assert row["product_flops_per_step"] == 2 * product_weights(config)
        assert row["attention_flops_per_step"] == int(4 * (16 + 9 / 2) * config.n_layers * config.n_heads *
                                                      config.head_dim)
        assert row["screened_head_flops_per_step"] == 0
        flops = row["product_flops_per_step"] + row["attention_flops_per_step"]
        assert row["compute_roofline_tokens_per_s"] == pytest.approx(100e9 / flops)
        assert row["compute_roofline_fraction"] == pytest.approx(row["decode_tokens_per_s"] /
                                                                 row["compute_roofline_tokens_per_s"])


def test_the_roofline_counts_the_screen_a_greedy_step_reads(report):
    """Where the kernels run, llm_jax's batch-1 greedy steps read the LM head through its int8 screen:
    bytes_per_step counts it (1 byte a weight, 8 a column) in place of the head, in both engines' rows."""
    config = shape_config("260K", dtype="float32")
    kv = int((16 + 9 / 2) * cache_bytes_per_token(config))
    screen = "int8" if build.load() else None
    V, D = config.vocab_size, config.d_model
    for row in report["rows"]:
        assert row["head_screen"] == screen
        assert row["bytes_per_step"] == weight_bytes_per_step(config, 1, screen=screen) + kv
    assert weight_bytes_per_step(config, 1, screen="int8") == weight_bytes_per_step(config, 1) - 3 * V * D + 8 * V
    assert weight_bytes_per_step(config, 1, screen="bfloat16") == weight_bytes_per_step(config, 1) - 2 * V * D + 4 * V
    assert weight_bytes_per_step(config, 1, screen="int8_quads") == weight_bytes_per_step(config, 1) - 3 * V * D + 12 * V


def test_the_roofline_at_a_steps_size_is_not_measured_with_a_given_bandwidth(report):
    for row in report["rows"]:
        assert row["bandwidth_at_size_gbps"] is None and row["roofline_at_size_fraction"] is None
        assert row["run_bandwidth_gbps"] is None and row["roofline_at_run_fraction"] is None
        assert row["run_burst_bandwidth_gbps"] is None and row["roofline_at_run_burst_fraction"] is None


def test_numbers_are_well_formed(report):
    for row in report["rows"]:
        for field in ("ttft_s", "decode_tokens_per_s", "prefill_tokens_per_s", "roofline_tokens_per_s",
                      "peak_rss_mb", "itl_p50_s", "itl_p90_s"):
            assert positive_finite(row[field]), (field, row[field])
        spread = row["decode_tokens_per_s_spread"]
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert spread["median"] == row["decode_tokens_per_s"]
        assert row["itl_p50_s"] <= row["itl_p90_s"]
        assert row["roofline_fraction"] == pytest.approx(row["decode_tokens_per_s"] / row["roofline_tokens_per_s"])
    ours, theirs = report["rows"]
    assert ours["compile_s"] > 0 and theirs["compile_s"] == 0  # torch runs eagerly
    assert ours["roofline_tokens_per_s"] == theirs["roofline_tokens_per_s"]


def test_the_backend_choices_are_the_librarys():
    assert BACKENDS == backends.CHOICES  # spelled out in the CLI so that --help does not import JAX


def test_an_engine_reads_the_screen_its_weights_hold():
    """The roofline counts the LM head's screen where the engine's prepared weights hold one that serves its
    rows: the CPU kernels' (int8 at batch 1), not XLA's weights nor the CPU kernels' without screens."""
    config = shape_config("260K", dtype="float32")
    params = init_params(config)

    def screen(backend, batch):
        workload = Workload(batch=batch, prompt_len=4, new_tokens=5, chunk_steps=4)
        return LlmJaxEngine(backend.prepare(params, config), config, workload, backend=backend).screen

    assert screen(backends.Xla(), 1) is None
    if not build.load():
        return
    assert screen(backends.CpuKernels(), 1) == "int8"
    assert screen(backends.CpuKernels(), 8) in ("int8_quads", "bfloat16", None)  # many rows: not the int8 screen
    assert screen(backends.CpuKernels(greedy_screen=False), 1) is None


@pytest.mark.skipif(not build.load(), reason="the cpu backend needs the kernels built")
def test_backends_take_turns_as_engines_and_their_ratio_is_reported(tmp_path, capsys):
    """--backend cpu xla: two llm_jax engines on the same weights, each prepared for its backend, running in
    turn; the report gives the second's decode rate over the first's, repeat by repeat."""
    path = tmp_path / "bench.json"
    assert benchmark_main(["--model", "260K", "--backend", "cpu", "xla", "cpu", "--new-tokens", "5",
                           "--chunk-steps", "4", "--repeats", "2", "--bandwidth", "10", "--peak-gflops", "100",
                           "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    progress = [line.split(",")[1].split(" run ")[0].strip() for line in err.splitlines() if " run " in line]
    assert progress == ["llm_jax[cpu]", "llm_jax[xla]"] * 2  # each backend once, in turn
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [(r["engine"], r["backend"]) for r in rows] == [("llm_jax[cpu]", "cpu"), ("llm_jax[xla]", "xla")]
    [ratio] = report["backend_ratios"]
    assert (ratio["engine"], ratio["over"], ratio["shape"], ratio["batch"]) == ("llm_jax[xla]", "llm_jax[cpu]",
                                                                                "260K", 1)
    paired = sorted(x / c for c, x in zip(rows[0]["decode_tokens_per_s_runs"], rows[1]["decode_tokens_per_s_runs"]))
    assert (ratio["min"], ratio["max"]) == pytest.approx(tuple(paired))
    assert f"decode llm_jax[xla] ÷ llm_jax[cpu] 260K float32 batch 1: {ratio['ratio']:.2f}×" in out


def test_kv_cache_dtypes_take_turns_as_engines(tmp_path, capsys):
    """--kv-cache-dtype auto int8: an engine per cache, on the same weights; the int8 row's cache holds
    (H + 4) / 4H of float32's bytes per token, and its roofline counts them."""
    path = tmp_path / "bench.json"
    assert benchmark_main(["--model", "260K", "--kv-cache-dtype", "auto", "int8", "--prompt-len", "40",
                           "--new-tokens", "9", "--chunk-steps", "4", "--repeats", "2", "--bandwidth", "10",
                           "--peak-gflops", "100", "--json", str(path)]) == 0
    out, _ = capsys.readouterr()
    rows = json.loads(path.read_text())["rows"]
    assert [r["engine"] for r in rows] == ["llm_jax", "llm_jax[int8 KV]"]
    config = shape_config("260K", dtype="float32")
    assert [r["kv_cache_bytes_per_token"] for r in rows] == [cache_bytes_per_token(config),
                                                           cache_bytes_per_token(config, "int8")]
    assert rows[1]["kv_cache_bytes_per_token"] * 4 * config.head_dim == (
        rows[0]["kv_cache_bytes_per_token"] * (config.head_dim + 4))
    mean_context = 40 + 9 / 2
    kv_saved = mean_context * (rows[0]["kv_cache_bytes_per_token"] - rows[1]["kv_cache_bytes_per_token"])
    assert rows[0]["bytes_per_step"] - rows[1]["bytes_per_step"] == pytest.approx(kv_saved, abs=1)
    assert rows[1]["kv_cache_mb"] < rows[0]["kv_cache_mb"]
    assert "decode llm_jax[int8 KV] ÷ llm_jax 260K float32 batch 1:" in out
    assert f"KV cache 260K float32 (int8 KV): {rows[1]['kv_cache_bytes_per_token']} bytes per token" in out


def test_compile_time_is_measured_at_every_depth():
    """Each depth compiles afresh: the same depth twice (as after the benchmark's own run of the shape)
    reports a real compile time both times, not a hit in JAX's in-memory caches."""
    workload = Workload(batch=1, prompt_len=8, new_tokens=5, chunk_steps=4)
    depth = compile_vs_depth("260K", "float32", [2, 2], workload, backends.default())
    assert [d.n_layers for d in depth] == [2, 2]
    for d in depth:
        assert positive_finite(d.prefill_s) and positive_finite(d.decode_s), d


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_weight_bytes_are_the_params_a_step_reads(shape):
    """Independently of the formula: every parameter leaf once, the embedding table only when it is the head."""
    config = shape_config(shape, dtype="bfloat16")
    leaves = jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]
    total = sum(np.prod(leaf.shape) * 2 for _, leaf in leaves)
    embedding = config.vocab_size * config.d_model * 2
    batch = 3
    expected = total - (0 if config.tie_embeddings else embedding) + batch * config.d_model * 2
    assert weight_bytes_per_step(config, batch) == expected


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_product_weights_are_the_matrices_a_row_multiplies(shape):
    """Independently of the formula: every parameter leaf of two or more dimensions but the embedding
    table, plus the LM head (the table itself when tied) — projections and head, no norm scales."""
    config = shape_config(shape, dtype="float32")
    leaves = jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]
    stacked = sum(int(np.prod(leaf.shape)) for path, leaf in leaves
                  if len(leaf.shape) >= 3 and "embedder" not in jax.tree_util.keystr(path))
    assert product_weights(config) == stacked + config.vocab_size * config.d_model


def test_compute_roofline_takes_products_and_attention_at_their_peaks():
    config = shape_config("15M", dtype="bfloat16")
    roof = compute_roofline(config, batch=32, prompt_len=16, new_tokens=129, product_gflops=400.0,
                            attention_gflops=200.0)
    assert roof.product_flops == 2 * 32 * product_weights(config)
    attention = 4 * 32 * (16 + 129 / 2) * config.n_layers * config.n_heads * config.head_dim
    assert roof.attention_flops == int(attention)
    assert roof.tokens_per_s == pytest.approx(32 / (roof.product_flops / 400e9 + roof.attention_flops / 200e9))
    assert roof.screened_head_flops == 0
    screened = compute_roofline(config, batch=32, prompt_len=16, new_tokens=129, product_gflops=400.0,
                                attention_gflops=200.0, head_gflops=800.0, screen="bfloat16")
    head = 2 * 32 * config.vocab_size * config.d_model
    assert screened.screened_head_flops == head and screened.product_flops == roof.product_flops
    assert screened.tokens_per_s == pytest.approx(32 / ((roof.product_flops - head) / 400e9 + head / 800e9 +
                                                        roof.attention_flops / 200e9))
    widened = compute_roofline(config, batch=32, prompt_len=16, new_tokens=129, product_gflops=400.0,
                               attention_gflops=200.0, head_gflops=800.0, screen="int8")  # at the product peak
    assert widened.screened_head_flops == 0 and widened.tokens_per_s == pytest.approx(roof.tokens_per_s)
    quads = compute_roofline(config, batch=32, prompt_len=16, new_tokens=129, product_gflops=400.0,
                             attention_gflops=200.0, head_gflops=1600.0, screen="int8_quads")
    assert quads.screened_head_flops == head
    assert quads.tokens_per_s == pytest.approx(32 / ((roof.product_flops - head) / 400e9 + head / 1600e9 +
                                                     roof.attention_flops / 200e9))
    peaks = (100.0, 300.0, 500.0)
    assert [head_peak(s, peaks) for s in (None, "int8", "bfloat16", "int8_quads")] == [100.0, 100.0, 300.0, 500.0]
    # 15M's products at 32 rows: 0.97 GFLOP a step
    assert roof.product_flops == pytest.approx(0.972e9, rel=1e-3)


def test_roofline_counts_the_cache_in_use():
    config = shape_config("110M", dtype="float32")
    roofline = decode_roofline(config, batch=2, prompt_len=16, new_tokens=33, bandwidth_gbps=40.0)
    assert roofline.kv_bytes == int(2 * (16 + 33 / 2) * cache_bytes_per_token(config))
    assert roofline.tokens_per_s == pytest.approx(2 * 40e9 / roofline.bytes_per_step)
    # The published figure for the 110M story model: about 0.44 GB per step at batch 1.
    assert weight_bytes_per_step(config, 1) == pytest.approx(0.44e9, rel=0.01)


def test_agreement_is_the_shared_prefix():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert agreement(a, a) == 1.0
    b = np.array([[1, 2, 0, 4], [9, 6, 7, 8]])
    assert agreement(a, b) == pytest.approx((2 / 4 + 0) / 2)


def test_first_differences_name_the_reference_s_second_choice():
    ours = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], [2, 2, 2, 2]])
    reference = np.array([[1, 2, 9, 4], [5, 0, 7, 8], [1, 1, 1, 1], [2, 5, 2, 2]])
    runner_up, gap = np.full((4, 4), 7), np.full((4, 4), 0.5)
    runner_up[0, 2], gap[0, 2] = 3, 0.0  # row 0: the reference's best logits at step 2 are equal for 9 and 3, we took 3
    runner_up[1, 1] = 4  # row 1: the reference's second choice is another token than ours
    runner_up[3, 1], gap[3, 1] = 2, 0.0078125  # row 3: ours is its second choice, one bfloat16 unit (at 1.45) below
    differences = first_differences(ours, reference, runner_up, gap)
    assert differences == [Difference(row=0, step=2, gap=0.0), Difference(row=1, step=1),
                           Difference(row=3, step=1, gap=0.0078125)]
    assert [d.at_tie for d in differences] == [True, False, False]
    assert first_differences(ours, reference)[0] == Difference(row=0, step=2)  # the reference did not say
    assert json.loads(json.dumps([dataclasses.asdict(d) for d in differences]))
    assert first_differences(ours, ours, runner_up, gap) == []
    said = describe_differences(differences)
    assert "3 row(s) differ, row 1 first at step 1; 2 of them first where ours is transformers' second choice" in said
    assert "0, 0.00781 below its best logit" in said
    assert describe_differences(differences[1:2]).endswith("none of them first where ours is transformers' second choice")
    assert describe_differences(differences[1:2], "llama.cpp[Q8_0]").endswith("ours is llama.cpp[Q8_0]'s second choice")
    assert describe_differences([]) == ""


def test_the_runner_up_is_the_best_token_argmax_did_not_take():
    logits = np.array([[0.5, 2.0, 1.0, 2.0], [3.0, 1.0, 2.5, 0.0], [2.0, 0.0, 0.0, 2.0]], dtype=np.float32)
    ids, gaps = runner_up(logits)
    # row 0: argmax takes 1, 3 ties with it; row 1: argmax takes 0, 2 is next; row 2: argmax takes 0, 3 ties
    assert ids.tolist() == [3, 2, 3]
    assert gaps.tolist() == [0.0, 0.5, 0.0]


def test_json_reports_agreement_and_differences(report):
    (entry,) = report["agreement"]
    assert (entry["shape"], entry["dtype"], entry["batch"]) == ("260K", "float32", 1)
    assert entry["greedy_agreement"] == 1.0 and entry["first_differences"] == []  # the real 260K model, float32


def test_machine_probes_give_positive_numbers():
    assert positive_finite(machine.measure_bandwidth(threads=2, nbytes=1 << 24, repeats=1))
    around = machine.measure_run_bandwidth(threads=2, seconds=0.05)
    assert positive_finite(around.sustained_gbps) and around.sustained_gbps <= around.burst_gbps
    float32, bfloat16, int8 = machine.measure_peaks(threads=2)
    assert positive_finite(float32) and positive_finite(bfloat16) and positive_finite(int8)
    machine.reset_peak_rss()
    assert positive_finite(machine.peak_rss_mb())


def test_the_run_probe_sustains_the_best_readers_rate_and_bursts_at_its_fastest_read():
    reads = [(0, 0.01), (1, 0.02), (0, 0.03), (1, 0.06), (2, 0.05)]  # (reader, seconds) of 1 GB each
    around = machine.run_bandwidth_of(reads, 10**9)
    assert around.sustained_gbps == pytest.approx(2 / 0.04)  # reader 0: 2 GB in 0.04 s, not its best read's 100
    assert around.burst_gbps == pytest.approx(1 / 0.01)
    later = machine.RunBandwidth(sustained_gbps=60.0, burst_gbps=70.0)
    assert around.better(later) == machine.RunBandwidth(sustained_gbps=60.0, burst_gbps=100.0)


@pytest.mark.parametrize("peaks", [["100", "200", "300", "400"], ["0"], ["-5", "10"]])
def test_a_bad_peak_is_a_clear_error(peaks):
    with pytest.raises(ValueError, match="--peak-gflops takes one to three positive numbers"):
        benchmark_main(["--model", "260K", "--bandwidth", "10", "--peak-gflops", *peaks])


def test_unknown_shape_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown model shape '7B'.*260K, 15M, 110M, 1B"):
        shape_config("7B", dtype="float32")


def test_generate_cli_twice_with_a_fresh_compilation_cache(stories260k_dir):
    result = cli_ttft(stories260k_dir / "stories260K.bin", prompt_ids=[1, 403, 407], max_new_tokens=5,
                      dtype="float32")
    for value in (result.first_ttft_s, result.second_ttft_s, result.first_compile_s):
        assert positive_finite(value)
    assert positive_finite(result.ratio)


def test_roofline_uses_the_best_bandwidth_of_before_and_after_the_runs(tmp_path, monkeypatch):
    """Without --bandwidth the harness measures before and after the runs and keeps the best, for every
    row (llm_jax's and transformers', whose × hf ratio is still reported); then the bandwidth of reading
    just a step's bytes, for the roofline at that size (never below memory's)."""
    measured = iter([4.0, 8.0])
    sizes = []

    def measure(*, threads, nbytes=machine.BANDWIDTH_BYTES, repeats=5):
        if nbytes == machine.BANDWIDTH_BYTES:
            return next(measured)
        sizes.append(nbytes)
        return 20.0

    monkeypatch.setattr(machine, "measure_bandwidth", measure)
    around = iter([machine.RunBandwidth(sustained_gbps=5.0, burst_gbps=6.0),  # before and after each run
                   machine.RunBandwidth(sustained_gbps=4.0, burst_gbps=7.5)] * 2)
    monkeypatch.setattr(machine, "measure_run_bandwidth", lambda *, threads: next(around))
    peaks = iter([(100.0, 300.0, 500.0), (150.0, 200.0, 600.0)])  # before, after: the best of each is kept
    monkeypatch.setattr(machine, "measure_peaks", lambda *, threads: next(peaks))
    path = tmp_path / "bench.json"
    status = benchmark_main(["--model", "260K", "--compare", "hf", "--new-tokens", "5", "--chunk-steps", "4",
                             "--repeats", "1", "--json", str(path)])
    assert status == 0
    report = json.loads(path.read_text())
    assert report["machine"]["bandwidth_gbps"] == 8.0
    assert (report["machine"]["peak_gflops"], report["machine"]["peak_gflops_bf16"],
            report["machine"]["peak_gops_int8"]) == (150.0, 300.0, 600.0)
    for row in report["rows"]:
        flops = row["product_flops_per_step"] + row["attention_flops_per_step"]
        assert row["compute_roofline_tokens_per_s"] == pytest.approx(150e9 / flops)  # float32: both at 150
    assert {row["engine"] for row in report["rows"]} == {"llm_jax", "transformers"}
    for row in report["rows"]:
        assert row["roofline_tokens_per_s"] == pytest.approx(8.0e9 / row["bytes_per_step"], rel=1e-6)
        assert row["bandwidth_at_size_gbps"] == 20.0
        assert row["roofline_at_size_tokens_per_s"] == pytest.approx(20.0e9 / row["bytes_per_step"], rel=1e-6)
        assert row["roofline_at_size_fraction"] == pytest.approx(row["decode_tokens_per_s"] /
                                                                 row["roofline_at_size_tokens_per_s"])
        # each run against the better of the bandwidths measured just before and just after it: the
        # sustained read's (before) and the fastest single read's (after)
        assert row["run_bandwidth_gbps"] == {"median": 5.0, "min": 5.0, "max": 5.0}
        assert row["roofline_at_run_fraction"] == pytest.approx(row["decode_tokens_per_s"] * row["bytes_per_step"] /
                                                                (row["batch"] * 5.0e9))
        assert row["run_burst_bandwidth_gbps"] == {"median": 7.5, "min": 7.5, "max": 7.5}
        assert row["roofline_at_run_burst_fraction"] == pytest.approx(row["roofline_at_run_fraction"] * 5.0 / 7.5)
    assert sizes == sorted({row["bytes_per_step"] for row in report["rows"]})


def test_a_runs_peak_memory_is_read_before_the_probe_after_it(tmp_path, monkeypatch):
    """The bandwidth probes around a run allocate a large array: the run's peak memory is counted between
    them (reset after the probe before the run, read before the probe after it)."""
    events = []
    monkeypatch.setattr(machine, "measure_bandwidth",
                        lambda *, threads, nbytes=machine.BANDWIDTH_BYTES, repeats=5: 8.0)
    around = machine.RunBandwidth(sustained_gbps=5.0, burst_gbps=6.0)
    monkeypatch.setattr(machine, "measure_run_bandwidth", lambda *, threads: events.append("probe") or around)
    reset, peak = machine.reset_peak_rss, machine.peak_rss_mb
    monkeypatch.setattr(machine, "reset_peak_rss", lambda: events.append("reset") or reset())
    monkeypatch.setattr(machine, "peak_rss_mb", lambda: events.append("peak") or peak())
    assert benchmark_main(["--model", "260K", "--new-tokens", "5", "--chunk-steps", "4", "--repeats", "2",
                           "--json", str(tmp_path / "bench.json")]) == 0
    timed = events[events.index("probe"):]  # compilation (a reset and a read) comes first
    assert timed == ["probe", "reset", "peak", "probe"] * 2


def test_the_roofline_at_a_steps_size_is_never_below_memorys(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "measure_bandwidth",
                        lambda *, threads, nbytes=machine.BANDWIDTH_BYTES, repeats=5:
                        8.0 if nbytes == machine.BANDWIDTH_BYTES else 5.0)
    path = tmp_path / "bench.json"
    assert benchmark_main(["--model", "260K", "--new-tokens", "5", "--chunk-steps", "4", "--repeats", "1",
                           "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["bandwidth_at_size_gbps"] == 8.0


@pytest.mark.parametrize("peak_gflops", ["1000", "0.5"])  # the memory roofline binds at batch 3 / the arithmetic
def test_batch_sizes_take_turns_and_their_throughput_ratio_is_reported(tmp_path, capsys, peak_gflops):
    """Each repeat runs every batch size once (so ratios between batch sizes compare the same moments), and
    the report gives each batch size's decode throughput over batch 1's, and the most it could be: the
    batch's roofline (the lower of memory's and the arithmetic's) over batch 1's median rate."""
    path = tmp_path / "bench.json"
    status = benchmark_main(["--model", "260K", "--batch", "1", "3", "--new-tokens", "5", "--chunk-steps", "4",
                             "--repeats", "2", "--bandwidth", "10", "--peak-gflops", peak_gflops,
                             "--json", str(path)])
    assert status == 0
    captured = capsys.readouterr()
    progress = [line.split(",")[0].strip() for line in captured.err.splitlines() if " run " in line]
    assert progress == ["float32 batch 1", "float32 batch 3"] * 2
    report = json.loads(path.read_text())
    rows = {row["batch"]: row for row in report["rows"]}
    runs = {batch: row["decode_tokens_per_s_runs"] for batch, row in rows.items()}
    assert all(len(r) == 2 for r in runs.values())
    [scaling] = report["batch_scaling"]
    assert (scaling["shape"], scaling["engine"], scaling["batch"]) == ("260K", "llm_jax", 3)
    paired = sorted(b / a for a, b in zip(runs[1], runs[3]))  # repeat by repeat
    assert (scaling["min"], scaling["max"]) == pytest.approx(tuple(paired))
    assert scaling["times_batch_1"] == pytest.approx(sum(paired) / 2)
    memory, arithmetic = rows[3]["roofline_tokens_per_s"], rows[3]["compute_roofline_tokens_per_s"]
    assert (arithmetic < memory) == (peak_gflops == "0.5")
    assert scaling["roofline_times_batch_1"] == pytest.approx(min(memory, arithmetic) /
                                                              rows[1]["decode_tokens_per_s"])
    assert f"at its roofline {scaling['roofline_times_batch_1']:.1f}×" in captured.out


def test_dtypes_take_turns_and_their_ratio_is_reported_repeat_by_repeat(tmp_path, capsys):
    """Each repeat runs float32 and bfloat16 once each (both loaded at once), and the report gives
    bfloat16's decode rate over float32's from the runs of the same repeat."""
    path = tmp_path / "bench.json"
    status = benchmark_main(["--model", "260K", "--dtype", "float32", "bfloat16", "--new-tokens", "5",
                             "--chunk-steps", "4", "--repeats", "3", "--bandwidth", "10", "--json", str(path)])
    assert status == 0
    out, err = capsys.readouterr()
    progress = [line.split(",")[0].strip() for line in err.splitlines() if " run " in line]
    assert progress == ["float32 batch 1", "bfloat16 batch 1"] * 3
    report = json.loads(path.read_text())
    runs = {row["dtype"]: row["decode_tokens_per_s_runs"] for row in report["rows"]}
    paired = sorted(b / a for a, b in zip(runs["float32"], runs["bfloat16"]))
    [ratio] = report["dtype_ratios"]
    assert (ratio["shape"], ratio["engine"], ratio["batch"]) == ("260K", "llm_jax", 1)
    assert (ratio["min"], ratio["bfloat16_over_float32"], ratio["max"]) == pytest.approx(tuple(paired))
    assert f"decode bfloat16 ÷ float32 260K batch 1 llm_jax: {paired[1]:.2f}×" in out


def test_a_paired_ratio_takes_runs_of_the_same_repeat():
    row = lambda *runs: types.SimpleNamespace(decode_tokens_per_s_runs=runs, repeats=len(runs))
    spread = paired_ratio(row(30.0, 10.0, 40.0), row(10.0, 20.0, 20.0))  # the medians' ratio: 30 / 20
    assert (spread.min, spread.median, spread.max) == (0.5, 2.0, 3.0)
    with pytest.raises(ValueError, match="as many repeats"):
        paired_ratio(row(1.0, 2.0), row(1.0))


def test_bandwidth_readers_read_every_value():
    """Each reader returns the sum (or max) of all of its array, so none can skip memory it should read;
    where the kernels build, the compiled read is among them."""
    data = np.arange(1, 1 + 1000 + 37, dtype=np.float32) % 7  # a length with a tail after the vector loop
    results = [float(read(data)) for read in machine.readers()]
    assert {round(r) for r in results} <= {int(data.sum()), int(data.max())}
    assert round(results[0]) == int(data.sum())
    if build.find_compiler() is not None:
        assert len(results) == 3


def test_the_profile_attributes_a_decode_step_to_its_ops(report):
    [profile] = report["step_profiles"]  # llm_jax's; transformers' steps are not traced
    assert (profile["engine"], profile["shape"], profile["batch"], profile["steps"]) == ("llm_jax", "260K", 1, 4)
    assert positive_finite(profile["wall_ms_per_step"]) and positive_finite(profile["ops_ms_per_step"])
    assert profile["ops"] and all(op["us_per_step"] >= 0 and op["calls_per_step"] > 0 for op in profile["ops"])
    times = [op["us_per_step"] for op in profile["ops"]]
    assert times == sorted(times, reverse=True)
    labels = [op["label"] for op in profile["ops"]]
    assert len(set(labels)) == len(labels)
    if build.load():  # on CPU the kernels run: the products and the attention are named by where they run
        # greedy batch-1 steps: the LM head through its int8 screen (llm_jax.backends.cpu.greedy_head)
        assert any(label.startswith("greedy_head: matmul_panels_i8") for label in labels), labels
        assert any(label.startswith("greedy_head: screened_argmax_f32") for label in labels), labels
        products = [op for op in profile["ops"] if "matmul_" in op["label"]]
        assert products and all(op["flops_per_call"] > 0 for op in products)
        assert any(label.startswith("DecoderLayer: decode_attention_append_f32") for label in labels), labels


def _event(op, ts, dur, tid=1, module="jit_decode"):
    return {"ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "name": op,
            "args": {"hlo_module": module, "hlo_op": op}}


def test_an_ops_time_excludes_the_ops_nested_in_it():
    events = [_event("while.1", 0, 100), _event("dot.2", 10, 20), _event("fusion.3", 40, 50),
              _event("ffi_call.4", 50, 10), _event("dot.2", 0, 20, tid=2), _event("dot.2", 0, 99, module="jit_prefill"),
              {"ph": "X", "ts": 0, "dur": 500, "pid": 1, "tid": 1, "name": "ThunkExecutor::Execute", "args": {}}]
    assert exclusive_times(events, "jit_decode") == {"while.1": (30.0, 1), "dot.2": (40.0, 2), "fusion.3": (40.0, 1),
                                                     "ffi_call.4": (10.0, 1)}


def test_ops_are_labelled_from_the_program_text():
    text = """
  %ffi_call.22 = f32[2,512]{1,0} custom-call(%c, %x, %w), custom_call_target="llm_jax_matmul_panels_f32", operand_layout_constraints={s32[], f32[2,64]{1,0}, f32[1,32,64,16]{3,2,1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(decode)/while/body/closed_call/cond/branch_0_fun/Embedder.decode/cond/branch_0_fun/ffi_call" stack_frame_id=455}
  ROOT %wrapped_scatter.1 = f32[5,2,32,4,8]{4,3,2,1,0} fusion(%a, %b), kind=kLoop, calls=%scatter, metadata={op_name="jit(decode)/while/body/DecoderLayer/scatter"}
  %bitcast.3 = f32[2,64]{1,0} bitcast(%x)
"""
    assert op_labels(text) == {
        "ffi_call.22": "Embedder.decode: matmul_panels_f32 f32[2,64] · f32[1,32,64,16] → f32[2,512]",
        "wrapped_scatter.1": "XLA wrapped_scatter.1 (DecoderLayer)",
        "bitcast.3": "XLA bitcast.3",
    }
    assert op_flops(text) == {"ffi_call.22": 2 * 2 * 64 * 512}  # products only: 2 · R · K · N


def test_a_products_flops_count_every_result():
    """q/k/v as three results of one call ([R, N_i] each), bfloat16 weights: 2 · R · K · Σ N_i."""
    line = ('  %ffi_call.7 = (f32[4,96]{1,0}, f32[4,32]{1,0}, f32[4,32]{1,0}) custom-call(%i, %x, %q, %k, %v), '
            'custom_call_target="llm_jax_matmul_panels_bf16", operand_layout_constraints={s32[], f32[4,48]{1,0}, '
            'bf16[3,6,48,16]{3,2,1,0}, bf16[3,2,48,16]{3,2,1,0}, bf16[3,2,48,16]{3,2,1,0}}, '
            'api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(decode)/DecoderLayer/attn.project/ffi_call"}')
    assert op_flops(line) == {"ffi_call.7": 2 * 4 * 48 * (96 + 32 + 32)}
    op = OpTime(label="q/k/v", calls_per_step=2.0, us_per_step=4.0, flops_per_call=1000)
    assert op.gflops == pytest.approx(2 * 1000 / 4e-6 / 1e9)
    assert OpTime(label="XLA add", calls_per_step=1.0, us_per_step=1.0).gflops is None


@pytest.mark.parametrize("shape", ["260K", "15M"])
def test_the_products_timed_alone_are_a_layers_in_the_cpu_backends_form(shape):
    """Each of the four is a matrix of the CPU backend's prepared weights (q/k/v and gate/up fused), a
    layer's slice of it K × N values, in panels exactly where the output width is a multiple of 16 (260K's
    gate/up is not)."""
    config = shape_config(shape, dtype="float32")
    layers = forms.prepare(init_params(config), config)["layers"]
    attn, mlp = layers["attn"], layers["mlp"]
    assert isinstance(attn["q_proj"], forms.Fused) and isinstance(mlp["gate_proj"], forms.Fused)
    matrices = {"qkv": attn["q_proj"].data, "o": attn["o_proj"], "gate_up": mlp["gate_proj"].data,
                "down": mlp["down_proj"]}
    products = product_shapes(config)
    assert [p.name for p in products] == list(matrices)
    for product in products:
        matrix = matrices[product.name]
        assert isinstance(matrix, forms.Panels) == product.panels == (product.N % 16 == 0), product
        assert (matrix.shape[0], matrix.shape[-1]) == (config.n_layers, product.N)  # [L, *in, N]
        assert int(np.prod(matrix.shape[1:])) == product.K * product.N


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_product_is_timed_alone_beside_torch(dtype):
    config = shape_config("260K", dtype=dtype)
    times = time_products(config, rows=3, dtype=dtype, threads=2, calls=4, repeats=2, weight_bytes=1 << 16)
    assert [t.name for t in times] == ["qkv", "o", "gate_up", "down"]
    for t, shape in zip(times, product_shapes(config)):
        assert (t.K, t.N, t.rows, t.dtype) == (shape.K, shape.N, 3, dtype)
        assert t.copies >= 2 and t.copies * t.K * t.N * (4 if dtype == "float32" else 2) >= 1 << 16
        assert t.flops == 2 * 3 * t.K * t.N
        for seconds in (t.llm_jax_s, t.llm_jax_cached_s, t.torch_s, t.torch_cached_s):  # torch: the test extra
            assert positive_finite(seconds), t
        assert t.to_dict()["llm_jax_gflops"] == pytest.approx(t.flops / t.llm_jax_s / 1e9)
    text = product_table(times, 100.0, config.n_layers)
    assert all(name in text for name in ("qkv", "o", "gate_up", "down"))
    step_ms = config.n_layers * sum(t.llm_jax_s for t in times) * 1e3
    assert f"a step's products ({config.n_layers} layers): llm_jax {step_ms:.2f} /" in text


def test_the_cli_times_the_products_at_every_batch_size(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert benchmark_main(["--model", "260K", "--batch", "1", "2", "--new-tokens", "5", "--chunk-steps", "4",
                           "--repeats", "1", "--bandwidth", "10", "--peak-gflops", "100", "--products",
                           "--json", str(path)]) == 0
    products = json.loads(path.read_text())["products"]
    assert [(p["rows"], p["name"]) for p in products] == [(r, n) for r in (1, 2) for n in ("qkv", "o", "gate_up", "down")]
    assert all(positive_finite(p["llm_jax_gflops"]) and positive_finite(p["torch_cached_gflops"]) for p in products)
    assert "matrix products alone, 260K float32, 2 rows" in capsys.readouterr().out


def test_products_take_named_shapes_only(tmp_path):
    with pytest.raises(ValueError, match="--products takes named shapes"):
        benchmark_main(["--model", str(tmp_path), "--bandwidth", "10", "--peak-gflops", "100", "--products",
                        "--new-tokens", "2", "--repeats", "1"])
