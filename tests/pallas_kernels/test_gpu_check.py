"""scripts/gpu_check.py: its dry run runs every check on the CPU (interpreted kernels, tiny shapes)
and prints one table in which none failed, and writes it as JSON."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKS = ["device", "(a) pallas kernel tests", "(a) default tiles compile",
          "(b) logits pallas vs cpu", "(b) LoRA logits pallas vs cpu", "(b) greedy ids pallas vs cpu",
          "(b) logits xla vs cpu", "(b) LoRA logits xla vs cpu", "(b) greedy ids xla vs cpu",
          "(c) decode xla", "(c) decode pallas_kernels", "(c) decode cudnn", "(c) prefill xla",
          "(c) prefill pallas_kernels", "(c) prefill cudnn", "(c) decode stacked layer",
          "(c) ragged paged attention", "(c) ragged paged attention int8",
          "(d) tiny (dry run) bf16 decode pallas"]


@pytest.mark.slow
def test_dry_run_runs_every_check(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"{len(CHECKS)} rows, 0 failed" in result.stdout, output[-4000:]
    table = json.loads((tmp_path / "gpu_check.json").read_text())
    assert table["dry_run"] is True
    results = {row["check"]: row["result"] for row in table["rows"]}
    assert list(results) == CHECKS
    for check, outcome in results.items():
        expected = {"SKIP"} if "cudnn" in check else {"INFO"} if check.startswith(
            ("device", "(d)")) else {"PASS"}
        assert outcome in expected, (check, outcome)
    # The table printed at the end holds every row.
    table_text = result.stdout[result.stdout.rindex("check "):]
    assert all(check in table_text for check in CHECKS)
