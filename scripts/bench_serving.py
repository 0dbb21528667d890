#!/usr/bin/env python
"""Benchmark llm_jax's serving engine offline: ``python scripts/bench_serving.py --model 15M --compare generate``.

N requests of random lengths (as ``vllm bench serve --dataset random``) go through
``llm_jax.serving.Engine``, and with ``--compare`` the same requests through ``llm_jax.generate`` in static
batches and through ``transformers``' continuous batching, taking turns; prints a table on stdout (progress
on stderr) and with ``--json`` writes every number. The workload and engines are in
``benchmarking/serving.py`` beside this file (Python puts this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import shlex
import sys

from llm_jax.cli.common import CliParser, non_negative_int, positive_int, run_main

EPILOG = """\
examples:
  bench_serving.py --model 15M --num-prompts 16 --input-len-range 32 128 --output-len 32 --compare generate --compare hf
  bench_serving.py --model 110M --num-prompts 64 --input-len-range 32 256 --output-len 128 --max-num-seqs 16 --compare generate --compare hf
  bench_serving.py --model 110M --num-prompts 16 --input-len 16 --output-len 256 --max-num-seqs 16 --compare generate --static-batch 16
  bench_serving.py --model 110M --num-prompts 32 --prefix-len 512 --input-len 32 --output-len 16 --compare no-prefix-cache
  bench_serving.py --model 110M --num-prompts 8 --input-len 32 --output-len 192 --late-request 1000 3 --max-num-seqs 16 --max-num-batched-tokens 32
  bench_serving.py --model 110M --num-prompts 64 --input-len-range 32 256 --output-len 128 --max-num-seqs 16 --max-concurrency 16 --launch llm_jax --launch transformers --compare engine
  bench_serving.py --model 15M --num-prompts 64 --request-rate 8 --json serving.json

models: a named shape with random weights (260K, 15M, 110M: llama2.c stories; 1B: TinyLlama 1.1B) or a
checkpoint path (llama2.c .bin, Hugging Face or llm_jax folder; --compare hf needs a named shape or a
Hugging Face folder, whose weights transformers then runs too). Every engine decodes greedily and ignores
end-of-sequence ids, so each request gets exactly the tokens it asked for.

Requests: prompts of --prefix-len shared random tokens, then --input-len (or a length drawn uniformly in
--input-len-range) random tokens; --output-len (or --output-len-range) tokens to generate; arriving all at
once or, with --request-rate, as a Poisson process (exponential gaps, the first at once). --seed fixes
them all; a different rate does not change the prompts.

Measured per run, from the first arrival to the last token, after each engine's warm-up (reported apart):
requests/s, output tokens/s, total (prompt + output) tokens/s; TTFT (arrival → first token), TPOT
((last token − first token) ÷ (tokens − 1)) and E2E latency, each p50 and p99 over requests; ITL, the gaps
between a request's deliveries of tokens, each split evenly over the tokens it delivered, p50 and p99
over all tokens (llm_jax.generate delivers a chunk of 16 steps at once). Times are the host's, when a
step's outputs are back (transformers stamps each token itself). For llm_jax's engine also: device steps
and the mean sequences and tokens per step, the most KV blocks in use (sampled between steps), the
prefix-cache hit rate (prompt tokens found cached ÷ looked up), preemptions, and step programs compiled
and XLA compilations after the warm-up (both should be 0).

