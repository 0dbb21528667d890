"""``scripts/run_batch.py`` / ``python -m llm_jax.run_batch``: OpenAI batch files, run offline on the engine.

Each line of the input file is one request in the format of OpenAI's Batch API (as vLLM's ``run-batch``
reads it)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": ...}}

and each line of the output file its result, in the input's order::

    {"id": "batch_req_…", "custom_id": "q1", "response": {"status_code": 200, "request_id": "…", "body": {…}},
     "error": null}

The requests go to the server's own app in this process (no socket), so they are checked and answered
exactly as the HTTP server answers them, and all of them run through the engine together (continuous
batching). A request the server refuses gets its 4xx body as its response; a line that is not a request
(bad JSON, a missing field, another method or endpoint, a repeated ``custom_id``, ``stream``) gets
``response: null`` and an ``error`` saying why. The output is written to a temporary file beside it and
renamed once complete, so an interrupted run leaves no partial file. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import sys
import tempfile
import time
import uuid
from typing import Any

from llm_jax.cli.common import CliError, positive_int, run_main
from llm_jax.server import cli

log = logging.getLogger("llm_jax.server")

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank",
        "/v1/classify")
PROGRESS_EVERY_S = 5.0
EPILOG = """\
input lines (OpenAI's Batch API format; one request per line):
  {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}
  url: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /v1/score, /v1/rerank, or
  /v1/classify (a sequence classifier)

output lines (in the input's order):
  {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...",
   "body": {...}}, "error": null}

example:
  run_batch.py -i requests.jsonl -o results.jsonl --model path/to/model --max-num-seqs 16
"""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One input line: a request to send, or why it is not one (``error``)."""

    line: int  # 1-based
    custom_id: str | None
    url: str = ""
    body: Any = None
    error: str | None = None


def read_entries(path: pathlib.Path) -> list[Entry]:
    """The input file's requests, each checked; blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read the input file {path}: {error}") from None
    entries, seen = [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            entry = _entry(number, raw, seen)
            seen.add(entry.custom_id)
            entries.append(entry)
    return entries


def _entry(number: int, raw: str, seen: set) -> Entry:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as error:
        return Entry(number, None, error=f"line {number} is not JSON: {error}")
    if not isinstance(item, dict):
        return Entry(number, None, error=f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Entry(number, None, error=f"line {number}: custom_id must be a non-empty string")

    def refused(why: str) -> Entry:
        return Entry(number, custom_id, error=f"line {number}: {why}")

    if custom_id in seen:
        return refused(f"custom_id {custom_id!r} is not unique")
    if unknown := sorted(set(item) - {"custom_id", "method", "url", "body"}):
        return refused(f"unknown fields {unknown}")
    if item.get("method") != "POST":
        return refused(f"method must be POST, got {item.get('method')!r}")
    if item.get("url") not in URLS:
        return refused(f"url must be one of {list(URLS)}, got {item.get('url')!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return refused("body must be a JSON object")
    if body.get("stream"):
        return refused("stream is not supported in a batch (each result is written whole)")
    return Entry(number, custom_id, url=item["url"], body=body)


async def run_entries(app, entries: list[Entry], *, max_concurrency: int,
                      progress=lambda done, total, failed: None) -> list[dict]:
    """Each entry's output line (a dict), sending at most ``max_concurrency`` requests to ``app`` at once."""
    import httpx

    limit = asyncio.Semaphore(max_concurrency)
    done = failed = 0
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:

        async def one(entry: Entry) -> dict:
            nonlocal done, failed
            line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": entry.custom_id, "response": None,
                    "error": None}
            if entry.error is not None:
                line["error"] = {"code": "invalid_request", "message": entry.error}
            else:
                async with limit:
                    response = await client.post(entry.url, json=entry.body)
                line["response"] = {"status_code": response.status_code,
                                    "request_id": response.headers.get("x-request-id", ""), "body": response.json()}
            done += 1
            failed += line["error"] is not None or line["response"]["status_code"] != 200
            progress(done, len(entries), failed)
            return line

        return list(await asyncio.gather(*(one(entry) for entry in entries)))


def write_atomically(path: pathlib.Path, lines: list[dict]) -> None:
    """The output file, complete or not at all: written beside it, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    parser.description = "Run a file of OpenAI batch requests on the serving engine, offline (as vLLM's run-batch)."
    parser.epilog = EPILOG
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", type=pathlib.Path, required=True, metavar="FILE",
                       help="requests, one JSON object per line")
    batch.add_argument("-o", "--output-file", type=pathlib.Path, required=True, metavar="FILE",
                       help="results, one per request in the input's order (written whole, at the end)")
    batch.add_argument("--max-concurrency", type=positive_int, metavar="N",
                       help="requests in flight at once (default: all; the engine runs --max-num-seqs of them)")
    return parser


class _Progress:
    def __init__(self):
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int, failed: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            log.info("batch: %d/%d done, %d failed, %.1f s", done, total, failed, now - self.start)


async def _run(args: argparse.Namespace, engine, model, template, entries: list[Entry]) -> list[dict]:
    from llm_jax.server.app import build_app
    from llm_jax.serving.async_engine import AsyncEngine

    # Every request is queued at once: no 503 for a full queue.
    config = cli.server_config(args, model, template, api_key=None, max_waiting=max(len(entries), 1))
    app = build_app(None if engine is None else AsyncEngine(engine), config, model)
    try:
        return await run_entries(app, entries, max_concurrency=args.max_concurrency or max(len(entries), 1),
                                 progress=_Progress())
    finally:
        await app.state.service.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_args(build_parser(), argv)
    entries = read_entries(args.input_file)  # before the slow start: an unreadable file fails at once
    if not entries:
        raise CliError(f"the input file {args.input_file} holds no requests")
    template = cli.read_template(args)
    engine, model = cli.start_engine(args)
    lines = asyncio.run(_run(args, engine, model, template, entries))
    write_atomically(args.output_file, lines)
    failed = sum(line["error"] is not None or line["response"]["status_code"] != 200 for line in lines)
    log.info("wrote %d results to %s (%d failed)", len(lines), args.output_file, failed)
    return 0


def entry() -> int:
    return run_main(main)


if __name__ == "__main__":
    sys.exit(entry())
