"""Joining a multi-process run: argument handling, and two processes on localhost (2 CPU devices each,
gloo collectives over TCP) that together run one sharded model and generate what one process does."""

from __future__ import annotations

import json
import socket
import subprocess

import jax
import pytest

import llm_jax
from llm_jax import distributed
from llm_jax.distributed import DistributedError
from multi_device import PYTHON, REPO, cpu_devices_env

PROMPTS = ("Once upon a time", "Lily")
NEW_TOKENS = 12


def test_requested_by_arguments_or_jax_environment(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert not distributed.requested()
    assert distributed.requested("10.0.0.1:1234")
    assert distributed.requested(num_processes=2)
    assert distributed.requested(process_id=0)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert distributed.requested()


def test_process_id_out_of_range():
    with pytest.raises(DistributedError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        distributed.initialize("127.0.0.1:1", 2, 2)


def test_initialize_after_devices_are_in_use_is_refused():
    jax.devices()  # the backend is up, as in any process that has computed something
    with pytest.raises(DistributedError, match="must run before anything uses a device"):
        distributed.initialize("127.0.0.1:1", 2, 0)


def test_single_process_info():
    info = distributed.process_info()
    assert (info.process_id, info.num_processes, info.is_main) == (0, 1, True)
    assert info.devices == info.local_devices == jax.device_count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json_line(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]  # gloo logs to stdout too
    return json.loads(lines[-1]) if lines else None


@pytest.fixture(scope="module")
def one_process_ids(stories260k_dir) -> list[list[int]]:
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    return [r.output_ids for r in llm_jax.generate(model, list(PROMPTS), max_new_tokens=NEW_TOKENS,
                                                    ignore_eos=True)]


# model=4: one model split across both processes (its all-reduces cross them); default: data across the
# processes (batch rows on different hosts) and model=2 inside each. Speculative decoding (greedy: plain
# decoding's tokens) with prompt lookup, and with a draft model (the same model: each process loads it and
# lays its own devices' shards out on the mesh).
@pytest.mark.parametrize("mesh, speculative", [("model=4", None), (None, None), ("model=4", "draft"),
                                               (None, "ngram")],
                         ids=["model=4", "default-data=2,model=2", "model=4-draft", "default-ngram"])
def test_two_processes_generate_like_one(stories260k_dir, one_process_ids, mesh, speculative):
    model = str(stories260k_dir / "stories260K.bin")
    command = [PYTHON, str(REPO / "scripts/generate.py"), "--model", model,
               "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json",
               "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    command += [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
    command += ["--mesh", mesh] if mesh else []
    command += [] if speculative is None else ["--speculative", model if speculative == "draft" else "ngram"]
    processes = [subprocess.Popen(command + ["--process-id", str(i)], env=cpu_devices_env(2), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=600) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for i, (p, (_, stderr)) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"process {i}: {stderr[-3000:]}"
    report = _json_line(outputs[0][0])
    assert report is not None, outputs[0]
    assert [r["output_ids"] for r in report["results"]] == one_process_ids
    assert _json_line(outputs[1][0]) is None  # process 0 reports; process 1 only computes
