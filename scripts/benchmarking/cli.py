"""``scripts/benchmark.py``: how fast llm_jax decodes, against the memory roofline, ``transformers`` and llama.cpp.

One command runs a matrix of models × dtypes × batch sizes, prints progress on stderr and a table on
stdout, and with ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import TYPE_CHECKING

from llm_jax.cli.common import positive_int, run_main

if TYPE_CHECKING:
    from llm_jax.backends import Backend

    from benchmarking.results import Spread

EPILOG = """\
examples:
  benchmark.py --model 15M --model 110M --dtype float32 bfloat16 --compare hf --repeats 3
  benchmark.py --model 15M --batch 1 8 32
  benchmark.py --model 15M --batch 1 32 --backend cpu xla
  benchmark.py --model 1B --dtype bfloat16 --new-tokens 33
  benchmark.py --model 110M --compile-layers 6 12 24 --cli-ttft
  benchmark.py --model 15M --batch 32 --profile
  benchmark.py --model 15M --batch 1 32 --products
  benchmark.py --model 110M --dtype float32 bfloat16 --quantize int8 int4
  benchmark.py --model 110M --dtype bfloat16 --quantize int8 int4 --compare llama.cpp --new-tokens 97
  benchmark.py --model 110M --prompt-len 1000 --kv-cache-dtype auto int8
  benchmark.py --model model-Q8_0.gguf --compare llama.cpp
  benchmark.py --model 110M --speculative ngram --num-speculative-tokens 4
  benchmark.py --model checkpoints/stories-1m --speculative checkpoints/stories-1m-draft

