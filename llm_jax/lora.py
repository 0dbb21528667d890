"""LoRA adapters (Hu et al. 2021): a low-rank update ``W + s·a·b`` of the model's projections.

Letters here, beside the package's: I a projection's flat inputs, O its flat outputs, R the adapters'
rank, A the adapter slots of a stack.

An adapter (:class:`LoraAdapter`, read from PEFT's files by ``weights/from_peft.py``) holds, for each
projection it changes, a [L, I, R] and b [L, R, O] (PEFT's ``lora_A`` and ``lora_B``, transposed; the
scale ``s`` = alpha / r, or alpha / √r for rsLoRA, already in b). It is used two ways:

- **merged** (:func:`merge_lora`, ``Model.with_lora``, ``load(..., lora=)``): W + a·b written into the
  params, so ``generate`` and every backend run the adapted model at the base model's speed;
- **batched** (:class:`LoraWeights`, :class:`LoraBatch`, :class:`LoraRows`): many adapters stacked in A
  slots beside the unchanged weights, each token choosing its slot (or none), as the serving engine runs
  requests of different adapters in one step. Each projection adds ``((x·a) · select) · b`` over the
  slots: two matrix products over A·R columns, whatever the mix of adapters.

The targets are the seven projections, named as PEFT names them (``TARGETS``). Quantized base weights
take batched adapters (the update is added to the product), not merged ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.backends.base import layer_of
from llm_jax.config import ModelConfig
from llm_jax.quantization import QuantizedArray

# PEFT's module name → where the weight is in our params.
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("attn", "q_proj"), "k_proj": ("attn", "k_proj"), "v_proj": ("attn", "v_proj"),
    "o_proj": ("attn", "o_proj"), "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


def target_dims(config: ModelConfig, target: str) -> tuple[int, int]:
    """A projection's flat (input, output) widths in a model of ``config``."""
    D, F, NH, KH = config.d_model, config.d_ff, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"q_proj": (D, NH), "k_proj": (D, KH), "v_proj": (D, KH), "o_proj": (NH, D), "gate_proj": (D, F),
            "up_proj": (D, F), "down_proj": (F, D)}[target]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraAdapter:
    """One adapter on the host: ``weights[target] = (a [L, I, R], b [L, R, O])`` in float32, the scale in
    b; layers the adapter leaves alone hold zeros. ``score`` [D, C]: a sequence classifier's head trained
    whole beside the adapter (PEFT's ``modules_to_save``, as reward models are fine-tuned), which merging
    puts in place of the model's."""

    name: str
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    path: str = ""
    score: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return max(a.shape[-1] for a, _ in self.weights.values())

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in TARGETS if t in self.weights)

    def check(self, config: ModelConfig) -> None:
        """Refuses an adapter whose shapes are not ``config``'s model's."""
        if config.experts is not None:  # PEFT names each expert's projections apart; TARGETS are the dense MLP's
            raise ValueError(f"LoRA adapter {self.name!r}: LoRA adapters on mixture-of-experts models are not "
                             "supported")
        if self.score is not None:
            head = config.classifier
            if head is None:
                raise ValueError(f"LoRA adapter {self.name!r} trains a classifier's head (score), and the model is a "
                                 "language model: load the adapter on its *ForSequenceClassification model")
            if self.score.shape != (config.d_model, head.num_labels):
                raise ValueError(f"LoRA adapter {self.name!r}: score is {list(self.score.shape)}, expected "
                                 f"[{config.d_model}, {head.num_labels}] for this classifier")
        for target, (a, b) in self.weights.items():
            In, Out = target_dims(config, target)
            L = config.n_layers
            if a.shape[:2] != (L, In) or b.shape[0] != L or b.shape[2] != Out or a.shape[2] != b.shape[1]:
                raise ValueError(f"LoRA adapter {self.name!r}: {target} has A {a.shape} and B {b.shape}, expected "
                                 f"A [{L}, {In}, r] and B [{L}, r, {Out}] for this model")

    def for_config(self, config: ModelConfig) -> "LoraAdapter":
        """This adapter for ``config``'s model, whose K/V heads a mesh may repeat (``llm_jax.sharding``):
        k/v updates repeated head by head as the weights are."""
        H, weights = config.head_dim, dict(self.weights)
        for target in ("k_proj", "v_proj"):
            if target in weights:
                a, b = weights[target]
                K0, K = b.shape[2] // H, config.n_kv_heads
                if K != K0 and K % K0 == 0:
                    b = np.repeat(b.reshape(*b.shape[:2], K0, H), K // K0, axis=2).reshape(*b.shape[:2], K * H)
                weights[target] = (a, b)
        adapter = dataclasses.replace(self, weights=weights)
        adapter.check(config)
        return adapter


def merge_lora(params: dict, config: ModelConfig, adapter: LoraAdapter) -> dict:
    """``params`` with the adapter's update added to each projection it changes (W + a·b, in the
    weight's dtype); other leaves are shared, not copied."""
    adapter = adapter.for_config(config)
    layers = {group: dict(leaves) for group, leaves in params["layers"].items()}
    for target, (a, b) in adapter.weights.items():
        group, name = TARGETS[target]
        w = layers[group][name]
        if isinstance(w, QuantizedArray):
            raise ValueError(f"cannot merge LoRA adapter {adapter.name!r} into quantized {name}: merge it before "
                             "quantizing (load(..., lora=..., quantize=...) does), or serve it unmerged (Engine's "
                             "lora_adapters)")
        delta = jnp.einsum("lir,lro->lio", jnp.asarray(a), jnp.asarray(b), precision="highest")
        layers[group][name] = (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    if adapter.score is not None:  # a classifier's head, trained whole: it replaces the model's
        return {**params, "layers": layers, "score": jnp.asarray(adapter.score, params["score"].dtype)}
    return {**params, "layers": layers}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraWeights:
    """Adapters stacked in A slots, on device: ``a[target]`` [L, A, I, R] and ``b[target]`` [L, A, R, O]
    (R the largest rank; smaller ranks and empty slots padded with zeros, which add nothing)."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]

    @property
    def num_slots(self) -> int:
        return next(iter(self.a.values())).shape[1]

    @property
    def rank(self) -> int:
        return next(iter(self.a.values())).shape[3]

    @staticmethod
    def stack(adapters: list[LoraAdapter | None], config: ModelConfig, *, targets: tuple[str, ...] | None = None,
              rank: int | None = None) -> "LoraWeights":
        """Slot s holds ``adapters[s]`` (None: empty). ``targets`` (default: every adapter's) and ``rank``
        (default: the largest) fix the stack's shapes, so that later adapters can fill slots in place."""
        if config.experts is not None:
            raise ValueError("LoRA adapters on mixture-of-experts models are not supported")
        adapters = [None if a is None else a.for_config(config) for a in adapters]
        present = [a for a in adapters if a is not None]
        if head := next((a for a in present if a.score is not None), None):
            raise ValueError(f"LoRA adapter {head.name!r} replaces the classifier's head (score): merge it "
                             "(load(..., lora=...), Model.with_lora) rather than run it unmerged")
        targets = targets or tuple(t for t in TARGETS if any(t in a.weights for a in present))
        rank = rank or max((a.rank for a in present), default=1)
        if not targets:
            raise ValueError("no LoRA targets: give adapters or targets")
        for adapter in present:
            if extra := set(adapter.targets) - set(targets):
                raise ValueError(f"LoRA adapter {adapter.name!r} changes {sorted(extra)}, outside the targets "
                                 f"{list(targets)}")
            if adapter.rank > rank:
                raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above the largest rank "
                                 f"{rank}")
        L, A = config.n_layers, len(adapters)
        a_stacks, b_stacks = {}, {}
        for target in targets:
            In, Out = target_dims(config, target)
            a_LAIR, b_LARO = np.zeros((L, A, In, rank), np.float32), np.zeros((L, A, rank, Out), np.float32)
            for s, adapter in enumerate(adapters):
                if adapter is not None and target in adapter.weights:
                    a, b = adapter.weights[target]
                    a_LAIR[:, s, :, :a.shape[2]], b_LARO[:, s, :b.shape[1]] = a, b
            a_stacks[target], b_stacks[target] = jnp.asarray(a_LAIR), jnp.asarray(b_LARO)
        return LoraWeights(a=a_stacks, b=b_stacks)

    def with_slot(self, slot: int, adapter: LoraAdapter | None, config: ModelConfig) -> "LoraWeights":
        """These weights with ``slot`` holding ``adapter`` (None: emptied); same shapes, so nothing compiles."""
        one = LoraWeights.stack([adapter], config, targets=tuple(self.a), rank=self.rank)
        return LoraWeights(a={t: self.a[t].at[:, slot].set(one.a[t][:, 0]) for t in self.a},
                           b={t: self.b[t].at[:, slot].set(one.b[t][:, 0]) for t in self.b})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraBatch:
    """The adapters of one call: the stacked weights and each token's choice of slot, ``select_BTA``
    (one-hot, or zeros for the base model)."""

    weights: LoraWeights
    select_BTA: jax.Array

    @staticmethod
    def of_slots(weights: LoraWeights, slots_BT: jax.Array) -> "LoraBatch":
        """Token (b, t) uses slot ``slots_BT[b, t]``; -1: no adapter."""
        return LoraBatch(weights=weights, select_BTA=jax.nn.one_hot(slots_BT, weights.num_slots, dtype=jnp.float32))

    def apply(self, target: str, x_BTI: jax.Array, y: jax.Array, layer: jax.Array) -> jax.Array:
        """``y`` (a projection of ``x_BTI`` [B, T, ...inputs] by layer ``layer``'s ``target`` weight, [B, T,
        ...outputs]) plus the update of each token's adapter; ``y`` itself where no adapter changes
        ``target``."""
        if target not in self.weights.a:
            return y
        B, T = y.shape[:2]
        x_BTI = x_BTI.reshape(B, T, -1).astype(jnp.float32)
        a_AIR, b_ARO = layer_of(self.weights.a[target], layer), layer_of(self.weights.b[target], layer)
        xa_BTAR = jnp.einsum("bti,air->btar", x_BTI, a_AIR) * self.select_BTA[..., None]
        delta_BTO = jnp.einsum("btar,aro->bto", xa_BTAR, b_ARO)
        return (y.astype(jnp.float32) + delta_BTO.reshape(y.shape)).astype(y.dtype)



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRows:
    """Each row's adapter for a whole generation (``generate(..., lora=)``): the stacked weights and each
    row's slot ``slots_B`` (int32, -1 for the base model)."""

    weights: LoraWeights
    slots_B: jax.Array

    def batch(self, T: int) -> LoraBatch:
        """The :class:`LoraBatch` of a call over T tokens per row."""
        slots_B = jnp.asarray(self.slots_B)
        return LoraBatch.of_slots(self.weights, jnp.broadcast_to(slots_B[:, None], (slots_B.shape[0], T)))

    def take_rows(self, index_B: jax.Array) -> "LoraRows":
        return dataclasses.replace(self, slots_B=jnp.asarray(self.slots_B)[index_B])
