"""Measuring compilation: how many XLA compilations a block of code triggered, and how long they took.

Built on ``jax.monitoring`` events, so it sees every compilation (jit, AOT, the persistent cache's
misses) without wrapping functions.

Each tracing, lowering or compiling phase is taken as a span of ``time.perf_counter`` time: it starts
when JAX announces the phase (a scalar event carrying its start) and ends when JAX reports its
duration. The spans are merged before they are added up, and cut at the start of the block, so a
block's ``seconds`` never exceeds its wall time: a compilation nested in another phase (an eager
operation run while a function is traced) counts once, and a step of the wall clock, which JAX's own
durations are measured on (``time.time``), changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import jax

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"
_PHASES = (_TRACE, _LOWER, _BACKEND)

_lock = threading.Lock()
_active: list["CompileStats"] = []
_registered = False
_open = threading.local()  # per thread: {phase: [perf_counter start of each open phase, innermost last]}


@dataclasses.dataclass
class CompileStats:
    """Filled while its ``measure_compilation`` block runs."""

    compilations: int = 0  # backend compilations (one per new executable)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    spans: list[tuple[float, float]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def seconds(self) -> float:
        """Time spent tracing, lowering and compiling: the union of those phases' spans, in seconds."""
        total, reach = 0.0, self.started
        for start, end in sorted(self.spans):
            start = max(start, reach)
            if end > start:
                total, reach = total + end - start, end
        return total


def _starts() -> dict[str, list[float]]:
    if not hasattr(_open, "starts"):
        _open.starts = {phase: [] for phase in _PHASES}
    return _open.starts


def _on_start(event: str, _value: float, **_) -> None:
    if event in _PHASES:
        _starts()[event].append(time.perf_counter())


def _on_duration(event: str, duration: float, **_) -> None:
    if event not in _PHASES:
        return
    end, opened = time.perf_counter(), _starts()[event]
    start = opened.pop() if opened else end - duration  # a JAX that does not announce the phase
    with _lock:
        for stats in _active:
            stats.spans.append((start, end))
            if event == _BACKEND:
                stats.compilations += 1


@contextlib.contextmanager
def measure_compilation():
    """``with measure_compilation() as stats: ...`` — then ``stats.seconds`` and ``stats.compilations``."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_scalar_listener(_on_start)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        stats = CompileStats()
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)
