"""``generate.py --json-schema / --regex / --choice / --grammar``: the flags become a constraint, bad
combinations are refused, and the output follows the constraint end to end."""

import json
import re

import pytest

from llm_jax.cli.common import run_main
from llm_jax.cli.generate import build_parser, check_flags, guided_option, main
from llm_jax.guided import Choice, Json, Regex


def parse(*flags):
    parser = build_parser()
    args = parser.parse_args(["--model", "m.bin", "--prompt", "a", *flags])
    check_flags(parser, args)
    return args


def test_flags_become_a_constraint(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert guided_option(parse("--json-schema", str(path))) == Json(schema)
    assert guided_option(parse("--json-schema", json.dumps(schema))) == Json(schema)
    assert guided_option(parse("--regex", "a+")) == Regex("a+")
    assert guided_option(parse("--choice", "x", "--choice", "y")) == Choice(("x", "y"))
    assert guided_option(parse()) is None


@pytest.mark.parametrize("flags", [["--regex", "a", "--choice", "b"], ["--regex", "a", "--num-beams", "2"],
                                   ["--choice", "a", "--speculative", "ngram"]])
def test_bad_combinations_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2


def test_outputs_follow_the_constraint(stories260k_dir, capsys):
    common = ["--model", str(stories260k_dir / "stories260K.bin"), "--prompt", "Once upon a time",
              "--prompt", "The dog ran", "--max-new-tokens", "60", "--json", "--temperature", "1", "--seed", "3"]
    assert main([*common, "--regex", r"(Tom|Sue) (saw|liked) a [a-z]{1,8}\."]) == 0
    for result in json.loads(capsys.readouterr().out)["results"]:
        assert re.fullmatch(r"(Tom|Sue) (saw|liked) a [a-z]{1,8}\.", result["text"])
        assert result["finish_reason"] == "stop"
    assert main([*common, "--json-schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                                           '"required": ["ok"], "additionalProperties": false}']) == 0
    for result in json.loads(capsys.readouterr().out)["results"]:
        assert isinstance(json.loads(result["text"])["ok"], bool)
    assert run_main(main, [*common, "--regex", "a(b"]) == 1
    assert "error: the regex constraint does not compile" in capsys.readouterr().err
