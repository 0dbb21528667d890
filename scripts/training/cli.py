"""``scripts/train_tiny.py``: train llm_jax's default story model from scratch and save it as a checkpoint.

With no arguments it reproduces the model shipped in ``checkpoints/`` (pass ``--force`` to replace
it); ``--steps`` and the model-shape flags make quick variants, e.g. a smoke run.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shlex
import sys

from llm_jax.cli.common import CliError, CliParser, non_negative_float, non_negative_int, positive_int, run_main
from llm_jax.cli.generate import DEFAULT_MODEL

# Recipe fields set by flags: argparse type, help. Model-shape flags set ModelConfig fields; head_dim
# follows as d_model // n_heads.
_RECIPE_FLAGS = {
    "seed": (non_negative_int, "seed of the stories, the tokenizer and the initial params"),
    "steps": (positive_int, "optimizer steps"),
    "batch_size": (positive_int, "stories per step"),
    "seq_len": (positive_int, "tokens per row the model sees (one story per row)"),
    "peak_lr": (non_negative_float, "learning rate after warmup (cosine decay to a tenth of it)"),
    "warmup_steps": (positive_int, "steps of linear learning-rate warmup"),
    "tokenizer_stories": (positive_int, "training stories the tokenizer is trained on"),
    "val_stories": (positive_int, "held-out stories for the validation loss"),
    "eval_every": (positive_int, "steps between held-out evaluations (each logs a sample story)"),
    "log_every": (positive_int, "steps between progress lines"),
}
_MODEL_FLAGS = {
    "vocab_size": "tokenizer and embedding size",
    "d_model": "model width",
    "n_layers": "decoder layers",
    "n_heads": "query heads",
    "n_kv_heads": "key/value heads (grouped-query attention)",
    "d_ff": "SwiGLU hidden width",
}


def build_parser() -> CliParser:
    from training.recipe import STORIES  # the defaults; imports jax but starts nothing

    p = CliParser(description="Train llm_jax's default story model from scratch and save it as a checkpoint.",
                  epilog="With no flags it reproduces the model shipped in checkpoints/ "
                         "(add --force to replace it).")
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_MODEL, metavar="DIR",
                   help="checkpoint folder to write (default: the shipped model's)")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
    train = p.add_argument_group("training")
    for name, (kind, text) in _RECIPE_FLAGS.items():
        train.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(STORIES, name),
                           metavar="LR" if kind is non_negative_float else "N",
                           help=f"{text} (default: %(default)s)")
    model = p.add_argument_group("model")
    for name, text in _MODEL_FLAGS.items():
        model.add_argument(f"--{name.replace('_', '-')}", type=positive_int,
                           default=getattr(STORIES.model, name), metavar="N", help=f"{text} (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from llm_jax.weights.checkpoint import check_destination

    from training import model_card
    from training import recipe as rc

    shape = {name: getattr(args, name) for name in _MODEL_FLAGS}
    if shape["d_model"] % shape["n_heads"]:
        raise CliError(f"--d-model {shape['d_model']} must be a multiple of --n-heads {shape['n_heads']}")
    # An invalid combination raises ConfigError / ValueError, which run_main reports as one line.
    model = rc.STORIES.model.replace(**shape, head_dim=shape["d_model"] // shape["n_heads"])
    recipe = dataclasses.replace(rc.STORIES, model=model, **{n: getattr(args, n) for n in _RECIPE_FLAGS})
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
