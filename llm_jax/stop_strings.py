"""Stop strings, matched on the host in streamed text.

A stop string ("\\nUser:", "</answer>") rarely lines up with tokens: it can start in the middle of one
token and end in another, or arrive in a single token with text on both sides. ``StopStringMatcher``
is fed the text pieces an ``IncrementalDetokenizer`` returns, and

- finds a stop string wherever it falls across pieces,
- holds back text that could be the start of one (a trailing "\\nUs" waits for the next piece), so a
  streamed answer never shows part of a stop string,
- on a match, releases the text before the stop string and says which stop string it was.

When several stop strings could match, the one that is complete earliest in the text wins (ties go to the
one that starts earliest, i.e. the longest): that is the one a character-by-character stream would see
first, so the result does not depend on how the text was split into pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from llm_jax.detokenize import IncrementalDetokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Released:
    """Text that is safe to show, and the stop string that ended the text (None: not stopped)."""

    text: str
    stop: str | None = None


class StopStringMatcher:
    """Incremental stop-string detection over streamed text; host-side state, one per sequence."""

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings = tuple(dict.fromkeys(stop_strings))
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop strings must be non-empty strings; got {list(self.stop_strings)!r}")
        # Every proper prefix of a stop string: a text ending in one of these may be a stop string's start.
        self._prefixes = frozenset(s[:k] for s in self.stop_strings for k in range(1, len(s)))
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self._held = ""
        self.stop: str | None = None

    def push(self, text: str) -> Released:
        """Add newly decoded text; return what can be shown now, and the stop string if one completed."""
        if self.stop is not None:
            raise RuntimeError(f"push() after stop string {self.stop!r} matched: the sequence has ended")
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held, self.stop = "", stop
            return Released(text=buffer[:start], stop=stop)
        keep = self._possible_start_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return Released(text=buffer[: len(buffer) - keep])

    def finish(self) -> str:
        """The text held back when generation ends without a stop string (it was not one after all)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in ``buffer``, ties to the earliest start."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.stop_strings:
            start = buffer.find(stop)  # a stop string's first occurrence is also its earliest-ending one
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _possible_start_length(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), self._longest_prefix), 0, -1):
            if buffer[-length:] in self._prefixes:
                return length
        return 0


class SequenceText:
    """Host-side text of one generated sequence: incremental detokenization after its prompt, then
    stop-string matching in the text after its first ``min_new_tokens`` tokens. Shared by ``generate``
    and the serving engine, so both end a sequence on the same token.

    ``skip_special=False`` keeps special tokens' text (a model's tool-call marker), except that of the
    ``end_ids`` token that ends the sequence (end-of-sequence, a stop token id), as vLLM leaves it out.
    ``include_stop=True`` ends the text with the stop string that ended it."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop_strings: Sequence[str], min_new_tokens: int = 0, *,
                 skip_special: bool = True, end_ids: frozenset[int] = frozenset(), include_stop: bool = False):
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.detok = (IncrementalDetokenizer(tokenizer, context_ids=prompt_ids, skip_special=skip_special)
                      if tokenizer else None)
        self.silent = frozenset() if skip_special else end_ids  # ids whose text is not shown
        self.matcher = StopStringMatcher(stop_strings) if stop_strings else None
        self.unmatched = min_new_tokens  # leading tokens whose text is never part of a stop string
        self.include_stop = include_stop

    def push(self, new_ids: list[int], last: bool) -> tuple[list[int], str, bool]:
        """Add ids one by one; return the ids kept, the text now safe to show, and whether a stop string
        ended the sequence (then the ids after the one completing it are dropped)."""
        if self.detok is None:
            self.ids.extend(new_ids)
            return new_ids, "", False
        # Each id's text, then (on the last push) what the detokenizer still holds.
        pieces = [(i + 1, "" if token in self.silent else self.detok.push([token])) for i, token in enumerate(new_ids)]
        if last:
            pieces.append((len(new_ids), self.detok.finish()))
        shown = []
        for kept, text in pieces:
            if self.matcher is not None and len(self.ids) + kept > self.unmatched:
                released = self.matcher.push(text)
                shown.append(released.text + (released.stop or "" if self.include_stop else ""))
                if released.stop is not None:
                    return self._keep(new_ids[:kept], shown, stopped=True)
            else:
                shown.append(text)
        if last and self.matcher is not None:
            shown.append(self.matcher.finish())
        return self._keep(new_ids, shown, stopped=False)

    def _keep(self, ids: list[int], shown: list[str], stopped: bool) -> tuple[list[int], str, bool]:
        self.ids.extend(ids)
        self.pieces.extend(shown)
        return ids, "".join(shown), stopped

    @property
    def text(self) -> str | None:
        return "".join(self.pieces) if self.detok is not None else None