models: a named shape with random weights (260K, 15M, 110M: llama2.c stories; 1B: TinyLlama 1.1B) or a
checkpoint path (llama2.c .bin or Hugging Face folder). The roofline is the measured memory bandwidth
divided by the bytes one decode step must read (weights + the KV cache in use); "% roof" is the share
of it reached, at the best bandwidth measured before and after all the runs. "% roof@run" is the median
over the runs of each run's share of the roofline at the bandwidth a streaming read sustains around it
(half a second of reads just before and just after, the better of the two; on a machine shared with
others, memory's speed moves from one moment to the next), "% @burst" the same at the fastest single
read around it (a burst of memory, which a run lasting longer sees only part of). "% roof@size" is
the share of the same bound at the bandwidth of reading just a step's bytes over and over: a model that
fits in a cache (15M in a large L3) is read from the cache, faster than memory allows, and can pass
100 % of the memory roofline. "flop roof" is the arithmetic bound: the
tokens/s the measured peak of multiply-adds (bfloat16 weights: of the CPU's bfloat16 dot products, where
it has them) allows for a step's matrix products and attention; "% flop" the share of it reached. It
binds where it is below the memory roofline: batched decode. "× hf" is llm_jax's decode rate over
transformers' in the same process, runs alternating. The dtypes and batch sizes of a model take turns as
well (each repeat runs every one once), and the lines under the table give their ratios repeat by repeat
(median, min–max): bfloat16 ÷ float32 and batch B ÷ batch 1 decode throughput, the latter with the
most it can be here while batch 1 runs as it did ("at its roofline": batch B's roofline, the lower of
memory's and the arithmetic's, over batch 1's median rate).
--backend runs llm_jax on each backend named, as separate engines taking turns ("cpu xla": the CPU kernels
against XLA's own operations); "auto" is the one llm_jax picks here, and its rows are named "llm_jax".
--products times a layer's four products alone (q/k/v and gate/up fused, as the CPU backend runs them),
each over many copies of its weights so that they come from memory as in a step, and over two copies that
stay in the caches, through llm_jax's CPU kernels and torch's F.linear taking turns, with the share of the
arithmetic peak each reaches: batched decode is bound by arithmetic, so these say how far batch B ÷ batch 1
can go here.
--quantize int8 int4 adds each --dtype's weights quantized (llm_jax.quantization: int8 per output channel,
int4 in groups of 32) as rows "float32+int8", ..., taking turns with the float ones; their roofline counts
the integers and scales the projections read.
--compare llama.cpp (batch 1; needs `pip install llama-cpp-python`, a benchmark-only dependency) writes each
dtype's weights as a GGUF file of the same kind (llm_jax.weights.to_gguf: float32 F32, bfloat16 BF16, +int8
Q8_0, +int4 Q4_0, rounded as llama.cpp's converter rounds them; named shapes with the Llama 2 tokenizer) and
runs llama.cpp on it (--threads threads; OMP_WAIT_POLICY=PASSIVE unless set: llama.cpp's OpenMP threads
spinning at a barrier slow it down many times over on a machine whose cores are shared), greedy, one token
per llama_decode call, taking turns with llm_jax; for Q8_0 and Q4_0 also llm_jax on that very file (rows
"llm_jax[Q8_0 file]": the same weights, where --quantize's own are llm_jax's rounding of the floats). The
lines under the table give each llm_jax row's decode rate over llama.cpp's, repeat by repeat, and how far
their greedy tokens agree. Rooflines of these rows count the bytes of llm_jax's own weights of the dtype.
A .gguf model is run by llama.cpp as it is.
--speculative runs only the speculative study: plain and speculative generate taking turns on a
repetitive and a novel prompt, with their decode tokens/s, ratio, acceptance rate and tokens per step.
Peak memory is the process's: with --compare hf both engines' weights are resident, and with several
dtypes every dtype's copy.
"""


BACKENDS = ("auto", "xla", "cpu", "pallas")  # llm_jax.backends.CHOICES, without importing JAX for --help


def engine_name(choice: str) -> str:
    """The rows' name of llm_jax on backend ``choice``: "llm_jax" for auto's, "llm_jax[xla]" for another."""
    return "llm_jax" if choice == "auto" else f"llm_jax[{choice}]"


def kv_label(engine: str) -> str:
    """" (int8 KV)" for a row of engine "llm_jax[int8 KV]"; "" for others."""
    return f" ({engine.rsplit('[', 1)[1][:-1]})" if engine.endswith(" KV]") else ""


def chosen_engines(choices: list[str]) -> tuple[tuple[str, Backend], ...]:
    """(name, backend) of llm_jax's engine on each of ``choices``, in order, each once."""
    from llm_jax import backends

    return tuple((engine_name(choice), backends.choose(choice)) for choice in dict.fromkeys(choices))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark llm_jax decode and prefill.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", dest="models", action="append", help="named shape or checkpoint (repeatable)")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    p.add_argument("--quantize", nargs="+", choices=["int8", "int4", "int4-asym"], default=[],
                   help="also run each --dtype's weights quantized (llm_jax.quantization; int4 in groups of 32, "
                        "int4-asym with an offset per group), "
                        "taking turns with the float ones: rows 'bfloat16+int8'")
    p.add_argument("--batch", nargs="+", type=positive_int, default=[1])
    p.add_argument("--prompt-len", type=positive_int, default=16)
    p.add_argument("--new-tokens", type=positive_int, default=129,
                   help="tokens generated per sequence (decode steps are rounded up to whole chunks)")
    p.add_argument("--chunk-steps", type=positive_int, default=16, help="decode steps per device call")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--compare", choices=["hf", "llama.cpp"],
                   help="also run Hugging Face transformers, or llama.cpp (llama-cpp-python; batch 1), on the same "
                        "weights")
    p.add_argument("--backend", nargs="+", choices=BACKENDS, default=["auto"],
                   help="how llm_jax runs: auto (the CPU kernels on one CPU device where they build, Pallas on GPU "
                        "and TPU, XLA otherwise), cpu, xla (XLA's own operations) or pallas; several run as "
                        "separate engines, taking turns")
    p.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "int8", "bfloat16", "float32"], default=["auto"],
                   help="what llm_jax's KV cache holds (auto: the compute dtype); several run as separate engines, "
                        "taking turns: rows 'llm_jax[int8 KV]'")
    p.add_argument("--threads", type=positive_int, help="threads for torch and the bandwidth probe (default: all)")
    p.add_argument("--bandwidth", type=float, help="memory bandwidth in GB/s to use instead of measuring it")
    p.add_argument("--peak-gflops", type=float, nargs="+", metavar="GFLOPS",
                   help="arithmetic peaks to use instead of measuring them: float32, then bfloat16, then int8 (the "
                        "LM head's screen in quads; each by default the one before)")
    p.add_argument("--compile-layers", nargs="+", type=positive_int,
                   help="also report compile time of the first model's shape at these depths")
    p.add_argument("--cli-ttft", action="store_true",
                   help="also time the first token of two generate CLI runs sharing a fresh compilation cache")
    p.add_argument("--profile", action="store_true",
                   help="also trace one decode chunk of each llm_jax cell and print where a step's time goes, op by op")
    p.add_argument("--products", action="store_true",
                   help="also time each of a layer's matrix products alone at each batch size, weights read from "
                        "memory as in a step and from the caches: llm_jax's kernels against torch's (what "
                        "transformers runs)")
    p.add_argument("--speculative", metavar="ngram|PATH",
                   help="instead of the matrix: plain against speculative decoding (prompt lookup, or the draft "
                        "model at PATH), side by side")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4, metavar="K",
                   help="tokens proposed per step with --speculative (default: %(default)s)")
    p.add_argument("--json", type=pathlib.Path, help="write all numbers to this file")
    return p


