"""``scripts/bench_serving.py``'s workload and engines: a stream of requests of random lengths, served.

The workload is that of ``vllm bench serve --dataset random``: prompt and output lengths drawn from a
seeded distribution, random token ids, an optional prefix shared by every prompt, and arrivals all at
once or as a Poisson process. Three engines serve it, each timed from its first arrival to its last
token, after a warm-up reported apart:

- llm_jax's serving engine (``llm_jax.serving.Engine``): requests added as they arrive, one ``step()`` at
  a time; each step's outputs stamped on the host as the step returns;
- ``llm_jax.generate`` in static batches, every request there from the start, batch after batch;
- ``transformers``' continuous batching (its ``ContinuousBatchingManager``, what ``generate_batch``
  runs), fed in the same arrival order, stamping each token itself; where it cannot run, its
  ``generate`` in static batches.

Every engine decodes greedily and ignores end-of-sequence ids, so each request gets exactly the tokens
it asked for.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

import llm_jax
from llm_jax import buckets
from llm_jax.compile_stats import measure_compilation
from llm_jax.config import ModelConfig
from llm_jax.loading import Model
from llm_jax.lora import LoraAdapter
from llm_jax.serving import Engine
from llm_jax.serving import step as step_module

from benchmarking.results import agreement


LATE_OUTPUT = 16  # tokens the late request generates (fewer if every request generates fewer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    num_prompts: int
    input_len: tuple[int, int]  # prompt tokens after the shared prefix, drawn uniformly in [lo, hi]
    output_len: tuple[int, int]  # tokens to generate, drawn uniformly in [lo, hi]
    prefix_len: int = 0  # the same random tokens before every prompt
    request_rate: float = math.inf  # requests per second, Poisson; inf: all at once
    seed: int = 0
    late: tuple[int, float] | None = None  # one more request: (prompt tokens, arrival s), LATE_OUTPUT tokens out
    repeat_period: int = 0  # each prompt's own random tokens repeat with this period (0: no repetition)

    @property
    def longest(self) -> int:
        """The most tokens a request can reach: prefix, prompt and output."""
        late = self.late[0] + min(LATE_OUTPUT, self.output_len[0]) if self.late else 0
        return max(self.prefix_len + self.input_len[1] + self.output_len[1], late)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float  # after the first request's


def sample_requests(spec: WorkloadSpec, vocab_size: int) -> list[ServingRequest]:
    """``spec``'s requests in arrival order; the same seed gives the same requests for any rate (the
    arrival gaps are drawn last)."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    prefix = rng.integers(0, vocab_size, spec.prefix_len).tolist()
    input_lens = rng.integers(spec.input_len[0], spec.input_len[1] + 1, n)
    output_lens = rng.integers(spec.output_len[0], spec.output_len[1] + 1, n)
    period = spec.repeat_period

    def own(length: int) -> list[int]:  # a passage repeated: what prompt lookup predicts
        tokens = rng.integers(0, vocab_size, min(period, length) if period else length)
        return np.resize(tokens, length).tolist()

    prompts = [prefix + own(length) for length in input_lens]
    if math.isinf(spec.request_rate):
        arrivals = np.zeros(n)
    else:  # the first at once, then exponential gaps (vllm's: send, then wait)
        arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / spec.request_rate, n - 1))])
    requests = [ServingRequest(request_id=f"r{i}", prompt_ids=tuple(p), max_new_tokens=int(m), arrival_s=float(a))
                for i, (p, m, a) in enumerate(zip(prompts, output_lens, arrivals))]
    if spec.late is not None:
        length, at = spec.late
        requests.append(ServingRequest(request_id="late", prompt_ids=tuple(rng.integers(0, vocab_size, length).tolist()),
                                       max_new_tokens=min(LATE_OUTPUT, spec.output_len[0]), arrival_s=at))
        requests.sort(key=lambda r: r.arrival_s)
    return requests


