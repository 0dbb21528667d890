"""Request defaults from the model's ``generation_config.json``, as vLLM applies them.

A model's creator may recommend sampling settings (Llama 3 Instruct: temperature 0.6, top_p 0.9; Qwen:
top_k 20 ...). With ``--generation-config auto`` (the default, as vLLM's) the server reads them from the
model's folder (a Hugging Face folder, or an llm_jax checkpoint, which keeps the file) and uses them for
requests that do not set them: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
and ``max_new_tokens`` as the default ``max_tokens``: each value the file sets (``transformers``'
``GenerationConfig.to_diff_dict``, whose defaults are all unset). ``--generation-config vllm`` keeps the
API's neutral defaults, a folder reads that folder's file instead, and
``--override-generation-config '{"temperature": 0.5}'`` sets values on top. A request's own values always
win; the defaults only fill what it leaves out (vLLM also caps every request at the default
``max_tokens``; here it is only a default).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

FILE = "generation_config.json"
# The generation config's fields that become request defaults (vLLM's list).
FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def read_generation_config(folder: pathlib.Path) -> dict[str, Any]:
    """``folder``'s ``generation_config.json`` (empty when it has none: a llama2.c or GGUF file's folder)."""
    path = folder / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable generation config ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def sampling_defaults(source: str, model_path: str | pathlib.Path, overrides: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The request defaults: ``source`` is "auto" (the model's folder), "vllm" (none) or a folder;
    ``overrides`` are set on top. Keys are request fields (``max_tokens`` for ``max_new_tokens``)."""
    if source == "vllm":
        config = {}
    else:
        folder = pathlib.Path(model_path if source == "auto" else source)
        config = read_generation_config(folder) if folder.is_dir() else {}
    config.update(overrides or {})
    defaults = {k: config[k] for k in FIELDS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults
