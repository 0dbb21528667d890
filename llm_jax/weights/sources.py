"""The weight formats llm_jax reads, recognised from a path, and what each says besides tensors.

- an llm_jax checkpoint folder (``checkpoint.json``, see ``checkpoint.py``);
- a Hugging Face folder (``config.json`` + ``*.safetensors``, see ``from_hf.py``);
- a llama2.c ``.bin`` file, its sentencepiece model beside it (see ``from_llama2c.py``);
- a GGUF file (llama.cpp), its tokenizer in its metadata (see ``from_gguf.py`` and ``llm_jax.gguf_tokenizer``).

``load`` and ``convert`` both start here: which format, its config, its params tensor by tensor, the
tokenizer files that travel with it, and the ids generation stops on.
"""

from __future__ import annotations

import enum
import json
import pathlib
from typing import Any, Callable

import numpy as np

from llm_jax import gguf_tokenizer
from llm_jax.config import ModelConfig
from llm_jax.tokenizer import Tokenizer
from llm_jax.weights import checkpoint, from_compressed, from_gguf, from_hf, from_llama2c
from llm_jax.weights.hf_config import read_hf_config, read_json

# Tokenizer files of a Hugging Face folder worth keeping with converted weights.
HF_TOKENIZER_FILES = checkpoint.TOKENIZER_FILES
# Fields of config.json that ``generation_config.json`` repeats (transformers derives one from the other).
_GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class WeightFormat(enum.Enum):
    LLM_JAX = "llm_jax checkpoint"
    HUGGING_FACE = "Hugging Face folder"
    LLAMA2C = "llama2.c .bin"
    GGUF = "GGUF file"


def detect_format(path: pathlib.Path) -> WeightFormat:
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix == ".bin":
            return WeightFormat.LLAMA2C
        if path.suffix == ".gguf":
            return WeightFormat.GGUF
        raise ValueError(f"{path}: unrecognised model file; expected a llama2.c .bin, a .gguf or a model folder")
    if checkpoint.is_checkpoint(path):
        return WeightFormat.LLM_JAX
    if (path / "config.json").is_file():
        return WeightFormat.HUGGING_FACE
    raise ValueError(f"{path}: not a model folder (neither {checkpoint.METADATA_FILE} nor config.json) "
                     "and not a llama2.c .bin file")


def source_config(path: pathlib.Path, fmt: WeightFormat, *, dequantize: bool = False) -> ModelConfig:
    """The config of a Hugging Face, llama2.c or GGUF source, dtypes set to the source's own (a GGUF's
    Q8_0 / Q4_0 projections: its quantization, unless ``dequantize``)."""
    match fmt:
        case WeightFormat.HUGGING_FACE:
            hf = read_json(path / "config.json")
            dtype = hf.get("dtype") or hf.get("torch_dtype")
            dtype = dtype if dtype in checkpoint.PARAM_DTYPES else "float32"
            config = read_hf_config(path).replace(param_dtype=dtype, compute_dtype=dtype)
            scheme = from_compressed.read_scheme(hf, str(path))  # packed projections stay quantized; FP8: floats
            if scheme is None or dequantize or isinstance(scheme, from_compressed.Float8Weights):
                return config
            names = from_hf.TextTensors(path).names()
            return config.replace(quantization=from_compressed.quantization(scheme, names, config, str(path)))
        case WeightFormat.LLAMA2C:
            return from_llama2c.read_llama2c_config(path)
        case WeightFormat.GGUF:
            return from_gguf.read_gguf_config(path, dequantize=dequantize)
    raise ValueError(f"{path}: a {fmt.value} is not a conversion source")


