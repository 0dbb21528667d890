"""CLI plumbing: one-line errors with their exit statuses, argument types."""

import argparse

import pytest

from llm_jax.cli import common
from llm_jax.cli.common import CliError, CliParser, run_main


def raising(error: BaseException):
    def main(argv):
        raise error
    return main


@pytest.mark.parametrize("error, status, message", [
    (CliError("no prompt"), 1, "error: no prompt\n"),
    (FileNotFoundError("model path m.bin does not exist"), 1, "error: model path m.bin does not exist\n"),
    (ValueError("first line\n  details a user does not need"), 1, "error: first line\n"),
    (KeyboardInterrupt(), 130, "interrupted\n"),
])
def test_run_main_reports_one_line(capsys, error, status, message):
    assert run_main(raising(error), []) == status
    captured = capsys.readouterr()
    assert captured.err == message and captured.out == ""


def test_run_main_lets_bugs_show_their_traceback():
    with pytest.raises(ZeroDivisionError):
        run_main(raising(ZeroDivisionError("a bug")), [])


def test_usage_errors_are_one_line_with_status_2(capsys):
    parser = CliParser(prog="tool")
    parser.add_argument("--n", type=common.positive_int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--n", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: argument --n: expected a positive integer, got 0 (see tool --help)\n"


@pytest.mark.parametrize("parse, text, value", [
    (common.token_ids, "1,15043, 29892", [1, 15043, 29892]),
    (common.positive_int, "3", 3),
    (common.non_negative_int, "0", 0),
    (common.uint32, str(2**32 - 1), 2**32 - 1),
    (common.non_negative_float, "0.7", 0.7),
    (common.probability, "0", 0.0),
    (common.open_probability, "1", 1.0),
])
def test_argument_types_accept(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize("parse, text, message", [
    (common.token_ids, "1,a", "comma-separated token ids, got '1,a'"),
    (common.token_ids, ",", "at least one token id"),
    (common.positive_int, "0", "positive integer, got 0"),
    (common.positive_int, "1.5", "an integer, got '1.5'"),
    (common.non_negative_int, "-1", ">= 0, got -1"),
    (common.uint32, str(2**32), f"[0, 2**32), got {2**32}"),
    (common.non_negative_float, "-0.1", ">= 0, got -0.1"),
    (common.non_negative_float, "nan", "finite number, got 'nan'"),
    (common.probability, "1.01", "[0, 1], got 1.01"),
    (common.open_probability, "0", "(0, 1], got 0"),
])
def test_argument_types_reject_naming_the_value(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse(text)
    assert message in str(error.value)
