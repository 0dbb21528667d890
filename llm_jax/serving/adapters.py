"""The engine's LoRA adapters: named, in the slots of one stack on device, each step's tokens choosing theirs.

Every step runs the same program whatever the mix of adapters (``llm_jax.lora.LoraBatch``: a token picks
a slot, or none for the base model), so serving many adapters compiles nothing more than serving one.
The stack's shapes — slots, targets, largest rank — are fixed when the engine starts; an adapter loaded
later fills a free slot in place (``LoraWeights.with_slot``), and one unloaded empties it, so loading
compiles nothing either.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llm_jax.config import ModelConfig
from llm_jax.lora import TARGETS, LoraAdapter, LoraWeights
from llm_jax.loading import load_lora
from llm_jax.serving.blocks import BlockHash, root_hash

DEFAULT_MAX_RANK = 16  # the largest rank adapters loaded later may have, unless told (vLLM's default too)

AdapterArg = LoraAdapter | str | os.PathLike


class LoraSlots:
    """``max_loras`` slots (at least one per adapter given) of adapters for a model of ``config``.

    The targets and largest rank are the given adapters' when they fill every slot; with room for more,
    every projection and ``max_lora_rank`` (default ``DEFAULT_MAX_RANK``, or the largest given rank)."""

    def __init__(self, config: ModelConfig, adapters: Sequence[AdapterArg] = (), *, max_loras: int = 0,
                 max_lora_rank: int | None = None, mesh: Mesh | None = None):
        self.config, self.mesh = config, mesh
        loaded = [load_lora(a, config) for a in adapters]
        if len({a.name for a in loaded}) != len(loaded):
            raise ValueError(f"LoRA adapter names must differ, got {[a.name for a in loaded]}")
        num_slots = max(len(loaded), max_loras, 1)
        room = num_slots > len(loaded)
        targets = tuple(TARGETS) if room else tuple(t for t in TARGETS if any(t in a.targets for a in loaded))
        rank = max_lora_rank or max([a.rank for a in loaded] + ([DEFAULT_MAX_RANK] if room else []))
        self._slots: list[LoraAdapter | None] = [*loaded, *[None] * (num_slots - len(loaded))]
        self._loads = itertools.count()  # each load's prefix-cache namespace
        self._roots = {a.name: self._new_root() for a in loaded}
        self.weights = self._placed(LoraWeights.stack(self._slots, config, targets=targets, rank=rank))

    def _placed(self, weights: LoraWeights) -> LoraWeights:
        """On every device of the mesh (the stacks are small), or committed to the first device."""
        if self.mesh is None:
            return jax.device_put(weights, jax.devices()[0])
        return jax.device_put(weights, NamedSharding(self.mesh, PartitionSpec()))

    def _new_root(self) -> BlockHash:
        return root_hash(f"lora:{next(self._loads)}")

    def hash_root(self, name: str) -> BlockHash:
        """The prefix-cache namespace of adapter ``name`` as loaded now (``blocks.root_hash``)."""
        self.slot(name)
        return self._roots[name]

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self._slots if a is not None)

    def adapter(self, name: str) -> LoraAdapter:
        return self._slots[self.slot(name)]

    def slot(self, name: str) -> int:
        """The slot of adapter ``name``."""
        for s, adapter in enumerate(self._slots):
            if adapter is not None and adapter.name == name:
                return s
        raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {list(self.names)}")

    def add(self, adapter: AdapterArg, name: str | None = None) -> LoraAdapter:
        """Loads an adapter (or a PEFT folder, named ``name`` or after the folder) into a free slot."""
        adapter = load_lora(adapter, self.config, name)
        if adapter.name in self.names:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if None not in self._slots:
            raise ValueError(f"all {len(self._slots)} LoRA slots are in use ({list(self.names)}); unload one, or "
                             "start the engine with a larger max_loras")
        slot = self._slots.index(None)
        self.weights = self._placed(self.weights.with_slot(slot, adapter, self.config))  # refuses what does not fit
        self._slots[slot] = adapter
        self._roots[adapter.name] = self._new_root()
        return adapter

    def remove(self, name: str) -> None:
        """Empties adapter ``name``'s slot."""
        slot = self.slot(name)
        self.weights = self._placed(self.weights.with_slot(slot, None, self.config))
        self._slots[slot] = None
        del self._roots[name]
