"""Stop strings detected on device, inside the decode loop: no host round trip per step.

Each row keeps a rolling window of the last ``L - 1`` bytes of its output (L: the longest stop string,
in UTF-8 bytes). When a token arrives, the window followed by the token's first ``L - 1`` bytes is
compared with every stop string at every offset, and a precomputed table says whether the token alone
contains one. So a stop string is found wherever it falls: inside one token, or spread over any number
of tokens whose boundaries cut it anywhere (mid-character included: byte-fallback tokens carry single
bytes).

What is guaranteed: a row finishes (``FinishReason.STOP``) at the first output token after which the
concatenated **byte forms** of its output tokens contain one of its stop strings. A token's byte form is
what it adds to decoded text: sentencepiece's ``▁`` is a space, a ``<0xNN>`` byte-fallback piece is that
byte, a byte-level BPE piece (GPT-2 / Llama 3 alphabet) is its bytes, and special tokens are empty. The
decoded text differs from the byte forms in one place only: sentencepiece drops the space of the first
piece of a text, so a stop string beginning with a space is not matched at the very start of an output
whose text starts there. Prompt tokens never take part (the window starts empty).

The host cuts the final text at the stop string (:class:`llm_jax.stop_strings.StopStringMatcher`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.tokenizer import Tokenizer

_BYTE_PIECE = re.compile("<0x([0-9A-Fa-f]{2})>")
_NO_BYTE = -1  # window slots before the output's first byte
_PAST_TOKEN = -2  # token-prefix slots past the token's end


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for bytes (``bytes_to_unicode``), inverted: character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """Byte-level BPE vocabularies spell the space byte ``Ġ``."""
    space = tokenizer.piece_to_id("Ġ")
    return space is not None and tokenizer.decode([space], skip_special=False) == " "


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer: Tokenizer) -> tuple[bytes, ...]:
    """The byte form of every token id (see the module docstring)."""
    byte_level = _is_byte_level(tokenizer)
    decoder = _gpt2_byte_decoder()
    forms = []
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_piece(token_id)
        if token_id in tokenizer.special_ids:
            forms.append(b"")
        elif match := _BYTE_PIECE.fullmatch(piece):
            forms.append(bytes([int(match.group(1), 16)]))
        elif byte_level and all(c in decoder for c in piece):
            forms.append(bytes(decoder[c] for c in piece))
        else:
            forms.append(piece.replace("▁", " ").encode("utf-8"))
    return tuple(forms)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopTable:
    """Device tables for a set of Q stop strings over a vocabulary of V tokens (shared by the batch)."""

    strings_QL: jax.Array  # int32 bytes, padded with _NO_BYTE
    lengths_Q: jax.Array  # int32
    head_VP: jax.Array  # uint8: each token's first P = L - 1 bytes
    tail_VP: jax.Array  # uint8: each token's last P bytes (left-padded)
    token_len_V: jax.Array  # int32: bytes per token
    contains_QV: jax.Array  # bool: the token alone contains the stop string

    @property
    def window(self) -> int:
        return self.head_VP.shape[1]

    @classmethod
    def build(cls, tokenizer: Tokenizer, stop_strings: Sequence[str]) -> "StopTable":
        return _build(tokenizer, tuple(stop_strings))


@functools.lru_cache(maxsize=16)
def _build(tokenizer: Tokenizer, stop_strings: tuple[str, ...]) -> StopTable:
    encoded = [s.encode("utf-8") for s in stop_strings]
    if not encoded or any(not s for s in encoded):
        raise ValueError(f"stop strings must be non-empty; got {list(stop_strings)!r}")
    L = max(map(len, encoded))
    P = L - 1
    forms = token_bytes(tokenizer)
    V = len(forms)
    head = np.zeros((V, P), np.uint8)
    tail = np.zeros((V, P), np.uint8)
    for token_id, form in enumerate(forms):
        first, last = form[:P], form[max(0, len(form) - P):]
        head[token_id, : len(first)] = np.frombuffer(first, np.uint8)
        tail[token_id, P - len(last):] = np.frombuffer(last, np.uint8)
    strings = np.full((len(encoded), L), _NO_BYTE, np.int32)
    for q, s in enumerate(encoded):
        strings[q, : len(s)] = np.frombuffer(s, np.uint8)
    contains = np.array([[s in form for form in forms] for s in encoded], bool)
    table = StopTable(strings_QL=strings, lengths_Q=np.array([len(s) for s in encoded], np.int32),
                      head_VP=head, tail_VP=tail, token_len_V=np.array([len(f) for f in forms], np.int32),
                      contains_QV=contains)
    return jax.tree.map(jnp.asarray, table)  # on device once, reused by every generation that asks


def active_rows(stop_strings: Sequence[str], rows: Sequence[Sequence[str]]) -> np.ndarray:
    """[B, Q] bool: which of ``stop_strings`` (the table's order) each row stops on."""
    index = {s: q for q, s in enumerate(stop_strings)}
    active = np.zeros((len(rows), len(stop_strings)), bool)
    for b, row in enumerate(rows):
        active[b, [index[s] for s in row]] = True
    return active


def empty_window(batch_size: int, table: StopTable) -> jax.Array:
    """The byte window of rows that have generated nothing: [B, P] int32."""
    return jnp.full((batch_size, table.window), _NO_BYTE, jnp.int32)


def push(window_BP: jax.Array, token_B: jax.Array, active_B: jax.Array, table: StopTable,
         stop_strings_BQ: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Append each active row's token to its window; return the new window and whether a stop string of
    the row ends in this token [B] bool."""
    B, P = window_BP.shape
    L = table.strings_QL.shape[1]
    length_B1 = table.token_len_V[token_B][:, None]
    head_BP = table.head_VP[token_B].astype(jnp.int32)
    # Window, then the token's first bytes: every occurrence overlapping the token but not inside it
    # lies in here, starting in the window.
    text_BX = jnp.concatenate([window_BP, jnp.where(jnp.arange(P) < length_B1, head_BP, _PAST_TOKEN),
                               jnp.full((B, L), _PAST_TOKEN, jnp.int32)], axis=1)
    starts_S = np.arange(P)
    at_BSL = text_BX[:, starts_S[:, None] + np.arange(L)]  # bytes from each start
    lengths_Q1 = table.lengths_Q[:, None]
    same_BQSL = (at_BSL[:, None] == table.strings_QL[None, :, None, :]) | (np.arange(L) >= lengths_Q1[:, :, None])
    # Found where all bytes match and the occurrence ends past the window, i.e. inside the new token.
    found_BQ = jnp.any(jnp.all(same_BQSL, axis=-1) & (starts_S + lengths_Q1 > P), axis=-1)
    found_BQ |= table.contains_QV[:, token_B].T
    stopped_B = jnp.any(found_BQ & stop_strings_BQ, axis=-1) & active_B

    # The new window: the last P bytes of window + token.
    shifted_BP = jnp.take_along_axis(jnp.concatenate([window_BP, head_BP], axis=1),
                                     jnp.minimum(length_B1, P) + np.arange(P), axis=1)
    new_BP = jnp.where(length_B1 >= P, table.tail_VP[token_B].astype(jnp.int32), shifted_BP)
    return jnp.where(active_B[:, None], new_BP, window_BP), stopped_B
