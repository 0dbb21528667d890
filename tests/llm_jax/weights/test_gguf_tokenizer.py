"""The tokenizer rebuilt from a GGUF vocabulary against the tokenizer it was written from.

Sentencepiece vocabularies (llama2's 32000 pieces, stories260K's 512) must encode and decode exactly as
``sentencepiece`` with the original model; byte-level BPE vocabularies (GPT-2, Llama 3 and Qwen 2
pre-tokenizers) exactly as ``tokenizers`` with the original tokenizer.json. The vocabularies are written the
way llama.cpp's converter writes them (``llm_jax.weights.to_gguf.add_tokenizer``).
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import llm_jax
from llm_jax.gguf_tokenizer import _LLAMA3_REGEX, _QWEN2_REGEX, GGUFTokenizerError, gguf_chat_template
from llm_jax.tokenizer import load_tokenizer
from llm_jax.weights.to_gguf import add_tokenizer
from tests.llm_jax.conftest import BOS, CORPUS, EOS, EOT, train_byte_level_bpe, write_json

VARIED = (*CORPUS, " leading space", "double  space and trailing ", "tabs\tand\nnewlines\n\n", "ﬁ ligature ½ ①",
          "numbers 1234567 3.14159 1,000,000", "<s> text that spells </s> and <unk>", "I'm, you're, they'll, we'd",
          "  ", "\n", "a" * 100, "über naïve 東京 🚀🚀")
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{{ eos_token }}"


def write_vocab_gguf(path: pathlib.Path, folder: pathlib.Path, pre: str = "gpt-2", extra=None) -> pathlib.Path:
    writer = gguf.GGUFWriter(path, "llama")
    add_tokenizer(writer, folder, pre)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_ids(vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in (1, 5, 30, 200)]


# --- sentencepiece ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama2", "stories260K"])
def spm_case(request, llama2_tokenizer_path, stories260k_dir, tmp_path_factory):
    source = llama2_tokenizer_path if request.param == "llama2" else stories260k_dir / "tok512.model"
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "tokenizer.model").write_bytes(source.read_bytes())
    write_json(folder / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                                   "chat_template": TEMPLATE})
    write_json(folder / "config.json", {"bos_token_id": 1, "eos_token_id": 2})  # where convert reads the ids
    path = write_vocab_gguf(folder / "vocab.gguf", folder)
    return sentencepiece.SentencePieceProcessor(model_file=str(source)), load_tokenizer(path), path, folder


def test_sentencepiece_vocabulary_encodes_and_decodes_as_sentencepiece(spm_case):
    reference, ours, _, folder = spm_case
    original = load_tokenizer(folder / "tokenizer.model")  # special tokens in text, BOS: as from the .model
    assert ours.vocab_size == reference.get_piece_size()
    for text in VARIED:
        assert ours.encode(text, add_bos=False, parse_special=False) == reference.encode(text), text
        assert ours.encode(text) == original.encode(text), text
        assert ours.encode(text, add_bos=True, parse_special=False) == [1, *reference.encode(text)]
        assert ours.decode(reference.encode(text)) == reference.decode(reference.encode(text))
    for ids in random_ids(reference.get_piece_size(), 0):
        assert ours.decode(ids) == reference.decode(ids)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id) == (1, (2,), None)
    assert ours.byte_ids == frozenset(range(3, 259))


def test_chat_template_and_its_special_tokens_come_from_the_metadata(spm_case):
    _, _, path, _ = spm_case
    template = gguf_chat_template(path)
    assert template.templates == {"default": TEMPLATE}
    assert template.special_tokens["eos_token"] == "</s>" and template.special_tokens["bos_token"] == "<s>"
    assert template.render([{"role": "user", "content": "hi"}]) == "<|user|>hi</s>"
    assert llm_jax.load_chat_template(path).templates == {"default": TEMPLATE}


# --- byte-level BPE --------------------------------------------------------------------------------------


def train_split_bpe(regex: str, ignore_merges: bool) -> tokenizers.Tokenizer:
    """A Llama 3 / Qwen 2 style tokenizer: a Split regex, then byte-level, as their tokenizer.json has."""
    tokenizer = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=[BOS, EOS, EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    tokenizer.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])])
    return tokenizer


BPE_KINDS = {
    "gpt-2": train_byte_level_bpe,
    "llama-bpe": lambda: train_split_bpe(_LLAMA3_REGEX, ignore_merges=True),
    "qwen2": lambda: train_split_bpe(_QWEN2_REGEX, ignore_merges=False),
}


@pytest.fixture(scope="module", params=sorted(BPE_KINDS))
def bpe_case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = BPE_KINDS[request.param]()
    reference.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", {"bos_token": BOS, "eos_token": EOT, "add_bos_token": True})
    ids = {t: reference.token_to_id(t) for t in (BOS, EOS, EOT)}
    write_json(folder / "config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOT]})
    path = write_vocab_gguf(folder / "vocab.gguf", folder, request.param)
    return reference, load_tokenizer(path), ids


def test_bpe_vocabulary_encodes_and_decodes_as_tokenizers(bpe_case):
    reference, ours, ids = bpe_case
    assert ours.vocab_size == reference.get_vocab_size()
    for text in (*VARIED, f"{BOS}special {EOT} in text <think>x"):
        assert ours.encode(text) == reference.encode(text).ids, text
        assert ours.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False).ids
        theirs = reference.encode(text).ids
        assert ours.decode(theirs) == reference.decode(theirs)
        assert ours.decode(theirs, skip_special=False) == reference.decode(theirs, skip_special_tokens=False)
    for token_ids in random_ids(reference.get_vocab_size(), 1):
        assert ours.decode(token_ids) == reference.decode(token_ids)
    assert ours.bos_id == ids[BOS] and ours.eos_ids == (ids[EOT],)
    assert ours.special_ids == {i for i, t in reference.get_added_tokens_decoder().items() if t.special}


# --- what is refused -------------------------------------------------------------------------------------


def test_unsupported_vocabularies_are_named(tmp_path):
    folder = tmp_path / "bpe"
    folder.mkdir()
    train_byte_level_bpe().save(str(folder / "tokenizer.json"))
    falcon = write_vocab_gguf(tmp_path / "falcon.gguf", folder, "falcon")
    with pytest.raises(GGUFTokenizerError, match=r"tokenizer.ggml.pre='falcon' is not supported; supported: .*'qwen2'"):
        load_tokenizer(falcon)
    bert = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(bert, "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFTokenizerError, match=r"tokenizer.ggml.model='bert' is not supported"):
        load_tokenizer(bert)


def test_generation_stops_on_end_of_turn_ids(tmp_path):
    folder = tmp_path / "bpe"
    folder.mkdir()
    reference = train_byte_level_bpe()
    reference.save(str(folder / "tokenizer.json"))
    eos, eot = reference.token_to_id(EOS), reference.token_to_id(EOT)
    path = write_vocab_gguf(tmp_path / "v.gguf", folder, extra=lambda w: (w.add_eos_token_id(eos),
                                                                         w.add_eot_token_id(eot)))
    assert load_tokenizer(path).eos_ids == (eos, eot)
