"""The tokenizer a GGUF file carries (``tokenizer.ggml.*`` metadata) → our :class:`Tokenizer`.

GGUF stores a vocabulary, not a tokenizer file, so the file the vocabulary came from is rebuilt and read by
the library that defines its behaviour:

- ``tokenizer.ggml.model = "llama"`` (sentencepiece: Llama 1/2, Mistral v1, Gemma, llama2.c): pieces,
  scores and token types (whose numbers are sentencepiece's piece types) → a sentencepiece ``ModelProto``
  (BPE, with ``add_space_prefix`` / ``remove_extra_whitespaces`` / ``precompiled_charsmap`` as its
  normalizer), encoded by ``sentencepiece`` itself;
- ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: Llama 3, Qwen 2/3): tokens and merges → a
  ``tokenizers`` BPE, with the pre-tokenizer llama.cpp selects by ``tokenizer.ggml.pre`` (GGUF names the
  pre-tokenizer; it does not store its regex). Control tokens become special added tokens, user-defined
  ones plain added tokens.

Special tokens come from ``tokenizer.ggml.{bos,eos,eot,eom,unknown,padding}_token_id`` and
``add_bos_token``; generation ends on EOS and on llama.cpp's other end-of-generation ids (EOT, EOM). The
chat template is ``tokenizer.chat_template``. ``tokenizer_files`` gives the same tokenizer as files
(``tokenizer.model`` or ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) for a
converted checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

from llm_jax.special_tokens import ModelConfigs
from llm_jax.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from llm_jax.weights.from_gguf import GGUFFile, open_gguf

# gguf.TokenType, whose numbers are sentencepiece's ModelProto.SentencePiece.Type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ``tokenizer.ggml.pre`` → (split regex, or None for GPT-2's own ByteLevel regex; ignore_merges), as llama.cpp
# reads each name (llama-vocab.cpp). Llama 3 takes a whole pre-token found in the vocabulary before merging.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "gpt-2": (None, False),
    "llama-bpe": (_LLAMA3_REGEX, True),
    "llama3": (_LLAMA3_REGEX, True),
    "llama-v3": (_LLAMA3_REGEX, True),
    "qwen2": (_QWEN2_REGEX, False),
    "deepseek-r1-qwen": (_QWEN2_REGEX, False),
}
_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unknown": "unk", "padding": "pad"}


class GGUFTokenizerError(ValueError):
    """A GGUF vocabulary llm_jax cannot turn into a tokenizer (its type, pre-tokenizer, or a bad field)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFVocab:
    """The ``tokenizer.*`` metadata of a GGUF file."""

    source: str
    model: str  # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    special_ids: dict[str, int]  # bos / eos / eot / eom / unknown / padding → id
    add_bos: bool | None
    add_space_prefix: bool
    remove_extra_whitespaces: bool
    precompiled_charsmap: bytes
    chat_templates: dict[str, str]

    @classmethod
    def read(cls, f: GGUFFile) -> GGUFVocab:
        model = f.get("tokenizer.ggml.model")
        if model is None:
            raise GGUFTokenizerError(f"{f.path} has no tokenizer (no tokenizer.ggml.model)")
        tokens = f.get("tokenizer.ggml.tokens") or []
        n = len(tokens)
        ids = {}
        for name in ("bos", "eos", "eot", "eom", "unknown", "padding"):
            value = f.get(f"tokenizer.ggml.{name}_token_id")
            if value is not None:
                if not 0 <= int(value) < n:
                    raise GGUFTokenizerError(f"{f.path}: tokenizer.ggml.{name}_token_id={value} is not an id of "
                                             f"its {n} tokens")
                ids[name] = int(value)
        templates = {}
        if (default := f.get("tokenizer.chat_template")) is not None:
            templates["default"] = default
        for name in f.get("tokenizer.chat_templates") or []:
            templates[name] = f.require(f"tokenizer.chat_template.{name}")
        charsmap = f.get("tokenizer.ggml.precompiled_charsmap")
        return cls(source=str(f.path), model=model, pre=f.get("tokenizer.ggml.pre"), tokens=tokens,
                   types=f.get("tokenizer.ggml.token_type") or [NORMAL] * n,
                   scores=f.get("tokenizer.ggml.scores") or [0.0] * n, merges=f.get("tokenizer.ggml.merges") or [],
                   special_ids=ids, add_bos=f.get("tokenizer.ggml.add_bos_token"),
                   add_space_prefix=bool(f.get("tokenizer.ggml.add_space_prefix", True)),
                   remove_extra_whitespaces=bool(f.get("tokenizer.ggml.remove_extra_whitespaces", False)),
                   precompiled_charsmap=bytes(charsmap or []), chat_templates=templates)

    @property
    def eos_ids(self) -> list[int]:
        """What generation stops on: llama.cpp's end-of-generation ids."""
        return list(dict.fromkeys(self.special_ids[k] for k in ("eos", "eot", "eom") if k in self.special_ids))

    @property
    def adds_bos(self) -> bool:
        # llama.cpp's defaults when the file does not say: sentencepiece vocabularies add BOS, BPE ones not.
        return self.add_bos if self.add_bos is not None else self.model == "llama"

    def token(self, key: str) -> str | None:
        token_id = self.special_ids.get(key)
        return None if token_id is None else self.tokens[token_id]


