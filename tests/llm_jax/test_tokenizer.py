"""llm_jax.tokenizer against the libraries it wraps: sentencepiece, tokenizers and transformers."""

import random
import shutil

import pytest
import sentencepiece
import tokenizers
import transformers

from llm_jax.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerFormat,
    load_tokenizer,
)

# Beyond the shared corpus: whitespace-only text, lone marks, and texts around the special tokens' spelling.
EXTRA_TEXTS = (" ", "  ", "\n", "\t \n ", "a", "▁", "x" * 300, "Hello, world!", "< s > and <s/> and <0x41>")


@pytest.fixture(scope="module", params=["llama2", "tok512"])
def sentencepiece_file(request, llama2_tokenizer_path, stories260k_dir):
    return {"llama2": llama2_tokenizer_path, "tok512": stories260k_dir / "tok512.model"}[request.param]


def random_ids(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    """Ids weighted towards the low range, where special and byte-fallback pieces live."""
    return [rng.randrange(0, 300) if rng.random() < 0.5 else rng.randrange(vocab_size) for _ in range(n)]


def test_sentencepiece_encode_decode_equal_sentencepiece(sentencepiece_file, text_corpus):
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_file))
    tokenizer = load_tokenizer(sentencepiece_file)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == reference.get_piece_size()
    assert (tokenizer.bos_id, tokenizer.eos_ids, tokenizer.pad_id) == (1, (2,), None)
    for text in (*text_corpus, *EXTRA_TEXTS):
        expected = reference.encode(text, add_bos=True)
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.encode(text, add_bos=False) == expected[1:], text
        assert tokenizer.decode(expected) == reference.decode(expected), text
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(rng, tokenizer.vocab_size, rng.randint(0, 40))
        assert tokenizer.decode(ids) == reference.decode(ids), ids


def test_sentencepiece_special_token_text(llama2_tokenizer_path):
    """A special token's text is its id by default (as transformers reads a rendered chat), or plain text."""
    reference = sentencepiece.SentencePieceProcessor(model_file=str(llama2_tokenizer_path))
    tokenizer = load_tokenizer(llama2_tokenizer_path)
    text = "[INST] hi [/INST] Hello</s><s>[INST] more"
    assert tokenizer.encode(text, parse_special=False) == reference.encode(text, add_bos=True)
    # Each stretch between special tokens is encoded on its own, as Meta's Llama 2 chat code does.
    expected = [1, *reference.encode("[INST] hi [/INST] Hello"), 2, 1, *reference.encode("[INST] more")]
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected) == reference.decode(expected)


def test_sentencepiece_decode_keeping_special_tokens_matches_converted_tokenizer(stories260k_dir, text_corpus):
    """With special tokens shown, sentencepiece decoding spaces them as transformers' tokenizer.json does."""
    tokenizer = load_tokenizer(stories260k_dir / "tok512.model")
    converted = tokenizers.Tokenizer.from_file(str(stories260k_dir / "hf" / "tokenizer.json"))
    rng = random.Random(1)
    texts = [t for t in text_corpus[:3] if t]
    for _ in range(100):
        ids = []
        for _ in range(rng.randint(1, 4)):
            ids += [rng.choice([1, 2])] * rng.randint(0, 2) + tokenizer.encode(rng.choice(texts), add_bos=False)
        assert tokenizer.decode(ids, skip_special=False) == converted.decode(ids, skip_special_tokens=False), ids
        assert tokenizer.decode(ids) == converted.decode(ids), ids


@pytest.fixture(scope="module", params=["byte_level", "stories260k_hf"])
def tokenizer_json_dir(request, byte_level_dir, stories260k_dir):
    return {"byte_level": byte_level_dir, "stories260k_hf": stories260k_dir / "hf"}[request.param]


