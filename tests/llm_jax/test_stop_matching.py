"""On-device stop strings against a brute-force search over the tokens' byte forms, and byte forms
against the tokenizers' own decoding."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax import stop_matching
from llm_jax.stop_matching import StopTable, token_bytes
from llm_jax.tokenizer import load_tokenizer

TEXTS = ("Once upon a time, Lily saw a big dog.", "The end!\n\nUser: hi", "我们今天去公园散步。",
         "emoji 😀👍🏽 ok", "café naïve", "  spaces\tand\nnewlines  ", "stop stopped st op")


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level"])
def tokenizer(request, stories260k_dir, byte_level_dir):
    if request.param == "sentencepiece":
        return load_tokenizer(stories260k_dir / "tok512.model")
    return load_tokenizer(byte_level_dir)


def random_ids(tokenizer, rng: random.Random, pieces: int = 6) -> list[int]:
    """Token ids of a few encoded text fragments (valid text, natural and unnatural boundaries)."""
    ids = []
    for _ in range(pieces):
        text = rng.choice(TEXTS)
        start = rng.randrange(len(text))
        ids += tokenizer.encode(text[start:start + rng.randrange(1, 12)], add_bos=False)
    return ids


def test_byte_forms_concatenate_to_the_decoded_text(tokenizer):
    forms = token_bytes(tokenizer)
    rng = random.Random(0)
    for _ in range(50):
        ids = random_ids(tokenizer, rng)
        text = tokenizer.decode(ids)
        joined = b"".join(forms[i] for i in ids).decode("utf-8")
        # sentencepiece drops the space of a text's first piece; nothing else may differ.
        assert joined == text or (joined.startswith(" ") and joined[1:] == text), (ids, joined, text)


def first_stop(forms, ids, stops) -> int | None:
    """Index of the token after which the output's byte forms first contain a stop string."""
    text = b""
    for i, token in enumerate(ids):
        text += forms[token]
        if any(s.encode() in text for s in stops):
            return i
    return None


@pytest.mark.parametrize("seed", [0, 1])
def test_device_matches_brute_force(tokenizer, seed):
    stop_strings = ["time", "e!\n\nUs", "公园", "👍", "p st", "a", "big dog."]
    rows = [["time"], ["e!\n\nUs", "公园"], ["👍", "p st"], ["a"], ["big dog.", "time"], []]
    table = StopTable.build(tokenizer, stop_strings)
    forms = token_bytes(tokenizer)
    rng = random.Random(seed)
    sequences = []
    for row in rows:
        ids = random_ids(tokenizer, rng, pieces=5)
        if row and rng.random() < 0.8:
            # One of the row's stop strings, cut at a random point: the cut becomes a token boundary.
            stop = rng.choice(row)
            cut = rng.randrange(len(stop) + 1)
            ids += tokenizer.encode(stop[:cut], add_bos=False) + tokenizer.encode(stop[cut:] + "x", add_bos=False)
        sequences.append(ids + random_ids(tokenizer, rng, pieces=3))
    steps = max(map(len, sequences))
    ids_BS = np.zeros((len(rows), steps), np.int32)
    active_BS = np.zeros((len(rows), steps), bool)
    for b, ids in enumerate(sequences):
        ids_BS[b, : len(ids)], active_BS[b, : len(ids)] = ids, True

    @jax.jit
    def run(ids_BS, active_BS):
        def step(window, inputs):
            token_B, active_B = inputs
            window, stopped_B = stop_matching.push(window, token_B, active_B, table,
                                                   jnp.asarray(stop_matching.active_rows(stop_strings, rows)))
            return window, stopped_B

        _, stopped_SB = jax.lax.scan(step, stop_matching.empty_window(len(rows), table), (ids_BS.T, active_BS.T))
        return stopped_SB.T

    stopped = np.asarray(run(ids_BS, active_BS))
    found = 0
    for b, ids in enumerate(sequences):
        expected = first_stop(forms, ids, rows[b])
        got = np.flatnonzero(stopped[b])
        assert (got[0] if len(got) else None) == expected, (b, rows[b], [forms[i] for i in ids])
        found += expected is not None
    assert found >= 3, "too few stops occurred for the test to mean much"


def test_single_byte_stop_and_split_characters(stories260k_dir):
    """A one-byte stop string (no window) and a CJK character split over byte-fallback tokens."""
    tokenizer = load_tokenizer(stories260k_dir / "tok512.model")
    ids = tokenizer.encode("ab 中", add_bos=False)
    assert sum(i in tokenizer.byte_ids for i in ids) == 3  # 中 is three byte tokens in a 512-piece vocabulary
    for stops, expected in ((["中"], len(ids) - 1), (["b"], first_stop(token_bytes(tokenizer), ids, ["b"]))):
        table = StopTable.build(tokenizer, stops)
        window = stop_matching.empty_window(1, table)
        push = jax.jit(stop_matching.push)
        hits = []
        for token in ids:
            window, stopped = push(window, jnp.array([token]), jnp.array([True]), table, jnp.ones((1, 1), bool))
            hits.append(bool(stopped[0]))
        assert hits.index(True) == expected


def test_empty_stop_string_is_rejected(stories260k_dir):
    with pytest.raises(ValueError, match="non-empty"):
        StopTable.build(load_tokenizer(stories260k_dir / "tok512.model"), ["x", ""])
