"""The optimizer and the jitted train and eval steps.

AdamW (Loshchilov & Hutter, 2019) with linear warmup then cosine decay, global-norm gradient
clipping, and no weight decay on RMSNorm scales. The train state is a pytree: state in, state out, its
buffers donated so XLA updates them in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from llm_jax.config import ModelConfig
from llm_jax.model import Params

from training.loss import mean_loss, token_losses


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    peak_lr: float = 3e-3
    final_lr_ratio: float = 0.1  # the cosine decays to peak_lr * final_lr_ratio
    warmup_steps: int = 100
    total_steps: int = 1000
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=self.peak_lr, warmup_steps=self.warmup_steps,
            decay_steps=max(self.total_steps, self.warmup_steps + 1), end_value=self.peak_lr * self.final_lr_ratio)


def _decay_mask(params: Params) -> Params:
    """True for every parameter except RMSNorm ``scale`` vectors (stacked as [L, D] in ``layers``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(config.schedule(), b1=config.b1, b2=config.b2, weight_decay=config.weight_decay,
                    mask=_decay_mask))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    step: jax.Array  # int32 scalar
    params: Params
    opt_state: optax.OptState


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


StepFn = Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict[str, jax.Array]]]


def make_train_step(config: ModelConfig, optimizer: optax.GradientTransformation) -> StepFn:
    """``step(state, tokens_BT, lengths_B) -> (state, metrics)``, jitted, the state donated."""

    def train_step(state: TrainState, tokens_BT: jax.Array, lengths_B: jax.Array):
        loss, grads = jax.value_and_grad(mean_loss)(state.params, config, tokens_BT, lengths_B)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(config: ModelConfig) -> Callable[[Params, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """``eval(params, tokens_BT, lengths_B) -> (summed loss, target count)``, to average over many batches."""

    @jax.jit
    def eval_step(params: Params, tokens_BT: jax.Array, lengths_B: jax.Array):
        losses_BT, mask_BT = token_losses(params, config, tokens_BT, lengths_B)
        return losses_BT.sum(), mask_BT.sum()

    return eval_step
