"""``scripts/train_tiny.py``: train llm_jax's default story model from scratch and save it as a checkpoint.

With no arguments it reproduces the model shipped in ``checkpoints/`` (pass ``--force`` to replace
it); ``--steps`` and the model-shape flags make quick variants, e.g. a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import sys

from llm_jax.cli.common import CliError, positive_int, run_main
from llm_jax.cli.generate import DEFAULT_MODEL

# Model-shape flags → ModelConfig fields; head_dim follows as d_model // n_heads.
_MODEL_FLAGS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
# Training flags → Recipe fields.
_RECIPE_FLAGS = ("seed", "steps", "batch_size", "seq_len", "peak_lr", "warmup_steps", "tokenizer_stories",
                 "val_stories", "eval_every", "log_every")


def build_parser() -> argparse.ArgumentParser:
    from llm_jax.training.recipe import STORIES  # light: no JAX computation at import

    p = argparse.ArgumentParser(description="Train llm_jax's default story model from scratch.")
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_MODEL,
                   help=f"checkpoint folder (default: {DEFAULT_MODEL})")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
    for name in _RECIPE_FLAGS:
        default = getattr(STORIES, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=float if isinstance(default, float) else positive_int,
                       default=default, help=f"(default: {default})")
    for name in _MODEL_FLAGS:
        default = getattr(STORIES.model, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=default,
                       help=f"(default: {default})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from llm_jax.config import ConfigError
    from llm_jax.training import model_card
    from llm_jax.training import recipe as rc
    from llm_jax.weights.checkpoint import check_destination

    shape = {name: getattr(args, name) for name in _MODEL_FLAGS}
    if shape["d_model"] % shape["n_heads"]:
        raise CliError(f"--d-model {shape['d_model']} must be a multiple of --n-heads {shape['n_heads']}")
    try:
        model = rc.STORIES.model.replace(**shape, head_dim=shape["d_model"] // shape["n_heads"])
        recipe = dataclasses.replace(rc.STORIES, model=model, **{n: getattr(args, n) for n in _RECIPE_FLAGS})
    except ConfigError as e:
        raise CliError(str(e)) from e
    check_destination(args.out, force=args.force)  # fail now, not after the training
    command = shlex.join(["python", "scripts/train_tiny.py", *(sys.argv[1:] if argv is None else argv)])
    result = rc.train(recipe, log=lambda line: print(line, flush=True))
    rc.save(result, args.out, force=args.force, command=command)
    model_card.write(result, args.out, command=command)
    print(f"saved {args.out} · held-out loss {result.val_loss:.4f} (perplexity {result.val_perplexity:.2f}) · "
          f"{result.train_s / 60:.1f} min")
    return 0


def entry() -> int:
    return run_main(main)
