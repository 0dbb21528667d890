"""Guided decoding (structured outputs): a request's tokens constrained to a JSON schema, a regular
expression, a list of choices or a grammar.

The constraint is compiled by ``llguidance`` (the grammar engine vLLM and llama.cpp users know) against
the model's vocabulary. Before each of the request's steps the host asks its :class:`Matcher` which tokens
may come next, as a bitmask of the vocabulary (one bit per token, 32 to an int32); the device step sets
the logits of every other token to -inf (:func:`apply_bitmask`) before the processors and sampling, so
greedy, seeded sampling, penalties and log-probabilities all see the constrained distribution. After the
step the matcher consumes the tokens chosen. Once the constraint is complete and nothing may follow, the
request ends (finish reason "stop"); where the constraint may end or go on (``a+``), the model's
end-of-sequence token is allowed and ends it. With speculative decoding a step verifies several positions
of a request, each under its own mask: what may follow the proposals before it
(:meth:`Matcher.fill_ahead`).

    engine.add_request("r", prompt, guided=llm_jax.guided.Json({"type": "object", ...}))

What the model sees as text is the tokens' byte forms (:func:`llm_jax.stop_matching.token_bytes`):
sentencepiece's ``▁`` is a space, so a JSON value may open with a space-led token (``▁{``) only where
the constraint allows a space; JSON schemas are compiled without free whitespace (``", "`` and ``": "``
between items and after keys) unless the schema's ``x-guidance`` options say otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.tokenizer import Tokenizer

WORD_BITS = 32  # tokens per bitmask word
# How JSON schemas are written out unless the schema's "x-guidance" says otherwise: one space after
# separators, none elsewhere (a small model given free whitespace may emit newlines without end).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedError(ValueError):
    """A constraint that does not compile (a bad schema, regular expression or grammar)."""


@dataclasses.dataclass(frozen=True)
class Json:
    """Text that is one JSON value matching ``schema`` (a JSON Schema, as a dict or its text); None:
    any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""

    schema: Mapping[str, Any] | str | None = None

    def grammar(self) -> str:
        import llguidance

        schema = {"type": "object"} if self.schema is None else self.schema
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as error:
            raise GuidedError(f"the JSON schema is not valid: {error}") from None


@dataclasses.dataclass(frozen=True)
class Regex:
    """Text that matches ``pattern`` whole (Rust ``regex`` syntax: no look-around, no back-references)."""

    pattern: str

    def grammar(self) -> str:
        import llguidance

        return llguidance.LLMatcher.grammar_from_regex(self.pattern)


@dataclasses.dataclass(frozen=True)
class Choice:
    """Text that is exactly one of ``options``."""

    options: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.options, str) or not self.options or not all(isinstance(o, str) for o in self.options):
            raise GuidedError(f"choices must be a non-empty list of strings, got {self.options!r}")
        object.__setattr__(self, "options", tuple(self.options))

    def grammar(self) -> str:
        import llguidance

        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in self.options))


@dataclasses.dataclass(frozen=True)
class Grammar:
    """Text in the language of a context-free grammar: Lark syntax (llguidance's dialect) or llama.cpp's
    GBNF, told apart by llguidance."""

    text: str

    def grammar(self) -> str:
        import llguidance

        try:
            return llguidance.grammar_from("grammar", self.text)
        except ValueError as error:
            raise GuidedError(str(error)) from None


Guided = Union[Json, Regex, Choice, Grammar]


class Vocabulary:
    """A model's vocabulary as llguidance reads it: every token's byte form (special tokens marked as
    llguidance marks them, 0xFF and their name), the end-of-sequence ids, and an encoder of text into the
    tokens that spell it exactly (no BOS, no sentencepiece dummy-prefix space)."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int], vocab_size: int):
        import llguidance

        from llm_jax.stop_matching import token_bytes

        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        forms = list(token_bytes(tokenizer))
        # A token spelled as another is one llguidance keeps once: a byte-fallback token (<0x61>) that spells
        # a piece's bytes ("a") is one no tokenization uses, so it stays out of the masks, as a special token.
        self._by_form: dict[bytes, int] = {}
        for i, form in enumerate(forms):
            if form and i not in tokenizer.special_ids and i not in tokenizer.byte_ids:
                self._by_form.setdefault(form, i)
        for i in tokenizer.special_ids | {b for b in tokenizer.byte_ids if forms[b] in self._by_form}:
            forms[i] = b"\xff" + tokenizer.id_to_piece(i).encode("utf-8")
        forms += [b"\xff<unused_%d>" % i for i in range(len(forms), vocab_size)]  # rows past the tokenizer's
        self.forms = forms
        eos = list(eos_ids) or list(tokenizer.eos_ids)
        if not eos:
            raise GuidedError("guided decoding needs an end-of-sequence token, and the model has none")
        wrapper = _Wrapper(tokens=forms, eos_token_id=eos[0], bos_token_id=tokenizer.bos_id,
                           special_token_ids=sorted(tokenizer.special_ids), encode=self.encode)
        self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos)

    @property
    def words(self) -> int:
        """int32 words in a row of the bitmask."""
        return -(-self.vocab_size // WORD_BITS)

    def _spell(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.forms[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        """Tokens whose byte forms spell ``text`` (llguidance asks for the tokens of text a constraint
        forces): the tokenizer's own where they spell it. Sentencepiece adds a space in front (a dummy
        prefix: the text is encoded after a newline, whose tokens are then dropped) and may drop runs of
        spaces and trailing ones (the text is then encoded word by word, spaces on their own)."""
        ids = self._exact(text)
        if ids is not None:
            return ids
        out = []
        for part in re.findall(r" ?[^ ]+| ", text):
            ids = self._exact(part)
            if ids is None:
                token = self._by_form.get(part.encode("utf-8"))
                ids = [token] if token is not None else self.llg.greedy_tokenize(part)
            out += ids
        return out

    def _exact(self, text: str) -> list[int] | None:
        data = text.encode("utf-8")
        ids = self.tokenizer.encode(text, add_bos=False, parse_special=False)
        if self._spell(ids) == data:
            return ids
        ids = self.tokenizer.encode("\n" + text, add_bos=False, parse_special=False)
        for i in range(len(ids)):
            if self._spell(ids[:i + 1]) in (b"\n", b" \n"):
                return ids[i + 1:] if self._spell(ids[i + 1:]) == data else None
        return None


@dataclasses.dataclass(frozen=True)
class _Wrapper:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    tokens: list[bytes]
    eos_token_id: int
    bos_token_id: int | None
    special_token_ids: list[int]
    encode: Any

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer: Tokenizer, eos_ids: tuple[int, ...], vocab_size: int) -> Vocabulary:
    """The :class:`Vocabulary` of a model's tokenizer (built once: ~1 s for 128K tokens)."""
    return Vocabulary(tokenizer, eos_ids, vocab_size)


