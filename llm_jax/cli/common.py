"""What every command-line program shares: one-line errors, exit statuses, argument types.

Errors a user can cause and fix (a missing file, a bad value, a prompt too long for the model) are
printed as one line, ``error: <what>``, with exit status 1; usage errors (an unknown flag, a value of
the wrong type) with status 2, as argparse does; Ctrl-C ends with status 130, as shells expect. A
traceback means a bug in llm_jax.

This module imports no JAX: ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class CliError(Exception):
    """An error to report as one line on stderr, with exit status 1."""


class CliParser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (``error: argument --top-p: ...``) instead of the usage
    block; ``--help`` still shows everything."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run ``main``; failures the user can fix become one line on stderr and a non-zero exit status."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``): nothing more to say, and nowhere to say it. Point stdout at
        # devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except (CliError, OSError, ValueError) as e:  # OSError: missing files; ValueError: bad input, by design
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def one_line(error: BaseException) -> str:
    """The first line of an error's message (a JAX runtime error carries a long report after it)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# --- argument types: parse at the edge into checked values; argparse names the flag on error -------------


def token_ids(text: str) -> list[int]:
    """``1,15043,29892`` → [1, 15043, 29892]."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _ranged(parse: Callable[[str], float], accept: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: ``parse`` the text, then insist on ``accept`` (the error says ``expected``)."""

    def parse_checked(text: str):
        value = parse(text)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse_checked


positive_int = _ranged(_integer, lambda v: v >= 1, "a positive integer")
non_negative_int = _ranged(_integer, lambda v: v >= 0, "an integer >= 0")
uint32 = _ranged(_integer, lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)")
non_negative_float = _ranged(_number, lambda v: v >= 0, "a number >= 0")
positive_float = _ranged(_number, lambda v: v > 0, "a number > 0")
finite_float = _ranged(_number, lambda v: True, "a finite number")
probability = _ranged(_number, lambda v: 0 <= v <= 1, "a number in [0, 1]")
open_probability = _ranged(_number, lambda v: 0 < v <= 1, "a number in (0, 1]")  # a nucleus mass: 0 keeps nothing
