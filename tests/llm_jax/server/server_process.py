"""The server as users start it — ``python -m llm_jax.serve`` in a subprocess, on a free port of
127.0.0.1 — and what the server tests read from it (``/metrics`` samples)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
API_KEY = "test-key"
UI_ORIGIN = "http://ui.example:3000"  # the origin the shared server lets browsers call it from
MODEL_NAME = "stories"
# A small engine: 3 decode and 2 prefill step shapes, each compiled for greedy, sampled and logprobs steps.
ENGINE_FLAGS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "256",
                "--block-size", "16")
MAX_MODEL_LEN = 256
START_TIMEOUT_S = 600  # a cold compile on a loaded machine
LISTENING = re.compile(r"ready: serving '[^']*' on (https?://127\.0\.0\.1:\d+)")
CHAT_TEMPLATE = (  # with tools (short: the context is 256 tokens), and calls in Hermes' format
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}"
    "({{ (t.function.parameters or {}).get('properties', {}) | list | join(', ') }}){% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.tool_calls if m.tool_calls is defined %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclasses.dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: pathlib.Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit status (killed, and the test failed, if it does not stop in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"the server did not stop within {timeout} s of SIGTERM; its log:\n{self.log()[-3000:]}")


# What the child runs first, given the test process's pid: it asks Linux for SIGTERM when the test process
# dies (PR_SET_PDEATHSIG, kept across exec; a crashed xdist worker would otherwise leave its server
# running), then becomes the server. Not a preexec_fn: that runs Python between fork and exec, which can
# deadlock a multithreaded parent such as JAX's.
_LAUNCHER = """
import ctypes, os, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != int(sys.argv[1]):  # the test process died before that
        sys.exit(1)
os.execv(sys.executable, [sys.executable, "-m", "llm_jax.serve", *sys.argv[2:]])
"""


def start_server(model: pathlib.Path, folder: pathlib.Path, cache: pathlib.Path, *flags: str,
                 verify: ssl.SSLContext | bool = True) -> ServerProcess:
    """Start a server on a free port (``--port 0``) and wait until ``/health`` answers 200 (``verify``: how
    an HTTPS server is trusted)."""
    log_path = folder / "server.log"
    env = {**os.environ, "LLM_JAX_COMPILATION_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(os.getpid()), "--model", str(model),
                                    "--port", "0", "--served-model-name", MODEL_NAME, *ENGINE_FLAGS, *flags],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    server = ServerProcess(process=process, url="", log_path=log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.url:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not start (status {process.poll()}); its log:\n{server.log()[-3000:]}")
        if match := LISTENING.search(server.log()):
            server.url = match.group(1)
        time.sleep(0.2)
    assert httpx.get(f"{server.url}/health", timeout=10, verify=verify).status_code == 200
    return server


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """A sample of ``GET /metrics`` by its full name (``llm_jax:kv_cache_usage_perc``) and labels; 0 if absent."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_until_idle(http: httpx.Client, timeout: float = 10) -> None:
    """No request running or waiting, and no KV-cache block held."""
    deadline = time.monotonic() + timeout
    names = ("llm_jax:num_requests_running", "llm_jax:num_requests_waiting", "llm_jax:kv_cache_usage_perc")
    while (values := [metric(http, n) for n in names]) != [0, 0, 0]:
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {dict(zip(names, values))}"
        time.sleep(0.05)
