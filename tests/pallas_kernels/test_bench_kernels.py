"""scripts/bench_kernels.py: its dry run traces, checks and lowers every case, with no GPU."""

import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dry_run_checks_every_case():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench_kernels.py"), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "dry run: 60 cases, 0 failed" in result.stdout
    for kind in ("prefill", "decode"):
        for impl in ("pallas_kernels", "xla", "cudnn", "jax pallas op"):
            assert any(line.startswith(kind) and impl in line and " ok" in line
                       for line in result.stdout.splitlines()), (kind, impl)