# --- sentencepiece ---------------------------------------------------------------------------------------


def sentencepiece_model(vocab: GGUFVocab) -> bytes:
    """A serialized sentencepiece ``ModelProto`` with the vocabulary's pieces, scores and types."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    if len(vocab.types) != len(vocab.tokens) or len(vocab.scores) != len(vocab.tokens):
        raise GGUFTokenizerError(f"{vocab.source}: {len(vocab.tokens)} tokens but {len(vocab.types)} token types "
                                 f"and {len(vocab.scores)} scores")
    proto = spm.ModelProto()
    for piece, score, kind in zip(vocab.tokens, vocab.scores, vocab.types, strict=True):
        if kind not in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE):
            raise GGUFTokenizerError(f"{vocab.source}: token {piece!r} has unknown token type {kind}")
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, kind
    unknown = [i for i, kind in enumerate(vocab.types) if kind == UNKNOWN]
    if len(unknown) != 1:
        raise GGUFTokenizerError(f"{vocab.source}: a sentencepiece vocabulary needs exactly one unknown token, "
                                 f"found {len(unknown)}")
    trainer = proto.trainer_spec
    trainer.model_type = spm.TrainerSpec.BPE  # llama.cpp's SPM tokenizer merges pieces by score: BPE
    trainer.vocab_size = len(vocab.tokens)
    trainer.byte_fallback = BYTE in vocab.types
    trainer.unk_id, trainer.unk_piece = unknown[0], vocab.tokens[unknown[0]]
    for key, field in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = vocab.special_ids.get(key, -1)
        setattr(trainer, f"{field}_id", token_id)
        if token_id >= 0:
            setattr(trainer, f"{field}_piece", vocab.tokens[token_id])
    normalizer = proto.normalizer_spec
    normalizer.name = "identity" if not vocab.precompiled_charsmap else "user_defined"
    normalizer.precompiled_charsmap = vocab.precompiled_charsmap
    normalizer.add_dummy_prefix = vocab.add_space_prefix
    normalizer.remove_extra_whitespaces = vocab.remove_extra_whitespaces
    normalizer.escape_whitespaces = True
    return proto.SerializeToString()


# --- byte-level BPE --------------------------------------------------------------------------------------


def tokenizer_json(vocab: GGUFVocab) -> str:
    """A ``tokenizer.json`` for a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    if vocab.pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"{vocab.source}: BPE pre-tokenizer tokenizer.ggml.pre={vocab.pre!r} is not "
                                 f"supported; supported: {sorted(PRE_TOKENIZERS)}")
    regex, ignore_merges = PRE_TOKENIZERS[vocab.pre]
    if len(vocab.types) != len(vocab.tokens):
        raise GGUFTokenizerError(f"{vocab.source}: {len(vocab.tokens)} tokens but {len(vocab.types)} token types")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise GGUFTokenizerError(f"{vocab.source}: the vocabulary repeats tokens")
    merges = []
    for merge in vocab.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"{vocab.source}: merge {merge!r} is not two tokens separated by a space")
        merges.append((left, right))
    tk = tokenizers.Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=ignore_merges))
    if regex is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    # Tokens already in the vocabulary keep their ids as added tokens.
    added = [(token, kind == CONTROL) for token, kind in zip(vocab.tokens, vocab.types, strict=True)
             if kind in (CONTROL, USER_DEFINED)]
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t, s in added if s])
    tk.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t, s in added if not s])
    steps = [processors.ByteLevel(trim_offsets=False)]
    bos = vocab.token("bos")
    if vocab.adds_bos and bos is not None:
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                   special_tokens=[(bos, vocab.special_ids["bos"])]))
    tk.post_processor = processors.Sequence(steps)
    return tk.to_str()


