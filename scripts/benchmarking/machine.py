"""What the machine can do, measured: memory bandwidth, arithmetic peak, and the process's peak memory.

Decode at small batch reads every weight once per step, so its speed limit is memory bandwidth. We
measure the bandwidth a streaming read reaches with one thread per core, which is what a well-written
matrix-vector product can hope for: compiled code (``cpu_kernels/stream_read.cc``) where the kernels
build, and NumPy's reductions (which release the GIL), keeping the fastest. Decode at large batch does
many multiply-adds per weight read and is bound by arithmetic instead: its peak is measured by chains
of the instructions the kernels use (``cpu_kernels/peak_flops.cc``), one thread per core.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import platform
import time
from typing import Sequence

import jax
import numpy as np

from cpu_kernels import build

BANDWIDTH_BYTES = 1 << 30  # far larger than any cache
# The probe beside each run: several times a large last-level cache, so that it reads memory, yet read in
# tens of milliseconds, so that a window of reads samples memory's speed many times.
RUN_PROBE_BYTES = 1 << 28
RUN_PROBE_S = 0.5  # each window of reads beside a run: about as long as a short run
PEAK_PROBE_S = 0.05  # each thread's run of the arithmetic probe


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    bandwidth_gbps: float  # best streaming-read bandwidth, 10^9 bytes/s
    # Arithmetic peaks, 10^9 flops/s (None where the kernels cannot be built): float32 multiply-adds, what
    # bfloat16 weights' products can reach (AVX-512's bfloat16 dot products, else the float32 peak), and
    # the int8 products of the LM head's screen in quads (AVX-512 VNNI, else the bfloat16 peak).
    peak_gflops: float | None
    peak_gflops_bf16: float | None
    peak_gops_int8: float | None
    threads: int
    cpu: str
    jax_version: str
    backend: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cpu_threads() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_bandwidth(*, threads: int | None = None, nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Streaming-read bandwidth in GB/s: ``threads`` threads each read their share of one large array.

    The best over the readers (the compiled stream read when available, NumPy's sum and max) and
    ``repeats`` runs of each: a reader that computes too slowly would understate the bandwidth and
    flatter every roofline fraction measured against it.
    """
    threads = threads or cpu_threads()
    data = np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _, seconds in _timed_reads(data, threads, rounds=repeats):
        best = min(best, seconds)
    return data.nbytes / best / 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunBandwidth:
    """What memory gave a streaming read beside a timed run, in GB/s."""

    sustained_gbps: float  # bytes read over the window ÷ its time (the best reader's)
    burst_gbps: float  # the fastest single read in the window

    def better(self, other: "RunBandwidth") -> "RunBandwidth":
        return RunBandwidth(sustained_gbps=max(self.sustained_gbps, other.sustained_gbps),
                            burst_gbps=max(self.burst_gbps, other.burst_gbps))


def measure_run_bandwidth(*, threads: int | None = None, seconds: float = RUN_PROBE_S) -> RunBandwidth:
    """The bandwidth right now: reads of :data:`RUN_PROBE_BYTES` for ``seconds``, the readers taking
    turns. Measured just before and just after each timed run, it says what memory could give that run
    on a machine shared with others. Its sustained rate is the bound of a run, which streams for as long;
    the best single read (the burst) can state what no run of a second sustains, where memory's speed
    swings within tens of milliseconds. Its array is freed on return, before a run's peak memory is
    counted."""
    threads = threads or cpu_threads()
    data = np.ones(RUN_PROBE_BYTES // 4, np.float32)
    return run_bandwidth_of(list(_timed_reads(data, threads, seconds=seconds)), data.nbytes)


def run_bandwidth_of(reads: Sequence[tuple[int, float]], nbytes: int) -> RunBandwidth:
    """:class:`RunBandwidth` of ``reads`` (reader index, seconds) of ``nbytes`` each: the sustained rate is
    the best reader's bytes ÷ its time in all, the burst the fastest single read's."""
    spent: dict[int, float] = {}
    counts: dict[int, int] = {}
    for reader, seconds in reads:
        spent[reader] = spent.get(reader, 0.0) + seconds
        counts[reader] = counts.get(reader, 0) + 1
    sustained = max(counts[r] * nbytes / spent[r] for r in spent)
    return RunBandwidth(sustained_gbps=sustained / 1e9, burst_gbps=nbytes / min(t for _, t in reads) / 1e9)


def _timed_reads(data: np.ndarray, threads: int, *, rounds: int = 1, seconds: float = 0.0):
    """Yields (reader index, seconds) for reads of the whole of ``data`` by ``threads`` threads, each
    reading its share: ``rounds`` rounds of every reader taking turns (so that no reader has only the
    machine's slow moments), and more rounds until ``seconds`` have passed. The pages are touched first."""
    parts = np.array_split(data, threads)
    candidates = readers()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        start = time.perf_counter()
        done = 0
        while done < rounds or time.perf_counter() - start < seconds:
            for i, read in enumerate(candidates):
                began = time.perf_counter()
                list(pool.map(read, parts))
                yield i, time.perf_counter() - began
            done += 1


def measure_peak_gflops(*, threads: int | None = None, dtype: str = "float32", repeats: int = 3) -> float | None:
    """Arithmetic peak in GFLOP/s: ``threads`` threads each run independent chains of float32
    multiply-adds (``dtype="bfloat16"``: of bfloat16 dot products; ``"int8"``: of VNNI's int8 ones) for
    :data:`PEAK_PROBE_S`; the best of ``repeats``. None where the kernels cannot be built, or for bfloat16
    and int8 where the CPU lacks the dot products (its bfloat16 weights are then multiplied in float32)."""
    probe = build.arithmetic_probe(dtype)
    if probe is None:
        return None
    threads = threads or cpu_threads()
    trial = 1 << 16
    start = time.perf_counter()
    if probe(trial) == 0:
        return None
    iterations = max(trial, int(trial * PEAK_PROBE_S / max(time.perf_counter() - start, 1e-9)))
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            flops = sum(pool.map(probe, [iterations] * threads))
            best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best


def measure_peaks(*, threads: int | None = None) -> tuple[float | None, float | None, float | None]:
    """(float32, bfloat16, int8) arithmetic peaks as :class:`Machine` reports them."""
    float32 = measure_peak_gflops(threads=threads)
    bfloat16 = measure_peak_gflops(threads=threads, dtype="bfloat16") or float32
    return float32, bfloat16, measure_peak_gflops(threads=threads, dtype="int8") or bfloat16


def readers() -> list:
    """Functions that read a whole float32 array once: the compiled stream read first, where it builds."""
    return [read for read in (build.stream_read(), np.sum, np.max) if read is not None]


def describe(bandwidth_gbps: float, peaks: tuple[float | None, ...] = (None, None, None)) -> Machine:
    return Machine(bandwidth_gbps=bandwidth_gbps, peak_gflops=peaks[0], peak_gflops_bf16=peaks[1], peak_gops_int8=peaks[2],
                   threads=cpu_threads(), cpu=cpu_name(), jax_version=jax.__version__, backend=jax.default_backend())


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter of this process (Linux ``clear_refs``); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident memory of this process since the last :func:`reset_peak_rss`, in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # peak since process start, in KiB on Linux

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
