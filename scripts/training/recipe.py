"""The default model's recipe, end to end: stories → tokenizer → padded rows → AdamW steps → checkpoint.

:data:`STORIES` reproduces the model shipped in ``checkpoints/``; ``scripts/train_tiny.py`` runs it (or a
variant: fewer steps, a smaller model). Everything is seeded: the same recipe gives the same tokenizer,
the same rows and, on the same platform, the same params.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import tempfile
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
import sentencepiece

from llm_jax.config import ModelConfig
from llm_jax.model import Params, init_params

from training import data
from training.step import OptimizerConfig, init_state, make_eval_step, make_optimizer, make_train_step
from training.stories import stories

# A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, tied embeddings.
STORIES_MODEL = ModelConfig(vocab_size=1536, d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=32,
                            d_ff=384, max_seq_len=512, tie_embeddings=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """How to train one model. ``model.vocab_size`` is also the tokenizer's vocabulary size."""

    model: ModelConfig = STORIES_MODEL
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    # Tokens per row the model sees (a row holds seq_len + 1: inputs and shifted targets). One story per
    # row: 1 in 20,000 stories is longer than 145 tokens.
    seq_len: int = 144
    peak_lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    tokenizer_stories: int = 5000  # training stories the tokenizer learns from
    val_stories: int = 500
    eval_every: int = 100
    log_every: int = 10

    def __post_init__(self) -> None:
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")
        for name in ("steps", "batch_size", "seq_len", "tokenizer_stories", "val_stories", "eval_every",
                     "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def optimizer(self) -> OptimizerConfig:
        return OptimizerConfig(peak_lr=self.peak_lr, warmup_steps=min(self.warmup_steps, self.steps),
                               total_steps=self.steps, weight_decay=self.weight_decay)

    @property
    def val_seed(self) -> int:
        """Held-out stories come from a stream of their own; any exact duplicate of a training story is
        dropped from them as well."""
        return self.seed + 1_000_003


STORIES = Recipe()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogPoint:
    step: int
    train_loss: float  # mean over the steps since the previous point
    val_loss: float | None
    elapsed_s: float  # wall time since the first step started (compile included)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainResult:
    recipe: Recipe
    params: Params
    tokenizer_model: bytes  # serialized sentencepiece model
    history: tuple[LogPoint, ...]
    train_stories: int
    train_tokens: int  # real (unpadded) tokens seen
    val_stories: int
    val_tokens: int
    compile_s: float
    train_s: float  # wall time of the whole loop, evals and compile included
    train_cpu_s: float  # CPU time of this process over the loop: what the run costs on a shared machine

    @property
    def val_loss(self) -> float:
        return next(p.val_loss for p in reversed(self.history) if p.val_loss is not None)

    @property
    def val_perplexity(self) -> float:
        return math.exp(self.val_loss)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corpus:
    """The tokenizer and the token rows of one recipe."""

    tokenizer_model: bytes  # serialized sentencepiece model
    train_rows: data.Rows  # steps * batch_size rows
    val_rows: data.Rows  # padded with empty rows to whole batches
    train_stories: int
    val_stories: int


def build_corpus(recipe: Recipe) -> Corpus:
    """Train the tokenizer, then put just enough training stories, and the held-out ones, into rows."""
    tokenizer_model = data.train_tokenizer(itertools.islice(stories(recipe.seed), recipe.tokenizer_stories),
                                           vocab_size=recipe.model.vocab_size)
    processor = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_model)
    row_len = recipe.seq_len + 1
    seen: set[str] = set()

    def recorded(texts: Iterator[str]) -> Iterator[str]:
        for text in texts:
            seen.add(text)
            yield text

    train_rows = data.pad_rows(data.encode_documents(processor, recorded(stories(recipe.seed))),
                                row_len=row_len, num_rows=recipe.steps * recipe.batch_size)
    val_texts = [t for t in itertools.islice(stories(recipe.val_seed), recipe.val_stories) if t not in seen]
    val_rows = data.pad_rows(data.encode_documents(processor, val_texts), row_len=row_len)
    return Corpus(tokenizer_model=tokenizer_model, train_rows=train_rows,
                  val_rows=_pad_to_multiple(val_rows, recipe.batch_size), train_stories=len(seen),
                  val_stories=len(val_texts))


