"""scripts/bench_serving.py runs end to end and reports consistent numbers (no timing assertions)."""

import dataclasses
import json
import math

import numpy as np
import pytest

from llm_jax.cli.common import run_main

from bench_serving import main as bench_main
from benchmarking.serving import (EngineLimits, HfContinuous, HfStatic, Percentiles, RequestTrace, ServingRun, Summary,
                                  WorkloadSpec, median_of, sample_requests, transformers_engine)

# A tiny engine: few step programs to compile (decode steps of 1 and 2 sequences, mixed steps of 16 tokens).
TINY = ["--model", "260K", "--num-prompts", "5", "--input-len-range", "4", "24", "--output-len-range", "3", "9",
        "--prefix-len", "24", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--block-size", "8",
        "--max-model-len", "64", "--compare", "generate"]
SERVING, GENERATE = "llm_jax serving", "llm_jax generate (static batches of 8)"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The JSON and the printed report of a run with the prefix cache and of one without."""
    out = {}
    for name, extra in (("cached", []), ("uncached", ["--no-prefix-caching"])):
        path = tmp_path_factory.mktemp("bench") / f"{name}.json"
        assert bench_main([*TINY, *extra, "--json", str(path)]) == 0
        out[name] = json.loads(path.read_text())
    return out


@pytest.fixture(scope="module")
def report(reports):
    return reports["cached"]


def test_the_report_names_the_machine_the_command_and_the_workload(report):
    assert report["command"].startswith("python scripts/bench_serving.py --model 260K")
    assert report["machine"]["threads"] >= 1 and report["machine"]["cpu"]
    w = report["workload"]
    assert len(w["prompt_lens"]) == len(w["output_lens"]) == len(w["arrivals_s"]) == 5
    assert all(24 + 4 <= n <= 24 + 24 for n in w["prompt_lens"]) and all(3 <= n <= 9 for n in w["output_lens"])
    assert w["arrivals_s"] == [0.0] * 5  # all at once by default
    assert report["engine_options"] == {"max_num_seqs": 2, "max_num_batched_tokens": 16, "block_size": 8, "max_model_len": 64,
                                            "enable_prefix_caching": True}
    assert set(report["warm_up"]) == {SERVING, GENERATE}
    assert all(w["seconds"] > 0 for w in report["warm_up"].values())


def test_every_engine_delivers_exactly_the_tokens_asked_for(report):
    w = report["workload"]
    for name in (SERVING, GENERATE):
        for s in (report["median"][name], *report["rounds"][name]):
            assert s["num_requests"] == 5
            assert s["output_tokens"] == sum(w["output_lens"])
            assert s["prompt_tokens"] == sum(w["prompt_lens"])
            d = s["duration_s"]
            assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / d)
            assert s["total_tokens_per_s"] == pytest.approx((s["prompt_tokens"] + s["output_tokens"]) / d)
            assert s["request_throughput"] == pytest.approx(5 / d)


def test_latency_percentiles_are_ordered(report):
    for name in (SERVING, GENERATE):
        s = report["median"][name]
        for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            p = s[metric]
            assert 0 < p["p50"] <= p["p99"], (name, metric, p)
        assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]


def test_the_engine_compiles_nothing_after_warm_up_and_counts_its_steps(report):
    s = report["median"][SERVING]
    c = s["counters"]
    assert c["new_programs"] == 0 and c["compilations"] == 0 and s["compilations"] == 0
    assert report["median"][GENERATE]["compilations"] == 0  # its warm-up ran every batch shape
    assert c["steps"] >= max(report["workload"]["output_lens"])  # a token per step per sequence at most
    assert 1 <= c["mean_batch"] <= 2 and 1 <= c["mean_step_tokens"] <= 16
    assert 0 < c["peak_blocks"] <= c["num_blocks"] == 16  # the engine's default: 2 sequences of 64 tokens
    assert c["preemptions"] == 0


def test_prefix_cache_hits_with_a_shared_prefix_and_none_without_the_cache(reports):
    assert reports["cached"]["median"][SERVING]["counters"]["prefix_hit_rate"] > 0
    assert reports["uncached"]["median"][SERVING]["counters"]["prefix_hit_rate"] == 0
    assert reports["uncached"]["engine_options"]["enable_prefix_caching"] is False


def test_the_engine_and_generate_give_the_same_greedy_tokens(report):
    assert report["agreement"] == {GENERATE: 1.0}
    assert report["serving_over"][GENERATE] > 0


def test_the_table_is_printed_with_the_machine_and_command(capsys):
    assert bench_main([*TINY, "--num-prompts", "2", "--request-rate", "1000"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("machine: ") and lines[1].startswith("command: python scripts/bench_serving.py")
    assert "Poisson at 1000 req/s" in lines[2]
    header = next(line for line in lines if line.startswith("engine"))
    for column in ("req/s", "out tok/s", "total tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99/max ms"):
        assert column in header
    assert any(line.startswith(SERVING + " ") for line in lines) and any(line.startswith(GENERATE) for line in lines)
    assert "prefix-cache hit rate" in out and "step programs compiled" in out


# The workload.
def test_requests_are_seeded_and_within_their_ranges():
    spec = WorkloadSpec(num_prompts=50, input_len=(32, 256), output_len=(8, 16), prefix_len=10, seed=3)
    a, b = sample_requests(spec, 1000), sample_requests(spec, 1000)
    assert a == b
    assert a != sample_requests(dataclasses.replace(spec, seed=4), 1000)
    prefix = a[0].prompt_ids[:10]
    for r in a:
        assert r.prompt_ids[:10] == prefix and 10 + 32 <= len(r.prompt_ids) <= 10 + 256
        assert 8 <= r.max_new_tokens <= 16 and all(0 <= t < 1000 for t in r.prompt_ids)
        assert r.arrival_s == 0.0
    assert len({len(r.prompt_ids) for r in a}) > 10  # lengths drawn, not fixed
    assert [r.request_id for r in a] == [f"r{i}" for i in range(50)]


def test_poisson_arrivals_keep_the_prompts_and_have_the_rate():
    spec = WorkloadSpec(num_prompts=4000, input_len=(4, 8), output_len=(2, 2), request_rate=20.0)
    timed, at_once = sample_requests(spec, 100), sample_requests(dataclasses.replace(spec, request_rate=math.inf), 100)
    assert [r.prompt_ids for r in timed] == [r.prompt_ids for r in at_once]
    arrivals = np.array([r.arrival_s for r in timed])
    assert arrivals[0] == 0 and (np.diff(arrivals) > 0).all()
    assert np.diff(arrivals).mean() == pytest.approx(1 / 20, rel=0.1)


# The measurements.
def test_ttft_tpot_and_itl_follow_vllms_definitions():
    # Arrives at 1 s; 5 tokens: the first at 1.5 s, then two at 2.0 s (one delivery), one at 2.25, one at 2.5.
    trace = RequestTrace(request_id="a", arrival_s=1.0, prompt_len=7, token_ids=(1, 2, 3, 4, 5),
                         deliveries=((1.5, 1), (2.0, 2), (2.25, 1), (2.5, 1)))
    assert trace.ttft_s == 0.5 and trace.e2e_s == 1.5
    assert trace.tpot_s == pytest.approx(1.0 / 4)
    assert trace.itl_s() == [0.25, 0.25, 0.25, 0.25]
    single = RequestTrace(request_id="b", arrival_s=0.0, prompt_len=3, token_ids=(9,), deliveries=((0.1, 1),))
    assert single.tpot_s is None and single.itl_s() == []
    s = Summary.of(ServingRun(engine="x", duration_s=2.5, traces=(trace, single)))
    assert (s.prompt_tokens, s.output_tokens) == (10, 6)
    assert s.output_tokens_per_s == pytest.approx(6 / 2.5) and s.request_throughput == pytest.approx(2 / 2.5)
    assert s.tpot_s == Percentiles(mean=0.25, p50=0.25, p99=0.25, max=0.25)  # over requests with more than one token
    stalled = dataclasses.replace(trace, deliveries=((1.5, 1), *((1.5 + 0.1 * i, 1) for i in range(1, 200)), (30.0, 1)))
    itl = Summary.of(ServingRun(engine="x", duration_s=30, traces=(stalled,))).itl_s
    assert itl.p99 == pytest.approx(0.1) and itl.max == pytest.approx(30.0 - 21.4)  # one stall: only the max sees it
    assert s.ttft_s.p50 == pytest.approx(0.3) and s.ttft_s.p99 == pytest.approx(0.496)
    assert Percentiles.of([]) is None


def test_median_of_runs_is_taken_field_by_field():
    runs = [Percentiles(mean=m, p50=m, p99=2 * m, max=3 * m) for m in (1.0, 3.0, 2.0)]
    assert median_of(runs) == Percentiles(mean=2.0, p50=2.0, p99=4.0, max=6.0)
    assert median_of([1, 2, 4]) == 2 and median_of(["a", "a"]) == "a" and median_of([None, None]) is None


# transformers, on the same random weights.
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from benchmarking.hf_engine import load_hf_model, save_random_hf_model
    from benchmarking.shapes import shape_config

    folder = tmp_path_factory.mktemp("hf") / "260K"
    save_random_hf_model(shape_config("260K", dtype="float32"), folder)
    return load_hf_model(folder, "float32", threads=1)


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_transformers_delivers_the_tokens_asked_for(hf_model, engine):
    spec = WorkloadSpec(num_prompts=3, input_len=(4, 20), output_len=(2, 6), prefix_len=16, request_rate=200.0)
    requests = sample_requests(spec, 512)
    limits = EngineLimits(block_size=8, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=2, prefix_caching=True)
    runner = HfContinuous(hf_model, limits) if engine == "continuous" else HfStatic(hf_model, 2)
    runner.warm_up(requests)
    run = runner.run(requests)
    assert [len(t.token_ids) for t in run.traces] == [r.max_new_tokens for r in requests]
    for trace in run.traces:
        assert sum(n for _, n in trace.deliveries) == len(trace.token_ids) and trace.ttft_s > 0
    if engine == "continuous":  # arrivals as the workload says; static runs have everything from the start
        assert [t.arrival_s for t in run.traces] == [r.arrival_s for r in requests]
        assert all(len(t.deliveries) == len(t.token_ids) for t in run.traces)  # a stamp per token


class _NoContinuousBatching:
    """A transformers model whose continuous batching fails (as where its paged attention cannot run)."""

    def __init__(self, model):
        self.generate = model.generate

    def init_continuous_batching(self, **_):
        raise RuntimeError("paged attention needs a GPU")


def test_without_continuous_batching_transformers_runs_static_batches_and_says_why(hf_model):
    requests = sample_requests(WorkloadSpec(num_prompts=3, input_len=(4, 8), output_len=(2, 3)), 512)
    limits = EngineLimits(block_size=8, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=2, prefix_caching=True)
    said = []
    engine, warm_up = transformers_engine(_NoContinuousBatching(hf_model), limits, 2, requests, said.append)
    assert isinstance(engine, HfStatic) and engine.name == "transformers generate (static batches of 2)"
    assert "continuous batching cannot run here (RuntimeError: paged attention needs a GPU)" in engine.note
    assert said == [engine.note] and warm_up.seconds > 0
    assert [len(t.token_ids) for t in engine.run(requests).traces] == [r.max_new_tokens for r in requests]


# The command line.
@pytest.mark.parametrize("argv, status, message", [
    (["--input-len-range", "10", "5"], 1, "--input-len-range 10 5: MIN must not exceed MAX"),
    (["--input-len", "200", "--output-len", "100"], 1, "exceeds 15M's context of 256 tokens"),
    (["--input-len", "5", "--input-len-range", "1", "2"], 2, "not allowed with argument"),
    (["--request-rate", "0"], 2, "expected a rate > 0"),
    (["--compare", "vllm"], 2, "invalid choice"),
])
def test_bad_arguments_fail_in_one_line(capsys, argv, status, message):
    try:
        got = run_main(bench_main, ["--model", "15M", *argv])
    except SystemExit as usage:  # argparse's errors, one line too
        got = usage.code
    err = capsys.readouterr().err
    assert got == status
    assert message in err and len(err.strip().splitlines()) == 1, err


# Online mode: the requests as text over HTTP.
@pytest.fixture(scope="module")
def online_report(stories260k_dir, tmp_path_factory):
    """llm_jax's server launched on stories260K, driven at a concurrency of 2, beside the engine in process."""
    path = tmp_path_factory.mktemp("online") / "online.json"
    argv = ["--model", str(stories260k_dir / "hf"), "--num-prompts", "4", "--input-len-range", "4", "12",
            "--output-len", "6", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--block-size", "8",
            "--max-model-len", "64", "--max-concurrency", "2", "--launch", "llm_jax", "--compare", "engine",
            "--goodput", "ttft:600000", "--json", str(path)]
    assert bench_main(argv) == 0
    return json.loads(path.read_text())