# --- our tokenizer and its files -------------------------------------------------------------------------


def _configs(vocab: GGUFVocab) -> dict[str, dict[str, Any]]:
    """The tokenizer_config.json and generation_config.json that say what the GGUF metadata says."""
    config: dict[str, Any] = {"add_bos_token": vocab.adds_bos}
    for key, name in _SPECIAL_KEYS.items():
        if (token := vocab.token(key)) is not None:
            config[f"{name}_token"] = token
    match list(vocab.chat_templates.items()):
        case []:
            pass
        case [("default", template)]:
            config["chat_template"] = template
        case named:
            config["chat_template"] = [{"name": name, "template": template} for name, template in named]
    generation: dict[str, Any] = {}
    if "bos" in vocab.special_ids:
        generation["bos_token_id"] = vocab.special_ids["bos"]
    if vocab.eos_ids:
        generation["eos_token_id"] = vocab.eos_ids if len(vocab.eos_ids) > 1 else vocab.eos_ids[0]
    if "padding" in vocab.special_ids:
        generation["pad_token_id"] = vocab.special_ids["padding"]
    return {"tokenizer_config.json": config, "generation_config.json": generation}


def _tokenizer_file(vocab: GGUFVocab) -> tuple[str, bytes]:
    match vocab.model:
        case "llama":
            return "tokenizer.model", sentencepiece_model(vocab)
        case "gpt2":
            return "tokenizer.json", tokenizer_json(vocab).encode()
    raise GGUFTokenizerError(f"{vocab.source}: tokenizer.ggml.model={vocab.model!r} is not supported; supported: "
                             "'llama' (sentencepiece) and 'gpt2' (byte-level BPE)")


def has_tokenizer(path: str | os.PathLike) -> bool:
    return open_gguf(path).get("tokenizer.ggml.model") not in (None, "none", "no_vocab")


def tokenizer_files(path: str | os.PathLike) -> dict[str, bytes]:
    """The GGUF file's tokenizer as the files of a model folder: {name: content}."""
    vocab = GGUFVocab.read(open_gguf(path))
    name, content = _tokenizer_file(vocab)
    files = {name: content}
    for config_name, config in _configs(vocab).items():
        files[config_name] = (json.dumps(config, ensure_ascii=False, indent=1) + "\n").encode()
    return files


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file; ``path`` names it in messages."""
    path = pathlib.Path(path)
    vocab = GGUFVocab.read(open_gguf(path))
    name, content = _tokenizer_file(vocab)
    configs = ModelConfigs(folder=path, contents=_configs(vocab))
    if name == "tokenizer.model":
        return SentencePieceTokenizer(path, configs, content=content)
    return HFTokenizer(path, configs, content=content.decode())


def gguf_chat_template(path: str | os.PathLike):
    """The chat template(s) of a GGUF file (``tokenizer.chat_template``), with its special token strings."""
    from llm_jax.chat_template import ChatTemplate, ChatTemplateError

    vocab = GGUFVocab.read(open_gguf(path))
    if not vocab.chat_templates:
        raise ChatTemplateError(f"{path} has no chat template (no tokenizer.chat_template; a base model?)")
    special = {f"{name}_token": token for key, name in _SPECIAL_KEYS.items()
               if (token := vocab.token(key)) is not None}
    return ChatTemplate(templates=vocab.chat_templates, special_tokens=special, source=str(path))