def _paired_against(rows, field: str, base_value):
    """(row, its base, its ratio to the base) for each row whose ``field`` is not ``base_value`` and that has a
    base: the row equal to it but for ``field`` (shape, dtype, engine, batch). Ratios of decode rates repeat
    by repeat (``results.paired_ratio``)."""
    from benchmarking.results import paired_ratio

    key = lambda r: {f: getattr(r, f) for f in ("shape", "dtype", "engine", "batch") if f != field}
    for r in rows:
        base = next((b for b in rows if getattr(b, field) == base_value and key(b) == key(r)), None)
        if base is not None and getattr(r, field) != base_value:
            yield r, base, paired_ratio(r, base)


@dataclasses.dataclass(frozen=True)
class Scaling:
    times_batch_1: Spread  # decode throughput over batch 1's, repeat by repeat
    ceiling: float  # the batch's roofline over batch 1's measured (median) rate


def batch_scaling(rows) -> dict:
    """Decode throughput (tokens/s of all rows) of each batch size over batch 1's, repeat by repeat, per
    shape, dtype and engine that ran batch 1 and another batch size; with the most that ratio can be on
    this machine while batch 1 runs as it did: the batch's roofline (the lower of memory's and, where the
    peaks were measured, the arithmetic's) over batch 1's median rate."""
    out: dict = {}
    for r, base, ratio in _paired_against(rows, "batch", 1):
        roof = min(r.roofline_tokens_per_s, r.compute_roofline_tokens_per_s or float("inf"))
        out.setdefault((r.shape, r.dtype, r.engine), {})[r.batch] = Scaling(ratio, roof / base.decode_tokens_per_s)
    return out


def backend_ratios(rows) -> dict:
    """Each other llm_jax engine's decode rate over the first's (the first backend of --backend), repeat by
    repeat, per shape, dtype and batch size."""
    ours = [r for r in rows if r.backend is not None]
    if not ours:
        return {}
    first = ours[0].engine
    return {(r.shape, r.dtype, r.batch, r.engine, first): ratio
            for r, _, ratio in _paired_against(ours, "engine", first)}


def dtype_ratios(rows) -> dict:
    """bfloat16's decode rate over float32's, repeat by repeat, per shape, engine and batch size that ran
    both."""
    return {(r.shape, r.engine, r.batch): ratio for r, _, ratio in _paired_against(rows, "dtype", "float32")
            if r.dtype == "bfloat16"}


