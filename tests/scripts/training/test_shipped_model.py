"""The model shipped in checkpoints/ is what scripts/train_tiny.py reports: same tokenizer, same held-out loss."""

import itertools
import json

import numpy as np
import pytest

import llm_jax
from llm_jax.cli.generate import DEFAULT_MODEL
from training import data
from training.recipe import STORIES, recipe_dict
from training.step import make_eval_step
from training.stories import stories


@pytest.fixture(scope="module")
def log() -> dict:
    return json.loads((DEFAULT_MODEL / "train_log.json").read_text())


@pytest.fixture(scope="module")
def model() -> llm_jax.Model:
    return llm_jax.load(DEFAULT_MODEL)


def test_it_was_trained_with_the_default_recipe(log, model):
    expected = json.loads(json.dumps(recipe_dict(STORIES)))
    assert log["recipe"] == expected
    assert log["command"] == "python scripts/train_tiny.py --force"
    assert model.config == STORIES.model
    assert 1_000_000 <= log["params"] <= 5_000_000


def test_its_tokenizer_is_the_one_the_recipe_trains():
    texts = itertools.islice(stories(STORIES.seed), STORIES.tokenizer_stories)
    assert data.train_tokenizer(texts, vocab_size=STORIES.model.vocab_size) == (
        DEFAULT_MODEL / "tokenizer.model").read_bytes()


def test_held_out_loss_matches_the_log(log, model):
    # None of the held-out stories repeats a training story, so they are the stream's first val_stories.
    assert log["data"]["val_stories"] == STORIES.val_stories
    texts = itertools.islice(stories(STORIES.val_seed), STORIES.val_stories)
    docs = [[data.BOS_ID, *model.tokenizer.encode(t, add_bos=False), data.EOS_ID] for t in texts]
    rows = data.pad_rows(docs, row_len=STORIES.seq_len + 1)
    assert rows.num_tokens == log["data"]["val_tokens"]
    eval_step = make_eval_step(model.config)
    sums = [eval_step(model.params, tokens_BT, lengths_B)
            for tokens_BT, lengths_B in data.batches(rows, batch_size=50)]
    total, count = (sum(float(s[i]) for s in sums) for i in (0, 1))
    assert count == rows.num_tokens - len(rows)  # every row has one token more than it has targets
    np.testing.assert_allclose(total / count, log["val_loss"], rtol=1e-5)


def test_it_tells_a_story_and_stops_at_eos(model):
    [result] = llm_jax.generate(model, ["Once upon a time"], max_new_tokens=192)
    assert result.finish_reason == "eos"
    assert result.text.startswith(",") and result.text.rstrip().endswith((".", "!", '"'))
    words = result.text.split()
    assert 40 <= len(words) <= 150
