"""Stop strings matched in streamed text, however the text is split into pieces."""

import random

import pytest

from llm_jax.detokenize import IncrementalDetokenizer
from llm_jax.stop_strings import Released, StopStringMatcher
from llm_jax.tokenizer import load_tokenizer


def first_stop(text: str, stop_strings) -> tuple[str, str | None]:
    """Oracle: reveal ``text`` one character at a time; the first stop string the text ends with wins
    (the longest if several end there). Returns (text before it, the stop string)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stop_strings, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], stop
    return text, None


def stream(matcher: StopStringMatcher, pieces, expected_text: str) -> tuple[str, str | None]:
    """Feed pieces; check that what is released so far is always a prefix of the expected text."""
    shown = ""
    for piece in pieces:
        released = matcher.push(piece)
        shown += released.text
        assert expected_text.startswith(shown), (pieces, shown)
        if released.stop is not None:
            return shown, released.stop
    return shown + matcher.finish(), None


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, max(len(text) - 1, 0)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(
    ("text", "stop_strings"),
    [
        ("The answer is 42.\nUser: and now?", ["\nUser:"]),
        ("no stop string in here", ["</s>", "###"]),
        ("partial \nUse but not the whole", ["\nUser:"]),  # a prefix that never completes is released
        ("xabcd", ["bcd", "abc"]),  # "abc" is complete first
        ("abcd", ["abcd", "bc"]),  # "bc" is complete first although "abcd" starts earlier
        ("ab", ["b", "ab"]),  # both end at once: the one starting earliest
        ("aaab", ["aab"]),  # the stop string overlaps its own false start
        ("emoji 😀👍 stop", ["👍"]),
        ("STOP at the start", ["STOP"]),
        ("ends with the stop string END", ["END"]),
        ("<|im_end|><|im_start|>", ["<|im_end|>", "<|im_start|>"]),
    ],
)
def test_any_split_gives_the_oracle_result(text, stop_strings):
    expected = first_stop(text, stop_strings)
    rng = random.Random(0)
    splits = [[text], list(text)] + [random_split(rng, text) for _ in range(50)]
    for pieces in splits:
        assert stream(StopStringMatcher(stop_strings), pieces, expected[0]) == expected, pieces


def test_random_texts_and_stop_strings():
    rng = random.Random(1)
    alphabet = "ab\n😀"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        expected = first_stop(text, stops)
        assert stream(StopStringMatcher(stops), random_split(rng, text), expected[0]) == expected, (text, stops)


def test_held_back_text_waits_for_the_next_piece():
    matcher = StopStringMatcher(["\nUser:"])
    assert matcher.push("Sure.\nUs") == Released(text="Sure.")
    assert matcher.push("ually") == Released(text="\nUsually")
    assert matcher.push(" yes\n") == Released(text=" yes")
    assert matcher.push("User: next") == Released(text="", stop="\nUser:")
    with pytest.raises(RuntimeError, match=r"push\(\) after stop string '\\nUser:' matched"):
        matcher.push("more")


def test_stop_string_across_tokens(llama2_tokenizer_path):
    """Detokenized pieces of real tokens: the stop string starts inside one token and ends in another."""
    tokenizer = load_tokenizer(llama2_tokenizer_path)
    ids = tokenizer.encode("The end.\n\nUser: what next?", add_bos=False)
    pieces = [tokenizer.id_to_piece(i) for i in ids]
    assert "\n\nUser:" not in pieces  # it really spans tokens
    detokenizer, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher([".\n\nUser", "never"])
    shown = ""
    for token_id in ids:
        released = matcher.push(detokenizer.push(token_id))
        shown += released.text
        if released.stop:
            break
    assert (shown, released.stop) == ("The end", ".\n\nUser")


def test_invalid_stop_strings():
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        StopStringMatcher(["ok", ""])
    assert StopStringMatcher(["a", "a"]).stop_strings == ("a",)
    assert StopStringMatcher([]).push("text") == Released(text="text")
