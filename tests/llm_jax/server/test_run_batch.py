"""``python -m llm_jax.run_batch``: an OpenAI batch file in, one result per line out, in order. Greedy
completions and chat answers are ``generate``'s (the chat's through the server's template, as the shared
server's answer, which the ``openai`` client reads), embeddings ``embed_texts``'; requests the server
refuses keep its 4xx body; lines that are not requests get an error naming why; nothing is written when
the run fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from server_process import CHAT_TEMPLATE, ENGINE_FLAGS, MODEL_NAME, REPO_ROOT

import llm_jax

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben"]


def _run_batch(model_path, compile_cache, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLM_JAX_COMPILATION_CACHE": str(compile_cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "llm_jax.run_batch", "--model", str(model_path),
                           "--served-model-name", MODEL_NAME, *ENGINE_FLAGS, *args], capture_output=True, text=True,
                          timeout=900, cwd=REPO_ROOT, env=env)


def _line(custom_id, url, body, **extra):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


@pytest.fixture(scope="module")
def results(model_path, compile_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    lines = [_line(f"c{i}", "/v1/completions", {"model": MODEL_NAME, "prompt": p, "max_tokens": 24,
                                                "temperature": 0, "ignore_eos": True})
             for i, p in enumerate(PROMPTS)]
    lines += [
        _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                               "temperature": 0}),
        _line("embed", "/v1/embeddings", {"input": PROMPTS}),
        _line("score", "/v1/score", {"text_1": PROMPTS[0], "text_2": PROMPTS[1:]}),
        "",  # blank lines are skipped
        _line("too-long", "/v1/completions", {"prompt": "x", "max_tokens": 10_000}),
        "{not json",
        _line("c0", "/v1/completions", {"prompt": "again"}),
        _line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        _line("models", "/v1/models", {}),
        _line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("sampled", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.8,
                                             "seed": 3, "n": 2}),
    ]
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    done = _run_batch(model_path, compile_cache, "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
                      "--chat-template", str(folder / "template.jinja"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batch: 13/13 done, 6 failed" in done.stderr
    return [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]


def test_results_follow_the_input_one_per_request(results):
    assert [r["custom_id"] for r in results] == ["c0", "c1", "c2", "chat", "embed", "score", "too-long", None, "c0",
                                                 "get", "models", "streamed", "sampled"]
    assert len({r["id"] for r in results}) == len(results) and all(r["id"].startswith("batch_req_") for r in results)


def test_greedy_completions_and_embeddings_are_the_librarys(results, stories):
    by_id = {}
    for r in results:
        by_id.setdefault(r["custom_id"], r)  # the first c0 (the second is refused)
    for i, prompt in enumerate(PROMPTS):
        response = by_id[f"c{i}"]["response"]
        assert response["status_code"] == 200 and response["request_id"]
        expected = llm_jax.generate(stories, [prompt], max_new_tokens=24, ignore_eos=True)[0].text
        assert response["body"]["choices"][0]["text"] == expected
        assert response["body"]["object"] == "text_completion" and by_id[f"c{i}"]["error"] is None
    vectors = np.array([d["embedding"] for d in by_id["embed"]["response"]["body"]["data"]])
    np.testing.assert_allclose(vectors, llm_jax.embed_texts(stories, PROMPTS), atol=1e-5, rtol=0)
    scores = [d["score"] for d in by_id["score"]["response"]["body"]["data"]]
    np.testing.assert_allclose(scores, vectors[1:] @ vectors[0], atol=1e-5)
    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    sampled = by_id["sampled"]["response"]["body"]["choices"]
    expected = llm_jax.generate(stories, [PROMPTS[0]], max_new_tokens=16, n=2,
                                sampling=llm_jax.Sampling(temperature=0.8, seed=3))
    assert [c["text"] for c in sampled] == [r.text for r in expected]


def test_refusals_keep_the_servers_body_and_bad_lines_say_why(results):
    too_long = next(r for r in results if r["custom_id"] == "too-long")
    assert too_long["response"]["status_code"] == 400 and too_long["response"]["body"]["error"]["param"]
    errors = {r["custom_id"]: r["error"]["message"] for r in results if r["error"] is not None}
    assert errors[None].startswith("line 9 is not JSON")
    assert "custom_id 'c0' is not unique" in errors["c0"]
    assert "method must be POST, got 'GET'" in errors["get"]
    assert "url must be one of" in errors["models"]
    assert "stream is not supported in a batch" in errors["streamed"]
    assert all(r["response"] is None for r in results if r["error"] is not None)


def test_a_run_that_cannot_start_writes_nothing(model_path, compile_cache, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n\n")
    done = _run_batch(model_path, compile_cache, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert done.returncode == 1 and "holds no requests" in done.stderr and not (tmp_path / "out.jsonl").exists()
    done = _run_batch(model_path, compile_cache, "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o"))
    assert done.returncode == 1 and "cannot read the input file" in done.stderr


def test_help_and_a_missing_flag_answer_at_once():
    done = subprocess.run([sys.executable, "-m", "llm_jax.run_batch", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0 and "--input-file" in done.stdout and "--max-num-seqs" in done.stdout
    done = subprocess.run([sys.executable, "-m", "llm_jax.run_batch", "-o", "out.jsonl"], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 2 and "-i/--input-file" in done.stderr
