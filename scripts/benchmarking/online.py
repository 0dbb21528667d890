"""``scripts/bench_serving.py``'s online mode: the workload sent over HTTP to OpenAI-compatible servers.

Each request is a streamed ``POST /v1/completions`` (``temperature`` 0, ``max_tokens`` its output length,
``stream_options.include_usage``), sent when its arrival time has passed and a slot of
``--max-concurrency`` is free. Every server-sent event that carries a choice is a delivery of one token
(the usage chunk corrects the count where an event carried several, or none); TTFT is arrival → first
such event, ITL the gaps between them. Prompts are text (what every server takes): random whole words of
the tokenizer's vocabulary, as many as the drawn prompt length, counted again with the tokenizer.

Servers are given by URL (any OpenAI-compatible one), or launched here on a free port of 127.0.0.1 and
stopped afterwards: llm_jax's ``scripts/serve.py`` and ``transformers serve`` (continuous batching) on the
same Hugging Face folder. A server is driven in its own dialect: for llm_jax (and vLLM) ``ignore_eos``,
for transformers a ``generation_config`` with ``min_new_tokens``, so every request gets all its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from benchmarking.serving import RequestTrace, ServingRequest, ServingRun, WarmUp

DIALECTS = ("vllm", "transformers")
READY_TIMEOUT_S = 900.0  # a server's start-up, compilation included
REQUEST_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextRequest:
    """A workload request as text: ``prompt`` and the token count the tokenizer gives it."""

    request: ServingRequest
    prompt: str
    prompt_len: int


def word_pieces(tokenizer) -> list[int]:
    """Ids of vocabulary pieces that are a whole lowercase word (``▁`` then letters), which encode back to
    themselves one token per word."""
    pieces = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_piece(i)
        if piece.startswith("▁") and piece[1:].isascii() and piece[1:].isalpha() and piece[1:].islower():
            pieces.append(i)
    return pieces


def text_requests(requests: Sequence[ServingRequest], tokenizer, *, seed: int) -> list[TextRequest]:
    """Each request's prompt as random words, one per prompt token (the shared prefix shared as words too)."""
    rng = np.random.default_rng(seed)
    pieces = np.array(word_pieces(tokenizer))
    if len(pieces) < 20:
        raise ValueError("the tokenizer has too few whole-word pieces to make text prompts")
    words = {}  # token id → word, so that a shared prefix of ids stays a shared prefix of words

    def word(token: int) -> str:
        if token not in words:
            words[token] = tokenizer.id_to_piece(int(pieces[rng.integers(len(pieces))]))[1:]
        return words[token]

    out = []
    for r in requests:
        prompt = " ".join(word(t) for t in r.prompt_ids)
        out.append(TextRequest(request=r, prompt=prompt, prompt_len=len(tokenizer.encode(prompt))))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI-compatible server at ``url`` (…/v1), driven in ``dialect``; ``process`` when launched here."""

    def __init__(self, name: str, url: str, dialect: str, *, process: subprocess.Popen | None = None,
                 log_path: pathlib.Path | None = None):
        if dialect not in DIALECTS:
            raise ValueError(f"unknown server dialect {dialect!r}; choose one of {DIALECTS}")
        self.name, self.url, self.dialect = name, url.rstrip("/"), dialect
        self.process, self.log_path = process, log_path
        self.model_name: str | None = None
        self.start_s: float | None = None  # launch → ready, for a server launched here
        self.note = ""

    def wait_ready(self, log: Callable[[str], None], timeout: float = READY_TIMEOUT_S) -> None:
        """Until ``/health`` answers 200 and ``/v1/models`` names a model."""
        import httpx

        root = self.url.removesuffix("/v1")
        deadline, said = time.monotonic() + timeout, time.monotonic()
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before it was ready; "
                                   f"its log: {self.log_path}\n{self.log_tail()}")
            try:
                if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                    models = httpx.get(f"{self.url}/models", timeout=5).json()["data"]
                    self.model_name = self.model_name or models[0]["id"]
                    return
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} at {self.url} was not ready after {timeout:.0f} s")
            if time.monotonic() - said > 30:
                log(f"  waiting for {self.name} at {self.url}...")
                said = time.monotonic()
            time.sleep(1.0)

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def body(self, r: TextRequest) -> dict:
        body = {"model": self.model_name, "prompt": r.prompt, "max_tokens": r.request.max_new_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if self.dialect == "vllm":
            body["ignore_eos"] = True
        else:
            body["generation_config"] = json.dumps({"min_new_tokens": r.request.max_new_tokens})
        return body

    def warm_up(self, requests: Sequence[TextRequest], concurrency: int) -> WarmUp:
        """A few requests (as many as run at once), so that the timed run finds everything loaded."""
        t0 = time.perf_counter()
        few = [dataclasses.replace(r, request=dataclasses.replace(r.request, arrival_s=0.0, max_new_tokens=4))
               for r in requests[:max(1, min(concurrency, len(requests)))]]
        asyncio.run(_send_all(self, few, concurrency))
        return WarmUp(seconds=time.perf_counter() - t0, detail=f"{len(few)} short requests")

    def run(self, requests: Sequence[TextRequest], concurrency: int) -> ServingRun:
        traces, duration = asyncio.run(_send_all(self, requests, concurrency))
        return ServingRun(engine=self.name, duration_s=duration, traces=tuple(traces))


async def _send_all(server: Server, requests: Sequence[TextRequest], concurrency: int):
    import httpx

    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()

        async def one(r: TextRequest) -> RequestTrace:
            await asyncio.sleep(max(0.0, r.request.arrival_s - (time.perf_counter() - start)))
            async with slots:
                return await _stream_one(client, server, r, start)

        traces = await asyncio.gather(*(one(r) for r in requests))
    return traces, max(t.deliveries[-1][0] for t in traces)


async def _stream_one(client, server: Server, r: TextRequest, start: float) -> RequestTrace:
    """One streamed completion: its deliveries (time from ``start``, tokens) and text; latencies count
    from when it was sent."""
    deliveries, pieces, usage = [], [], None
    sent = time.perf_counter() - start
    async with client.stream("POST", "/completions", json=server.body(r)) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"{server.name} answered {response.status_code} to {r.request.request_id}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{server.name} failed {r.request.request_id}: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                deliveries.append((time.perf_counter() - start, 1))
                pieces.append(choice.get("text") or "")
    if not deliveries:
        raise RuntimeError(f"{server.name} sent no tokens for {r.request.request_id}")
    counted = usage.get("completion_tokens") if usage else None
    if counted is not None and counted != len(deliveries):  # events that carried several tokens, or none
        extra = counted - len(deliveries)
        t, n = deliveries[-1]
        deliveries[-1] = (t, max(1, n + extra))
    return RequestTrace(request_id=r.request.request_id, arrival_s=sent, prompt_len=r.prompt_len,
                        token_ids=(), deliveries=tuple(deliveries), text="".join(pieces))


# Launching servers.
@contextlib.contextmanager
def launched(kind: str, folder: pathlib.Path, *, dtype: str, limits, workdir: pathlib.Path, threads: int,
             log: Callable[[str], None], flags: Sequence[str] = ()) -> Iterator[Server]:
    """``kind`` ("llm_jax" or "transformers") serving the Hugging Face ``folder`` on a free port of
    127.0.0.1, with the engine ``limits`` (block size and count, token budget, sequences) and, for
    llm_jax, more ``flags`` of serve.py; stopped on exit."""
    port = free_port()
    log_path = workdir / f"{kind}-server.log"
    env = dict(os.environ)
    if kind == "llm_jax":
        root = pathlib.Path(__file__).resolve().parents[2]
        command = [sys.executable, str(root / "scripts" / "serve.py"), "--model", str(folder), "--dtype", dtype,
                   "--port", str(port), "--served-model-name", "bench", "--max-num-seqs", str(limits.max_num_seqs),
                   "--max-num-batched-tokens", str(limits.max_num_batched_tokens), "--block-size",
                   str(limits.block_size), "--num-blocks", str(limits.num_blocks + 1),
                   "--max-waiting", "100000", "--log-level", "warning"]
        if not limits.prefix_caching:
            command.append("--no-prefix-caching")
        command += flags
        name, dialect = "llm_jax server", "vllm"
    elif kind == "transformers":
        executable = shutil.which("transformers") or "transformers"
        command = [executable, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                   "--device", "cpu", "--dtype", dtype, "--cb-block-size", str(limits.block_size),
                   "--cb-num-blocks", str(limits.num_blocks), "--cb-max-batch-tokens",
                   str(limits.max_num_batched_tokens), "--log-level", "warning", str(folder)]
        env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        name, dialect = "transformers serve", "transformers"
    else:
        raise ValueError(f"unknown server {kind!r}; choose llm_jax or transformers")
    log(f"{name}: starting on 127.0.0.1:{port} (log {log_path})")
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(name, f"http://127.0.0.1:{port}/v1", dialect, process=process, log_path=log_path)
    try:
        t0 = time.perf_counter()
        server.wait_ready(log)
        server.start_s = time.perf_counter() - t0
        log(f"{name}: ready after {server.start_s:.0f} s")
        yield server
    finally:
        server.stop()
