"""Where params live: the ``sharding`` argument of ``load`` / ``load_checkpoint``, resolved per tensor.

``sharding`` may be

- ``None``: every tensor on the default device;
- one ``jax.sharding.Sharding``: used for every tensor (e.g. replicated over a mesh);
- a pytree of ``Sharding`` with the structure of the params;
- a callable ``config -> either of the above``, for callers that need the config to decide
  (the config is only known once the checkpoint's metadata has been read).

Tensors are addressed by their path in the params pytree, written ``layers/attn/q_proj``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Union

import jax
import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.model import Params, param_shapes

Path = tuple[str, ...]
ShardingArg = Union[None, jax.sharding.Sharding, Params, Callable[[ModelConfig], Any]]


def tensor_name(path: Path) -> str:
    return "/".join(path)


def leaves_by_path(tree: Params) -> dict[Path, Any]:
    """``{("layers", "attn", "q_proj"): leaf, ...}`` for a nested dict of arrays (a quantized leaf's
    arrays at ``(..., "q_proj", "values")`` and ``(..., "q_proj", "scales")``)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in keys): leaf for keys, leaf in flat}


def tree_from_paths(leaves: dict[Path, Any]) -> Params:
    tree: dict = {}
    for path, leaf in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


@functools.lru_cache(maxsize=32)
def expected_shapes(config: ModelConfig) -> dict[Path, tuple[int, ...]]:
    """The shape of every tensor a model with ``config`` has, from the model's own initialiser."""
    return {path: tuple(leaf.shape) for path, leaf in leaves_by_path(param_shapes(config)).items()}


def resolve_shardings(sharding: ShardingArg, config: ModelConfig) -> dict[Path, jax.sharding.Sharding]:
    """One ``Sharding`` per tensor path of a model with ``config``."""
    paths = expected_shapes(config)
    if callable(sharding) and not isinstance(sharding, jax.sharding.Sharding):
        sharding = sharding(config)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return {path: sharding for path in paths}
    given = leaves_by_path(sharding)
    missing, extra = sorted(set(paths) - set(given)), sorted(set(given) - set(paths))
    if missing or extra:
        raise ValueError(f"the sharding pytree does not match the params: missing "
                         f"{[tensor_name(p) for p in missing]}, unexpected {[tensor_name(p) for p in extra]}")
    wrong = [tensor_name(p) for p, s in given.items() if not isinstance(s, jax.sharding.Sharding)]
    if wrong:
        raise TypeError(f"sharding entries {wrong} are not jax.sharding.Sharding objects")
    return given


def device_placer(shardings: dict[Path, jax.sharding.Sharding]) -> Callable[[Path, np.ndarray], jax.Array]:
    """``place(path, host_array)``: the array on its devices. Used tensor by tensor while converting,
    so the host copy of each tensor can be freed before the next one is built."""

    def place(path: Path, host: np.ndarray) -> jax.Array:
        return jax.device_put(host, shardings[path])

    return place
