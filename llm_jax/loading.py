"""``load(path)``: one entry point for every weight format, returning a ready-to-run :class:`Model`.

Formats are detected from the path: a llama2.c ``.bin`` file, or a Hugging Face folder
(``config.json`` + safetensors). Conversion to our layout happens tensor by tensor on the host; params
then move to the device in the requested dtype.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llm_jax import sharding
from llm_jax.config import AttentionImpl, ModelConfig
from llm_jax.model import Params
from llm_jax.tokenizer import Tokenizer, load_tokenizer
from llm_jax.weights.from_hf import load_hf, read_json
from llm_jax.weights.from_llama2c import load_llama2c


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """A loaded model: its config, params pytree, tokenizer (None if it has none) and stop ids."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    eos_ids: tuple[int, ...]  # generation ends on these (finish_reason "eos")
    stop_ids: tuple[int, ...] = ()  # format-specific extra stops (finish_reason "stop")
    path: str = ""
    mesh: Mesh | None = None  # the mesh the params are laid out on (``llm_jax.sharding``); None: one device

    def shard(self, mesh: Mesh) -> "Model":
        """This model laid out on ``mesh``; its config repeats K/V heads where the mesh needs it."""
        config, params = sharding.shard_params(self.config, self.params, mesh)
        return dataclasses.replace(self, config=config, params=params, mesh=mesh)

    def with_attention(self, attention: AttentionImpl | str) -> "Model":
        return dataclasses.replace(self, config=self.config.replace(attention_impl=AttentionImpl.parse(attention)))


def _find_llama2c_tokenizer(bin_path: pathlib.Path, vocab_size: int) -> pathlib.Path | None:
    """llama2.c keeps its sentencepiece model next to the checkpoint (``tok512.model`` for vocab 512)."""
    folder = bin_path.parent
    for candidate in (folder / f"tok{vocab_size}.model", folder / "tokenizer.model"):
        if candidate.is_file():
            return candidate
    found = sorted(folder.glob("tok*.model"))
    return found[0] if len(found) == 1 else None


def _hf_dtype(folder: pathlib.Path) -> str:
    hf = read_json(folder / "config.json")
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def load(path: str | pathlib.Path, *, dtype=None, attention: AttentionImpl | str = AttentionImpl.XLA,
         tokenizer: str | pathlib.Path | None = None, mesh: Mesh | str | None = None) -> Model:
    """Load a llama2.c ``.bin`` or a Hugging Face folder.

    ``dtype`` sets both parameter and compute dtype (default: the checkpoint's own, float32 for
    llama2.c). ``tokenizer`` overrides the tokenizer found next to the weights. ``mesh`` (a ``Mesh`` or
    a spec like ``"data=2,model=4"``) lays the params out over devices, each receiving only its shard.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    stop_ids: tuple[int, ...] = ()
    if path.is_file():
        if path.suffix != ".bin":
            raise ValueError(f"{path}: unrecognised model file; expected a llama2.c .bin or a model folder")
        dtype = jnp.dtype(dtype or "float32")
        config, host_params = load_llama2c(path, dtype=np.float32)
        tok_path = tokenizer or _find_llama2c_tokenizer(path, config.vocab_size)
    elif (path / "config.json").is_file():
        dtype = jnp.dtype(dtype or _hf_dtype(path))
        config, host_params = load_hf(path, dtype=np.float32)
        tok_path = tokenizer or path
    else:
        raise ValueError(f"{path}: not a model folder (no config.json) and not a llama2.c .bin file")
    tok = load_tokenizer(tok_path) if tok_path is not None and _has_tokenizer(pathlib.Path(tok_path)) else None
    if path.is_file() and tok is not None and tok.bos_id is not None:
        # llama2.c models end a story by emitting BOS, and llama2.c's run stops there.
        stop_ids = (tok.bos_id,)
    config = config.replace(param_dtype=dtype.name, compute_dtype=dtype.name,
                            attention_impl=AttentionImpl.parse(attention))
    if mesh is None:
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype), host_params)
    else:
        mesh = sharding.make_mesh(mesh) if isinstance(mesh, str) else mesh
        config, params = sharding.shard_params(config, host_params, mesh, dtype=dtype)
    eos_ids = tok.eos_ids if tok is not None else ()
    return Model(config=config, params=params, tokenizer=tok, eos_ids=tuple(eos_ids), stop_ids=stop_ids,
                 path=str(path), mesh=mesh)


def _has_tokenizer(path: pathlib.Path) -> bool:
    if path.is_file():
        return True
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
