"""What the machine can do, measured: memory bandwidth, and the process's peak memory.

Decode at small batch reads every weight once per step, so its speed limit is memory bandwidth. We
measure the bandwidth a streaming read reaches with one thread per core, which is what a well-written
matrix-vector product can hope for: compiled code (``cpu_kernels/stream_read.cc``) where the kernels
build, and NumPy's reductions (which release the GIL), keeping the fastest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import platform
import time

import jax
import numpy as np

from cpu_kernels import build

BANDWIDTH_BYTES = 1 << 30  # far larger than any cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    bandwidth_gbps: float  # best streaming-read bandwidth, 10^9 bytes/s
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
    flatter every roofline fraction measured against it (NumPy alone read up to 30 % slower than the
    compiled read on the development machine).
    """
    threads = threads or cpu_threads()
    data = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    candidates = readers()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # touches the pages once
        for _ in range(repeats):
            for read in candidates:  # taking turns, so that no reader has only the machine's slow moments
                start = time.perf_counter()
                list(pool.map(read, parts))
                best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


def readers() -> list:
    """Functions that read a whole float32 array once: the compiled stream read first, where it builds."""
    return [read for read in (build.stream_read(), np.sum, np.max) if read is not None]


def describe(bandwidth_gbps: float) -> Machine:
    return Machine(bandwidth_gbps=bandwidth_gbps, threads=cpu_threads(), cpu=cpu_name(),
                   jax_version=jax.__version__, backend=jax.default_backend())


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
