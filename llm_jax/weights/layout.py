"""Assembling a parameter pytree from named source tensors, one tensor at a time.

Each converter describes its format as a list of :class:`TensorSpec`: which source tensor fills which
leaf of our pytree, the source shape it must have, and how to turn it into our layout. Per-layer
tensors are written into one preallocated [L, ...] array, so at most one source tensor and the target
params are in host memory at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import numpy as np

from llm_jax.config import ModelConfig


class WeightsError(ValueError):
    """Weights that do not match what the model expects (missing, extra, wrong shape, corrupt)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One leaf of our params. ``source`` may contain ``{layer}``; then the leaf is stacked over L; and
    ``{expert}`` (a mixture of experts' per-expert tensors), then stacked over E after L."""

    path: tuple[str, ...]
    source: str
    source_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray] = lambda w: w

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.source

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.source

    def stack(self, config: ModelConfig) -> tuple[int, ...]:
        """The leading axes the leaf is stacked over: none, [L], or [L, E]."""
        return (config.n_layers,) * self.per_layer + ((config.experts.num_experts,) if self.per_expert else ())

    def sources(self, config: ModelConfig) -> list[tuple[tuple[int, ...], str]]:
        """(index into the leaf's stacked axes, source name) of every tensor the leaf is read from, in order."""
        names = ("layer",) * self.per_layer + ("expert",) * self.per_expert
        return [(index, self.source.format(**dict(zip(names, index)))) for index in np.ndindex(*self.stack(config))]


def transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def heads_in(n_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """[n*H, D] (torch Linear, out × in) → [D, n, H]."""
    return lambda w: w.T.reshape(w.shape[1], n_heads, head_dim)


def heads_out(n_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """[D, N*H] (torch Linear) → [N, H, D]."""
    return lambda w: w.T.reshape(n_heads, head_dim, w.shape[0])


def heads_bias(n_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """[n*H] → [n, H]."""
    return lambda b: b.reshape(n_heads, head_dim)


def rows(start: int, stop: int, then: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """Rows ``start:stop`` of a fused source tensor (Phi-3's qkv_proj [(N + 2K)·H, D], gate_up_proj [2F, D]),
    then ``then``: each of our leaves reads its own block of the one source."""
    return lambda w: then(w[start:stop])


def interleaved_to_halves(n_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """Undo Meta's RoPE layout on a q/k projection [n*H, D] → ours [D, n, H].

    Meta (and llama2.c) rotate adjacent pairs (x[2i], x[2i+1]); we rotate halves (x[i], x[i + H/2]).
    Within each head, output row 2i + j moves to row j * H/2 + i.
    """

    def permute(w: np.ndarray) -> np.ndarray:
        D = w.shape[1]
        w = w.reshape(n_heads, head_dim // 2, 2, D).transpose(0, 2, 1, 3).reshape(n_heads * head_dim, D)
        return heads_in(n_heads, head_dim)(w)

    return permute


FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _set_leaf(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def assemble(specs: Iterable[TensorSpec], config: ModelConfig, read: Callable[[str], np.ndarray],
             available: set[str], *, where: str, dtype, progress: Callable[[str], None] | None = None,
             locate: Callable[[str], str] | None = None,
             place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None) -> dict:
    """Build the params pytree from ``read(name)``, one leaf at a time, cast to ``dtype``.

    Each finished leaf goes through ``place(path, array)`` (e.g. onto its devices) before the next is
    built, so host memory holds one leaf, not the model, when ``place`` moves it elsewhere. Raises
    :class:`WeightsError` naming ``where`` (or ``locate(tensor)``, the file holding it) and the tensor on
    a missing, extra, misshapen or non-float tensor.
    """
    specs = list(specs)
    expected = {name for s in specs for _, name in s.sources(config)}
    missing = sorted(expected - available)
    if missing:
        raise WeightsError(f"{where}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                           f"({len(missing)} of {len(expected)} expected)")
    extra = sorted(available - expected)
    if extra:
        raise WeightsError(f"{where}: unexpected tensors {extra[:8]}{' ...' if len(extra) > 8 else ''}; "
                           "the config does not describe these weights")
    params: dict = {}
    for spec in specs:
        stacked = None
        for index, name in spec.sources(config):
            ours = _convert(spec, name, read(name), locate(name) if locate else where)
            if stacked is None:
                stacked = np.empty((*spec.stack(config), *ours.shape), dtype)
            stacked[index] = ours
            del ours  # a memory map of the source: released before the next tensor is read
            if progress is not None:
                progress(name)
        _set_leaf(params, spec.path, stacked if place is None else place(spec.path, stacked))
        del stacked
    return params


def _convert(spec: TensorSpec, name: str, source: np.ndarray, where: str) -> np.ndarray:
    if tuple(source.shape) != tuple(spec.source_shape):
        raise WeightsError(f"{where}: tensor {name!r} has shape {tuple(source.shape)}, "
                           f"expected {tuple(spec.source_shape)} from the config")
    if source.dtype.name not in FLOAT_DTYPES:
        raise WeightsError(f"{where}: tensor {name!r} has dtype {source.dtype.name}, expected one of {FLOAT_DTYPES}")
    return spec.to_ours(source)
