"""Measuring compilation: how many XLA compilations a block of code triggered, and how long they took.

Built on ``jax.monitoring`` events, so it sees every compilation (jit, AOT, the persistent cache's
misses) without wrapping functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_active: list["CompileStats"] = []
_registered = False


@dataclasses.dataclass
class CompileStats:
    """Filled while its ``measure_compilation`` block runs."""

    seconds: float = 0.0  # tracing + lowering + backend compilation
    compilations: int = 0  # backend compilations (one per new executable)


def _listener(event: str, duration: float, **_) -> None:
    if event not in (_TRACE, _LOWER, _BACKEND):
        return
    with _lock:
        for stats in _active:
            stats.seconds += duration
            if event == _BACKEND:
                stats.compilations += 1


@contextlib.contextmanager
def measure_compilation():
    """``with measure_compilation() as stats: ...`` — then ``stats.seconds`` and ``stats.compilations``."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _registered = True
        stats = CompileStats()
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)