def test_online_mode_streams_every_token_asked_for_and_agrees_with_the_engine(online_report):
    server, engine = online_report["median"]["llm_jax server"], online_report["median"]["llm_jax serving"]
    for summary in (server, engine):
        assert summary["num_requests"] == 4 and summary["output_tokens"] == 4 * 6
        assert summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    assert server["prompt_tokens"] == engine["prompt_tokens"]  # the same text, tokenized alike
    assert online_report["agreement"] == {"llm_jax serving": 1.0}  # greedy: the same text over HTTP and in process
    assert online_report["goodput"]["llm_jax server"] == pytest.approx(server["request_throughput"])


def test_goodput_counts_the_requests_that_meet_every_target():
    from benchmarking.serving import goodput

    fast = RequestTrace(request_id="a", arrival_s=0.0, prompt_len=1, token_ids=(1, 2), deliveries=((0.1, 1), (0.2, 1)))
    slow = RequestTrace(request_id="b", arrival_s=0.0, prompt_len=1, token_ids=(1, 2), deliveries=((0.5, 1), (2.0, 1)))
    run = ServingRun(engine="x", duration_s=2.0, traces=(fast, slow))
    assert goodput(run, {"ttft": 200}) == 0.5
    assert goodput(run, {"ttft": 600, "tpot": 1000}) == 0.5
    assert goodput(run, {"e2e": 3000}) == 1.0


