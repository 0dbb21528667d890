"""Text ↔ token ids: one interface over sentencepiece ``.model`` files and Hugging Face ``tokenizer.json``.

``load_tokenizer(path)`` accepts a sentencepiece model (Llama 1/2, Mistral v1, Gemma, llama2.c's
``tok512.model``), a ``tokenizer.json`` (Llama 3, Qwen, …) or a model folder holding either. Special
tokens (BOS, EOS, PAD, whether BOS is added) come from the model's own files, read by
``llm_jax.special_tokens``.

A folder holding both files loads ``tokenizer.json``, the file ``transformers`` uses, so ids match the
reference implementation the rest of llm_jax is tested against; pass ``format=TokenizerFormat.SENTENCEPIECE``
to load ``tokenizer.model`` instead. The two disagree where a conversion lost sentencepiece behaviour,
e.g. stories260K's ``remove_extra_whitespaces`` (whitespace runs) — there the sentencepiece file is what
the model was trained with.

Decoding follows the underlying library exactly: ``sentencepiece``'s ``decode`` (which drops the
dummy-prefix space of the first piece) and ``tokenizers``' ``decode(ids, skip_special_tokens=...)``.
Special tokens (BOS, EOS, chat markers) are skipped by default, which is what generated text wants.
"""

from __future__ import annotations

import abc
import enum
import functools
import pathlib
import re
from collections.abc import Sequence

import sentencepiece
import tokenizers

from llm_jax.special_tokens import NO_CONFIGS, ModelConfigs, SpecialTokens, resolve_special_tokens

BYTE_PIECE = re.compile("<0x[0-9A-Fa-f]{2}>")


class TokenizerFormat(enum.Enum):
    SENTENCEPIECE = "sentencepiece"  # a sentencepiece ModelProto, usually tokenizer.model
    HF_TOKENIZERS = "tokenizers"  # a Hugging Face tokenizers JSON, usually tokenizer.json