Comparisons (each engine warmed up once, then --repeats rounds in which each runs the requests in turn;
the table gives each number's median over the rounds; "serving ×" is llm_jax serving's output tokens/s
over the row's, round by round, median):
  generate  llm_jax.generate in static batches of --static-batch, in arrival order, all requests there
            from the start whatever --request-rate says (its warm-up runs each distinct batch shape once).
  hf        transformers' continuous batching (ContinuousBatchingManager, what model.generate_batch runs)
            on the same weights, given the engine's block size, block count, token budget and sequences,
            fed at the same arrival times; where it cannot run, model.generate in static batches,
            labelled so, with the reason.
  no-prefix-cache  the engine again with its prefix cache off (what the cache saves, side by side).

Online (--launch, --url): each request a streamed POST /v1/completions of a text prompt (random whole
words of the tokenizer's vocabulary, one per drawn prompt token; a named shape gets the Llama 2 tokenizer),
temperature 0, every token asked for (ignore_eos; transformers serve: min_new_tokens). --launch starts
llm_jax's server (scripts/serve.py, the engine options above) or 'transformers serve --continuous-batching'
(the same block size, block count and token budget) on a free port of 127.0.0.1 on the same weights, one
after the other, and stops it; --url drives a server already running. Deliveries are the server-sent
events; latencies count from when a request is sent (after --max-concurrency lets it go). --compare
engine then runs the same token ids through the engine in this process (HTTP's cost, side by side);
--goodput counts the requests per second that meet every latency target.
"""

BACKENDS = ("auto", "xla", "cpu", "pallas")  # llm_jax.backends.CHOICES, without importing JAX for --help


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def request_rate(text: str) -> float:
    """A positive number of requests per second, or inf."""
    value = _number(text, "a number of requests per second or inf")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 (or inf), got {text}")
    return value


def non_negative_number(text: str) -> float:
    """A number >= 0 (one of --late-request's two)."""
    value = _number(text, "a number")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def slo(text: str) -> tuple[str, float]:
    """A goodput target, METRIC:MS."""
    name, _, ms = text.partition(":")
    if name not in ("ttft", "tpot", "e2e"):
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2e:MS, got {text!r}")
    value = _number(ms, f"a number of milliseconds after {name}:")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a target > 0 ms in {text!r}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="bench_serving.py", description="Benchmark llm_jax's serving engine on a stream of requests.",
                  epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="15M", help="named shape (260K, 15M, 110M, 1B) or checkpoint path (default 15M)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="how llm_jax runs: auto (the CPU kernels on one CPU device where they build, Pallas on GPU "
                        "and TPU, XLA otherwise), cpu, xla or pallas")
    w = p.add_argument_group("requests")
    w.add_argument("--num-prompts", type=positive_int, default=64, help="requests (default 64)")
    lengths = w.add_mutually_exclusive_group()
    lengths.add_argument("--input-len", type=positive_int, help="prompt tokens after the prefix (default 64)")
    lengths.add_argument("--input-len-range", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                         help="prompt tokens after the prefix, drawn uniformly in [MIN, MAX]")
    outputs = w.add_mutually_exclusive_group()
    outputs.add_argument("--output-len", type=positive_int, help="tokens to generate per request (default 128)")
    outputs.add_argument("--output-len-range", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                         help="tokens to generate, drawn uniformly in [MIN, MAX]")
    w.add_argument("--prefix-len", type=non_negative_int, default=0,
                   help="random tokens shared by every prompt, before its own (default 0)")
    w.add_argument("--request-rate", type=request_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    w.add_argument("--late-request", type=non_negative_number, nargs=2, metavar=("LEN", "AT"),
                   help="one more request, of a LEN-token prompt (and 16 output tokens), arriving AT seconds "
                        "after the first (what a long prompt does to the others' inter-token latency)")
    w.add_argument("--repeat-period", type=non_negative_int, default=0, metavar="N",
                   help="each prompt repeats its own N random tokens (a passage to continue; what speculative "
                        "decoding's prompt lookup predicts; default 0: no repetition)")
    w.add_argument("--seed", type=non_negative_int, default=0, help="seed of lengths, tokens and arrivals")
    e = p.add_argument_group("serving engine (llm_jax.serving.Engine's options; unset: the engine's defaults)")
    e.add_argument("--max-num-seqs", type=positive_int, help="sequences running at once (engine default 8)")
    e.add_argument("--max-num-batched-tokens", type=positive_int, help="tokens per step (engine default 256)")
    e.add_argument("--block-size", type=positive_int, help="tokens per KV block (engine default 16)")
    e.add_argument("--num-blocks", type=positive_int,
                   help="KV blocks (engine default: enough for --max-num-seqs sequences of --max-model-len)")
    e.add_argument("--max-model-len", type=positive_int, help="longest sequence (engine default: the model's context)")
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's prefix cache off")
    e.add_argument("--kv-cache-dtype", choices=["auto", "int8", "bfloat16", "float32"], default="auto",
                   help="what the engine's KV cache holds (auto: the compute dtype; --launch servers keep theirs)")
    e.add_argument("--speculative", metavar="ngram|PATH",
                   help="speculative decoding: each decoding request verifies proposals every step, from prompt "
                        "lookup ('ngram') or from the draft model at PATH")
    e.add_argument("--num-speculative-tokens", type=positive_int, default=4, metavar="K",
                   help="proposals per request and step at most (default 4)")
    e.add_argument("--lora", type=positive_int, metavar="N",
                   help="serve N random LoRA adapters (every projection), the requests taking turns among them")
    e.add_argument("--lora-rank", type=positive_int, default=16, metavar="R", help="their rank (default 16)")
    e.add_argument("--speculative-max-batch", type=positive_int, metavar="N",
                   help="propose only while at most N requests run (default: always)")
    o = p.add_argument_group("online (over HTTP, streamed /v1/completions; any of these turns it on)")
    o.add_argument("--launch", action="append", choices=["llm_jax", "transformers"], default=[],
                   help="start this server on a free port of 127.0.0.1 on the same weights (a Hugging Face copy), "
                        "run the requests, stop it: llm_jax's scripts/serve.py with the engine options, or "
                        "'transformers serve --continuous-batching' with the same limits (repeatable)")
    o.add_argument("--url", action="append", default=[],
                   help="an OpenAI-compatible server already running, as http://HOST:PORT/v1 (repeatable)")
    o.add_argument("--dialect", choices=["vllm", "transformers"], default="vllm",
                   help="how --url servers are asked for every token: ignore_eos (llm_jax, vLLM) or a "
                        "generation_config with min_new_tokens (transformers serve)")
    o.add_argument("--max-concurrency", type=positive_int,
                   help="requests in flight at most (default: no limit but --request-rate)")
    o.add_argument("--goodput", nargs="+", metavar="METRIC:MS", type=slo, default=[],
                   help="latency targets for goodput (requests/s meeting all of them): ttft:MS, tpot:MS, e2e:MS")
    c = p.add_argument_group("comparisons")
    c.add_argument("--compare", action="append",
                   choices=["generate", "hf", "no-prefix-cache", "no-speculation", "no-lora", "engine"], default=[],
                   help="also run llm_jax.generate in static batches, transformers' continuous batching, the engine "
                        "with its prefix cache, its speculative decoding or its LoRA adapters off, or (online) "
                        "llm_jax's engine in this process on the same prompts (repeatable)")
    c.add_argument("--static-batch", type=positive_int, default=8, help="batch size of the static runs (default 8)")
    c.add_argument("--repeats", type=positive_int, default=1, help="rounds of runs, the engines taking turns (default 1)")
    c.add_argument("--threads", type=positive_int, help="torch threads (default: every CPU)")
    p.add_argument("--json", type=pathlib.Path, help="write every number to this file")
    return p


def workload_spec(args):
    from benchmarking.serving import WorkloadSpec

    input_len = tuple(args.input_len_range) if args.input_len_range else (args.input_len or 64,) * 2
    output_len = tuple(args.output_len_range) if args.output_len_range else (args.output_len or 128,) * 2
    for name, (lo, hi) in (("--input-len-range", input_len), ("--output-len-range", output_len)):
        if lo > hi:
            raise ValueError(f"{name} {lo} {hi}: MIN must not exceed MAX")
    late = None
    if args.late_request:
        length, at = args.late_request
        if length != int(length) or length < 1:
            raise ValueError(f"--late-request LEN must be a whole number of tokens, got {length:g}")
        late = (int(length), at)
    return WorkloadSpec(num_prompts=args.num_prompts, input_len=input_len, output_len=output_len,
                        prefix_len=args.prefix_len, request_rate=args.request_rate, seed=args.seed, late=late,
                        repeat_period=args.repeat_period)


def check_fits(spec, context: int, what: str) -> None:
    if spec.longest > context:
        raise ValueError(f"the longest request ({spec.prefix_len} prefix + {spec.input_len[1]} prompt + "
                         f"{spec.output_len[1]} output tokens = {spec.longest}) exceeds {what} of {context} tokens")


@functools.cache
def load_draft(path: str, dtype: str, backend: str):
    """The draft model at ``path`` (once per run)."""
    import llm_jax

    if not pathlib.Path(path).exists():
        raise ValueError(f"--speculative takes 'ngram' or a draft model's path; {path} does not exist")
    return llm_jax.load(path, dtype=dtype, backend=backend)


def engine_options(args) -> dict:
    """The Engine keywords given on the command line (the others keep the engine's defaults)."""
    given = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
             "block_size": args.block_size, "num_blocks": args.num_blocks, "max_model_len": args.max_model_len,
             "kv_cache_dtype": None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype}
    if args.speculative:
        from llm_jax.speculative import Speculative

        draft = None if args.speculative == "ngram" else load_draft(args.speculative, args.dtype, args.backend)
        given["speculative"] = Speculative(method="ngram" if draft is None else "draft", draft_model=draft,
                                           num_tokens=args.num_speculative_tokens,
                                           max_batch=args.speculative_max_batch)
    return {k: v for k, v in given.items() if v is not None} | {"enable_prefix_caching": not args.no_prefix_caching}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    spec = workload_spec(args)
    # Imported here so --help answers without starting JAX.
    import tempfile

    from benchmarking.cli import engine_name
    from benchmarking.shapes import SHAPES
    from benchmarking.suite import log_stderr

    if args.model in SHAPES:  # before any slow work
        check_fits(spec, args.max_model_len or SHAPES[args.model].max_seq_len, f"{args.model}'s context")
    with tempfile.TemporaryDirectory(prefix="llm_jax_bench_serving_") as tmp:
        report = run(args, argv, spec, pathlib.Path(tmp), engine_name(args.backend), log_stderr)
    print(report["text"])
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in report.items() if k != "text"}, indent=2) + "\n")
        log_stderr(f"wrote {args.json}")
    return 0


def run(args, argv: list[str], spec, workdir: pathlib.Path, name: str, log) -> dict:
    from benchmarking import machine as machine_lib
    from benchmarking import serving
    from benchmarking.hf_engine import load_hf_model
    from benchmarking.suite import ModelSource

    online = bool(args.launch or args.url)
    source = ModelSource(args.model, need_hf="hf" in args.compare or "transformers" in args.launch or online,
                         workdir=workdir, tokenizer=online)
    log(f"{source.label} {args.dtype}: loading" + (" (and saving the Hugging Face copy)" if source.hf_folder else ""))
    model = source.load_model(args.dtype, args.backend)
    options = engine_options(args)
    if args.lora:
        options["lora_adapters"] = serving.random_adapters(model.config, args.lora, args.lora_rank, seed=args.seed)
    check_fits(spec, min(options.get("max_model_len", model.config.max_seq_len), model.config.max_seq_len),
               "the longest sequence the engine serves")
    requests = serving.sample_requests(spec, model.config.vocab_size)
    ours = serving.LlmJaxServing(model, options, name=name)
    threads = args.threads or machine_lib.cpu_threads()
    if online:
        return run_online(args, argv, spec, source, model, requests, ours, workdir, threads, log)
    engines = [ours]
    if "no-prefix-cache" in args.compare:
        engines.append(serving.LlmJaxServing(model, options | {"enable_prefix_caching": False}, name=name,
                                             variant="no prefix cache"))
    if "no-speculation" in args.compare:
        engines.append(serving.LlmJaxServing(model, options | {"speculative": None}, name=name,
                                             variant="no speculation"))
    if "no-lora" in args.compare:
        engines.append(serving.LlmJaxServing(model, options | {"lora_adapters": ()}, name=name, variant="no LoRA"))
    if "generate" in args.compare:
        engines.append(serving.StaticGenerate(model, args.static_batch, name=name))
    warm_ups = {}
    for engine in engines:
        log(f"{engine.name}: warming up...")
        warm_ups[engine.name] = engine.warm_up(requests)
    if "hf" in args.compare:
        log("transformers: loading and warming up...")
        hf, warm_up = serving.transformers_engine(load_hf_model(source.hf_folder, args.dtype, threads=threads),
                                                  ours.limits, args.static_batch, requests, log)
        engines.append(hf)
        warm_ups[hf.name] = warm_up
    runs = {engine.name: [] for engine in engines}
    for round_ in range(args.repeats):
        for engine in engines:
            run_ = engine.run(requests)
            runs[engine.name].append(run_)
            log_round(log, round_, args.repeats, engine.name, run_)
    return report(args, argv, spec, source.label, requests, engines, warm_ups, runs, threads,
                  backend=model.backend.name)


def log_round(log, round_: int, repeats: int, name: str, run_) -> None:
    from benchmarking import serving

    summary = serving.Summary.of(run_)
    log(f"  round {round_ + 1}/{repeats}, {name}: {summary.output_tokens_per_s:.1f} output tok/s, "
        f"TTFT p50 {1e3 * summary.ttft_s.p50:.0f} ms")


def run_online(args, argv, spec, source, model, requests, ours, workdir: pathlib.Path, threads: int, log) -> dict:
    """The requests as text over HTTP: to each --url server, to each --launch server (started on the same
    weights, one after the other), and with --compare engine to the engine in this process."""
    import dataclasses

    from benchmarking import online
    from benchmarking.serving import ServingRequest

    if set(args.compare) - {"engine"}:
        raise ValueError("online mode compares servers (--launch, --url) and --compare engine; run the other "
                         "comparisons without --launch/--url")
    if model.tokenizer is None:
        raise ValueError(f"online mode sends text: {args.model} has no tokenizer")
    texts = online.text_requests(requests, model.tokenizer, seed=args.seed)
    concurrency = args.max_concurrency or len(texts)
    # What the servers compute: each text prompt tokenized as a completion's prompt is.
    as_ids = [dataclasses.replace(t.request, prompt_ids=tuple(model.tokenizer.encode(t.prompt))) for t in texts]
    engines, warm_ups, runs = [], {}, {}

    def drive(server) -> None:
        log(f"{server.name}: warming up...")
        warm_ups[server.name] = server.warm_up(texts, concurrency)
        engines.append(server)
        runs[server.name] = []
        for round_ in range(args.repeats):
            run_ = server.run(texts, concurrency)
            runs[server.name].append(run_)
            log_round(log, round_, args.repeats, server.name, run_)

    for url in args.url:
        server = online.Server(f"server at {url}", url, args.dialect)
        server.wait_ready(log)
        drive(server)
    for kind in args.launch:
        folder = source.hf_folder if kind == "transformers" or source.named else pathlib.Path(args.model)
        flags = [] if not args.speculative else ["--speculative", args.speculative, "--num-speculative-tokens",
                                                 str(args.num_speculative_tokens)]
        if args.speculative and args.speculative_max_batch:
            flags += ["--speculative-max-batch", str(args.speculative_max_batch)]
        with online.launched(kind, folder, dtype=args.dtype, limits=ours.limits, workdir=workdir, threads=threads,
                             log=log, flags=flags) as server:
            drive(server)
    if "engine" in args.compare:
        log(f"{ours.name}: warming up...")
        warm_ups[ours.name] = ours.warm_up(as_ids)
        engines.append(ours)
        runs[ours.name] = []
        for round_ in range(args.repeats):
            run_ = ours.run(as_ids, max_concurrency=concurrency)
            runs[ours.name].append(run_)
            log_round(log, round_, args.repeats, ours.name, run_)
    prompts = [ServingRequest(request_id=t.request.request_id, prompt_ids=(0,) * t.prompt_len,
                              max_new_tokens=t.request.max_new_tokens, arrival_s=t.request.arrival_s) for t in texts]
    return report(args, argv, spec, source.label, prompts, engines, warm_ups, runs, threads,
                  backend=model.backend.name, concurrency=args.max_concurrency)


def report(args, argv, spec, label: str, requests, engines, warm_ups, runs, threads: int, *, backend: str,
           concurrency: int | None = None) -> dict:
    """The printed report (``text``) and every number, for ``--json``."""
    import dataclasses

    import numpy as np

    from benchmarking import serving

    summaries = {name: [serving.Summary.of(r) for r in rs] for name, rs in runs.items()}
    medians = {name: serving.median_of(s) for name, s in summaries.items()}
    ours = engines[0].name
    over = {name: float(np.median([a.output_tokens_per_s / b.output_tokens_per_s for a, b in zip(summaries[ours], s)]))
            for name, s in summaries.items() if name != ours}  # round by round: runs of the same moments
    agree = {name: serving.token_agreement(runs[ours][0], rs[0]) for name, rs in runs.items() if name != ours}
    machine = describe_machine(backend, threads if "hf" in args.compare or "transformers" in args.launch else None)
    command = shlex.join(["python", "scripts/bench_serving.py", *argv])
    goodput = {name: float(np.median([serving.goodput(r, dict(args.goodput)) for r in rs]))
               for name, rs in runs.items()} if args.goodput else {}
    lines = [machine_line(machine), f"command: {command}",
             workload_line(spec, requests, f"{label} {args.dtype}", concurrency), "", table(medians, over, goodput)]
    for engine in engines:
        warm_up = warm_ups[engine.name]
        lines.append(f"{engine.name}: warm-up {warm_up.seconds:.1f} s ({warm_up.detail})" + describe(medians[engine.name]))
        if engine.note:
            lines.append(f"  note: {engine.note}")
    if agree:
        lines.append(f"greedy tokens agree with {ours}: " + ", ".join(f"{n} {100 * a:.0f}%" for n, a in agree.items()))
    workload = dataclasses.asdict(spec) | {"prompt_lens": [len(r.prompt_ids) for r in requests],
                                           "output_lens": [r.max_new_tokens for r in requests],
                                           "arrivals_s": [r.arrival_s for r in requests]}
    return {"text": "\n".join(lines), "machine": machine, "command": command, "workload": workload,
            "engine_options": {k: repr(v) if k == "speculative" else v for k, v in engine_options(args).items()},
            "warm_up": {n: dataclasses.asdict(w) for n, w in warm_ups.items()},
            "median": {n: m.to_dict() for n, m in medians.items()},
            "rounds": {n: [s.to_dict() for s in ss] for n, ss in summaries.items()},
            "serving_over": over, "agreement": agree, "goodput": goodput, "notes": {e.name: e.note for e in engines if e.note}}


def describe_machine(llm_jax_backend: str, torch_threads: int | None) -> dict:
    """The host, and the versions of what ran on it (torch's with ``torch_threads``, when transformers ran)."""
    import jax

    from benchmarking import machine as machine_lib

    machine = {"cpu": machine_lib.cpu_name(), "threads": machine_lib.cpu_threads(), "jax_version": jax.__version__,
               "jax_backend": jax.default_backend(), "llm_jax_backend": llm_jax_backend}
    if torch_threads is not None:
        import torch
        import transformers

        machine |= {"torch_version": torch.__version__, "torch_threads": torch_threads,
                    "transformers_version": transformers.__version__}
    return machine


def machine_line(m: dict) -> str:
    line = (f"machine: {m['cpu']}, {m['threads']} threads, jax {m['jax_version']} ({m['jax_backend']}, llm_jax on "
            f"the {m['llm_jax_backend']} backend)")
    if "torch_version" in m:
        line += f", torch {m['torch_version']} ({m['torch_threads']} threads), transformers {m['transformers_version']}"
    return line


def workload_line(spec, requests, model: str, concurrency: int | None = None) -> str:
    prompts = [len(r.prompt_ids) for r in requests if r.request_id != "late"]
    lo, hi = spec.output_len
    rate = "all at once" if math.isinf(spec.request_rate) else f"Poisson at {spec.request_rate:g} req/s"
    if concurrency:
        rate += f", at most {concurrency} in flight"
    if spec.late:
        rate += f", and one of {spec.late[0]} prompt tokens arriving at {spec.late[1]:g} s"
    return (f"requests: {spec.num_prompts} on {model}, prompts {min(prompts)}–{max(prompts)} tokens (mean "
            f"{sum(prompts) / len(prompts):.0f}; shared prefix {spec.prefix_len}), outputs "
            f"{lo if lo == hi else f'{lo}–{hi}'} tokens, {rate}, seed {spec.seed}")


def table(medians: dict, over: dict, goodput: dict) -> str:
    """A row per engine (medians over the rounds); ``over[name]``: llm_jax serving's output tokens/s ÷ name's."""
    from benchmarking.results import format_table

    def ms(p) -> str:
        return "–" if p is None else f"{1e3 * p.p50:.1f} / {1e3 * p.p99:.1f}"

    def ms_max(p) -> str:
        return "–" if p is None else f"{ms(p)} / {1e3 * p.max:.0f}"

    header = ("engine", "req/s", "out tok/s", "total tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
              "ITL p50/p99/max ms", "E2E p50/p99 s", "serving ×") + (("goodput req/s",) if goodput else ())
    cells = [(name, f"{s.request_throughput:.2f}", f"{s.output_tokens_per_s:.1f}", f"{s.total_tokens_per_s:.1f}",
              ms(s.ttft_s), ms(s.tpot_s), ms_max(s.itl_s), f"{s.e2e_s.p50:.2f} / {s.e2e_s.p99:.2f}",
              f"{over[name]:.2f}" if name in over else "") + ((f"{goodput[name]:.2f}",) if goodput else ())
             for name, s in medians.items()]
    return format_table(header, cells)


def describe(s) -> str:
    """The engine counters of a summary, in words."""
    c = s.counters
    if c is None:
        return "" if s.compilations is None else f"; {s.compilations} XLA compilations in the timed run"
    return (f"; after it {c.new_programs} step programs compiled, {c.compilations} XLA compilations; {c.steps} steps, "
            f"mean batch {c.mean_batch:.1f} sequences ({c.mean_step_tokens:.1f} tokens); KV blocks in use at most "
            f"{c.peak_blocks} of {c.num_blocks}; prefix-cache hit rate {100 * c.prefix_hit_rate:.1f}%; "
            f"{c.preemptions} preemptions" + (f"; speculation: {100 * c.acceptance_rate:.0f}% of proposals accepted, "
                                               f"{c.mean_accepted_length:.2f} tokens per verification"
                                               if c.mean_accepted_length else ""))


def entry() -> int:
    return run_main(main)


if __name__ == "__main__":
    sys.exit(entry())