def test_tokenizer_json_encode_decode_equal_tokenizers(tokenizer_json_dir, text_corpus):
    reference = tokenizers.Tokenizer.from_file(str(tokenizer_json_dir / "tokenizer.json"))
    tokenizer = load_tokenizer(tokenizer_json_dir)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    for text in (*text_corpus, *EXTRA_TEXTS):
        expected = reference.encode(text).ids  # the post-processor adds BOS
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False).ids, text
        for skip in (True, False):
            assert tokenizer.decode(expected, skip_special=skip) == reference.decode(expected, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(rng, tokenizer.vocab_size, rng.randint(0, 40))
        assert tokenizer.decode(ids) == reference.decode(ids), ids


def test_tokenizer_json_equal_transformers(tokenizer_json_dir, text_corpus):
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_json_dir))
    tokenizer = load_tokenizer(tokenizer_json_dir)
    assert tokenizer.bos_id == reference.bos_token_id
    assert tokenizer.pad_id == reference.pad_token_id
    for text in (*text_corpus, *EXTRA_TEXTS):
        ids = reference(text).input_ids
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_byte_level_special_and_added_tokens(byte_level_dir, byte_level_tokenizer):
    tokenizer = load_tokenizer(byte_level_dir / "tokenizer.json")
    ids = byte_level_tokenizer.token_to_id
    assert tokenizer.bos_id == ids("<|begin_of_text|>")
    # generation_config.json's list wins over config.json's single id, as in transformers' generate.
    assert tokenizer.eos_ids == (ids("<|end_of_text|>"), ids("<|eot_id|>"))
    text = "<|im_start|>user\nhi<think>hmm</think><|im_end|>"
    parsed = tokenizer.encode(text, add_bos=False)
    assert parsed[0] == ids("<|im_start|>") and ids("<think>") in parsed
    # parse_special=False reads special tokens as text; non-special added tokens still match.
    plain = tokenizer.encode(text, add_bos=False, parse_special=False)
    assert ids("<|im_start|>") not in plain and ids("<think>") in plain
    assert tokenizer.decode(plain) == text
    assert tokenizer.decode(parsed) == "user\nhi<think>hmm</think>"
    assert tokenizer.decode(parsed, skip_special=False) == text
    assert tokenizer.special_ids >= {ids("<|im_start|>"), ids("<|eot_id|>")}
    assert ids("<think>") not in tokenizer.special_ids
    assert tokenizer.byte_ids == frozenset()  # byte-level BPE has no byte-fallback pieces


def test_byte_fallback_ids(llama2_tokenizer_path, stories260k_dir):
    for tokenizer in (load_tokenizer(llama2_tokenizer_path), load_tokenizer(stories260k_dir / "hf")):
        assert tokenizer.byte_ids == frozenset(range(3, 259))
        assert tokenizer.id_to_piece(3 + 0xE4) == "<0xE4>"
        assert tokenizer.piece_to_id("<0x0A>") == 13
        assert tokenizer.piece_to_id("no such piece") is None


def test_folder_prefers_tokenizer_json(stories260k_dir):
    folder = stories260k_dir / "hf"
    assert isinstance(load_tokenizer(folder), HFTokenizer)
    assert isinstance(load_tokenizer(folder, format=TokenizerFormat.SENTENCEPIECE), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(stories260k_dir), SentencePieceTokenizer)  # its only .model: tok512.model
    # The documented difference: the conversion lost sentencepiece's remove_extra_whitespaces.
    text = "two  spaces"
    assert load_tokenizer(folder, format=TokenizerFormat.SENTENCEPIECE).encode(text) == load_tokenizer(
        stories260k_dir / "tok512.model"
    ).encode(text)


def test_load_errors(tmp_path, llama2_tokenizer_path, byte_level_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"unrecognised tokenizer file .*vocab.txt"):
        load_tokenizer(tmp_path / "vocab.txt")
    no_tokenizer = r"has no tokenizer: expected tokenizer.json or .*found \['vocab.txt'\]"
    with pytest.raises(FileNotFoundError, match=no_tokenizer):
        load_tokenizer(tmp_path)
    (tmp_path / "broken.model").write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match=r"broken.model is not a readable sentencepiece model"):
        load_tokenizer(tmp_path / "broken.model")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer.json is not a readable Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="is a tokenizers file, not sentencepiece"):
        load_tokenizer(byte_level_dir / "tokenizer.json", format=TokenizerFormat.SENTENCEPIECE)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.model", "b.model"):
        shutil.copy(llama2_tokenizer_path, two / name)
    with pytest.raises(ValueError, match=r"several sentencepiece models \['a.model', 'b.model'\]"):
        load_tokenizer(two)
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "tokenizer.model").symlink_to(llama2_tokenizer_path)
    (bad_json / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON"):
        load_tokenizer(bad_json)


def test_decode_rejects_out_of_range_ids(llama2_tokenizer_path, byte_level_dir):
    for tokenizer in (load_tokenizer(llama2_tokenizer_path), load_tokenizer(byte_level_dir)):
        with pytest.raises(ValueError, match=rf"token ids \[-1, {tokenizer.vocab_size}\] out of range"):
            tokenizer.decode([5, -1, tokenizer.vocab_size])