class Tokenizer(abc.ABC):
    """Encode text to ids and decode ids to text; one behaviour whatever the file format."""

    path: pathlib.Path  # the tokenizer file
    special: SpecialTokens

    @property
    def bos_id(self) -> int | None:
        return self.special.bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.special.eos_ids

    @property
    def pad_id(self) -> int | None:
        return self.special.pad_id

    @property
    def add_bos_by_default(self) -> bool:
        return self.special.add_bos

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (every id < vocab_size decodes)."""

    @property
    @abc.abstractmethod
    def special_ids(self) -> frozenset[int]:
        """Special tokens: sentencepiece's control pieces and ``<unk>``, a tokenizer.json's special added tokens.

        ``encode(parse_special=True)`` reads their text as the token; ``decode(skip_special=True)`` gives
        no text for them — except sentencepiece's ``<unk>``, which decodes to " ⁇ " as sentencepiece does.
        """

    @property
    @abc.abstractmethod
    def byte_ids(self) -> frozenset[int]:
        """Byte-fallback ids (pieces ``<0x00>`` … ``<0xFF>``): one raw byte each, not a whole character."""

    @property
    @abc.abstractmethod
    def byte_runs_decode_as_one(self) -> bool:
        """Whether a run of byte tokens decodes as one unit: if the run is not valid UTF-8 as a whole,
        every byte gives U+FFFD, even those that formed complete characters (``tokenizers``' ByteFallback
        decoder). sentencepiece decodes a run character by character."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of an id, in the file's own spelling (``▁the``, ``Ġthe``, ``<0x0A>``)."""

    @abc.abstractmethod
    def piece_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry, None when the vocabulary has no such entry."""

    @abc.abstractmethod
    def _encode_text(self, text: str, *, parse_special: bool) -> list[int]:
        """Ids of ``text`` without BOS/EOS."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; with ``skip_special`` the special tokens (BOS, EOS, chat markers) give no text."""

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_bos``: None follows the model's files (``add_bos_by_default``); True on a tokenizer without
        BOS adds nothing. ``parse_special``: a special token's text (``<|im_start|>``, ``<s>``) becomes its
        id, as in ``transformers`` — what a rendered chat template needs; False encodes it as plain text.
        """
        if add_bos is None:
            add_bos = self.special.add_bos
        ids = self._encode_text(text, parse_special=parse_special)
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def _valid_ids(self, ids: Sequence[int]) -> list[int]:
        ids = list(map(int, ids))  # numpy / jax integers too
        vocab_size = self.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab_size):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            raise ValueError(f"token ids {bad[:8]} out of range for {self.path} ({vocab_size=})")
        return ids

    def token_to_id(self, token: str, *, source: str) -> int:
        """The id of a special token named in a config file; an error names the file when it is missing."""
        token_id = self.piece_to_id(token)
        if token_id is None:
            raise ValueError(f"{source} names token {token!r}, which is not in the tokenizer's vocabulary")
        return token_id


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model; ids and text equal ``sentencepiece.SentencePieceProcessor``'s."""

    def __init__(self, model_file: pathlib.Path, configs: ModelConfigs = NO_CONFIGS, *, content: bytes | None = None):
        self.path = model_file  # with ``content``: where the serialized model came from (a GGUF file)
        try:
            if content is not None:
                self._sp = sentencepiece.SentencePieceProcessor(model_proto=content)
            else:
                self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        except (RuntimeError, OSError) as error:
            raise ValueError(f"{model_file} is not a readable sentencepiece model: {error}") from error
        size = self._sp.get_piece_size()
        # Control pieces (<s>, </s>) are never produced from text by sentencepiece and decode to "";
        # <unk> decodes to " ⁇ ". transformers treats all of them as special tokens.
        self._special_ids = frozenset(i for i in range(size) if self._sp.is_control(i) or self._sp.is_unknown(i))
        special_pieces = sorted((self._sp.id_to_piece(i) for i in self._special_ids), key=len, reverse=True)
        self._special_pattern = (
            re.compile("(" + "|".join(map(re.escape, special_pieces)) + ")") if special_pieces else None
        )
        # sentencepiece drops the dummy-prefix space of the output's first piece only; decoding text
        # after a special token separately must put that space back.
        word_id = next((i for i in range(size) if re.fullmatch("▁[^▁]+", self._sp.id_to_piece(i))), None)
        self._drops_first_space = word_id is not None and not self._sp.decode([word_id]).startswith(" ")
        library = SpecialTokens(
            bos_id=_non_negative(self._sp.bos_id()),
            eos_ids=tuple(i for i in [self._sp.eos_id()] if i >= 0),
            pad_id=_non_negative(self._sp.pad_id()),
            add_bos=bool(configs.get("tokenizer_config.json").get("add_bos_token", True)),
        )
        self.special = resolve_special_tokens(
            configs, library, token_to_id=self.token_to_id, vocab_size=self.vocab_size
        )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @functools.cached_property
    def byte_ids(self) -> frozenset[int]:
        return frozenset(i for i in range(self.vocab_size) if self._sp.is_byte(i))

    @property
    def byte_runs_decode_as_one(self) -> bool:
        return False

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def piece_to_id(self, piece: str) -> int | None:
        token_id = self._sp.piece_to_id(piece)
        # sentencepiece answers the unk id for an unknown piece.
        return token_id if self._sp.id_to_piece(token_id) == piece else None

    def _encode_text(self, text: str, *, parse_special: bool) -> list[int]:
        if not parse_special or self._special_pattern is None:
            return self._sp.encode(text)
        # Each stretch of text between special tokens is encoded on its own, with its own dummy prefix:
        # what Meta's Llama 2 chat code does and transformers' sentencepiece tokenizers with legacy=True.
        ids: list[int] = []
        for i, part in enumerate(self._special_pattern.split(text)):
            if i % 2:
                ids.append(self._sp.piece_to_id(part))
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        ids = self._valid_ids(ids)
        if skip_special or not any(i in self._special_ids for i in ids):
            return self._sp.decode(ids)
        out, run = [], []
        for position, token_id in enumerate([*ids, None]):
            if token_id is not None and token_id not in self._special_ids:
                run.append(token_id)
                continue
            if run:
                text = self._sp.decode(run)
                starts_output = position == len(run)
                if not starts_output and self._drops_first_space and self._sp.id_to_piece(run[0]).startswith("▁"):
                    text = " " + text
                out.append(text)
                run = []
            if token_id is not None:
                out.append(self._sp.id_to_piece(token_id))
        return "".join(out)


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``; ids and text equal the ``tokenizers`` library's."""

    def __init__(self, tokenizer_file: pathlib.Path, configs: ModelConfigs = NO_CONFIGS, *, content: str | None = None):
        self.path = tokenizer_file  # with ``content``: where the JSON came from (a GGUF file)
        try:
            if content is not None:
                self._tk = tokenizers.Tokenizer.from_str(content)
            else:
                self._tk = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{tokenizer_file} is not a readable Hugging Face tokenizer.json: {error}") from error
        self._tk_plain: tokenizers.Tokenizer | None = None  # copy that reads special tokens as text
        added = self._tk.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        # The post-processor is what adds BOS in a tokenizer.json (a TemplateProcessing, possibly
        # inside a Sequence); whatever it puts in front of an empty text is the BOS it adds.
        prefix = self._tk.encode("", add_special_tokens=True).ids
        library = SpecialTokens(bos_id=prefix[0] if prefix else None, eos_ids=(), pad_id=None, add_bos=bool(prefix))
        self.special = resolve_special_tokens(
            configs, library, token_to_id=self.token_to_id, vocab_size=self.vocab_size
        )

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @functools.cached_property
    def byte_ids(self) -> frozenset[int]:
        # The spelling tokenizers' ByteFallback decoder recognises; byte-level BPE vocabularies have none.
        return frozenset(i for piece, i in self._tk.get_vocab().items() if BYTE_PIECE.fullmatch(piece))

    @property
    def byte_runs_decode_as_one(self) -> bool:
        return bool(self.byte_ids)  # byte pieces exist for the ByteFallback decoder

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} out of range for {self.path} (vocab_size={self.vocab_size})")
        return piece

    def piece_to_id(self, piece: str) -> int | None:
        return self._tk.token_to_id(piece)

    def _encode_text(self, text: str, *, parse_special: bool) -> list[int]:
        if parse_special:
            return self._tk.encode(text, add_special_tokens=False).ids
        if self._tk_plain is None:
            self._tk_plain = tokenizers.Tokenizer.from_str(self._tk.to_str())
            self._tk_plain.encode_special_tokens = True
        return self._tk_plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tk.decode(self._valid_ids(ids), skip_special_tokens=skip_special)


