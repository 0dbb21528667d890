"""Running the benchmark matrix: models × dtypes × batch sizes × engines, all taking turns.

Each repeat runs every cell (dtype and batch size of one model) on every engine once, one after the
other: llm_jax on each backend asked for, then transformers or llama.cpp. So every ratio the report
gives (llm_jax over transformers or llama.cpp, one backend over another, bfloat16 over float32, batch B
over batch 1) compares runs of the same moments, and holds on a shared machine whose memory bandwidth
moves from minute to minute. Every dtype's weights are loaded at once for it, in each backend's prepared
form.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import tempfile
from typing import Callable, Sequence

import llm_jax
from llm_jax.backends import Backend, default
from llm_jax.config import ModelConfig
from llm_jax.kv_cache import cache_bytes_per_token
from llm_jax.loading import Model
from llm_jax.model import Params, init_params
from llm_jax.quantization import parse_quantization, quantize_params

from benchmarking import machine as machine_lib
from benchmarking.hf_engine import HfEngine, save_random_hf_model
from benchmarking.llm_jax_engine import LlmJaxEngine, Run, Workload
from benchmarking.results import Difference, Row, Spread, agreement, first_differences, paired_ratio, summarise
from benchmarking.roofline import compute_roofline, decode_roofline, head_peak, product_peak
from benchmarking.shapes import SHAPES, shape_config
from benchmarking.step_profile import StepProfile, profile_decode


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cell:
    model: str  # a named shape or a checkpoint path
    dtype: str
    batch: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    prompt_len: int = 16
    new_tokens: int = 129
    repeats: int = 3
    chunk_steps: int = 16
    compare_hf: bool = False
    compare_llama_cpp: bool = False  # llama.cpp, and llm_jax on llama.cpp's file (benchmarking.llama_cpp)
    # llm_jax's engines: (name, the backend it runs on); the default, "auto"'s choice, named "llm_jax"
    engines: tuple[tuple[str, Backend], ...] = ()
    # what each engine's KV cache holds (None: the compute dtype); an engine per entry, named "[int8 KV]" etc.
    kv_cache_dtypes: tuple[str | None, ...] = (None,)
    threads: int = 0  # torch threads (0: every CPU)
    bandwidth_gbps: float = 0.0
    peaks_gflops: tuple[float | None, ...] = (None, None, None)  # float32, bfloat16, int8 (Machine's)
    probe_each_run: bool = False  # measure the bandwidth around every timed run (roofline_at_run_fraction)
    profile: bool = False  # also trace one decode chunk of each llm_jax engine (step_profile)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """One llm_jax engine against a reference engine of the same cell (llama.cpp)."""

    engine: str
    reference: str
    ratio: Spread  # the engine's decode tokens/s over the reference's, repeat by repeat
    agreement: float  # greedy-token agreement (results.agreement)
    differences: tuple[Difference, ...] = ()  # where its greedy tokens first differ from the reference's


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellResult:
    rows: list[Row]
    hf_ratio: float | None  # llm_jax ÷ transformers decode tokens/s
    agreement: float | None  # greedy-token agreement between the engines
    differences: tuple[Difference, ...] = ()  # where llm_jax's greedy tokens first differ from transformers'
    profiles: tuple[tuple[str, StepProfile], ...] = ()  # (engine, where its decode step's time goes)
    llama_cpp: tuple[Comparison, ...] = ()  # each llm_jax engine against llama.cpp (--compare llama.cpp)


Log = Callable[[str], None]


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def save_llama2_tokenizer(folder: pathlib.Path) -> None:
    """The Llama 2 tokenizer (``../shared`` or ``$LLM_JAX_ASSETS``), in ``folder`` as sentencepiece's model
    and as the ``transformers`` tokenizer files made from it."""
    import os
    import shutil

    import transformers

    shared = pathlib.Path(os.environ.get("LLM_JAX_ASSETS", pathlib.Path(__file__).resolve().parents[2].parent / "shared"))
    model_file = shared / "tokenizers" / "llama2" / "tokenizer.model"
    if not model_file.is_file():
        raise FileNotFoundError(f"{model_file} is missing (set LLM_JAX_ASSETS to the shared/ folder)")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_file, folder / "tokenizer.model")
    # With the BOS id first, as sentencepiece's Llama models (and llm_jax) encode a prompt.
    transformers.AutoTokenizer.from_pretrained(model_file.parent, add_bos_token=True).save_pretrained(folder)


class ModelSource:
    """Params of a model (named shape: random weights; path: a checkpoint) in each dtype, and for
    comparisons a Hugging Face folder holding the very same weights."""

    def __init__(self, model: str, *, need_hf: bool, workdir: pathlib.Path, tokenizer: bool = False):
        """``tokenizer``: the Hugging Face copy of a named shape gets the Llama 2 tokenizer (its vocabulary is
        the shapes'), for what sends text."""
        self.model, self.workdir = model, workdir
        self.named = model in SHAPES
        self.hf_folder: pathlib.Path | None = None
        if need_hf:
            if self.named:
                self.hf_folder = workdir / f"hf-{model}"
                save_random_hf_model(shape_config(model, dtype="float32"), self.hf_folder)
                if tokenizer:
                    self._check_llama2_vocabulary("text")
                    save_llama2_tokenizer(self.hf_folder)
            elif (pathlib.Path(model) / "config.json").is_file():
                self.hf_folder = pathlib.Path(model)
            else:
                raise ValueError(f"--compare hf needs a named shape or a Hugging Face folder, got {model}")

    def _check_llama2_vocabulary(self, needed_by: str) -> None:
        if SHAPES[self.model].vocab_size != 32000:
            raise ValueError(f"{self.model} has a vocabulary of {SHAPES[self.model].vocab_size}, not the Llama 2 "
                             f"tokenizer's 32000: {needed_by} needs 15M, 110M, 1B or a checkpoint")

    @property
    def label(self) -> str:
        return self.model if self.named else pathlib.Path(self.model).name

    @property
    def is_gguf(self) -> bool:
        return not self.named and pathlib.Path(self.model).suffix == ".gguf"

    def gguf_file(self, dtype: str) -> pathlib.Path:
        """The model as a GGUF file of the type of ``dtype``'s weights (``llama_cpp.gguf_type``), written once
        into the work folder from the float weights, with a tokenizer (llama.cpp needs one): the Llama 2
        tokenizer for a named shape, the checkpoint's own otherwise. A GGUF model is its own file."""
        from llm_jax.weights.to_gguf import save_gguf

        from benchmarking.llama_cpp import gguf_type

        if self.is_gguf:
            return pathlib.Path(self.model)
        type_name = gguf_type(dtype)
        path = self.workdir / f"{self.label}-{type_name}.gguf"
        if path.is_file():
            return path
        if self.named:
            self._check_llama2_vocabulary("llama.cpp")
            tokenizer = self.workdir / "llama2-tokenizer"
            if not tokenizer.is_dir():
                save_llama2_tokenizer(tokenizer)
            config = shape_config(self.model, dtype="float32")
            params = init_params(config)  # the draws of load_model's, in float32
        else:  # the checkpoint's folder holds its tokenizer
            tokenizer = self.hf_folder or pathlib.Path(self.model)
            model = llm_jax.load(self.model, dtype="float32", backend="xla")
            config, params = model.config, model.params
        save_gguf(path, config, params, type_name, tokenizer=tokenizer, name=self.label)
        return path

    def load(self, dtype: str, backends: Sequence[Backend]) -> tuple[ModelConfig, list[Params]]:
        """The config in ``dtype`` and the weights each of ``backends`` reads (``Backend.prepare``). The
        canonical params are not kept: only what the prepared forms share with them stays in memory."""
        loaded = self.load_model(dtype)
        return loaded.config, [backend.prepare(loaded.params, loaded.config) for backend in backends]

    def load_model(self, dtype: str, backend: Backend | str = "auto") -> Model:
        """The model in ``dtype``, run by ``backend``: the Hugging Face copy or the checkpoint as
        ``llm_jax.load`` gives it, or a named shape's random weights (no tokenizer, no end-of-sequence id).
        ``dtype`` "bfloat16+int8" is bfloat16 weights quantized to int8 (``--quantize``)."""
        dtype, _, quantize = dtype.partition("+")
        quantize = parse_quantization(quantize) if quantize else None
        if self.hf_folder is not None or not self.named:
            return llm_jax.load(self.hf_folder or self.model, dtype=dtype, backend=backend, quantize=quantize)
        config = shape_config(self.model, dtype=dtype)
        params = init_params(config)
        if quantize is not None:
            config, params = quantize_params(params, config, quantize)
        return Model(config=config, params=params, tokenizer=None, eos_ids=(), path=self.model, backend=backend)


def engines_of(options: Options) -> tuple[tuple[str, Backend], ...]:
    """``options.engines``, or the default backend's one engine."""
    return options.engines or (("llm_jax", default()),)


def kv_engine_name(name: str, kv_cache_dtype: str | None) -> str:
    """The rows' name of engine ``name`` over a KV cache of ``kv_cache_dtype``: "llm_jax[int8 KV]"."""
    return name if kv_cache_dtype is None else f"{name}[{kv_cache_dtype} KV]"


def run_cells(source: ModelSource, cells: Sequence[tuple[Cell, ModelConfig, Sequence[Params]]],
              options: Options, log: Log) -> list[CellResult]:
    """Every cell's engines compiled (each cell with the config of its dtype and the weights of each of
    :func:`engines_of`'s backends, in order), then ``options.repeats`` rounds in which each cell runs each
    of its engines once."""
    plans = []
    for cell, config, weights in cells:
        workload = Workload(batch=cell.batch, prompt_len=options.prompt_len, new_tokens=options.new_tokens,
                            chunk_steps=options.chunk_steps)
        engines = [LlmJaxEngine(w, config, workload, backend=backend, name=kv_engine_name(name, kv), kv_cache_dtype=kv)
                   for (name, backend), w in zip(engines_of(options), weights, strict=True)
                   for kv in options.kv_cache_dtypes]
        if options.compare_hf:
            threads = options.threads or machine_lib.cpu_threads()
            engines.append(HfEngine(source.hf_folder, config, workload, threads=threads))
        if options.compare_llama_cpp:
            engines += llama_cpp_engines(source, cell, config, workload, options)
        plans.append((cell, config, workload, engines))
    compiled, runs, peaks, bandwidths = {}, {}, {}, {}
    for c, (cell, _, _, engines) in enumerate(plans):
        for engine in engines:
            key = (c, engine.name)
            machine_lib.reset_peak_rss()
            done = compiled[key] = engine.compile()
            peaks[key], runs[key], bandwidths[key] = machine_lib.peak_rss_mb(), [], []
            log(f"  {source.label} {cell.dtype} batch {cell.batch}, {engine.name}: compiled in "
                f"{done.prefill_s:.1f}+{done.decode_s:.1f} s")
    for rep in range(options.repeats):
        for c, (cell, _, _, engines) in enumerate(plans):
            for engine in engines:
                key = (c, engine.name)
                probe = functools.partial(machine_lib.measure_run_bandwidth, threads=options.threads or None)
                before = probe() if options.probe_each_run else None
                machine_lib.reset_peak_rss()
                run = engine.run()
                peaks[key] = max(peaks[key], machine_lib.peak_rss_mb())  # before the probe's array
                if options.probe_each_run:  # the better of before and after: the run's roofline is not understated
                    bandwidths[key].append(before.better(probe()))
                runs[key].append(run)
                log(f"  {cell.dtype} batch {cell.batch}, {engine.name} run {rep + 1}/{options.repeats}: ttft "
                    f"{run.ttft_s * 1e3:.1f} ms, decode {run.decode_tokens / run.decode_s:.1f} tok/s")
    profiles: dict[int, list] = {c: [] for c in range(len(plans))}
    if options.profile:
        for c, (cell, _, _, engines) in enumerate(plans):
            for engine in engines:
                if isinstance(engine, LlmJaxEngine):
                    log(f"  {cell.dtype} batch {cell.batch}, {engine.name}: tracing a decode chunk")
                    profiles[c].append((engine.name, profile_decode(engine)))
    results = []
    for c, (cell, config, workload, engines) in enumerate(plans):
        # The bound of what llm_jax's step reads and computes: through the LM head's screen where it decodes so.
        screen = next((e.screen for e in engines if isinstance(e, LlmJaxEngine) and e.screen), None)
        roofline = decode_roofline(config, batch=cell.batch, prompt_len=options.prompt_len,
                                   new_tokens=1 + workload.decode_steps, bandwidth_gbps=options.bandwidth_gbps,
                                   screen=screen)
        measured = all(options.peaks_gflops)
        arithmetic = options.peaks_gflops if measured else (1.0, 1.0, 1.0)  # unmeasured: the flops alone are reported
        compute = compute_roofline(config, batch=cell.batch, prompt_len=options.prompt_len,
                                   new_tokens=1 + workload.decode_steps,
                                   product_gflops=product_peak(cell.dtype, arithmetic), attention_gflops=arithmetic[0],
                                   head_gflops=head_peak(screen, arithmetic), screen=screen)
        def kv_dtype(engine):
            return engine.kv_cache_dtype if isinstance(engine, LlmJaxEngine) else None

        rows = [summarise(engine=e.name, backend=e.backend.name if isinstance(e, LlmJaxEngine) else None,
                          shape=source.label, dtype=cell.dtype, workload=workload, compiled=compiled[c, e.name],
                          runs=runs[c, e.name], compute=compute,
                          roofline=roofline if kv_dtype(e) is None else decode_roofline(
                              config, batch=cell.batch, prompt_len=options.prompt_len,
                              new_tokens=1 + workload.decode_steps, bandwidth_gbps=options.bandwidth_gbps,
                              screen=screen, kv_cache_dtype=kv_dtype(e)),
                          kv_bytes_per_token=cache_bytes_per_token(config, kv_dtype(e)), peak_rss_mb=peaks[c, e.name],
                          run_bandwidths=bandwidths[c, e.name], peaks_measured=measured, head_screen=screen)
                for e in engines]
        if options.compare_llama_cpp:
            *ours, reference = engines
            results.append(CellResult(rows=rows, hf_ratio=None, agreement=None, profiles=tuple(profiles[c]),
                                      llama_cpp=tuple(compare(rows[i], rows[-1], runs[c, e.name][0],
                                                              runs[c, reference.name][0])
                                                      for i, e in enumerate(ours))))
            continue
        if not options.compare_hf:
            results.append(CellResult(rows=rows, hf_ratio=None, agreement=None, profiles=tuple(profiles[c])))
            continue
        ratio = rows[0].decode_tokens_per_s / rows[-1].decode_tokens_per_s
        ours, theirs = runs[c, engines[0].name][0], runs[c, "transformers"][0]
        results.append(CellResult(rows=rows, hf_ratio=ratio, agreement=agreement(ours.tokens, theirs.tokens),
                                  differences=tuple(first_differences(ours.tokens, theirs.tokens, theirs.runner_up,
                                                                       theirs.runner_up_gap)),
                                  profiles=tuple(profiles[c])))
    return results


def llama_cpp_engines(source: ModelSource, cell: Cell, config: ModelConfig, workload: Workload,
                      options: Options) -> list:
    """For ``--compare llama.cpp``: llm_jax (the first of ``engines_of``'s backends) on llama.cpp's file of the
    cell's weights where its matrices are blocks (Q8_0, Q4_0: the very same weights, which llm_jax's own
    quantization only approximates; float files hold ours exactly), then llama.cpp on that file."""
    from llm_jax.weights.from_gguf import open_gguf

    from benchmarking.llama_cpp import LlamaCppEngine, is_block_type

    path = source.gguf_file(cell.dtype)
    type_name = open_gguf(path).tensors["blk.0.ffn_up.weight"].type_name
    engines: list = []
    if is_block_type(type_name) and not source.is_gguf:
        name, backend = engines_of(options)[0]
        model = llm_jax.load(path, dtype=cell.dtype.partition("+")[0], backend=backend)
        engines.append(LlmJaxEngine(backend.prepare(model.params, model.config), model.config, workload,
                                    backend=backend, name=f"{name}[{type_name} file]"))
    engines.append(LlamaCppEngine(path, config, workload, threads=options.threads or machine_lib.cpu_threads(),
                                  type_name=type_name))
    return engines


def compare(row: Row, reference: Row, run: Run, reference_run: Run) -> Comparison:
    """``row`` 's engine against ``reference`` 's: decode rate ratio repeat by repeat, greedy agreement of
    their first runs."""
    return Comparison(engine=row.engine, reference=reference.engine, ratio=paired_ratio(row, reference),
                      agreement=agreement(run.tokens, reference_run.tokens),
                      differences=tuple(first_differences(run.tokens, reference_run.tokens, reference_run.runner_up,
                                                          reference_run.runner_up_gap)))


def run_matrix(models: Sequence[str], dtypes: Sequence[str], batches: Sequence[int], options: Options,
               log: Log = log_stderr) -> list[CellResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="llm_jax_bench_") as tmp:
        for model in models:
            log(f"{model}: preparing weights" + (" (and the transformers copy)" if options.compare_hf else ""))
            source = ModelSource(model, need_hf=options.compare_hf, workdir=pathlib.Path(tmp))
            backends = [backend for _, backend in engines_of(options)]
            loaded = {dtype: source.load(dtype, backends) for dtype in dtypes}
            log(f"{source.label} {' and '.join(dtypes)}, batch {', '.join(map(str, batches))}, taking turns:")
            cells = [(Cell(model=model, dtype=dtype, batch=batch), *loaded[dtype]) for dtype in dtypes
                     for batch in batches]
            results.extend(run_cells(source, cells, options, log))
            del cells, loaded
    return results
