"""scripts/train_tiny.py end to end on a tiny model: train a few steps, save, load, generate."""

import json

import pytest

import llm_jax
from training import cli as train_tiny
from training import data

TINY = ["--steps", "24", "--batch-size", "4", "--seq-len", "64", "--warmup-steps", "4", "--peak-lr", "0.01",
        "--tokenizer-stories", "200", "--val-stories", "16", "--eval-every", "12", "--log-every", "4",
        "--vocab-size", "384", "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
        "--d-ff", "64"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny"
    assert train_tiny.main(["--out", str(out), *TINY]) == 0
    return out


def test_loss_decreases_and_the_log_records_the_run(trained):
    log = json.loads((trained / "train_log.json").read_text())
    history = log["history"]
    assert [p["step"] for p in history] == [4, 8, 12, 16, 20, 24]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.5
    vals = [p["val_loss"] for p in history if p["val_loss"] is not None]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert log["val_loss"] == vals[-1]
    assert log["recipe"]["steps"] == 24 and log["recipe"]["model"]["d_model"] == 32
    assert log["command"].startswith("python scripts/train_tiny.py --out ")


def test_the_checkpoint_loads_with_its_tokenizer_and_stop_ids(trained):
    model = llm_jax.load(trained)
    assert model.config.d_model == 32 and model.config.vocab_size == 384 and model.config.tie_embeddings
    assert model.tokenizer.vocab_size == 384
    assert model.tokenizer.encode("Tom ran.")[0] == data.BOS_ID
    assert model.eos_ids == (data.EOS_ID,) and model.stop_ids == (data.BOS_ID,)
    [result] = llm_jax.generate(model, ["Once upon a time"], max_new_tokens=8)
    assert len(result.output_ids) >= 1 and isinstance(result.text, str)


def test_the_readme_reports_the_run(trained):
    readme = (trained / "README.md").read_text()
    log = json.loads((trained / "train_log.json").read_text())
    assert f"**{log['val_loss']:.4f}**" in readme
    assert readme.count("`--prompt ") == 6  # four greedy, two sampled samples
    assert "| 24 |" in readme  # the loss curve's last row


def test_an_existing_output_is_kept_without_force(trained):
    with pytest.raises(FileExistsError, match="already exists"):
        train_tiny.main(["--out", str(trained), *TINY])


def test_bad_shapes_fail_before_training(tmp_path):
    with pytest.raises(train_tiny.CliError, match="--d-model 30 must be a multiple of --n-heads 4"):
        train_tiny.main(["--out", str(tmp_path / "x"), *TINY, "--d-model", "30"])


def test_flag_values_are_checked_at_the_edge(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_tiny.main(["--out", str(tmp_path / "x"), "--steps", "0"])
    assert "--steps: expected a positive integer, got 0" in capsys.readouterr().err
    assert train_tiny.build_parser().parse_args(["--seed", "0"]).seed == 0