def load_tokenizer(path: str | pathlib.Path, *, format: TokenizerFormat | None = None) -> Tokenizer:
    """Load a tokenizer file (``.model`` / ``tokenizer.json`` / a ``.gguf``) or a model folder holding one.

    Config files next to it (``tokenizer_config.json``, ``special_tokens_map.json``,
    ``generation_config.json``, ``config.json``) set the special tokens; see the module docstring.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if path.suffix == ".gguf":  # the vocabulary in a GGUF file's metadata
        from llm_jax.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    file, file_format = _tokenizer_file(path, format) if path.is_dir() else (path, _file_format(path, format))
    configs = ModelConfigs.read(file.parent)
    match file_format:
        case TokenizerFormat.SENTENCEPIECE:
            return SentencePieceTokenizer(file, configs)
        case TokenizerFormat.HF_TOKENIZERS:
            return HFTokenizer(file, configs)


def _tokenizer_file(folder: pathlib.Path, format: TokenizerFormat | None) -> tuple[pathlib.Path, TokenizerFormat]:
    json_file = folder / "tokenizer.json"
    model_files = sorted(folder.glob("*.model"))
    if folder / "tokenizer.model" in model_files:
        model_files = [folder / "tokenizer.model"]
    if format in (None, TokenizerFormat.HF_TOKENIZERS) and json_file.is_file():
        return json_file, TokenizerFormat.HF_TOKENIZERS
    if format in (None, TokenizerFormat.SENTENCEPIECE) and len(model_files) == 1:
        return model_files[0], TokenizerFormat.SENTENCEPIECE
    if len(model_files) > 1 and format is not TokenizerFormat.HF_TOKENIZERS:
        names = [f.name for f in model_files]
        raise ValueError(f"{folder} holds several sentencepiece models {names}; pass the file itself")
    wanted = {
        None: "tokenizer.json or a sentencepiece .model file",
        TokenizerFormat.HF_TOKENIZERS: "tokenizer.json",
        TokenizerFormat.SENTENCEPIECE: "a sentencepiece .model file",
    }[format]
    found = sorted(p.name for p in folder.iterdir())
    raise FileNotFoundError(f"{folder} has no tokenizer: expected {wanted}; found {found}")


def _file_format(file: pathlib.Path, format: TokenizerFormat | None) -> TokenizerFormat:
    detected = {".model": TokenizerFormat.SENTENCEPIECE, ".json": TokenizerFormat.HF_TOKENIZERS}.get(file.suffix)
    if detected is None:
        raise ValueError(f"unrecognised tokenizer file {file}: expected a sentencepiece .model or a tokenizer.json")
    if format is not None and format is not detected:
        raise ValueError(f"{file} is a {detected.value} file, not {format.value}")
    return detected


def _non_negative(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None
