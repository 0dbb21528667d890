"""Converting a Hugging Face folder, a llama2.c ``.bin`` or a GGUF file into an llm_jax checkpoint.

Tensors stream one at a time from memory maps of the source into the target dtype, so the host holds
one copy of the model (in the target dtype) plus one source tensor. The checkpoint is written to a
staging folder and renamed into place at the end (``checkpoint.staging_folder``): an interrupted or
failed conversion never leaves a partial checkpoint under the final name.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp

from llm_jax.config import Quantization
from llm_jax.quantization import quantize_params
from llm_jax.tokenizer import load_tokenizer
from llm_jax.weights import sources
from llm_jax.weights.checkpoint import PARAM_DTYPES, check_destination, save_checkpoint
from llm_jax.weights.sources import WeightFormat


@dataclasses.dataclass(frozen=True)
class ConvertProgress:
    """One tensor done: ``stage`` is "read" (source tensors converted) or "save" (our tensors stored)."""

    stage: str
    tensor: str
    done: int
    total: int


def convert(source: str | os.PathLike, dest: str | os.PathLike, *, dtype=None, force: bool = False,
            quantize: Quantization | None = None, dequantize: bool = False,
            progress: Callable[[ConvertProgress], None] | None = None) -> pathlib.Path:
    """Convert ``source`` into an llm_jax checkpoint at ``dest``; returns ``dest``.

    ``dtype`` (float32, bfloat16 or float16) is the stored and compute dtype; default: the source's own
    (config.json's ``dtype`` for Hugging Face, float32 for llama2.c). ``dest`` is overwritten only with
    ``force``, and only if it is an llm_jax checkpoint. ``quantize`` stores the projections (and
    optionally the embedding) as integers (``llm_jax.quantization``), recorded in the config. A GGUF file
    whose projections are all Q8_0 or all Q4_0 is stored with those blocks as they are, unless
    ``dequantize`` (or ``quantize``) asks for float weights.
    """
    source, dest = pathlib.Path(source), pathlib.Path(dest)
    fmt = sources.detect_format(source)
    if fmt is WeightFormat.LLM_JAX:
        raise ValueError(f"{source} is already an llm_jax checkpoint")
    check_destination(dest, force=force)  # before the slow part
    config = sources.source_config(source, fmt, dequantize=dequantize or quantize is not None)
    if dtype is not None:
        name = jnp.dtype(dtype).name
        if name not in PARAM_DTYPES:
            raise ValueError(f"dtype must be one of {PARAM_DTYPES}, got {name!r}")
        config = config.replace(param_dtype=name, compute_dtype=name)
    tok_source = sources.tokenizer_source(source, fmt, config)
    eos_ids, stop_ids = sources.generation_ids(fmt, load_tokenizer(tok_source) if tok_source else None)
    read = _counter(progress, "read", sources.source_tensor_count(fmt, config))
    params = sources.source_params(source, fmt, config, dtype=config.param_jnp_dtype, progress=read)
    if quantize is not None:
        config, params = quantize_params(params, config, quantize)
    return save_checkpoint(dest, config=config, params=params,
                           tokenizer_files=sources.tokenizer_files(source, fmt, config), eos_ids=eos_ids,
                           stop_ids=stop_ids, force=force, progress=_counter(progress, "save", len(jax.tree.leaves(params))),
                           source=str(source))


def _counter(progress: Callable[[ConvertProgress], None] | None, stage: str,
             total: int) -> Callable[[str], None] | None:
    if progress is None:
        return None
    done = 0

    def report(tensor: str) -> None:
        nonlocal done
        done += 1
        progress(ConvertProgress(stage=stage, tensor=tensor, done=done, total=total))

    return report
