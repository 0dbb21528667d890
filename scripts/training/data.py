"""Training text → token rows: a sentencepiece tokenizer trained on the text, and one document per
fixed-length, right-padded row.

Each row is ``BOS doc EOS`` followed by padding; its ``length`` counts the real tokens and the loss
ignores everything after it. One document per row, rather than documents concatenated across rows,
costs some padding but means every row starts at position 0 with BOS, as generation does, and that all
the context a token sees belongs to its own story: the names earlier in the row are the ones to repeat.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterable, Iterator

import numpy as np
import sentencepiece

# Fixed special-token ids of the tokenizers trained here (sentencepiece's defaults, as Llama's).
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
PAD_ID = 0  # padding value in rows; never a target (the loss mask excludes it)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> bytes:
    """A serialized sentencepiece BPE model trained on ``texts`` (one document each, no newlines).

    Llama-style settings: byte fallback (any text encodes, no UNK in practice), identity normalization,
    digits split. Deterministic: one thread, every sentence used in order, and the model is written to
    memory so no file path ends up in its trainer spec.
    """
    model = io.BytesIO()
    with open(os.devnull, "w") as quiet:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=model, logstream=quiet,
            model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
            split_digits=True, allow_whitespace_only_pieces=True,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=1 << 16)
    return model.getvalue()


def encode_documents(processor: sentencepiece.SentencePieceProcessor, texts: Iterable[str]) -> Iterator[list[int]]:
    """``[BOS, *ids, EOS]`` for each text."""
    for text in texts:
        yield [BOS_ID, *processor.encode(text), EOS_ID]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rows:
    """R rows of T tokens: ``tokens_RT`` right-padded with PAD_ID, ``lengths_R`` real tokens per row."""

    tokens_RT: np.ndarray  # int32 [R, T]
    lengths_R: np.ndarray  # int32 [R]

    def __len__(self) -> int:
        return len(self.lengths_R)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths_R.sum())


def pad_rows(documents: Iterable[list[int]], *, row_len: int, num_rows: int | None = None) -> Rows:
    """One document per row of ``row_len`` tokens, right-padded with PAD_ID.

    A document longer than a row continues in the next rows. With ``num_rows``, stops once that many
    rows exist (``documents`` may be endless); otherwise takes every document.
    """
    if row_len < 2:
        raise ValueError(f"row_len={row_len} must be at least 2 (an input and a target token)")
    rows: list[list[int]] = []
    for doc in documents:
        rows.extend(doc[i:i + row_len] for i in range(0, len(doc), row_len))
        if num_rows is not None and len(rows) >= num_rows:
            break
    if num_rows is not None:
        if len(rows) < num_rows:
            raise ValueError(f"documents ran out after {len(rows)} of {num_rows} rows")
        rows = rows[:num_rows]
    tokens_RT = np.full((len(rows), row_len), PAD_ID, np.int32)
    for r, row in enumerate(rows):
        tokens_RT[r, :len(row)] = row
    return Rows(tokens_RT=tokens_RT, lengths_R=np.array([len(row) for row in rows], np.int32))


def batches(rows: Rows, *, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Consecutive ``(tokens_BT, lengths_B)`` batches in row order; a last partial batch is dropped."""
    for start in range(0, len(rows) - batch_size + 1, batch_size):
        yield rows.tokens_RT[start:start + batch_size], rows.lengths_R[start:start + batch_size]