def quantized_ratios(rows) -> dict:
    """Each quantized row's decode rate over the float row it was quantized from ("bfloat16+int8" over
    "bfloat16"), repeat by repeat, per shape, engine and batch size that ran both."""
    from benchmarking.results import paired_ratio

    out = {}
    for r in rows:
        float_dtype, _, scheme = r.dtype.partition("+")
        base = next((b for b in rows if b.dtype == float_dtype and (b.shape, b.engine, b.batch) == (r.shape, r.engine,
                                                                                                  r.batch)), None)
        if scheme and base is not None:
            out[(r.shape, r.engine, r.batch, r.dtype, float_dtype)] = paired_ratio(r, base)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    models = args.models or ["15M"]
    # Imported here so --help answers without starting JAX.
    from benchmarking import machine as machine_lib
    from benchmarking.compile_study import compile_vs_depth
    from benchmarking.llm_jax_engine import Workload
    from benchmarking.results import at_bandwidth, at_peaks, at_size, describe_differences, table, write_json
    from benchmarking.shapes import SHAPES
    from benchmarking.step_profile import table as step_table
    from benchmarking.suite import Options, log_stderr, run_matrix

    if args.products and any(m not in SHAPES for m in models):
        raise ValueError(f"--products takes named shapes ({', '.join(SHAPES)}), got "
                         f"{', '.join(m for m in models if m not in SHAPES)}")
    engines = chosen_engines(args.backend)  # before any slow work: a backend that cannot run here is an error
    if args.compare == "llama.cpp":
        from benchmarking import llama_cpp

        llama_cpp.require()
        if args.batch != [1] or args.speculative is not None:
            raise ValueError(f"--compare llama.cpp runs batch 1 decode only (got --batch {' '.join(map(str, args.batch))}"
                             f"{' and --speculative' if args.speculative is not None else ''})")
    if args.speculative is not None:
        return _speculative(models, args, engines, log_stderr)
    threads = args.threads or machine_lib.cpu_threads()
    if args.bandwidth:
        bandwidth = args.bandwidth
    else:
        log_stderr(f"measuring memory bandwidth ({threads} threads)...")
        bandwidth = machine_lib.measure_bandwidth(threads=threads)
    if args.peak_gflops:
        if len(args.peak_gflops) > 3 or min(args.peak_gflops) <= 0:
            raise ValueError("--peak-gflops takes one to three positive numbers (float32, bfloat16, int8)")
        given = list(args.peak_gflops)
        peaks = tuple(given[min(i, len(given) - 1)] for i in range(3))
    else:
        log_stderr(f"measuring the arithmetic peak ({threads} threads)...")
        peaks = machine_lib.measure_peaks(threads=threads)
    machine = machine_lib.describe(bandwidth, peaks)
    log_stderr(f"machine: {machine.cpu}, {machine.threads} threads, {bandwidth:.1f} GB/s, "
               f"arithmetic peak {_gflops(peaks)}, jax {machine.jax_version} ({machine.backend}); "
               + ", ".join(f"{name} on the {backend.name} backend" for name, backend in engines))
    options = Options(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                      chunk_steps=args.chunk_steps, compare_hf=args.compare == "hf",
                      compare_llama_cpp=args.compare == "llama.cpp", threads=threads,
                      bandwidth_gbps=bandwidth, peaks_gflops=peaks, probe_each_run=not args.bandwidth,
                      engines=engines, profile=args.profile,
                      kv_cache_dtypes=tuple(None if kv == "auto" else kv for kv in dict.fromkeys(args.kv_cache_dtype)))
    dtypes = [*args.dtype, *(f"{d}+{q}" for q in args.quantize for d in args.dtype)]
    results = run_matrix(models, dtypes, args.batch, options)
    rows = [row for result in results for row in result.rows]
    ratios = {}
    for result in results:
        if result.hf_ratio is not None:
            ratios[rows.index(result.rows[0])] = result.hf_ratio
    if not args.bandwidth:
        # The best of a measurement before and one after the runs: on a shared machine one measurement can
        # land in a busy moment, understate the bandwidth and overstate every roofline fraction.
        log_stderr("measuring memory bandwidth again...")
        best = max(bandwidth, machine_lib.measure_bandwidth(threads=threads))
        rows, bandwidth = [at_bandwidth(r, bandwidth, best) for r in rows], best
        # Reading only a step's bytes, again and again: a model that fits in a cache is read from it.
        at = {n: max(bandwidth, machine_lib.measure_bandwidth(threads=threads, nbytes=n))
              for n in sorted({r.bytes_per_step for r in rows})}
        rows = [at_size(r, at[r.bytes_per_step]) for r in rows]
    if not args.peak_gflops and all(peaks):
        # The same for the arithmetic peak: the CPU's clock moves with what else runs on the machine.
        log_stderr("measuring the arithmetic peak again...")
        again = machine_lib.measure_peaks(threads=threads)
        peaks = tuple(max(a, b) for a, b in zip(peaks, again))
        rows = [at_peaks(r, peaks) for r in rows]
    machine = machine_lib.describe(bandwidth, peaks)
    print(f"\nmachine: {machine.cpu}, {machine.threads} threads, measured bandwidth {bandwidth:.1f} GB/s, "
          f"arithmetic peak {_gflops(peaks)}")
    print(table(rows, ratios or None))
    for result in results:
        if result.agreement is not None:
            r = result.rows[0]
            print(f"greedy tokens agree with transformers: {100 * result.agreement:.0f}% "
                  f"({r.shape} {r.dtype} batch {r.batch}{describe_differences(result.differences)})")
    shown = set()
    for r in rows:
        if (r.shape, r.dtype, r.kv_cache_bytes_per_token) not in shown:
            shown.add((r.shape, r.dtype, r.kv_cache_bytes_per_token))
            print(f"KV cache {r.shape} {r.dtype}{kv_label(r.engine)}: {r.kv_cache_bytes_per_token} bytes per token")
        if r.kv_cache_mb is not None:
            print(f"decode memory {r.shape} {r.dtype}{kv_label(r.engine)} batch {r.batch}: "
                  f"cache {r.kv_cache_mb:.1f} MiB, donated and "
                  f"updated in place {r.decode_aliased_mb:.1f} MiB, scratch {r.decode_temp_mb:.1f} MiB")
    extra: dict = {}
    against_llama_cpp = _llama_cpp_report(results)
    if against_llama_cpp:
        extra["llama_cpp"] = against_llama_cpp
    compared = [r for r in results if r.agreement is not None]
    if compared:
        extra["agreement"] = [{"shape": r.rows[0].shape, "dtype": r.rows[0].dtype, "batch": r.rows[0].batch,
                               "greedy_agreement": r.agreement,
                               "first_differences": [{**dataclasses.asdict(d), "at_tie": d.at_tie}
                                                     for d in r.differences]}
                              for r in compared]
    # Ratios of runs of the same round (median, min–max over the repeats): cells took turns in each round.
    scaling = batch_scaling(rows)
    for (shape, dtype, engine), by_batch in scaling.items():
        print(f"decode throughput {shape} {dtype} {engine}: "
              + ", ".join(f"batch {b} {x.times_batch_1.median:.1f}× batch 1 ({x.times_batch_1.min:.1f}–"
                          f"{x.times_batch_1.max:.1f}; at its roofline {x.ceiling:.1f}×)" for b, x in by_batch.items()))
    if scaling:
        extra["batch_scaling"] = [{"shape": shape, "dtype": dtype, "engine": engine, "batch": b,
                                   "times_batch_1": x.times_batch_1.median, "min": x.times_batch_1.min,
                                   "max": x.times_batch_1.max, "roofline_times_batch_1": x.ceiling}
                                  for (shape, dtype, engine), by_batch in scaling.items() for b, x in by_batch.items()]
    by_backend = backend_ratios(rows)
    for (shape, dtype, batch, engine, base), x in by_backend.items():
        print(f"decode {engine} ÷ {base} {shape} {dtype} batch {batch}: {x.median:.2f}× ({x.min:.2f}–{x.max:.2f})")
    if by_backend:
        extra["backend_ratios"] = [{"shape": shape, "dtype": dtype, "batch": batch, "engine": engine, "over": base,
                                    "ratio": x.median, "min": x.min, "max": x.max}
                                   for (shape, dtype, batch, engine, base), x in by_backend.items()]
    by_dtype = dtype_ratios(rows)
    for (shape, engine, batch), x in by_dtype.items():
        print(f"decode bfloat16 ÷ float32 {shape} batch {batch} {engine}: {x.median:.2f}× ({x.min:.2f}–{x.max:.2f})")
    if by_dtype:
        extra["dtype_ratios"] = [{"shape": shape, "engine": engine, "batch": batch, "bfloat16_over_float32": x.median,
                                  "min": x.min, "max": x.max} for (shape, engine, batch), x in by_dtype.items()]
    by_scheme = quantized_ratios(rows)
    for (shape, engine, batch, dtype, base), x in by_scheme.items():
        print(f"decode {dtype} ÷ {base} {shape} batch {batch} {engine}: {x.median:.2f}× ({x.min:.2f}–{x.max:.2f})")
    if by_scheme:
        extra["quantized_ratios"] = [{"shape": shape, "engine": engine, "batch": batch, "dtype": dtype, "over": base,
                                      "ratio": x.median, "min": x.min, "max": x.max}
                                     for (shape, engine, batch, dtype, base), x in by_scheme.items()]
    traced = [(result.rows[0], engine, profile) for result in results for engine, profile in result.profiles]
    for row, engine, profile in traced:
        print("\n" + step_table(profile, f"{row.shape} {row.dtype} batch {row.batch}, {engine}"))
    if traced:
        extra["step_profiles"] = [{"shape": row.shape, "dtype": row.dtype, "batch": row.batch, "engine": engine,
                                   **profile.to_dict()} for row, engine, profile in traced]
    if args.products:
        extra["products"] = _products(models, args, threads, peaks, log_stderr)
    if args.compile_layers:
        shape = next((m for m in models if m in SHAPES), None)
        if shape is None:
            raise ValueError("--compile-layers needs a named shape among the models")
        workload = Workload(batch=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                            chunk_steps=args.chunk_steps)
        log_stderr(f"compile time of {shape} at {args.compile_layers} layers...")
        name, backend = engines[0]
        depth = compile_vs_depth(shape, args.dtype[0], args.compile_layers, workload, backend)
        print(f"\ncompile time, {shape} {args.dtype[0]}, {name} (trace + lower + compile, s):")
        for d in depth:
            print(f"  {d.n_layers:3d} layers: prefill {d.prefill_s:.2f}  decode {d.decode_s:.2f}")
        extra["compile_vs_depth"] = [dataclasses.asdict(d) for d in depth]
    if args.cli_ttft:
        extra["cli_ttft"] = _cli_ttft(models[0], args, log_stderr)
    if args.json:
        write_json(args.json, machine, rows, extra)
        log_stderr(f"wrote {args.json}")
    return 0


