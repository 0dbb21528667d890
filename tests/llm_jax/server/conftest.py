"""Fixtures of the server tests: one server (stories260K, a small engine with n-gram speculative decoding,
an API key, a chat template with tools, Hermes' tool-call parser, Qwen 3's reasoning parser, and one
origin allowed to browsers) shared by a session's tests, and clients of it.

Its step programs are kept in pytest's cache folder between sessions, so a later session — or a second
server with the same engine flags — loads them instead of compiling them (about a minute on a loaded
2-core machine the first time, seconds after).
"""

from __future__ import annotations

import pathlib

import httpx
import openai
import pytest
from server_process import API_KEY, CHAT_TEMPLATE, UI_ORIGIN, start_server


@pytest.fixture(scope="session")
def compile_cache(request, tmp_path_factory) -> pathlib.Path:
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("llm_jax_server_xla") if cache is not None else tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="session")
def model_path(stories260k_dir) -> pathlib.Path:
    return stories260k_dir / "stories260K.bin"


@pytest.fixture(scope="session")
def server(model_path, compile_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    template = folder / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    # Speculative decoding on: every greedy answer the tests compare with generate is verified proposals.
    process = start_server(model_path, folder, compile_cache, "--api-key", API_KEY, "--chat-template", str(template),
                           "--speculative", "ngram", "--num-speculative-tokens", "4", "--tool-call-parser", "hermes",
                           "--reasoning-parser", "qwen3", "--allowed-origins", UI_ORIGIN)
    yield process
    process.terminate()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client