# Measurements.
@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestTrace:
    """What the host saw of one request: when it arrived and when its tokens came, in seconds from the
    run's start. ``deliveries``: (time, tokens delivered then). Over HTTP the tokens are not seen, only
    ``text``; ``token_ids`` is then empty."""

    request_id: str
    arrival_s: float
    prompt_len: int
    token_ids: tuple[int, ...]
    deliveries: tuple[tuple[float, int], ...]
    text: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.deliveries)

    @property
    def ttft_s(self) -> float:
        return self.deliveries[0][0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.deliveries[-1][0] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vllm's): None for a single token."""
        n = self.num_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    def itl_s(self) -> list[float]:
        """Inter-token latencies: each gap between deliveries, split evenly over the tokens it delivered
        (one sample per token but the first)."""
        out = []
        for (t0, _), (t1, n) in zip(self.deliveries, self.deliveries[1:]):
            out.extend([(t1 - t0) / n] * n)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineCounters:
    """What the serving engine says about a run."""

    steps: int  # device steps
    mean_batch: float  # sequences per step
    mean_step_tokens: float  # tokens computed per step (prefill chunks and decode tokens)
    peak_blocks: int  # KV blocks held by requests, at most (sampled between steps)
    num_blocks: int  # the pool's capacity
    prefix_hit_rate: float  # prompt tokens found in the prefix cache ÷ prompt tokens looked up
    preemptions: int
    new_programs: int  # step programs compiled during the run (after warm-up)
    compilations: int  # XLA compilations of any kind during the run
    # Speculative decoding: accepted ÷ proposed, and tokens per verification step (0 without).
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingRun:
    engine: str
    duration_s: float  # first arrival → last token
    traces: tuple[RequestTrace, ...]
    counters: EngineCounters | None = None
    compilations: int | None = None  # XLA compilations during the run (llm_jax's engines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Percentiles:
    mean: float
    p50: float
    p99: float
    max: float  # a rare stall (one long prefill step) hides below p99

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        if not len(values):
            return None
        v = np.asarray(values, np.float64)
        return cls(mean=float(v.mean()), p50=float(np.percentile(v, 50)), p99=float(np.percentile(v, 99)),
                   max=float(v.max()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    """One run's numbers (latencies in seconds; percentiles over requests, ITL over tokens)."""

    engine: str
    num_requests: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # requests/s
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt and output tokens
    ttft_s: Percentiles
    tpot_s: Percentiles | None
    itl_s: Percentiles | None
    e2e_s: Percentiles
    counters: EngineCounters | None = None
    compilations: int | None = None

    @classmethod
    def of(cls, run: ServingRun) -> Summary:
        traces, d = run.traces, run.duration_s
        prompt = sum(t.prompt_len for t in traces)
        output = sum(t.num_tokens for t in traces)
        return cls(engine=run.engine, num_requests=len(traces), duration_s=d, prompt_tokens=prompt,
                   output_tokens=output, request_throughput=len(traces) / d, output_tokens_per_s=output / d,
                   total_tokens_per_s=(prompt + output) / d, ttft_s=Percentiles.of([t.ttft_s for t in traces]),
                   tpot_s=Percentiles.of([t.tpot_s for t in traces if t.tpot_s is not None]),
                   itl_s=Percentiles.of([x for t in traces for x in t.itl_s()]),
                   e2e_s=Percentiles.of([t.e2e_s for t in traces]), counters=run.counters,
                   compilations=run.compilations)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def goodput(run: ServingRun, targets_ms: dict[str, float]) -> float:
    """Requests per second that met every latency target (``ttft``, ``tpot``, ``e2e``, in ms), as vLLM's
    benchmark counts goodput."""
    def meets(t: RequestTrace) -> bool:
        values = {"ttft": t.ttft_s, "tpot": t.tpot_s or 0.0, "e2e": t.e2e_s}
        return all(1e3 * values[name] <= ms for name, ms in targets_ms.items())

    return sum(meets(t) for t in run.traces) / run.duration_s


def median_of(values: Sequence):
    """The median of several runs' summaries field by field (of dataclasses, recursively; numbers as
    floats), or of numbers; the first for anything else (names)."""
    first = values[0]
    if dataclasses.is_dataclass(first):
        return type(first)(**{f.name: median_of([getattr(v, f.name) for v in values])
                              for f in dataclasses.fields(first)})
    if isinstance(first, (int, float)) and not isinstance(first, bool) and None not in values:
        median = float(np.median(values))
        return int(median) if isinstance(first, int) and median.is_integer() else median
    return first


def token_agreement(ours: ServingRun, theirs: ServingRun) -> float:
    """How far two runs' greedy tokens agree, request by request up to the first difference (1.0: the
    same tokens everywhere), averaged over requests."""
    by_id = {t.request_id: t for t in theirs.traces}
    return float(np.mean([_agreement(t, by_id[t.request_id]) for t in ours.traces]))


def _agreement(a: RequestTrace, b: RequestTrace) -> float:
    if a.token_ids and b.token_ids:
        return agreement(np.array([a.token_ids]), np.array([b.token_ids]))
    x, y = a.text or "", b.text or ""  # over HTTP: the common prefix of the texts, in characters
    n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return 1.0 if x == y else n / max(len(x), len(y))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmUp:
    seconds: float
    detail: str  # what was warmed up, in words


def _traces(requests: Sequence[ServingRequest], tokens: dict, deliveries: dict,
            sent: dict | None = None, texts: dict | None = None) -> tuple[RequestTrace, ...]:
    """``sent``: when each request was sent, where a limit on requests in flight held it after its arrival
    (latencies count from then, as a client's would)."""
    missing = [r.request_id for r in requests if len(tokens[r.request_id]) != r.max_new_tokens]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} did not get the tokens they asked for")
    sent, texts = sent or {}, texts or {}
    return tuple(RequestTrace(request_id=r.request_id, arrival_s=sent.get(r.request_id, r.arrival_s),
                              prompt_len=len(r.prompt_ids),
                              token_ids=tuple(tokens[r.request_id]), deliveries=tuple(deliveries[r.request_id]),
                              text=texts.get(r.request_id))
                 for r in requests)


def random_adapters(config: ModelConfig, count: int, rank: int, *, seed: int = 0) -> list[LoraAdapter]:
    """``count`` LoRA adapters of every projection at ``rank``, random (small updates: the text stays
    the model's kind), named lora0, lora1, ..."""
    from llm_jax.lora import TARGETS, target_dims

    rng, L = np.random.default_rng(seed), config.n_layers
    adapters = []
    for i in range(count):
        weights = {}
        for target in TARGETS:
            In, Out = target_dims(config, target)
            weights[target] = (rng.normal(0, In ** -0.5, (L, In, rank)).astype(np.float32),
                               rng.normal(0, 0.01 * rank ** -0.5, (L, rank, Out)).astype(np.float32))
        adapters.append(LoraAdapter(name=f"lora{i}", weights=weights))
    return adapters


# llm_jax's serving engine.
@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """The serving engine's limits (what transformers' continuous batching is given as its own)."""

    block_size: int
    num_blocks: int  # usable blocks (the engine's reserved null block left out)
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_caching: bool


class LlmJaxServing:
    """``llm_jax.serving.Engine`` on ``model`` with ``engine_options`` (Engine's keywords); a fresh engine
    for each run, so no run finds the previous one's prefixes cached."""

    note = ""

    def __init__(self, model: Model, engine_options: dict, *, name: str = "llm_jax", variant: str = ""):
        self.model, self.engine_options = model, engine_options
        self.name = f"{name} serving" + (f" ({variant})" if variant else "")
        self.engine: Engine | None = Engine(model, **engine_options)  # the next run's, once warmed up
        e = self.engine
        self.limits = EngineLimits(block_size=e.block_size, num_blocks=e.scheduler.pool.capacity,
                                   max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
                                   prefix_caching=e.scheduler.pool.enable_prefix_caching)

    def warm_up(self, requests: Sequence[ServingRequest]) -> WarmUp:
        t0 = time.perf_counter()
        with measure_compilation() as compiled:
            programs = self.engine.warm_up()
        return WarmUp(seconds=time.perf_counter() - t0,
                      detail=f"{programs} step programs, {compiled.compilations} XLA compilations")

    def run(self, requests: Sequence[ServingRequest], *, max_concurrency: int | None = None) -> ServingRun:
        engine = self.engine or Engine(self.model, **self.engine_options)
        self.engine = None
        programs = step_module.step._cache_size()
        with measure_compilation() as compiled:
            tokens, deliveries, duration, counted, sent, texts = _serve(engine, requests, max_concurrency)
        counters = EngineCounters(**counted, new_programs=step_module.step._cache_size() - programs,
                                  compilations=compiled.compilations)
        return ServingRun(engine=self.name, duration_s=duration, traces=_traces(requests, tokens, deliveries, sent, texts),
                          counters=counters, compilations=compiled.compilations)


def _serve(engine: Engine, requests: Sequence[ServingRequest],
           max_concurrency: int | None = None) -> tuple[dict, dict, float, dict, dict, dict]:
    """Adds each request once its arrival time has passed (and fewer than ``max_concurrency`` are in
    flight, as a client with that many connections would) and steps until every one has finished. Returns
    each request's tokens and deliveries, the time of the last, the engine's counters (but the
    compilations), when each request was added and its text. Which sequences a step ran is read from the requests' progress (``num_computed_tokens``)
    around it; the blocks in use are sampled between steps (a request that finishes in a step is not
    counted in it)."""
    scheduler = engine.scheduler
    adapters = engine.lora_names  # the requests take turns among them
    tokens = {r.request_id: [] for r in requests}
    deliveries = {r.request_id: [] for r in requests}
    steps = seqs = computed = peak = 0
    start, i, t = time.perf_counter(), 0, 0.0
    limit, in_flight, sent, texts = max_concurrency or len(requests), 0, {}, {}
    while i < len(requests) or engine.has_unfinished:
        now = time.perf_counter() - start
        while i < len(requests) and requests[i].arrival_s <= now and in_flight < limit:
            r = requests[i]
            engine.add_request(r.request_id, list(r.prompt_ids), max_new_tokens=r.max_new_tokens, ignore_eos=True,
                               lora=adapters[i % len(adapters)] if adapters else None)
            i, in_flight, sent[r.request_id] = i + 1, in_flight + 1, max(now, r.arrival_s)
        if not engine.has_unfinished:
            time.sleep(requests[i].arrival_s - now)
            continue
        before = [(r, r.num_computed_tokens) for r in (*scheduler.running, *scheduler.waiting)]
        hits = scheduler.pool.hit_tokens
        outputs = engine.step()
        t = time.perf_counter() - start
        for out in outputs:
            tokens[out.request_id].extend(out.token_ids)
            deliveries[out.request_id].append((t, len(out.token_ids)))
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            in_flight -= out.finish_reason is not None
        advanced = [r.num_computed_tokens - n for r, n in before if r.num_computed_tokens > n]
        if advanced:
            steps, seqs = steps + 1, seqs + len(advanced)
            computed += sum(advanced) - (scheduler.pool.hit_tokens - hits)  # prefix hits were not computed
        peak = max(peak, scheduler.pool.num_used)
    stats = engine.stats()
    counted = {"steps": steps, "mean_batch": seqs / max(steps, 1), "mean_step_tokens": computed / max(steps, 1),
               "peak_blocks": peak, "num_blocks": scheduler.pool.capacity, "prefix_hit_rate": stats.prefix_hit_rate,
               "preemptions": stats.num_preemptions, "acceptance_rate": stats.acceptance_rate,
               "mean_accepted_length": stats.mean_accepted_length}
    return tokens, deliveries, t, counted, sent, texts


# llm_jax.generate in static batches.
class StaticGenerate:
    """``llm_jax.generate`` over batches of ``batch`` requests in arrival order, one after another, every
    request there from the start (as an offline job would run them)."""

    note = ""

    def __init__(self, model: Model, batch: int, *, name: str = "llm_jax"):
        self.model, self.batch = model, batch
        self.name = f"{name} generate (static batches of {batch})"

    def _batches(self, requests: Sequence[ServingRequest]) -> list[Sequence[ServingRequest]]:
        return [requests[i:i + self.batch] for i in range(0, len(requests), self.batch)]

    def _program(self, batch: Sequence[ServingRequest]) -> tuple[int, int, int]:
        """What ``generate`` compiles a batch for: its size, prompt bucket and cache bucket."""
        longest, context = max(len(r.prompt_ids) for r in batch), self.model.config.max_seq_len
        return (len(batch), buckets.prompt_bucket(longest, context=context),
                buckets.cache_bucket(longest, max(r.max_new_tokens for r in batch), context=context))

    def warm_up(self, requests: Sequence[ServingRequest]) -> WarmUp:
        """Runs the first batch of each distinct program once."""
        t0, seen = time.perf_counter(), set()
        with measure_compilation() as compiled:
            for batch in self._batches(requests):
                if (program := self._program(batch)) not in seen:
                    seen.add(program)
                    self._generate(batch, t0, {r.request_id: [] for r in batch}, {r.request_id: [] for r in batch})
        return WarmUp(seconds=time.perf_counter() - t0,
                      detail=f"{len(seen)} batch shape{'s' * (len(seen) > 1)}, "
                                                                f"{compiled.compilations} XLA compilations")

    def run(self, requests: Sequence[ServingRequest]) -> ServingRun:
        requests = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
        tokens = {r.request_id: [] for r in requests}
        deliveries = {r.request_id: [] for r in requests}
        with measure_compilation() as compiled:
            start = time.perf_counter()
            for batch in self._batches(requests):
                self._generate(batch, start, tokens, deliveries)
        return ServingRun(engine=self.name, duration_s=max(d[-1][0] for d in deliveries.values()),
                          traces=_traces(requests, tokens, deliveries), compilations=compiled.compilations)

    def _generate(self, batch: Sequence[ServingRequest], start: float, tokens: dict, deliveries: dict) -> None:
        stream = llm_jax.generate_stream(self.model, [list(r.prompt_ids) for r in batch],
                                         max_new_tokens=[r.max_new_tokens for r in batch], ignore_eos=True)
        for event in stream:
            t = time.perf_counter() - start
            if event.token_ids:
                request_id = batch[event.index].request_id
                tokens[request_id].extend(event.token_ids)
                deliveries[request_id].append((t, len(event.token_ids)))


# transformers.
class HfContinuous:
    """``transformers``' continuous batching (``model.init_continuous_batching``, the manager
    ``generate_batch`` runs): requests added in their arrival order as their times pass, each token
    stamped by transformers as it is produced. A fresh manager for each run."""

    name = "transformers continuous batching"
    note = ""

    def __init__(self, hf_model, limits: EngineLimits):
        self.model, self.limits = hf_model, limits

    def _manager(self):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        limits = self.limits
        generation = GenerationConfig(do_sample=False, eos_token_id=-1)
        batching = ContinuousBatchingConfig(page_size=limits.block_size, num_blocks=limits.num_blocks,
                                            max_batch_tokens=limits.max_num_batched_tokens,
                                            max_requests_per_batch=limits.max_num_seqs,
                                            allow_block_sharing=limits.prefix_caching)
        manager = self.model.init_continuous_batching(generation_config=generation,
                                                      continuous_batching_config=batching)
        manager.warmup()
        manager.start()
        return manager

    def warm_up(self, requests: Sequence[ServingRequest]) -> WarmUp:
        """Serves the first ``max_num_seqs`` requests, four tokens each (torch's first calls are slow)."""
        t0 = time.perf_counter()
        first = [dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, 4), arrival_s=0.0)
                 for r in requests[:self.limits.max_num_seqs]]
        self.run(first)
        return WarmUp(seconds=time.perf_counter() - t0, detail=f"{len(first)} short requests")

    def run(self, requests: Sequence[ServingRequest]) -> ServingRun:
        manager = self._manager()
        try:
            start, done = self._feed(manager, requests)
        finally:
            manager.stop(block=True, timeout=5)
            manager.destroy()
        tokens = {rid: list(out.generated_tokens) for rid, out in done.items()}
        deliveries = {rid: [(t - start, 1) for t in out.timestamps[:len(out.generated_tokens)]]
                      for rid, out in done.items()}
        return ServingRun(engine=self.name, duration_s=max(d[-1][0] for d in deliveries.values()),
                          traces=_traces(requests, tokens, deliveries))

    @staticmethod
    def _feed(manager, requests: Sequence[ServingRequest]) -> tuple[float, dict]:
        done, i = {}, 0
        start = time.perf_counter()
        while len(done) < len(requests):
            now = time.perf_counter() - start
            while i < len(requests) and requests[i].arrival_s <= now:
                r = requests[i]
                manager.add_request(list(r.prompt_ids), request_id=r.request_id, max_new_tokens=r.max_new_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                i += 1
            wait = requests[i].arrival_s - now if i < len(requests) else 1.0
            out = manager.get_result(timeout=max(wait, 1e-3))
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before every request finished")
                continue
            if out.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed request {out.request_id}: {out.error}")
            if out.is_finished():
                done[out.request_id] = out
        return start, done


class HfStatic:
    """``transformers``' ``model.generate`` over static batches of ``batch`` requests (left-padded, greedy,
    each row running to the batch's longest output), every request there from the start. Without a
    stream, every token of a batch is stamped when the batch ends."""

    def __init__(self, hf_model, batch: int, *, note: str = ""):
        self.model, self.batch, self.note = hf_model, batch, note
        self.name = f"transformers generate (static batches of {batch})"

    def warm_up(self, requests: Sequence[ServingRequest]) -> WarmUp:
        t0 = time.perf_counter()
        self._generate([dataclasses.replace(r, max_new_tokens=2) for r in requests[:self.batch]])
        return WarmUp(seconds=time.perf_counter() - t0, detail="one batch of two tokens")

    def run(self, requests: Sequence[ServingRequest]) -> ServingRun:
        requests = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
        tokens, deliveries = {}, {}
        start = time.perf_counter()
        for i in range(0, len(requests), self.batch):
            batch = requests[i:i + self.batch]
            outputs = self._generate(batch)
            t = time.perf_counter() - start
            for r, ids in zip(batch, outputs):
                tokens[r.request_id], deliveries[r.request_id] = ids, [(t, len(ids))]
        return ServingRun(engine=self.name, duration_s=time.perf_counter() - start,
                          traces=_traces(requests, tokens, deliveries))

    def _generate(self, batch: Sequence[ServingRequest]) -> list[list[int]]:
        import torch

        T, new = max(len(r.prompt_ids) for r in batch), max(r.max_new_tokens for r in batch)
        ids_BT = torch.zeros((len(batch), T), dtype=torch.long)
        mask_BT = torch.zeros((len(batch), T), dtype=torch.long)
        for b, r in enumerate(batch):
            ids_BT[b, T - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask_BT[b, T - len(r.prompt_ids):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids_BT, attention_mask=mask_BT, max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0)
        return [out[b, T:T + r.max_new_tokens].tolist() for b, r in enumerate(batch)]


def transformers_engine(hf_model, limits: EngineLimits, static_batch: int, requests: Sequence[ServingRequest],
                        log: Callable[[str], None]):
    """transformers' continuous batching, warmed up; where it cannot run, its ``generate`` in static
    batches, saying why in its ``note``. Returns (the engine, its warm-up)."""
    from llm_jax.cli.common import one_line

    engine = HfContinuous(hf_model, limits)
    try:
        return engine, engine.warm_up(requests)
    except Exception as error:  # noqa: BLE001 — whatever fails in the library means: not here
        note = (f"transformers' continuous batching cannot run here ({type(error).__name__}: {one_line(error)}); "
                f"model.generate in static batches of {static_batch} instead")
        log(note)
        engine = HfStatic(hf_model, static_batch, note=note)
        return engine, engine.warm_up(requests)
