"""Reasoning in chat completions: a thinking model's ``<think>…</think>`` as ``reasoning_content``.

With ``--reasoning-parser`` (``qwen3`` or ``deepseek_r1``: both write their reasoning between ``<think>``
and ``</think>`` before the answer), a chat answer's reasoning goes to ``message.reasoning_content``
(streamed: ``delta.reasoning_content``) and the text after it to ``content`` — where tool calls are read
too. The reasoning starts with the output when the model writes ``<think>`` first, or at once when the
chat template already wrote it at the end of the prompt (DeepSeek-R1's, Qwen3's thinking models'); an
answer without it is all content, as written. White space around the reasoning and before the answer is
dropped, as ``transformers``' reader of these models drops it. A constraint (structured outputs, forced
tool calls) holds from the end of the reasoning — from ``</think>``, when the tokenizer has it as one
token (:func:`constraint_start`) — as vLLM's structured outputs with a reasoning parser do.
"""

from __future__ import annotations

from collections.abc import Callable

from llm_jax.server import tools
from llm_jax.server.tools import Read, Reader, held_back

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def thinking_at_start(prompt: str) -> bool:
    """The chat template opened the reasoning: the prompt ends with ``<think>``."""
    return prompt.rstrip().endswith(OPEN)


def constraint_start(tokenizer, prompt: str) -> int | None:
    """The token a constraint (structured outputs, forced tool calls) starts after: ``</think>``, when the
    tokenizer has it as one token and the chat template did not close the reasoning already (a thinking
    model answering without thinking); None: the constraint holds from the first token."""
    if tokenizer is None or prompt.rstrip().endswith(CLOSE):
        return None
    return tokenizer.piece_to_id(CLOSE)


class ThinkReader(Reader):
    """Reasoning, then the answer, which ``inner`` reads (content and tool calls)."""

    def __init__(self, inner: Reader, *, thinking: bool):
        self.inner = inner
        self.state = "thinking" if thinking else "start"  # start → (thinking → after →) answer
        self.pending = ""  # text not given out yet
        self.began = False  # the reasoning has given text (its leading white space is gone)

    @property
    def num_calls(self) -> int:
        return self.inner.num_calls

    def feed(self, text: str) -> Read:
        if self.state == "answer":
            return self.inner.feed(text)
        self.pending += text
        return self._drain(final=False)

    def finish(self) -> Read:
        read = self._drain(final=True) if self.state != "answer" else Read()
        read += self.inner.finish()
        return read

    def _drain(self, *, final: bool) -> Read:
        read = Read()
        while True:
            if self.state == "start":  # the output may open with <think>
                head = self.pending.lstrip()
                if head.startswith(OPEN):
                    self.pending, self.state = head[len(OPEN):], "thinking"
                elif OPEN.startswith(head) and not final:
                    return read
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                if not self.began:
                    self.pending = self.pending.lstrip()
                end = self.pending.find(CLOSE)
                if end < 0:
                    keep = len(self.pending) - len(self.pending.rstrip()) if final else held_back(self.pending, CLOSE)
                    given = self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(given):]
                    read.reasoning += given
                    self.began = self.began or bool(given)
                    return read
                read.reasoning += self.pending[:end].rstrip()
                self.pending, self.state = self.pending[end + len(CLOSE):], "after"
            elif self.state == "after":  # the answer's leading white space goes
                self.pending = self.pending.lstrip()
                if not self.pending and not final:
                    return read
                self.state = "answer"
            else:
                text, self.pending = self.pending, ""
                read += self.inner.feed(text)
                return read


def output_reader(calling: tools.ToolCalling | None, tool_parser: str | None, reasoning_parser: str | None, *,
                  prompt: str) -> Callable[[], Reader | None]:
    """What makes each choice's reader: the reasoning first, then tool calls; None when the output is plain
    text."""
    thinking = thinking_at_start(prompt)

    def make() -> Reader | None:
        inner = tools.reader(calling, tool_parser)
        if reasoning_parser is None:
            return inner
        return ThinkReader(inner or tools.PlainReader(), thinking=thinking)

    return make
