"""``scripts/generate.py`` without --model runs the story model shipped in checkpoints/, from any directory."""

import pathlib

import pytest

from llm_jax.cli import generate


def test_default_model_is_the_shipped_checkpoint():
    repo = pathlib.Path(__file__).resolve().parents[3]
    assert generate.DEFAULT_MODEL == repo / "checkpoints" / generate.DEFAULT_MODEL.name
    assert (generate.DEFAULT_MODEL / "checkpoint.json").is_file()
    assert generate.build_parser().parse_args(["--prompt", "x"]).model == str(generate.DEFAULT_MODEL)


def test_generate_without_model_prints_a_story(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert generate.main(["--prompt", "Once upon a time", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Once upon a time") and len(out.split()) >= 12


def test_a_missing_default_model_says_how_to_fix_it(monkeypatch):
    monkeypatch.setattr(generate, "DEFAULT_MODEL", pathlib.Path("/nonexistent/checkpoints/stories"))
    with pytest.raises(generate.CliError, match="ships with the llm_jax repository.*pass --model"):
        generate.main(["--model", "/nonexistent/checkpoints/stories", "--prompt", "x"])
