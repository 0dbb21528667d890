"""Streaming detokenization: token ids in, newly finished text out.

Decoding one token at a time is wrong twice over: sentencepiece drops the leading space of whatever it
decodes first ("▁the" alone decodes to "the"), and a character split over several byte tokens
(``<0xE4><0xB8><0xAD>`` = "中", four for an emoji) decodes to U+FFFD until its last byte arrives.
Re-decoding everything each step is right but quadratic. ``IncrementalDetokenizer`` uses the
prefix-offset / read-offset technique of Hugging Face text-generation-inference and vLLM: it decodes a
short window — tokens already shown, as context, plus the new ones — and emits the text the new tokens
add to it. The window is a few tokens long, except while text is held back (below), and each token is
decoded O(1) times, so streaming n tokens costs O(n).

What is held back, so that the pieces concatenate to exactly ``tokenizer.decode(all_ids)``:

- trailing U+FFFD characters, at most three: an unfinished UTF-8 character has at most three bytes and
  decodes to at least one U+FFFD at the very end of the text, so anything before the last three is a
  replacement character the full decode has too (invalid bytes).
- for ``tokenizers``' ByteFallback decoder (``Tokenizer.byte_runs_decode_as_one``), a whole trailing run
  of byte tokens: it decodes the run as one unit, and if the run ends up invalid UTF-8 every byte becomes
  U+FFFD — a later byte can turn an already complete "中" into "���". The run's text is final when a
  non-byte token ends it; pushes inside a run cost O(1) and the run is decoded once.

``finish`` releases whatever is still held when generation ends.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sequence

from llm_jax.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"
MAX_UNFINISHED_CHAR_BYTES = 3  # a 4-byte UTF-8 character is unfinished until its 4th byte
CONTEXT_TOKENS = 5  # prompt tokens decoded with the first generated ones, for their spacing


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, one ``push`` at a time.

    The pieces returned by ``push`` and ``finish`` concatenate to ``tokenizer.decode(ids,
    skip_special=skip_special)`` of all pushed ids — or, with ``context_ids`` (the prompt), to the text
    that decoding prompt + generated ids adds after the prompt's own text.

    Host-side mutable state, one object per sequence; it keeps only the current window of ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, context_ids: Sequence[int] = (), skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._whole_runs = tokenizer.byte_runs_decode_as_one
        context = [int(i) for i in context_ids]
        start, context_text = self._context(context, max(len(context) - CONTEXT_TOKENS, 0))
        self._window = context[start:]
        self._read = len(self._window)  # window[:read] was shown before the current push
        self._emitted = len(context_text)  # characters of decode(window) returned so far
        self._run_start = self._trailing_run_start()  # len(window) unless the window ends in a byte run
        self._finished = False

    def push(self, ids: int | Iterable[int]) -> str:
        """Add generated ids (one, or several); return the text they finish (possibly empty)."""
        if self._finished:
            raise RuntimeError("push() after finish(): start a new IncrementalDetokenizer for a new sequence")
        scalar = isinstance(ids, numbers.Integral) or getattr(ids, "ndim", None) == 0  # numpy / jax scalars too
        new_ids = [int(ids)] if scalar else [int(i) for i in ids]
        if not new_ids:
            return ""
        run_was_open = self._run_start < len(self._window)
        self._window.extend(new_ids)
        if run_was_open and all(self._in_run(i) for i in new_ids):
            return ""  # the open run continues: nothing of it is final yet
        self._run_start = self._trailing_run_start()
        text = self._decode(self._window[: self._run_start])
        stable = len(text) - _trailing_replacements(text, limit=MAX_UNFINISHED_CHAR_BYTES)
        new_text = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        if self._run_start == len(self._window) and stable == len(text):
            # All shown: the tokens of this push (or more, if they give no text) are the next context.
            start, context_text = self._context(self._window, self._read)
            self._window = self._window[start:]
            self._read = self._run_start = len(self._window)
            self._emitted = len(context_text)
        return new_text

    def finish(self) -> str:
        """Release the text still held back (bytes the ids never completed into characters)."""
        self._finished = True
        return self._decode(self._window)[self._emitted :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=self._skip_special)

    def _in_run(self, token_id: int) -> bool:
        """Byte tokens make up a run; skipped special tokens are removed before decoding, so they
        neither end nor start one."""
        return token_id in self._tokenizer.byte_ids or (self._skip_special and token_id in self._tokenizer.special_ids)

    def _trailing_run_start(self) -> int:
        """Start of the window's trailing byte run when runs decode as one; len(window) otherwise."""
        run_start = len(self._window)
        if self._whole_runs:
            for position in range(len(self._window) - 1, -1, -1):
                if self._window[position] in self._tokenizer.byte_ids:
                    run_start = position
                elif not self._in_run(self._window[position]):
                    break
        return run_start

    def _context(self, ids: list[int], start: int) -> tuple[int, str]:
        """Move ``start`` back until ``ids[start:]`` is usable context for the tokens that follow;
        return it and its text.

        It must give text — sentencepiece strips the leading space of the first piece that gives text —
        and must not begin inside a byte run that decodes as one unit."""
        while start > 0 and self._whole_runs and self._in_run(ids[start]) and self._in_run(ids[start - 1]):
            start -= 1
        text = self._decode(ids[start:])
        while start > 0 and not text:
            start -= 1
            text = self._decode(ids[start:])
        return start, text


def _trailing_replacements(text: str, *, limit: int) -> int:
    count = 0
    while count < limit and count < len(text) and text[-1 - count] == REPLACEMENT_CHARACTER:
        count += 1
    return count


def stream_decode(tokenizer: Tokenizer, ids: Iterable[int], *, skip_special: bool = True) -> Iterator[str]:
    """Text pieces for ``ids`` pushed one token at a time, as a generation loop produces them."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special=skip_special)
    for token_id in ids:
        if piece := detokenizer.push(token_id):
            yield piece
    if rest := detokenizer.finish():
        yield rest