def _llama_cpp_report(results) -> list[dict]:
    """Print each llm_jax engine's comparison with llama.cpp (``--compare llama.cpp``); the same as JSON."""
    from benchmarking.results import describe_differences

    out = []
    for result in results:
        r = result.rows[0]
        for x in result.llama_cpp:
            print(f"decode {x.engine} ÷ {x.reference} {r.shape} {r.dtype}: {x.ratio.median:.2f}× ({x.ratio.min:.2f}–"
                  f"{x.ratio.max:.2f}); greedy tokens agree {100 * x.agreement:.0f}%"
                  f"{describe_differences(x.differences, x.reference)}")
            out.append({"shape": r.shape, "dtype": r.dtype, "engine": x.engine, "over": x.reference,
                        "ratio": x.ratio.median, "min": x.ratio.min, "max": x.ratio.max,
                        "greedy_agreement": x.agreement,
                        "first_differences": [{**dataclasses.asdict(d), "at_tie": d.at_tie} for d in x.differences]})
    return out


def _gflops(peaks) -> str:
    if not all(peaks):
        return "not measured (no kernels)"
    return f"{peaks[0]:.0f} GFLOP/s float32, {peaks[1]:.0f} bfloat16, {peaks[2]:.0f} int8"


def _products(models, args, threads: int, peaks, log) -> list[dict]:
    from benchmarking.product_study import CALLS, REPEATS, table as product_table, time_products
    from benchmarking.roofline import product_peak
    from benchmarking.shapes import shape_config

    out = []
    for model in models:
        for dtype in args.dtype:
            config = shape_config(model, dtype=dtype)
            peak = product_peak(dtype, peaks) if all(peaks) else None
            for batch in args.batch:
                log(f"{model} {dtype}: each product alone at {batch} rows...")
                times = time_products(config, rows=batch, dtype=dtype, threads=threads, log=log)
                print(f"\nmatrix products alone, {model} {dtype}, {batch} rows (median of {REPEATS} timings of "
                      f"{CALLS} products each):")
                print(product_table(times, peak, config.n_layers))
                out.extend({"shape": model, **t.to_dict()} for t in times)
    return out