def source_params(path: pathlib.Path, fmt: WeightFormat, config: ModelConfig, *, dtype,
                  progress: Callable[[str], None] | None = None,
                  place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None) -> dict:
    """The params of a Hugging Face or llama2.c source, tensor by tensor (see ``layout.assemble``)."""
    match fmt:
        case WeightFormat.HUGGING_FACE:
            return from_hf.load_hf_params(path, config, dtype=dtype, progress=progress, place=place)
        case WeightFormat.LLAMA2C:
            return from_llama2c.load_llama2c(path, dtype=dtype, progress=progress, place=place)[1]
        case WeightFormat.GGUF:
            return from_gguf.load_gguf_params(path, config, dtype=dtype, progress=progress, place=place)
    raise ValueError(f"{path}: a {fmt.value} is not a conversion source")


def source_tensor_count(fmt: WeightFormat, config: ModelConfig) -> int:
    """How many source tensors ``source_params`` reads (for progress bars)."""
    match fmt:
        case WeightFormat.HUGGING_FACE:
            specs = from_hf.tensor_specs(config)
        case WeightFormat.LLAMA2C:
            specs = from_llama2c.tensor_specs(config)
        case WeightFormat.GGUF:
            specs = from_gguf.tensor_specs(config, interleaved=False)
        case _:
            raise ValueError(f"a {fmt.value} is not a conversion source")
    return sum(len(spec.sources(config)) for spec in specs)


def find_llama2c_tokenizer(bin_path: pathlib.Path, vocab_size: int) -> pathlib.Path | None:
    """llama2.c keeps its sentencepiece model next to the checkpoint (``tok512.model`` for vocab 512)."""
    folder = bin_path.parent
    for candidate in (folder / f"tok{vocab_size}.model", folder / "tokenizer.model"):
        if candidate.is_file():
            return candidate
    found = sorted(folder.glob("tok*.model"))
    return found[0] if len(found) == 1 else None


def tokenizer_source(path: pathlib.Path, fmt: WeightFormat, config: ModelConfig) -> pathlib.Path | None:
    """What ``load_tokenizer`` should read for this source (a file or a folder), if it has a tokenizer."""
    if fmt is WeightFormat.LLAMA2C:
        return find_llama2c_tokenizer(path, config.vocab_size)
    if fmt is WeightFormat.GGUF:  # load_tokenizer reads the vocabulary in its metadata
        return path if gguf_tokenizer.has_tokenizer(path) else None
    has = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    return path if has else None


def generation_ids(fmt: WeightFormat, tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(eos_ids, stop_ids) of a Hugging Face or llama2.c source."""
    if tokenizer is None:
        return (), ()
    if fmt is WeightFormat.LLAMA2C and tokenizer.bos_id is not None:
        # llama2.c models end a story by emitting BOS, and llama2.c's run stops there.
        return tuple(tokenizer.eos_ids), (tokenizer.bos_id,)
    return tuple(tokenizer.eos_ids), ()


def tokenizer_files(path: pathlib.Path, fmt: WeightFormat, config: ModelConfig) -> dict[str, pathlib.Path | bytes]:
    """The tokenizer files to store with weights converted from this source: {name: file or content}.

    A Hugging Face folder whose special token ids live only in ``config.json`` gets a
    ``generation_config.json`` holding them, as transformers derives one, so the checkpoint's tokenizer
    reads the same ids as the source's.
    """
    if fmt is WeightFormat.LLAMA2C:
        found = find_llama2c_tokenizer(path, config.vocab_size)
        return {"tokenizer.model": found} if found is not None else {}
    if fmt is WeightFormat.GGUF:
        return gguf_tokenizer.tokenizer_files(path) if gguf_tokenizer.has_tokenizer(path) else {}
    files: dict[str, pathlib.Path | bytes] = {
        name: path / name for name in HF_TOKENIZER_FILES if (path / name).is_file()}
    if "generation_config.json" not in files:
        hf = read_json(path / "config.json")
        generation = {k: hf[k] for k in _GENERATION_FIELDS if hf.get(k) is not None}
        if generation:
            files["generation_config.json"] = (json.dumps(generation, indent=1) + "\n").encode()
    return files
