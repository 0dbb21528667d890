"""The shipped model's README, written from the training run itself so its figures cannot drift."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pathlib
from collections.abc import Iterable

import jax
import numpy as np

from llm_jax.cli.generate import DEFAULT_MODEL

from training import data
from training.recipe import TrainResult
from training.stories import ANIMAL_NAMES, ANIMAL_SHARE, BOY_NAMES, GIRL_NAMES, NAMES, stories

# Greedy continuations shown in the README; the first is the README's main command, so it is generated
# with the command's own defaults.
GREEDY_PROMPTS = ("Once upon a time", "Once upon a time, there was a brave girl named Zoe.",
                  "There once was a little dog named Spot.", "In a little town, there was a boy named Leo.")
SAMPLED_PROMPT, SAMPLED_SEEDS, SAMPLED_TEMPERATURE = "Once upon a time", (1, 2), 0.8
SAMPLE_MAX_NEW_TOKENS = 192


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    prompt: str
    settings: str  # how it was generated, as generate.py flags
    text: str  # prompt + continuation
    finish_reason: str


def generate_samples(model) -> list[Sample]:
    """Greedy and sampled stories from ``model`` (an ``llm_jax.Model``), as ``generate.py`` prints them."""
    from llm_jax.cli.generate import build_parser
    from llm_jax.generation import generate
    from llm_jax.sampling import GREEDY, Sampling

    cli_max_new_tokens = build_parser().get_default("max_new_tokens")
    prompts = [*GREEDY_PROMPTS, *[SAMPLED_PROMPT] * len(SAMPLED_SEEDS)]
    budgets = [cli_max_new_tokens] + [SAMPLE_MAX_NEW_TOKENS] * (len(prompts) - 1)
    sampling = [GREEDY] * len(GREEDY_PROMPTS) + [Sampling(temperature=SAMPLED_TEMPERATURE, seed=s)
                                                 for s in SAMPLED_SEEDS]
    settings = [""] * len(GREEDY_PROMPTS) + [f"--temperature {SAMPLED_TEMPERATURE} --seed {s}"
                                             for s in SAMPLED_SEEDS]
    results = generate(model, prompts, max_new_tokens=budgets, sampling=sampling)  # one batch, one compile
    return [Sample(prompt=r.prompt, settings=flags, text=r.prompt + r.text, finish_reason=r.finish_reason)
            for r, flags in zip(results, settings)]


def name_consistency(model, texts: Iterable[str]) -> float | None:
    """How well the model keeps its characters' names: where a story names a character it already named,
    the probability the model gives that name, as a share of what it gives all names (averaged). 1 is
    perfect; ``1 / len(NAMES)`` is no better than chance. Names the tokenizer splits into several pieces
    are left out; None when it splits them all (a small vocabulary).
    """
    from llm_jax.model import forward

    name_ids = np.array([i for i in (model.tokenizer.piece_to_id("▁" + n) for n in NAMES) if i is not None],
                        np.int32)
    if not name_ids.size:
        return None
    docs = [[data.BOS_ID, *model.tokenizer.encode(t, add_bos=False), data.EOS_ID] for t in texts]
    rows = data.pad_rows(docs, row_len=max(map(len, docs)))
    logits_BTV = jax.jit(forward, static_argnums=1)(model.params, model.config, rows.tokens_RT[:, :-1],
                                                    rows.lengths_R)
    names_BTN = jax.nn.softmax(np.asarray(logits_BTV)[:, :, name_ids], axis=-1)
    shares = []
    for tokens_T, names_TN in zip(rows.tokens_RT, np.asarray(names_BTN)):
        for t in range(1, len(tokens_T)):
            hits = np.flatnonzero(name_ids == tokens_T[t])
            if hits.size and tokens_T[t] in tokens_T[:t]:
                shares.append(names_TN[t - 1, hits[0]])
    return float(np.mean(shares)) if shares else None


NAME_CHECK_STORIES = 100  # held-out stories the name-consistency figure is measured on


def write(result: TrainResult, path: pathlib.Path, *, command: str) -> None:
    """Write ``path/README.md`` for the checkpoint just saved there, measuring it as loaded by a user."""
    import llm_jax

    model = llm_jax.load(path)
    held_out = itertools.islice(stories(result.recipe.val_seed), NAME_CHECK_STORIES)
    readme = render(result, path=path, command=command, samples=generate_samples(model),
                    names=name_consistency(model, held_out))
    (path / "README.md").write_text(readme)


def _names_paragraph(names: float | None) -> str:
    if names is None:
        return "**Names**: not measured (the tokenizer splits every name into several pieces)."
    return f"""\
