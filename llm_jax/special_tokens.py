"""Which ids are BOS, EOS and PAD, and whether BOS is added: read from a model's own files.

Never from a per-family table. The files beside a tokenizer, and what each decides:

- ``bos_id`` / ``pad_id``: ``tokenizer_config.json`` / ``special_tokens_map.json`` (an explicit ``null``
  there means "none", as Qwen's ``bos_token: null``), then ``generation_config.json`` / ``config.json``,
  then the tokenizer file itself (sentencepiece's ids; for a ``tokenizer.json``, the token its
  post-processor puts in front of a sequence).
- ``eos_ids``: what generation stops on, so ``generation_config.json`` first (an int or a list), then
  ``config.json``, then the tokenizer files, as ``transformers``' ``generate`` does.
- whether ``encode`` adds BOS by default: a ``tokenizer.json``'s post-processor decides (``transformers``
  5 ignores ``add_bos_token`` when a ``tokenizer.json`` exists); for sentencepiece,
  ``tokenizer_config.json``'s ``add_bos_token``, else True whenever the model has a BOS piece, as every
  decoder-only model shipped with a bare sentencepiece file was trained. Either way only when a BOS exists.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """The special token ids a model's files declare; ``eos_ids`` are all ids that end generation."""

    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    add_bos: bool  # whether encode() prepends BOS unless told otherwise


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfigs:
    """The JSON config files beside a tokenizer file, by file name (absent files read as ``{}``)."""

    FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")

    folder: pathlib.Path
    contents: Mapping[str, Mapping[str, Any]]

    @classmethod
    def read(cls, folder: pathlib.Path) -> ModelConfigs:
        contents = {}
        for name in cls.FILES:
            file = folder / name
            if file.is_file():
                try:
                    contents[name] = json.loads(file.read_text(encoding="utf-8"))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{file} is not valid JSON: {error}") from error
        return cls(folder=folder, contents=contents)

    def get(self, name: str) -> Mapping[str, Any]:
        return self.contents.get(name, {})

    def special_token(self, key: str) -> tuple[str, str | None] | None:
        """(file name, token text) of a named special token (``bos_token``…), None when no file names it.

        The token text is None where a file says ``null``. Precedence as in ``transformers``: a
        ``tokenizer_config.json`` with ``added_tokens_decoder`` is complete; an older one is overridden by
        ``special_tokens_map.json``.
        """
        config, legacy = self.get("tokenizer_config.json"), self.get("special_tokens_map.json")
        if key in legacy and "added_tokens_decoder" not in config:
            return "special_tokens_map.json", _token_content(legacy[key])
        if key in config:
            return "tokenizer_config.json", _token_content(config[key])
        return None


NO_CONFIGS = ModelConfigs(folder=pathlib.Path(), contents={})


def resolve_special_tokens(
    configs: ModelConfigs, library: SpecialTokens, *, token_to_id: Callable[..., int], vocab_size: int
) -> SpecialTokens:
    """Special tokens as the model's config files declare them; ``library``: the tokenizer file's own.

    ``token_to_id(token, source=...)`` maps a token's text to its id, raising an error naming ``source``.
    """

    def from_tokenizer_files(key: str) -> tuple[bool, int | None]:
        # tokenizer_config / special_tokens_map reflect the tokenizer's real state: null means "none".
        declared = configs.special_token(key)
        if declared is None:
            return False, None
        name, token = declared
        return True, None if token is None else token_to_id(token, source=f"{configs.folder / name} {key}")

    def from_model_configs(key: str) -> tuple[int, ...] | None:
        # config.json / generation_config.json carry nulls as defaults: null means "not said here".
        for name in ("generation_config.json", "config.json"):
            value = configs.get(name).get(key)
            if value is not None:
                values = tuple(value) if isinstance(value, list) else (value,)
                if not all(isinstance(v, int) and 0 <= v < vocab_size for v in values):
                    raise ValueError(f"{configs.folder / name} {key}={value!r}: expected ids in [0, {vocab_size})")
                return values
        return None

    def single(key: str, library_id: int | None) -> int | None:
        found, token_id = from_tokenizer_files(f"{key}_token")
        if found:
            return token_id
        ids = from_model_configs(f"{key}_token_id")
        return ids[0] if ids else library_id

    bos_id = single("bos", library.bos_id)
    eos_ids = from_model_configs("eos_token_id")
    if eos_ids is None:
        found, eos_id = from_tokenizer_files("eos_token")
        eos_ids = (eos_id,) if eos_id is not None else () if found else library.eos_ids
    return SpecialTokens(
        bos_id=bos_id,
        eos_ids=tuple(dict.fromkeys(eos_ids)),
        pad_id=single("pad", library.pad_id),
        add_bos=library.add_bos and bos_id is not None,
    )


def _token_content(value: Any) -> str | None:
    """A token as config files spell it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value
