"""``generate.py --speculative`` and ``benchmark.py --speculative``: flags become a ``Speculative``, bad
combinations are refused by name, and both run end to end (no timing assertions)."""

import json
import pathlib

import pytest

from llm_jax.cli.generate import DEFAULT_MODEL, build_parser, check_flags, main, speculative_options
from llm_jax.speculative import Method, Speculative


def parse(*flags):
    parser = build_parser()
    args = parser.parse_args(["--model", "m.bin", "--prompt", "a", *flags])
    check_flags(parser, args)
    return args


def test_ngram_flags_become_a_speculative():
    args = parse("--speculative", "ngram", "--num-speculative-tokens", "6", "--prompt-lookup-min", "1",
                 "--prompt-lookup-max", "5")
    assert speculative_options(args) == Speculative(method=Method.NGRAM, num_tokens=6, prompt_lookup_min=1,
                                                    prompt_lookup_max=5)
    assert speculative_options(parse()) is None


@pytest.mark.parametrize("flags, message", [
    (["--num-beams", "2"], "--speculative cannot be combined with --num-beams"),
    (["--prompt-lookup-min", "5"], "--prompt-lookup-min 5 exceeds --prompt-lookup-max 4"),
])
def test_bad_combinations_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--speculative", "ngram", *flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_draft_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--speculative", str(tmp_path / "nowhere"))
    assert "does not exist" in capsys.readouterr().err


def test_generate_with_a_draft_gives_plain_output_and_reports_acceptance(stories260k_dir, capsys):
    model = str(stories260k_dir / "stories260K.bin")
    common = ["--model", model, "--prompt", "Once upon a time", "--max-new-tokens", "40", "--json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--speculative", model, "--num-speculative-tokens", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results"][0]["output_ids"] == plain["results"][0]["output_ids"]
    metrics = report["metrics"]
    assert metrics["proposed_tokens"] > 0 and metrics["accepted_tokens"] > 0.9 * metrics["proposed_tokens"]
    assert 1 < metrics["mean_accepted_length"] <= 4


def test_benchmark_reports_plain_and_speculative_side_by_side(tmp_path, capsys):
    from benchmarking.cli import main as benchmark_main

    out = tmp_path / "spec.json"
    assert benchmark_main(["--model", "260K", "--speculative", "ngram", "--new-tokens", "20", "--chunk-steps", "4",
                           "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["speculative"]
    assert [(r["prompt"], r["sampling"]) for r in rows] == [("repetitive", "greedy"), ("novel", "t=1")]
    for row in rows:
        assert row["identical"] and row["plain_tokens_per_s"] > 0 and row["speculative_tokens_per_s"] > 0
        assert 0 <= row["acceptance_rate"] <= 1
    assert "spec tok/s" in capsys.readouterr().out  # the table


def test_benchmark_runs_story_prompts_for_a_model_with_a_tokenizer(tmp_path):
    """Story openings told to their end (EOS honoured), the setting of the shipped draft's target."""
    from benchmarking.cli import main as benchmark_main

    out = tmp_path / "spec.json"
    draft = pathlib.Path(DEFAULT_MODEL).parent / "stories-1m-draft"
    assert benchmark_main(["--model", str(DEFAULT_MODEL), "--speculative", str(draft),
                           "--new-tokens", "24", "--chunk-steps", "4", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["speculative"]
    assert [r["prompt"] for r in rows] == ["repetitive", "novel", "story"]
    assert all(r["identical"] and r["proposer"] == "stories-1m-draft" for r in rows)
