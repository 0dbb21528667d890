"""``load(path)``: one entry point for every weight format, returning a ready-to-run :class:`Model`.

The format is detected from the path (``weights/sources.py``): an llm_jax checkpoint folder, a Hugging
Face folder, a llama2.c ``.bin`` or a GGUF file. A checkpoint is restored by orbax straight into the requested dtype
and sharding. The other formats are converted tensor by tensor: each tensor is read from a memory map,
cast, and put on its devices before the next is read, so host memory never holds the model twice.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llm_jax import backends
from llm_jax.backends import Backend, Pallas
from llm_jax.config import Classifier, ModelConfig, Quantization
from llm_jax.lora import LoraAdapter, LoraRows, LoraWeights, merge_lora
from llm_jax.model import Params, param_shapes
from llm_jax.quantization import QuantizedArray, parse_quantization, quantize_params
from llm_jax.sharding import make_mesh, param_shardings, shard_params
from llm_jax.tokenizer import Tokenizer, load_tokenizer
from llm_jax.weights import sources
from llm_jax.weights.checkpoint import load_checkpoint
from llm_jax.weights.from_peft import load_peft_adapter
from llm_jax.weights.placement import ShardingArg, device_placer, resolve_shardings
from llm_jax.weights.sources import WeightFormat


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """A loaded model: its config, canonical params pytree, tokenizer (None if it has none), stop ids,
    and the backend it runs on.

    ``params`` has the checkpoint's layout on every platform (``llm_jax.model.param_shapes``): research
    code reads, edits and differentiates it. ``weights`` is what the backend's kernels read, derived from
    ``params`` on first use (:meth:`llm_jax.backends.Backend.prepare`; ``params`` itself except on the
    CPU kernels) and kept: build a new ``Model`` (``dataclasses.replace``) after editing ``params``.
    """

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    eos_ids: tuple[int, ...]  # generation ends on these (finish_reason "eos")
    stop_ids: tuple[int, ...] = ()  # format-specific extra stops (finish_reason "stop")
    path: str = ""
    mesh: Mesh | None = None  # the mesh the params are laid out on (``llm_jax.sharding``); None: one device
    backend: Backend | str = "auto"  # a Backend, or a name for ``llm_jax.backends.choose``

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", backends.choose(self.backend, mesh=self.mesh))

    @functools.cached_property
    def weights(self) -> Params:
        """The params in the form the backend's kernels read (computed once)."""
        return self.backend.prepare(self.params, self.config)

    def shard(self, mesh: Mesh) -> "Model":
        """This model laid out on ``mesh``; its config repeats K/V heads where the mesh needs it."""
        config, params = shard_params(self.config, self.params, mesh)
        backend = self.backend if isinstance(self.backend, Pallas) else "auto"
        return dataclasses.replace(self, config=config, params=params, mesh=mesh, backend=backend)

    def with_backend(self, backend: Backend | str) -> "Model":
        """This model run by ``backend`` (a :class:`Backend` or a name)."""
        return dataclasses.replace(self, backend=backend)

    def with_lora(self, adapter: LoraAdapter | str | os.PathLike) -> "Model":
        """This model with a LoRA adapter merged into its weights (an adapter, or a PEFT folder)."""
        adapter = load_lora(adapter, self.config)
        return dataclasses.replace(self, params=merge_lora(self.params, self.config, adapter))

    def as_classifier(self, tokens: Sequence[str | int]) -> "Model":
        """This language model as a sequence classifier reading its next-token logits of ``tokens`` (each a
        token id, or a text that is one token), as vLLM's ``classifier_from_token`` makes rerankers of
        language models (Qwen3-Reranker, bge-reranker-v2-gemma, mxbai-rerank-v2). Two tokens give one logit,
        the second's minus the first's (its sigmoid is the second token's share of the two: "no", "yes");
        one token gives its logit; more give one logit each (their softmax is the next-token distribution
        restricted to them). The head is the LM head's columns of those tokens."""
        config = self.config
        if config.classifier is not None:
            raise ValueError("the model is a sequence classifier already")
        if config.final_logit_softcap is not None:
            raise ValueError("a model with final_logit_softcap (Gemma 2) squashes its logits after the head: no "
                             "linear head reads them")
        ids = [self._token_id(token) for token in tokens]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"as_classifier needs distinct tokens, got {list(tokens)}")
        tied = config.tie_embeddings
        head = self.params["embedder"]["embedding"] if tied else self.params["lm_head"]  # [V, D] or [D, V]
        if isinstance(head, QuantizedArray):  # (integers: the whole head dequantized, once)
            head = head.dequantize(jnp.float32)
        index = jnp.asarray(ids)  # the tokens' columns first, then float32: never a float32 copy of the head
        score_DC = (head[index].T if tied else head[:, index]).astype(jnp.float32)
        names = [self.tokenizer.decode([i]) if self.tokenizer is not None else str(i) for i in ids]
        if len(ids) == 2:
            score_DC, names = score_DC[:, 1:] - score_DC[:, :1], names[1:]
        params = {k: v for k, v in self.params.items() if k != "lm_head"}
        params["score"] = score_DC.astype(config.param_jnp_dtype)
        if self.mesh is not None:
            params["score"] = jax.device_put(params["score"], NamedSharding(self.mesh, PartitionSpec()))
        classified = config.replace(classifier=Classifier(labels=tuple(names)))
        return dataclasses.replace(self, config=classified, params=params)

    def _token_id(self, token: str | int) -> int:
        V = self.config.vocab_size
        if isinstance(token, int):
            if not 0 <= token < V:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {V})")
            return token
        if self.tokenizer is None:
            raise ValueError(f"the model has no tokenizer to read {token!r}: give token ids")
        ids = self.tokenizer.encode(token, add_bos=False)
        if len(ids) != 1:
            raise ValueError(f"{token!r} is {len(ids)} tokens {ids}, not one")
        return ids[0]


