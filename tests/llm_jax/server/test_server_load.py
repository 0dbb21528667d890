"""The server under load, bounded: concurrent clients with mixed settings each get their own answer; a
client that leaves mid-stream frees its KV-cache blocks at once; a full queue answers 503; SIGTERM lets
in-flight streams finish and the process exits 0; HTTPS with client certificates."""

from __future__ import annotations

import concurrent.futures
import json
import random
import ssl
import threading
import time

import httpx
import pytest
import trustme
from server_process import MODEL_NAME, metric, start_server, wait_until_idle

PROMPTS = ["Once upon a time", "The dog ran", "Lily and Tom", "One day", "The sun was", "A little bird", "Tim had a",
           "Sara liked"]
NUM_SPECS, REPEATS, CLIENTS = 16, 4, 16  # 64 requests


def _spec(i: int) -> dict:
    """Request i of a mix: completions and chat, greedy and seeded samples, n of 1 and 2, streamed or not."""
    prompt, max_tokens = PROMPTS[i % len(PROMPTS)], 4 + i % 7
    kind = ("greedy", "sampled", "chat", "sampled_n2")[i % 4]
    settings = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "stream": i % 3 == 0}
    if kind == "chat":
        return {"path": "/v1/chat/completions", **settings, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
    settings |= {"temperature": 0} if kind == "greedy" else {"temperature": 1.2, "seed": i}
    return {"path": "/v1/completions", **settings, "prompt": prompt, "n": 2 if kind == "sampled_n2" else 1}


def _ask(http: httpx.Client, spec: dict) -> tuple[tuple[str, ...], int]:
    """Each choice's text (by index) and the number of tokens generated, streamed or not."""
    path, body = spec["path"], {k: v for k, v in spec.items() if k != "path"}
    if not body["stream"]:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        texts = [c["text"] if "text" in c else c["message"]["content"]
                 for c in sorted(data["choices"], key=lambda c: c["index"])]
        return tuple(texts), data["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    texts: dict[int, str] = {}
    used = None
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                piece = c.get("text", c.get("delta", {}).get("content")) or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    return tuple(texts[i] for i in sorted(texts)), used


def test_concurrent_clients_each_get_their_own_answer(http):
    specs = [_spec(i) for i in range(NUM_SPECS)]
    alone = [_ask(http, spec) for spec in specs]  # each request with the server to itself
    order = [i for i in range(NUM_SPECS) for _ in range(REPEATS)]
    random.Random(0).shuffle(order)
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        together = list(pool.map(lambda i: _ask(http, specs[i]), order))
    for i, answer in zip(order, together):
        texts, used = answer
        assert answer == alone[i], f"request {i} ({specs[i]}) got another answer under load"
        assert used == specs[i]["max_tokens"] * specs[i].get("n", 1)  # ignore_eos: exactly what it asked for
    wait_until_idle(http)


def test_a_client_leaving_mid_stream_frees_its_blocks(http):
    wait_until_idle(http)
    aborted = metric(http, "llm_jax:request_success_total", finished_reason="abort")
    completed = metric(http, "llm_jax:request_success_total", finished_reason="length")
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 2
        running = metric(http, "llm_jax:kv_cache_usage_perc") > 0  # it holds blocks while it runs
    # Leaving the block closed the connection mid-stream: the request is aborted, its blocks free.
    wait_until_idle(http, timeout=5)
    if running:
        assert metric(http, "llm_jax:request_success_total", finished_reason="abort") == aborted + 1
    else:  # it had finished before the client left (a fast machine): nothing to abort
        assert metric(http, "llm_jax:request_success_total", finished_reason="length") == completed + 1


def test_a_full_queue_answers_503_and_sigterm_drains_then_exits_0(model_path, compile_cache, tmp_path):
    # No queue beyond the running batch of 4: a fifth request is refused while four run.
    server = start_server(model_path, tmp_path, compile_cache, "--max-waiting", "0", "--shutdown-timeout", "60")
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 240, "ignore_eos": True, "temperature": 0,
            "stream": True}
    started, results = threading.Barrier(5), []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started.wait()
            results.append([first, *lines])

    try:
        threads = [threading.Thread(target=stream) for _ in range(4)]
        for thread in threads:
            thread.start()
        started.wait(timeout=60)  # all four are running
        refused = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        status = server.terminate(timeout=120)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert status == 0, server.log()[-3000:]
    assert len(results) == 4
    for lines in results:  # every stream in flight at SIGTERM ran to its end
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    assert "stopped" in server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)


def test_sigterm_aborts_what_outlives_the_grace_period(model_path, compile_cache, tmp_path):
    server = start_server(model_path, tmp_path, compile_cache, "--shutdown-timeout", "0")
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    started, answers = threading.Barrier(2), {}

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait()
            answers["stream"] = [line for line in lines if line.startswith("data: ")]

    try:
        threads = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: answers.update(whole=httpx.post(
                       f"{server.url}/v1/completions", json=body, timeout=60)))]
        for thread in threads:
            thread.start()
        started.wait(timeout=60)
        with httpx.Client(base_url=server.url) as probe:  # both requests are in the engine
            deadline = time.monotonic() + 30
            while metric(probe, "llm_jax:num_requests_running") < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        status = server.terminate(timeout=60)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert status == 0, server.log()[-3000:]
    # Cut short and told why — unless it finished in the ~0.1 s uvicorn takes to give up (a fast machine; the
    # story model may also end on its BOS token, a stop token that ignore_eos keeps).
    *_, last, done = answers["stream"]
    assert done == "data: [DONE]"
    last = json.loads(last[6:])
    assert last.get("error", {}).get("code") == "shutting_down" or last["choices"][0]["finish_reason"] in (
        "length", "stop")
    whole = answers["whole"]
    assert (whole.status_code, whole.json().get("error", {}).get("code")) in ((503, "shutting_down"), (200, None))
    assert "stopped" in server.log() and "Traceback" not in server.log()


def test_https_with_client_certificates(model_path, compile_cache, tmp_path):
    """--ssl-certfile/--ssl-keyfile serve HTTPS; --ssl-ca-certs requires a client certificate signed by that
    CA: a client with one is answered, one without is refused in the handshake, and plain HTTP gets nothing."""
    ca = trustme.CA()
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "client_cert", "client_key")}
    ca.cert_pem.write_to_path(files["ca"])
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(files["cert"])
    issued.private_key_pem.write_to_path(files["key"])
    client = ca.issue_cert("client@example.org")
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    trusted = ssl.create_default_context(cafile=str(files["ca"]))
    with_certificate = ssl.create_default_context(cafile=str(files["ca"]))
    with_certificate.load_cert_chain(files["client_cert"], files["client_key"])
    server = start_server(model_path, tmp_path, compile_cache, "--ssl-certfile", str(files["cert"]), "--ssl-keyfile",
                          str(files["key"]), "--ssl-ca-certs", str(files["ca"]), verify=with_certificate)
    try:
        assert server.url.startswith("https://")
        body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, verify=with_certificate, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.post(f"{server.url}/v1/completions", json=body, verify=trusted, timeout=60).raise_for_status()
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10).raise_for_status()
    finally:
        assert server.terminate() == 0
