"""Streaming detokenization: the streamed pieces concatenate to the tokenizer's own decode of all ids."""

import random

import numpy as np
import pytest

from llm_jax.detokenize import IncrementalDetokenizer, stream_decode
from llm_jax.tokenizer import load_tokenizer

REPLACEMENT = "\ufffd"
CHUNKS = ("Hello world", "中文字符", "😀👍🏽🇫🇷", "  spaces   run\n\ttab", "def f(x):\n    return x**2", "café")


@pytest.fixture(scope="module", params=["llama2", "tok512", "stories260k_hf", "byte_level"])
def tokenizer(request, llama2_tokenizer_path, stories260k_dir, byte_level_dir):
    paths = {
        "llama2": llama2_tokenizer_path,  # sentencepiece, byte fallback, whitespace runs kept
        "tok512": stories260k_dir / "tok512.model",  # sentencepiece, 512 pieces: CJK and emoji are bytes
        "stories260k_hf": stories260k_dir / "hf",  # tokenizers: Metaspace + ByteFallback decoder
        "byte_level": byte_level_dir,  # tokenizers: byte-level BPE (Llama 3 / Qwen)
    }
    return load_tokenizer(paths[request.param])


def random_stream(rng: random.Random, tokenizer, length: int) -> list[int]:
    """Ids as a confused model might emit them: pieces of real text, stray bytes, specials, anything."""
    ids: list[int] = []
    specials = sorted(tokenizer.special_ids)
    byte_ids = sorted(tokenizer.byte_ids) or list(range(min(260, tokenizer.vocab_size)))
    while len(ids) < length:
        r = rng.random()
        if r < 0.45:
            encoded = tokenizer.encode(rng.choice(CHUNKS), add_bos=False)
            start = rng.randrange(len(encoded))
            ids += encoded[start : start + rng.randint(1, 6)]
        elif r < 0.75:
            ids.append(rng.choice(byte_ids))
        elif r < 0.85:
            ids.append(rng.choice(specials))
        else:
            ids.append(rng.randrange(tokenizer.vocab_size))
    return ids


@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_equals_decode_of_all_ids(tokenizer, skip_special):
    rng = random.Random(0)
    for _ in range(400):
        ids = random_stream(rng, tokenizer, rng.randint(0, 40))
        full = tokenizer.decode(ids, skip_special=skip_special)
        pieces = list(stream_decode(tokenizer, ids, skip_special=skip_special))
        assert "".join(pieces) == full, ids
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in piece for piece in pieces), ids


def test_stream_of_real_text(tokenizer, text_corpus):
    """Natural text streamed token by token: no replacement characters, every character as decoded."""
    for text in text_corpus:
        ids = tokenizer.encode(text)
        pieces = list(stream_decode(tokenizer, ids))
        assert "".join(pieces) == tokenizer.decode(ids), text
        assert REPLACEMENT not in "".join(pieces)


def test_pushing_several_ids_at_once(tokenizer, text_corpus):
    rng = random.Random(1)
    ids = [i for text in text_corpus for i in tokenizer.encode(text)] + random_stream(rng, tokenizer, 200)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces, position = [], 0
    while position < len(ids):  # lists, numpy arrays and numpy scalars, as a generation loop hands them
        step = rng.randint(0, 5)
        chunk = np.asarray(ids[position : position + step], dtype=np.int32)
        pieces.append(detokenizer.push(chunk[0] if step == 1 else chunk if step % 2 else chunk.tolist()))
        position += step
    pieces.append(detokenizer.finish())
    assert "".join(pieces) == tokenizer.decode(ids)


def test_context_gives_generated_text_its_spacing(tokenizer):
    """With the prompt as context, the stream is what decoding prompt + generated ids adds to the prompt."""
    rng = random.Random(2)
    prompts = ["Once upon a time", "中文", "x = [1, 2, 3]\n", "Hello world 😀"]
    checked = 0
    for trial in range(300):
        # Real prompts, then arbitrary id sequences (ending inside a character, in special tokens, …).
        prompt_ids = tokenizer.encode(rng.choice(prompts)) if trial % 2 else random_stream(rng, tokenizer, 12)
        generated = random_stream(rng, tokenizer, rng.randint(1, 20))
        prompt_text = tokenizer.decode(prompt_ids)
        full = tokenizer.decode(prompt_ids + generated)
        detokenizer = IncrementalDetokenizer(tokenizer, context_ids=prompt_ids)
        streamed = "".join(detokenizer.push(i) for i in generated) + detokenizer.finish()
        if full.startswith(prompt_text):  # else the prompt's own text changed (it ended in open bytes)
            assert streamed == full[len(prompt_text) :], (prompt_ids, generated)
            checked += 1
    assert checked >= 200  # most trials; the rest end the prompt inside a byte run


def test_sentencepiece_leading_space_after_prompt(llama2_tokenizer_path):
    tokenizer = load_tokenizer(llama2_tokenizer_path)
    prompt, generated = tokenizer.encode("Once upon a"), tokenizer.encode("time there", add_bos=False)
    assert "".join(stream_decode(tokenizer, generated)) == "time there"  # the decode of these ids alone
    detokenizer = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    assert [detokenizer.push(i) for i in generated] == [" time", " there"]


@pytest.mark.parametrize(
    ("folder", "pieces"),
    [
        # sentencepiece decodes byte runs character by character: the emoji appears with its last byte.
        ("tok512.model", ["", "", "", "😀", " the"]),
        # tokenizers' ByteFallback decodes a run as one unit: its text is final when the run ends.
        ("hf", ["", "", "", "", "😀 the"]),
    ],
)
def test_multibyte_character_appears_whole(stories260k_dir, folder, pieces):
    tokenizer = load_tokenizer(stories260k_dir / folder)
    emoji = [tokenizer.piece_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    detokenizer = IncrementalDetokenizer(tokenizer)
    (word,) = tokenizer.encode("the", add_bos=False)
    assert [detokenizer.push(i) for i in [*emoji, word]] == pieces
    assert detokenizer.finish() == ""


class CountingTokenizer:
    """Forwards to a tokenizer, counting the ids each decode call is given."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decoded_ids = 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, *, skip_special=True):
        self.decoded_ids += len(ids)
        return self._tokenizer.decode(ids, skip_special=skip_special)


def test_work_per_token_is_constant(tokenizer, text_corpus):
    """O(n) in total: the ids decoded per pushed token stay bounded however long the stream gets."""
    # The corpus repeated, then a long stretch of CJK: in stories260K's 512-piece vocabulary every
    # character of it is byte tokens, so the byte run lasts hundreds of tokens.
    texts = [*text_corpus * 20, "我们今天去公园散步，天气很好。" * 40]
    ids = [i for text in texts for i in tokenizer.encode(text)]
    counting = CountingTokenizer(tokenizer)
    assert "".join(stream_decode(counting, ids)) == tokenizer.decode(ids)
    assert counting.decoded_ids <= 16 * len(ids), (counting.decoded_ids, len(ids))


def test_push_after_finish_is_an_error(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.finish()
    with pytest.raises(RuntimeError, match="push\\(\\) after finish\\(\\)"):
        detokenizer.push(5)