def test_a_late_request_arrives_when_asked_with_its_prompt_length():
    spec = WorkloadSpec(num_prompts=3, input_len=(4, 8), output_len=(5, 9), late=(40, 1.5), seed=3)
    requests = sample_requests(spec, 100)
    late = [r for r in requests if r.request_id == "late"]
    assert len(late) == 1 and len(late[0].prompt_ids) == 40 and late[0].arrival_s == 1.5
    assert late[0].max_new_tokens == 5 and requests[-1] is late[0]  # arrival order
    assert spec.longest == max(8 + 9, 40 + 5)
    spec = dataclasses.replace(spec, output_len=(50, 60))
    assert [r.max_new_tokens for r in sample_requests(spec, 100) if r.request_id == "late"] == [16]


def test_speculative_decoding_side_by_side_gives_the_same_tokens(tmp_path):
    path = tmp_path / "speculative.json"
    tiny = [a for a in TINY if a not in ("--compare", "generate")]
    assert bench_main([*tiny, "--repeat-period", "3", "--speculative", "ngram", "--num-speculative-tokens", "3",
                       "--compare", "no-speculation", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["engine_options"]["speculative"].startswith("Speculative(method=<Method.NGRAM")
    assert report["agreement"] == {f"{SERVING} (no speculation)": 1.0}
    speculated = report["median"][SERVING]["counters"]
    assert 0 < speculated["acceptance_rate"] <= 1 and speculated["mean_accepted_length"] > 1
    assert speculated["new_programs"] == 0
    assert report["median"][f"{SERVING} (no speculation)"]["counters"]["mean_accepted_length"] == 0
