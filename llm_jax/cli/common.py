"""Helpers shared by the command-line programs: one-line errors and argument parsing at the edge."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn


class CliError(Exception):
    """An error to report as one line on stderr, with a non-zero exit status."""


def fail(message: str, status: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run ``main``; expected failures (bad input, missing files) become one line and exit status 1."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CliError, FileNotFoundError, ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def token_ids(text: str) -> list[int]:
    """argparse type for ``1,15043,29892``."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
