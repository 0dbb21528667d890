"""Fresh Python processes whose JAX sees several simulated CPU devices, for the multi-device tests.

XLA reads ``XLA_FLAGS`` once, when JAX starts, so a device count other than the test process's own
needs a new process.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import sys
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# XLA's CPU backend compiles several times faster at -O0; the runs compared with each other share it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"


def cpu_devices_env(count: int) -> dict[str, str]:
    """The environment for a process with ``count`` CPU devices that imports this checkout's llm_jax."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count} {_FAST_COMPILE}",
                JAX_PLATFORMS="cpu", PYTHONPATH=path)


def computed_once(name: str, compute: Callable[[], str], tmp_path_factory, worker_id: str) -> str:
    """``compute()`` (text) once per test session, shared by pytest-xdist workers: the first worker to
    ask runs it, the others wait for its file (the recipe of pytest-xdist's documentation)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # under xdist each worker has its own basetemp inside the session's
        root = root.parent
    result = root / f"{name}.out"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            result.write_text(compute())
    return result.read_text()
