"""Special tokens read from a model's files, checked through load_tokenizer and against transformers."""

import json

import pytest
import transformers

from llm_jax.special_tokens import ModelConfigs
from llm_jax.tokenizer import load_tokenizer


def make_folder(tmp_path, tokenizer_source, **configs):
    """A model folder holding a tokenizer file (symlinked) and the given config files."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / tokenizer_source.name).symlink_to(tokenizer_source)
    for name, content in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


def test_special_tokens_from_model_files(tmp_path, byte_level_dir, byte_level_tokenizer):
    ids = byte_level_tokenizer.token_to_id
    source = byte_level_dir / "tokenizer.json"

    # Qwen: no BOS in the tokenizer even though config.json has a bos_token_id; eos from the config.
    qwen = load_tokenizer(make_folder(
        tmp_path / "qwen", source,
        tokenizer_config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|end_of_text|>"},
        config={"bos_token_id": ids("<|end_of_text|>"), "eos_token_id": ids("<|end_of_text|>")},
    ))
    assert qwen.bos_id is None and qwen.encode("hi") == qwen.encode("hi", add_bos=False)
    assert qwen.eos_ids == (ids("<|end_of_text|>"),) and qwen.pad_id == ids("<|end_of_text|>")

    # eos from the tokenizer files when no model config names one; AddedToken dicts are read.
    dicts = load_tokenizer(make_folder(
        tmp_path / "dicts", source,
        tokenizer_config={"eos_token": {"content": "<|eot_id|>", "special": True}},
        generation_config={"eos_token_id": None},
    ))
    assert dicts.eos_ids == (ids("<|eot_id|>"),)
    assert dicts.bos_id == ids("<|begin_of_text|>") and dicts.add_bos_by_default  # from the post-processor

    # special_tokens_map.json overrides an old-style tokenizer_config.json (no added_tokens_decoder).
    legacy = load_tokenizer(make_folder(
        tmp_path / "legacy", source,
        tokenizer_config={"eos_token": "<|im_end|>"}, special_tokens_map={"eos_token": "<|eot_id|>"},
    ))
    assert legacy.eos_ids == (ids("<|eot_id|>"),)

    with pytest.raises(ValueError, match=r"tokenizer_config.json pad_token.*'<pad>'.*not in the tokenizer"):
        load_tokenizer(make_folder(tmp_path / "bad_pad", source, tokenizer_config={"pad_token": "<pad>"}))
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id=\[2, 100000\]"):
        load_tokenizer(make_folder(tmp_path / "bad_eos", source, generation_config={"eos_token_id": [2, 100000]}))


def test_sentencepiece_add_bos_from_tokenizer_config(tmp_path, llama2_tokenizer_path):
    folder = make_folder(tmp_path, llama2_tokenizer_path, tokenizer_config={"add_bos_token": False})
    tokenizer = load_tokenizer(folder)
    assert not tokenizer.add_bos_by_default
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_bos=False)
    assert tokenizer.encode("hi", add_bos=True)[0] == 1


@pytest.mark.parametrize(
    ("tokenizer_config", "special_tokens_map"),
    [
        ({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|end_of_text|>"}, None),  # Qwen
        ({"eos_token": "<|end_of_text|>", "pad_token": "<|eot_id|>"}, None),  # no BOS named
        # An old-style folder: special_tokens_map.json (AddedToken dicts) overrides the config.
        ({"eos_token": "<|end_of_text|>"}, {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
                                             "eos_token": {"content": "<|eot_id|>", "lstrip": False}}),
    ],
)
def test_tokenizer_files_read_as_transformers_reads_them(
    tmp_path, byte_level_dir, byte_level_tokenizer, tokenizer_config, special_tokens_map
):
    configs = {"tokenizer_config": {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}}
    if special_tokens_map is not None:
        configs["special_tokens_map"] = special_tokens_map
    folder = make_folder(tmp_path, byte_level_dir / "tokenizer.json", **configs)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer = load_tokenizer(folder)
    assert tokenizer.eos_ids == (reference.eos_token_id,)
    assert tokenizer.pad_id == reference.pad_token_id
    if reference.bos_token_id is not None or "bos_token" in tokenizer_config:
        assert tokenizer.bos_id == reference.bos_token_id
    else:  # no file names a BOS: transformers has none, we take the one the post-processor adds
        assert tokenizer.bos_id == byte_level_tokenizer.token_to_id("<|begin_of_text|>")


def test_generation_config_eos_as_int_or_list(tmp_path, byte_level_dir, byte_level_tokenizer):
    ids = byte_level_tokenizer.token_to_id
    source = byte_level_dir / "tokenizer.json"
    eot = ids("<|eot_id|>")
    single = load_tokenizer(make_folder(tmp_path / "int", source, generation_config={"eos_token_id": eot}))
    assert single.eos_ids == (ids("<|eot_id|>"),)
    several = [ids("<|eot_id|>"), ids("<|end_of_text|>"), ids("<|eot_id|>")]
    listed = load_tokenizer(make_folder(tmp_path / "list", source, generation_config={"eos_token_id": several}))
    assert listed.eos_ids == (ids("<|eot_id|>"), ids("<|end_of_text|>"))  # in order, once each


def test_model_configs_precedence(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<a>", "bos_token": {"content": "<b>", "lstrip": False}, "pad_token": None}
    ))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<c>"}))
    configs = ModelConfigs.read(tmp_path)
    assert configs.special_token("eos_token") == ("special_tokens_map.json", "<c>")
    assert configs.special_token("bos_token") == ("tokenizer_config.json", "<b>")
    assert configs.special_token("pad_token") == ("tokenizer_config.json", None)
    assert configs.special_token("unk_token") is None
    # A config with added_tokens_decoder is complete: special_tokens_map.json is not read.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<a>", "added_tokens_decoder": {}}))
    assert ModelConfigs.read(tmp_path).special_token("eos_token") == ("tokenizer_config.json", "<a>")
