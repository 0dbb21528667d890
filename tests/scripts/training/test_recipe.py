import json

import pytest

from training.recipe import STORIES, Recipe, recipe_dict


def test_the_shipped_recipe_is_a_small_model():
    assert 1_000_000 <= STORIES.model.num_params() <= 5_000_000
    assert STORIES.seq_len <= STORIES.model.max_seq_len
    assert STORIES.val_seed != STORIES.seed


def test_recipe_validation():
    with pytest.raises(ValueError, match="seq_len=1024 exceeds the model's max_seq_len=512"):
        Recipe(seq_len=1024)
    with pytest.raises(ValueError, match="steps must be positive, got 0"):
        Recipe(steps=0)


def test_warmup_is_clamped_to_a_short_run():
    assert Recipe(steps=5, warmup_steps=100).optimizer.warmup_steps == 5
    assert STORIES.optimizer.total_steps == STORIES.steps


def test_recipe_dict_is_json():
    d = json.loads(json.dumps(recipe_dict(STORIES)))
    assert d["model"]["d_model"] == STORIES.model.d_model and d["steps"] == STORIES.steps
    assert d["val_seed"] == STORIES.val_seed