def lora_rows(model: Model, adapters: Sequence[LoraAdapter | str | os.PathLike | None]) -> LoraRows:
    """Rows' adapters (``LoraAdapter`` s, PEFT folders, or None for the base model) for ``model``, unmerged:
    the distinct adapters stacked (on every device of the model's mesh), each row naming its slot."""
    slots, unique = [], {}
    for adapter in adapters:
        if adapter is not None:
            key = id(adapter) if isinstance(adapter, LoraAdapter) else str(adapter)
            unique.setdefault(key, load_lora(adapter, model.config))
        slots.append(-1 if adapter is None else list(unique).index(key))
    weights = LoraWeights.stack(list(unique.values()), model.config)
    weights = jax.device_put(weights, None if model.mesh is None else NamedSharding(model.mesh, PartitionSpec()))
    return LoraRows(weights=weights, slots_B=jnp.asarray(slots, jnp.int32))


def load_lora(adapter: LoraAdapter | str | os.PathLike, config: ModelConfig, name: str | None = None) -> LoraAdapter:
    """A :class:`~llm_jax.lora.LoraAdapter` for ``config``'s model: ``adapter`` itself, or read from the
    PEFT folder it names."""
    if isinstance(adapter, LoraAdapter):
        return adapter.for_config(config)
    return load_peft_adapter(adapter, config, name)


def load(path: str | os.PathLike, *, dtype=None, backend: Backend | str = "auto", sharding: ShardingArg = None,
         mesh: Mesh | str | None = None, tokenizer: str | os.PathLike | None = None, verify: bool = True,
         quantize: Quantization | str | None = None, dequantize: bool = False,
         lora: LoraAdapter | str | os.PathLike | None = None) -> Model:
    """Load an llm_jax checkpoint, a Hugging Face folder, a llama2.c ``.bin`` or a GGUF file.

    ``dtype`` sets both parameter and compute dtype (default: the checkpoint's own; float32 for
    llama2.c). ``backend``: how the model runs (``"auto"``, ``"xla"``, ``"cpu"``, ``"pallas"`` or a
    :class:`llm_jax.Backend`; see :func:`llm_jax.backends.choose`). ``sharding`` places each tensor (a
    ``Sharding``, a pytree of them, or a callable ``config -> either``; see ``weights/placement.py``);
    default: the first device. ``mesh`` (a ``Mesh`` or a spec like ``"data=2,model=4"``) instead lays the
    params out by the table of ``llm_jax.sharding``, each device receiving only its shard, and runs the
    model on it. ``tokenizer`` overrides the tokenizer found with the weights. ``verify`` checks an
    llm_jax checkpoint's checksums. ``quantize`` (a :class:`llm_jax.Quantization`, or ``"int8"`` /
    ``"int4"``) quantizes the weights once loaded (``llm_jax.quantization``); a quantized checkpoint
    loads quantized without it, and so does a GGUF file whose projections are all Q8_0 or all Q4_0
    (``weights/from_gguf.py``) unless ``dequantize`` (or ``quantize``) asks for float weights. ``lora`` (a
    PEFT adapter folder or a :class:`llm_jax.lora.LoraAdapter`) is merged into the weights, before they
    are quantized.
    """
    if isinstance(quantize, str):
        quantize = parse_quantization(quantize)
    if mesh is not None:
        if sharding is not None:
            raise ValueError("give load() a mesh or a sharding, not both")
        mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
        sharding = _table_layout(mesh)
    chosen = backends.choose(backend, mesh=mesh)  # before any slow work
    path = pathlib.Path(path)
    fmt = sources.detect_format(path)
    if fmt is WeightFormat.LLM_JAX:
        config, params, meta = load_checkpoint(path, dtype=dtype, sharding=sharding, verify=verify)
        tok = _tokenizer(tokenizer, sources.tokenizer_source(path, fmt, config))
        eos_ids, stop_ids = meta.eos_ids, meta.stop_ids  # the checkpoint's generation defaults
    else:
        config = sources.source_config(path, fmt, dequantize=dequantize or quantize is not None)
        if dtype is not None:
            name = jnp.dtype(dtype).name
            config = config.replace(param_dtype=name, compute_dtype=name)
        place = device_placer(resolve_shardings(sharding, config))
        params = sources.source_params(path, fmt, config, dtype=config.param_jnp_dtype, place=place)
        tok = _tokenizer(tokenizer, sources.tokenizer_source(path, fmt, config))
        eos_ids, stop_ids = sources.generation_ids(fmt, tok)
    if lora is not None:
        params = merge_lora(params, config, load_lora(lora, config))
    if quantize is not None:
        config, params = quantize_params(params, config, quantize)
    if mesh is not None:  # K/V heads repeated where the mesh needs it (nothing moves otherwise)
        config, params = shard_params(config, params, mesh)
    return Model(config=config, params=params, tokenizer=tok, eos_ids=eos_ids, stop_ids=stop_ids, path=str(path),
                 mesh=mesh, backend=chosen)


def _table_layout(mesh: Mesh):
    """The ``sharding`` argument that lays params out by the table of ``llm_jax.sharding`` on ``mesh``."""
    return lambda config: param_shardings(param_shapes(config), mesh)


def _tokenizer(override: str | os.PathLike | None, found: pathlib.Path | None) -> Tokenizer | None:
    source = pathlib.Path(override) if override is not None else found
    return load_tokenizer(source) if source is not None else None
