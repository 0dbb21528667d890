"""What ``scripts/generate.py`` prints: streamed text in prompt order, the ``--json`` report, the metrics line.

Imports no JAX at module level; the objects it formats come from ``llm_jax.generate``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Sequence, TextIO

if TYPE_CHECKING:
    from llm_jax.generation import GenerationMetrics, GenerationStream, StreamEvent
    from llm_jax.loading import Model


def write_stream(events: Iterable[StreamEvent], out: TextIO, *, echoes: Sequence[str], with_text: bool) -> None:
    """Write a batch's generated text to ``out`` as it streams, in prompt order.

    The first prompt whose output is not complete streams live; the others are held until every prompt
    before them has finished, then their text so far is written and they continue live. So the output
    reads as the prompts were given, and a single prompt streams exactly as it is generated. Each output
    starts with its ``echoes`` entry (the prompt text, under a ``--- i/n ---`` line in a batch) and ends
    with a newline. Models without a tokenizer (``with_text`` False) stream their token ids.
    """
    n = len(echoes)
    held: list[list[str]] = [[] for _ in range(n)]
    finished = [False] * n
    ids_written = [0] * n
    current = 0

    def begin(i: int) -> None:
        if n > 1:
            out.write(f"--- {i + 1}/{n} ---\n")
        out.write(echoes[i])
        out.write("".join(held[i]))
        held[i].clear()

    begin(0)
    for event in events:
        i = event.index
        if with_text:
            piece = event.text
        else:  # ids, space-separated across events
            piece = " " * bool(ids_written[i] and event.token_ids) + " ".join(map(str, event.token_ids))
            ids_written[i] += len(event.token_ids)
        if i == current:
            out.write(piece)
        else:
            held[i].append(piece)
        finished[i] = event.finish_reason is not None
        while current < n and finished[current]:
            out.write("\n")
            current += 1
            if current < n:
                begin(current)
        out.flush()


def prompt_echo(model: Model, prompt: str | Sequence[int]) -> str:
    """The text a prompt's output starts with: the prompt string, or its ids decoded when the model has a
    tokenizer (ids alone are not repeated)."""
    if isinstance(prompt, str):
        return prompt
    return model.tokenizer.decode(prompt) if model.tokenizer is not None else ""


def json_report(model_arg: str, stream: GenerationStream) -> dict:
    """The ``--json`` object. ``prompt`` is null for a ``--prompt-ids`` prompt and ``text`` for a model
    without a tokenizer; ``prompt_ids`` include BOS where the model adds one; ``output_ids`` are the
    generated ids only."""
    m = stream.metrics
    return {
        "model": model_arg,
        "results": [_result(r) for r in stream.results],
        "metrics": {"compile_s": m.compile_s, "ttft_s": m.ttft_s, "itl_s": m.itl_s,
                    "decode_tokens_per_s": m.decode_tokens_per_s},
    }


def _result(r) -> dict:
    """One completion; the optional outputs (several completions, log-probabilities) only when present."""
    out = {"prompt": r.prompt, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "text": r.text,
           "finish_reason": r.finish_reason}
    optional = {"sample": r.sample or None, "score": r.score, "logprobs": r.logprobs, "top_logprobs": r.top_logprobs,
                "prompt_logprobs": r.prompt_logprobs, "prompt_top_logprobs": r.prompt_top_logprobs}
    return out | {k: v for k, v in optional.items() if v is not None}


def metrics_fields(m: GenerationMetrics) -> list[str]:
    """The timings of one generation, for humans: time to first token, inter-token latency p50/p90,
    decode throughput, compile time."""
    return [f"{m.generated_tokens} tokens",
            f"ttft {m.ttft_s * 1e3:.0f} ms",
            f"itl p50 {m.itl_p50_s * 1e3:.1f} ms p90 {m.itl_p90_s * 1e3:.1f} ms",
            f"{m.decode_tokens_per_s:.1f} tok/s",
            f"compile {m.compile_s:.1f} s"]


def print_status(fields: Iterable[str], stream: TextIO) -> None:
    """``[field · field · …]`` on its own line, dimmed on a terminal (https://no-color.org permitting)."""
    line = "[" + " · ".join(fields) + "]"
    if stream.isatty() and not os.environ.get("NO_COLOR"):
        line = f"\033[2m{line}\033[0m"
    print(line, file=stream, flush=True)