def train(recipe: Recipe, *, log: Callable[[str], None] = print) -> TrainResult:
    """Run ``recipe`` from scratch, logging progress lines (and a sample story at each evaluation)."""
    corpus = build_corpus(recipe)
    log(f"data: {corpus.train_stories} training stories ({corpus.train_rows.num_tokens:,} tokens in "
        f"{len(corpus.train_rows)} rows), {corpus.val_stories} held-out ({corpus.val_rows.num_tokens:,} tokens)")
    config = recipe.model
    optimizer = make_optimizer(recipe.optimizer)
    state = init_state(init_params(config, recipe.seed), optimizer)
    log(f"model: {config.num_params():,} params · {config.n_layers} layers · d_model {config.d_model} · "
        f"vocab {config.vocab_size}")
    train_step = make_train_step(config, optimizer)
    evaluate = _evaluator(config, corpus.val_rows, recipe.batch_size)
    preview = _previewer(config, corpus.tokenizer_model)

    history: list[LogPoint] = []
    pending: list[jax.Array] = []  # losses since the last log point, read back lazily
    tokens_seen, compile_s = 0, 0.0
    start, start_cpu = time.perf_counter(), time.process_time()
    batches = data.batches(corpus.train_rows, batch_size=recipe.batch_size)
    for step, (tokens_BT, lengths_B) in enumerate(batches, 1):
        state, metrics = train_step(state, tokens_BT, lengths_B)
        pending.append(metrics["loss"])
        tokens_seen += int(lengths_B.sum())
        if step == 1:
            jax.block_until_ready(metrics)
            compile_s = time.perf_counter() - start
        evaluate_now = step % recipe.eval_every == 0 or step == recipe.steps
        if step % recipe.log_every == 0 or evaluate_now:
            train_loss, pending = float(np.mean(jax.device_get(pending))), []
            val_loss = evaluate(state.params) if evaluate_now else None
            elapsed = time.perf_counter() - start
            history.append(LogPoint(step=step, train_loss=train_loss, val_loss=val_loss, elapsed_s=elapsed))
            val = f" · val {val_loss:.4f} (ppl {math.exp(val_loss):.2f})" if val_loss is not None else ""
            log(f"step {step:>5}/{recipe.steps} · loss {train_loss:.4f}{val} · "
                f"lr {recipe.optimizer.schedule()(step):.2e} · {tokens_seen / elapsed:,.0f} tok/s · "
                f"{_clock(elapsed)} elapsed · eta {_clock(elapsed / step * (recipe.steps - step))}")
            if evaluate_now:
                log(f"  sample: {preview(state.params)}")
    return TrainResult(recipe=recipe, params=jax.device_get(state.params),
                       tokenizer_model=corpus.tokenizer_model, history=tuple(history),
                       train_stories=corpus.train_stories, train_tokens=tokens_seen,
                       val_stories=corpus.val_stories, val_tokens=corpus.val_rows.num_tokens,
                       compile_s=compile_s, train_s=time.perf_counter() - start,
                       train_cpu_s=time.process_time() - start_cpu)


def _evaluator(config: ModelConfig, val_rows: data.Rows, batch_size: int) -> Callable[[Params], float]:
    """Mean next-token loss over every held-out target token."""
    eval_step = make_eval_step(config)

    def evaluate(params: Params) -> float:
        total, count = 0.0, 0
        for tokens_BT, lengths_B in data.batches(val_rows, batch_size=batch_size):
            loss_sum, n = eval_step(params, tokens_BT, lengths_B)
            total, count = total + float(loss_sum), count + int(n)
        return total / count

    return evaluate


PREVIEW_PROMPT = "Once upon a time"


def _previewer(config: ModelConfig, tokenizer_model: bytes) -> Callable[[Params], str]:
    """A greedy story from :data:`PREVIEW_PROMPT`, through llm_jax's own generation path."""
    from llm_jax.generation import generate
    from llm_jax.loading import Model
    from llm_jax.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "tokenizer.model"
        path.write_bytes(tokenizer_model)
        tokenizer = load_tokenizer(path)

    def preview(params: Params) -> str:
        model = Model(config=config, params=params, tokenizer=tokenizer, eos_ids=(data.EOS_ID,),
                      stop_ids=(data.BOS_ID,))
        [result] = generate(model, [PREVIEW_PROMPT], max_new_tokens=192)
        return PREVIEW_PROMPT + result.text

    return preview


def _pad_to_multiple(rows: data.Rows, multiple: int) -> data.Rows:
    """Append empty rows (length 0: no targets) so every eval batch has the same shape."""
    extra = -len(rows) % multiple
    return data.Rows(tokens_RT=np.pad(rows.tokens_RT, ((0, extra), (0, 0))),
                     lengths_R=np.pad(rows.lengths_R, (0, extra)))


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s"


def recipe_dict(recipe: Recipe) -> dict:
    """The recipe as JSON-ready values (the model config as ``ModelConfig.to_dict``)."""
    out = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name != "model"}
    return {"model": recipe.model.to_dict(), **out, "val_seed": recipe.val_seed}


def training_log(result: TrainResult) -> dict:
    """What ``train_log.json`` beside the checkpoint records: the recipe, the data, the curve, the time."""
    return {
        "recipe": recipe_dict(result.recipe),
        "params": result.recipe.model.num_params(),
        "data": {"train_stories": result.train_stories, "train_tokens": result.train_tokens,
                 "val_stories": result.val_stories, "val_tokens": result.val_tokens},
        "val_loss": result.val_loss, "val_perplexity": result.val_perplexity,
        "compile_s": result.compile_s, "train_s": result.train_s, "train_cpu_s": result.train_cpu_s,
        "history": [dataclasses.asdict(p) for p in result.history],
    }


def save(result: TrainResult, path: str | pathlib.Path, *, force: bool = False, command: str = "") -> pathlib.Path:
    """Write the trained model as an llm_jax checkpoint at ``path``, with ``train_log.json`` beside it.

    Generation stops at EOS, and at BOS too: BOS only ever starts a story, so emitting it means one ended.
    """
    from llm_jax.weights.checkpoint import save_checkpoint

    path = pathlib.Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = pathlib.Path(tmp) / "tokenizer.model"
        tokenizer.write_bytes(result.tokenizer_model)
        save_checkpoint(path, config=result.recipe.model, params=result.params, tokenizer_files=[tokenizer],
                        eos_ids=(data.EOS_ID,), stop_ids=(data.BOS_ID,), force=force,
                        source=f"trained from scratch: {command}" if command else "trained from scratch")
    log = {"command": command, **training_log(result)}
    (path / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return path