def check(vocab: Vocabulary, guided: Guided) -> str:
    """``guided`` compiled for ``vocab`` (llguidance's grammar text), or a :class:`GuidedError` saying why
    it does not compile."""
    import llguidance

    if not isinstance(guided, (Json, Regex, Choice, Grammar)):
        raise TypeError(f"guided must be llm_jax.guided.Json, Regex, Choice or Grammar, got {type(guided).__name__}")
    try:
        grammar = guided.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, vocab.llg)
    except GuidedError:
        raise
    except Exception as exception:  # what llguidance refuses by raising (a schema of the wrong shape, ...)
        error = str(exception) or type(exception).__name__
    if error:
        raise GuidedError(f"the {type(guided).__name__.lower()} constraint does not compile: {error}")
    return grammar


class Matcher:
    """One request's place in its constraint: which tokens may come next, and the tokens it chose."""

    def __init__(self, vocab: Vocabulary, guided: Guided):
        import llguidance

        grammar = check(vocab, guided)
        self.vocab = vocab
        self._matcher = llguidance.LLMatcher(vocab.llg, grammar, log_level=0)
        if self._matcher.is_error():
            raise GuidedError(f"the {type(guided).__name__.lower()} constraint does not compile: "
                              f"{self._matcher.get_error()}")

    def fill(self, row_W: np.ndarray) -> None:
        """Write the allowed next tokens into ``row_W`` (int32 [words], C-contiguous)."""
        if row_W.dtype != np.int32 or row_W.shape != (self.vocab.words,) or not row_W.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a bitmask row is int32 [{self.vocab.words}], contiguous")
        self._matcher.unsafe_compute_mask_ptr(row_W.ctypes.data, row_W.nbytes)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the constraint allows one after another (nothing consumed)."""
        return self._matcher.validate_tokens([int(t) for t in tokens])

    def fill_ahead(self, rows_JW: np.ndarray, tokens: Sequence[int]) -> None:
        """Speculative decoding's masks: into row j of ``rows_JW`` (int32 [J, words]) what may follow
        ``tokens[:j]``, for every j up to the first token the constraint forbids, or up to the token that
        completes it (that token is rejected, or ends the request: nothing after it is read); the rows
        after are left as they are. The matcher ends where it started."""
        self.fill(rows_JW[0])
        valid = self.valid_prefix(tokens[:len(rows_JW) - 1])
        consumed = 0
        while consumed < valid and not self.done:
            self._matcher.consume_token(int(tokens[consumed]))
            consumed += 1
            if not self.done:
                self.fill(rows_JW[consumed])
        if consumed and not self._matcher.rollback(consumed):
            raise RuntimeError(f"llguidance did not roll back {consumed} tokens: {self._matcher.get_error()}")

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance past ``tokens``; False when one of them breaks the constraint (the matcher then stays
        in error)."""
        return self._matcher.consume_tokens([int(t) for t in tokens])

    @property
    def done(self) -> bool:
        """The constraint is complete and nothing may follow (or a token broke it)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


def all_allowed(B: int, vocab_size: int) -> np.ndarray:
    """A bitmask [B, words] allowing every token to every row."""
    return np.full((B, -(-vocab_size // WORD_BITS)), -1, np.int32)


def allowed_tokens(row_W: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (host, for tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(row_W, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def apply_bitmask(logits_BV: jax.Array, allowed_BW: jax.Array) -> jax.Array:
    """``logits_BV`` with every token whose bit is clear in ``allowed_BW`` (int32 [B, ⌈V / 32⌉]) at -inf;
    rows of all ones (-1) unchanged. Leading axes of the logits beyond the mask's (positions) broadcast: a
    mask [B, J, W] gives each of J positions its own."""
    V = logits_BV.shape[-1]
    bits_BWK = (allowed_BW[..., None] >> jnp.arange(WORD_BITS, dtype=jnp.int32)) & 1
    allowed_BV = bits_BWK.reshape(*allowed_BW.shape[:-1], -1)[..., :V].astype(bool)
    missing = (1,) * (logits_BV.ndim - allowed_BV.ndim)
    allowed_BV = allowed_BV.reshape(allowed_BV.shape[:1] + missing + allowed_BV.shape[1:])
    return jnp.where(allowed_BV, logits_BV, -jnp.inf)