def _speculative(models, args, engines, log) -> int:
    import tempfile

    from benchmarking import machine as machine_lib
    from benchmarking.results import write_json
    from benchmarking.speculative_study import speculative_for, study, table
    from benchmarking.suite import ModelSource

    rows = []
    name, backend = engines[0]
    with tempfile.TemporaryDirectory(prefix="llm_jax_bench_spec_") as tmp:
        for model in models:
            source = ModelSource(model, need_hf=False, workdir=pathlib.Path(tmp))
            for dtype in args.dtype:
                loaded = source.load_model(dtype, backend)
                speculative, proposer = speculative_for(args.speculative, args.num_speculative_tokens, dtype, backend)
                rows += study(loaded, source.label, dtype, args.batch, speculative, proposer,
                              new_tokens=args.new_tokens, repeats=args.repeats, chunk_steps=args.chunk_steps, log=log)
    machine = machine_lib.describe(0.0, (0.0, 0.0, 0.0))
    print(f"\nmachine: {machine.cpu}, {machine.threads} threads, jax {machine.jax_version}; {name} on the "
          f"{backend.name} backend; {args.new_tokens} new tokens, median of {args.repeats} repeats")
    print(table(rows))
    if args.json:
        write_json(args.json, machine, [], {"speculative": [dataclasses.asdict(r) for r in rows]})
        log(f"wrote {args.json}")
    return 0


def _cli_ttft(model: str, args, log) -> dict:
    import tempfile

    from benchmarking.compile_study import cli_ttft
    from benchmarking.hf_engine import save_random_hf_model
    from benchmarking.shapes import SHAPES, shape_config

    prompt_ids = list(range(1, args.prompt_len + 1))
    with tempfile.TemporaryDirectory(prefix="llm_jax_bench_cli_") as tmp:
        path = model
        if model in SHAPES:
            path = pathlib.Path(tmp) / model
            save_random_hf_model(shape_config(model, dtype="float32"), path)
        log(f"generate CLI twice on {model} (fresh compilation cache)...")
        result = cli_ttft(path, prompt_ids=prompt_ids, max_new_tokens=args.new_tokens, dtype=args.dtype[0])
    print(f"\ngenerate CLI, {model} {args.dtype[0]}: time to first token {result.first_ttft_s:.2f} s (first run, "
          f"compile {result.first_compile_s:.2f} s) → {result.second_ttft_s:.2f} s (second run, compile "
          f"{result.second_compile_s:.2f} s): {100 * result.ratio:.0f}% of the first")
    return {**dataclasses.asdict(result), "ratio": result.ratio}


def entry() -> int:
    return run_main(main)
