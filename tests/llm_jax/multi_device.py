"""Fresh Python processes whose JAX sees several simulated CPU devices, for the multi-device tests.

XLA reads ``XLA_FLAGS`` once, when JAX starts, so a device count other than the test process's own
needs a new process.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
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


_SHARDED_GREEDY = """
import json, sys
import llm_jax
folder, prompts, steps, meshes = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
out = {}
for spec in meshes:
    model = llm_jax.load(folder, dtype="float32", mesh=spec)
    out[spec] = [r.output_ids for r in llm_jax.generate(model, prompts, max_new_tokens=steps, ignore_eos=True)]
print(json.dumps(out))
"""


def sharded_greedy(folder, prompts: list[list[int]], steps: int, meshes: list[str], devices: int = 4
                   ) -> dict[str, list[list[int]]]:
    """Greedy tokens of the model in ``folder`` (float32) on each mesh of ``meshes`` (``"data=2,model=2"``),
    in a process with ``devices`` CPU devices."""
    done = subprocess.run([PYTHON, "-c", _SHARDED_GREEDY, str(folder), json.dumps(prompts), str(steps),
                           json.dumps(meshes)], env=cpu_devices_env(devices), capture_output=True, text=True,
                          timeout=600, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