**Names**: where a held-out story mentions a character again, the model gives the right name
**{names:.0%}** of the probability it gives to names, averaged over {NAME_CHECK_STORIES} stories
({len(NAMES)} names: chance is {1 / len(NAMES):.0%}, and {_kind_chance():.0%} for a guess that only gets the
kind of character right). {_names_verdict(names)}"""


def _kind_chance() -> float:
    """The name share of a model that knows whether a character is a girl, a boy or an animal, no more."""
    human = (1 - ANIMAL_SHARE) / 2
    return human / len(GIRL_NAMES) + human / len(BOY_NAMES) + ANIMAL_SHARE / len(ANIMAL_NAMES)


def _names_verdict(names: float) -> str:
    """One sentence on what :func:`name_consistency` says; copying needs attention to do more than
    local grammar, which small, briefly trained models learn last."""
    if names >= 0.9:
        return ("The model learned to copy a character's name from earlier in the story, the one thing here "
                "that takes attention beyond local grammar; a story can still slip on a pronoun or an object.")
    if names >= 0.3:
        return ("Copying a name from earlier in the story takes attention beyond local grammar, which this "
                "model has partly learned: a story can switch a name, a pronoun or an object midway.")
    return ("Copying a name from earlier in the story takes attention beyond local grammar, which this model "
            "has not learned: it keeps a character's kind (girl, boy or animal) and pronouns, but the name "
            "itself often changes midway.")


def _size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def render(result: TrainResult, *, path: pathlib.Path, command: str, samples: list[Sample],
           names: float | None) -> str:
    """README.md for the checkpoint at ``path`` (already saved, so its size is known); ``names`` is its
    :func:`name_consistency` on held-out stories."""
    r, c = result.recipe, result.recipe.model
    name = path.name
    main = samples[0]
    default = path.resolve() == DEFAULT_MODEL.resolve()
    model_flag = "" if default else f" --model {path}"
    role = ("It is what `scripts/generate.py` runs when no `--model` is given:" if default
            else f"A variant of llm_jax's default model (`{DEFAULT_MODEL.name}`):")
    curve = "\n".join(
        f"| {p.step} | {p.train_loss:.3f} | {p.val_loss:.3f} | {math.exp(p.val_loss):.2f} | "
        f"{p.elapsed_s / 60:.1f} |"
        for p in result.history if p.val_loss is not None)
    shown = "\n\n".join(
        f"`--prompt {s.prompt!r}{' ' + s.settings if s.settings else ''}` ({s.finish_reason}):\n\n> {s.text}"
        for s in samples)
    tokens_per_step = r.batch_size * r.seq_len
    return f"""\
# {name}{": llm_jax's default model" if default else ""}

A {c.num_params():,}-parameter Llama-style decoder trained from scratch with llm_jax's own model code
(`scripts/train_tiny.py`) on short, simple English stories that llm_jax generates itself. {role}

```
python scripts/generate.py{model_flag} --prompt "{main.prompt}"
```
> {main.text}

It writes stories in the style of its training text (below) and ends them with EOS. It knows nothing
else: it is a demonstration and a test fixture for the whole pipeline (train → checkpoint → load →
generate), not a general language model.

