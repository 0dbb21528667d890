"""``load(path)``: one entry point for every weight format, returning a ready-to-run :class:`Model`.

The format is detected from the path (``weights/sources.py``): an llm_jax checkpoint folder, a Hugging
Face folder or a llama2.c ``.bin``. A checkpoint is restored by orbax straight into the requested dtype
and sharding. The other formats are converted tensor by tensor: each tensor is read from a memory map,
cast, and put on its devices before the next is read, so host memory never holds the model twice.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax.numpy as jnp
from jax.sharding import Mesh

from llm_jax.config import AttentionImpl, ModelConfig
from llm_jax.model import Params, fuse_projections, param_shapes, unfuse_projections
from llm_jax.model.fused import kernels_prefer_fused
from llm_jax.sharding import make_mesh, param_shardings, shard_params
from llm_jax.tokenizer import Tokenizer, load_tokenizer
from llm_jax.weights import sources
from llm_jax.weights.checkpoint import load_checkpoint
from llm_jax.weights.placement import ShardingArg, device_placer, resolve_shardings
from llm_jax.weights.sources import WeightFormat


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """A loaded model: its config, params pytree, tokenizer (None if it has none) and stop ids.

    On one CPU device the params are in the layout the CPU kernels read fastest: q/k/v and gate/up fused
    into one matrix each (:mod:`llm_jax.model.fused`), and the projections and a tied embedding table held
    as panels of 16 columns (:mod:`llm_jax.model.panels`); ``llm_jax.model.unfuse_projections`` gives the
    separate layout of checkpoints and Hugging Face.
    """

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    eos_ids: tuple[int, ...]  # generation ends on these (finish_reason "eos")
    stop_ids: tuple[int, ...] = ()  # format-specific extra stops (finish_reason "stop")
    path: str = ""
    mesh: Mesh | None = None  # the mesh the params are laid out on (``llm_jax.sharding``); None: one device

    def shard(self, mesh: Mesh) -> "Model":
        """This model laid out on ``mesh``; its config repeats K/V heads where the mesh needs it."""
        config, params = shard_params(self.config, unfuse_projections(self.params, self.config), mesh)
        return dataclasses.replace(self, config=config, params=params, mesh=mesh)

    def with_attention(self, attention: AttentionImpl | str) -> "Model":
        return dataclasses.replace(self, config=self.config.replace(attention_impl=AttentionImpl.parse(attention)))


def load(path: str | os.PathLike, *, dtype=None, sharding: ShardingArg = None, mesh: Mesh | str | None = None,
         attention: AttentionImpl | str = AttentionImpl.XLA, tokenizer: str | os.PathLike | None = None,
         verify: bool = True, fuse: bool | None = None, greedy_screen: bool = True) -> Model:
    """Load an llm_jax checkpoint, a Hugging Face folder or a llama2.c ``.bin``.

    ``dtype`` sets both parameter and compute dtype (default: the checkpoint's own; float32 for
    llama2.c). ``sharding`` places each tensor (a ``Sharding``, a pytree of them, or a callable
    ``config -> either``; see ``weights/placement.py``); default: the first device. ``mesh`` (a ``Mesh``
    or a spec like ``"data=2,model=4"``) instead lays the params out by the table of ``llm_jax.sharding``,
    each device receiving only its shard, and runs the model on it. ``tokenizer`` overrides the tokenizer
    found with the weights. ``verify`` checks an llm_jax checkpoint's checksums. ``fuse``: params in the fused
    layout of :mod:`llm_jax.model.fused`, and in panels where the CPU kernels run (default: where they run
    the products, that is without ``mesh`` or ``sharding`` on one CPU device). ``greedy_screen``: in panels,
    the LM head's screens too, which greedy decoding reads instead of the head
    (:mod:`llm_jax.model.greedy_head`); False saves their memory (0.5 or 0.75 of a float32 head, 0.5 or 1
    of a bfloat16 one, as the CPU's dot products have them read) and computes every logit of every step.
    """
    attention = AttentionImpl.parse(attention)  # before any slow work
    if fuse and mesh is not None:
        raise ValueError("the fused layout is for one device (the mesh's sharding table names q/k/v and gate/up "
                         "separately): give load() fuse=True or a mesh, not both")
    if mesh is not None:
        if sharding is not None:
            raise ValueError("give load() a mesh or a sharding, not both")
        mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
        sharding = _table_layout(mesh)
    path = pathlib.Path(path)
    fmt = sources.detect_format(path)
    if fmt is WeightFormat.LLM_JAX:
        config, params, meta = load_checkpoint(path, dtype=dtype, sharding=sharding, verify=verify)
        tok = _tokenizer(tokenizer, sources.tokenizer_source(path, fmt, config))
        eos_ids, stop_ids = meta.eos_ids, meta.stop_ids  # the checkpoint's generation defaults
    else:
        config = sources.source_config(path, fmt)
        if dtype is not None:
            name = jnp.dtype(dtype).name
            config = config.replace(param_dtype=name, compute_dtype=name)
        place = device_placer(resolve_shardings(sharding, config))
        params = sources.source_params(path, fmt, config, dtype=config.param_jnp_dtype, place=place)
        tok = _tokenizer(tokenizer, sources.tokenizer_source(path, fmt, config))
        eos_ids, stop_ids = sources.generation_ids(fmt, tok)
    if mesh is not None:  # K/V heads repeated where the mesh needs it (nothing moves otherwise)
        config, params = shard_params(config, params, mesh)
    if fuse is None:
        fuse = mesh is None and sharding is None and kernels_prefer_fused()
    if fuse:
        params = fuse_projections(params, config, consume=True, panels=kernels_prefer_fused(), screen=greedy_screen)
    config = config.replace(attention_impl=attention)
    return Model(config=config, params=params, tokenizer=tok, eos_ids=eos_ids, stop_ids=stop_ids, path=str(path),
                 mesh=mesh)


def _table_layout(mesh: Mesh):
    """The ``sharding`` argument that lays params out by the table of ``llm_jax.sharding`` on ``mesh``."""
    return lambda config: param_shardings(param_shapes(config), mesh)


def _tokenizer(override: str | os.PathLike | None, found: pathlib.Path | None) -> Tokenizer | None:
    source = pathlib.Path(override) if override is not None else found
    return load_tokenizer(source) if source is not None else None