**Held-out quality**: loss **{result.val_loss:.4f}** nats/token, perplexity **{result.val_perplexity:.3f}**,
on {result.val_stories} held-out stories ({result.val_tokens:,} tokens) from a stream the training never
drew from. The text is templated, so the perplexity is not comparable to perplexities on natural text;
most of what remains is the genuinely random choices of the generator (which name, which toy, which
phrasing).

{_names_paragraph(names)}

## Samples

Greedy unless noted; the first with `generate.py`'s default `--max-new-tokens`, the others with
`--max-new-tokens {SAMPLE_MAX_NEW_TOKENS}`:

{shown}

## Data

`scripts/training/stories.py`: a story generator written for llm_jax (same license as the project,
no download, nothing third-party), in the spirit of TinyStories (Eldan & Li, 2023). Six plots (a lost
toy, a new friend, a rainy day, sharing, a fear, building something), each sentence drawn from a few
phrasings, with names, animals, places, toys, foods and feelings filled in and kept consistent within
a story — a few hundred distinct words. Deterministic: `stories(seed)` is an endless stream.

- training: the first {result.train_stories:,} stories of `stories({r.seed})`, each as
  `BOS story EOS` in its own row of {r.seq_len + 1} tokens, right-padded ({result.train_tokens:,} real tokens);
- held-out: the first {r.val_stories} stories of `stories({r.val_seed})`, minus any exact duplicate of a
  training story ({r.val_stories - result.val_stories} dropped).

CPython's `pydoc_data` text was the other candidate; a model of this size and compute learns far
more recognisable text from stories with a small vocabulary than from reference documentation.

## Tokenizer

`tokenizer.model`: sentencepiece BPE, {c.vocab_size} pieces, byte fallback (any text encodes),
identity normalization, digits split, trained with `sentencepiece.SentencePieceTrainer` on the first
{r.tokenizer_stories:,} training stories (one thread, every sentence, in order: deterministic).
UNK={data.UNK_ID}, BOS={data.BOS_ID}, EOS={data.EOS_ID}. Generation stops at EOS (and at BOS, which only
ever starts a story).

## Model

| | |
|---|---|
| layers × width | {c.n_layers} × {c.d_model} |
| attention | {c.n_heads} query heads, {c.n_kv_heads} kv heads (GQA), head dim {c.head_dim}, RoPE θ {c.rope_theta:g} |
| MLP | SwiGLU, hidden {c.d_ff} |
| vocabulary | {c.vocab_size}, tied input/output embedding |
| context | trained on {r.seq_len} tokens; `max_seq_len` {c.max_seq_len} |
| params | {c.num_params():,} ({c.param_dtype}); checkpoint folder {_size(path) / 2**20:.1f} MiB |

## Training

```
{command}
```

AdamW (β=({r.optimizer.b1}, {r.optimizer.b2}), weight decay {r.weight_decay} except on norm scales),
peak learning rate {r.peak_lr:g} after {r.optimizer.warmup_steps} warmup steps, cosine decay to
{r.peak_lr * r.optimizer.final_lr_ratio:g}, gradient clipping at {r.optimizer.grad_clip}; {r.steps} steps of
{r.batch_size} × {r.seq_len} tokens ({tokens_per_step:,} per step), seed {r.seed}. Next-token
cross-entropy, padding masked out.

Training took {result.train_s / 60:.1f} min of wall time (compilation {result.compile_s:.0f} s, evaluations
included) in float32 on 2 CPU cores shared with other jobs; the process itself used
{result.train_cpu_s / 60:.1f} CPU-minutes, about {result.train_cpu_s / 120:.1f} minutes on two idle cores.
`train_log.json` holds the full curve and the recipe.

| step | train loss | held-out loss | held-out perplexity | minutes |
|---:|---:|---:|---:|---:|
{curve}

## Files

`checkpoint.json` (config, EOS/stop ids, tensor manifest), `params/` (orbax), `tokenizer.model`,
`train_log.json`, this README. Load it with `llm_jax.load("{"checkpoints/" + name if default else path}")`.
"""
