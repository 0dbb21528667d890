"""Speculative decoding against plain decoding, side by side in one process (``benchmark.py --speculative``).

For each model, dtype, batch size and prompt kind, ``llm_jax.generate`` runs plainly and with speculation,
taking turns (each repeat runs both), greedy with EOS ignored. Reported: each one's decode tokens/s
(compilation excluded, as ``GenerationMetrics`` counts it), their ratio repeat by repeat, the acceptance
rate, tokens per verification step, and whether the ids were identical (they must be).

Prompt kinds: ``repetitive`` repeats a passage ("Keep repeating: ..." for a model with a tokenizer, a
passage of random ids otherwise) and ``novel`` has no repeated token (a story opening, or distinct ids).
A model with a tokenizer also runs ``story``: four openings of children's stories in turn (repeat r
starts from opening r mod 4), each told to its end (EOS stops it; the budget caps it), the setting in
which the shipped model's draft is measured.
Random weights decode greedily into a loop, which prompt lookup predicts whatever the prompt; so on a
model without a tokenizer (a named shape) the novel prompt samples at temperature 1 from the same seed,
which matches nothing (and gives plain decoding's tokens, as no proposal is made).
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
from typing import Callable, Sequence

import numpy as np

import llm_jax
from llm_jax.loading import Model

PASSAGE = ("The little girl took her red ball to the park. She threw it high into the sky and laughed when "
           "her dog ran after it.")
REPETITIVE_TEXT = "Keep repeating: " + " ".join([PASSAGE] * 3)
NOVEL_TEXT = "Once upon a time, in a small village near the mountains, there lived"
STORY_OPENINGS = ("Once upon a time, there was a curious girl named Lucy.",
                  "Once upon a time, there was a bear named Sunny.",
                  "Once upon a time, there lived a boy named Max.",
                  "There once was a curious boy named Noah.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeRow:
    model: str
    dtype: str
    batch: int
    prompt: str  # "repetitive", "novel" or "story"
    sampling: str  # "greedy" or "t=1"
    proposer: str  # "ngram" or the draft's name
    k: int
    plain_tokens_per_s: float  # median over the repeats
    speculative_tokens_per_s: float
    ratio: float  # speculative ÷ plain, median of the repeats' ratios
    ratio_min: float
    ratio_max: float
    acceptance_rate: float
    mean_accepted_length: float  # tokens per verification step
    speculative_share: float  # verification steps ÷ all steps (the rest were plain: no match, or backing off)
    identical: bool  # the ids equal plain decoding's


def prompts_for(model: Model, kind: str, batch: int, seed: int = 0, repeat: int = 0) -> list:
    """``batch`` prompts of ``kind``: text for a model with a tokenizer, ids otherwise (rows differ in length)."""
    if kind == "story":
        return [STORY_OPENINGS[(repeat + row) % len(STORY_OPENINGS)] for row in range(batch)]
    if model.tokenizer is not None:
        text = REPETITIVE_TEXT if kind == "repetitive" else NOVEL_TEXT
        return [text] * batch
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    prompts = []
    for row in range(batch):
        if kind == "repetitive":
            passage = rng.choice(V, size=24, replace=False).tolist()
            prompts.append(passage * 3)
        else:
            prompts.append(rng.choice(V, size=48 + row, replace=False).tolist())
    return prompts


def study(model: Model, label: str, dtype: str, batches: Sequence[int], speculative: llm_jax.Speculative,
          proposer: str, *, new_tokens: int, repeats: int, chunk_steps: int,
          log: Callable[[str], None]) -> list[SpeculativeRow]:
    rows = []
    for batch in batches:
        for kind in ("repetitive", "novel") + (("story",) if model.tokenizer is not None else ()):
            prompts = prompts_for(model, kind, batch)
            sampled = kind == "novel" and model.tokenizer is None
            sampling = llm_jax.Sampling(temperature=1.0, seed=0) if sampled else llm_jax.GREEDY
            kwargs = dict(max_new_tokens=new_tokens, ignore_eos=kind != "story", chunk_steps=chunk_steps,
                          sampling=sampling)
            log(f"{label} {dtype} batch {batch} {kind}: compiling plain and speculative...")
            llm_jax.generate(model, prompts, **kwargs)
            llm_jax.generate(model, prompts, speculative=speculative, **kwargs)
            plain_rates, spec_rates, ratios, identical, metrics = [], [], [], True, None
            for repeat in range(repeats):
                prompts = prompts_for(model, kind, batch, repeat=repeat)
                plain = llm_jax.generate(model, prompts, **kwargs)
                spec = llm_jax.generate(model, prompts, speculative=speculative, **kwargs)
                plain_rates.append(plain[0].metrics.decode_tokens_per_s)
                spec_rates.append(spec[0].metrics.decode_tokens_per_s)
                ratios.append(spec_rates[-1] / plain_rates[-1])
                identical &= [r.output_ids for r in plain] == [r.output_ids for r in spec]
                metrics = spec[0].metrics
                log(f"  repeat {repeat + 1}: plain {plain_rates[-1]:.1f} tok/s, speculative {spec_rates[-1]:.1f} "
                    f"tok/s ({ratios[-1]:.2f}×), acceptance {metrics.acceptance_rate:.2f}")
            decode_steps = metrics.speculative_steps + (metrics.generated_tokens - batch - metrics.accepted_tokens
                                                        - metrics.speculative_steps)
            rows.append(SpeculativeRow(
                model=label, dtype=dtype, batch=batch, prompt=kind, sampling="t=1" if sampled else "greedy",
                proposer=proposer, k=speculative.num_tokens, plain_tokens_per_s=statistics.median(plain_rates),
                speculative_tokens_per_s=statistics.median(spec_rates),
                ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                acceptance_rate=metrics.acceptance_rate, mean_accepted_length=metrics.mean_accepted_length,
                speculative_share=metrics.speculative_steps / max(decode_steps, 1), identical=identical))
    return rows


def table(rows: Sequence[SpeculativeRow]) -> str:
    head = (f"{'model':<12} {'dtype':<8} {'batch':>5} {'prompt':<10} {'sampling':<8} {'proposer':<16} {'k':>2} "
            f"{'plain tok/s':>11} {'spec tok/s':>10} {'ratio (min–max)':>17} {'accept':>6} {'tok/step':>8} "
            f"{'spec steps':>10} same")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r.ratio:.2f}× ({r.ratio_min:.2f}–{r.ratio_max:.2f})"
        lines.append(f"{r.model:<12} {r.dtype:<8} {r.batch:>5} {r.prompt:<10} {r.sampling:<8} {r.proposer:<16} "
                     f"{r.k:>2} {r.plain_tokens_per_s:>11.1f} {r.speculative_tokens_per_s:>10.1f} {ratio:>17} "
                     f"{r.acceptance_rate:>6.2f} {r.mean_accepted_length:>8.2f} {100 * r.speculative_share:>9.0f}% "
                     f"{'yes' if r.identical else 'NO'}")
    return "\n".join(lines)


def speculative_for(choice: str, k: int, dtype: str, backend) -> tuple[llm_jax.Speculative, str]:
    """The ``Speculative`` of ``--speculative ngram|PATH`` and the proposer's label."""
    if choice == "ngram":
        return llm_jax.Speculative(num_tokens=k), "ngram"
    path = pathlib.Path(choice)
    if not path.exists():
        raise ValueError(f"--speculative takes 'ngram' or a draft model's path; {choice} does not exist")
    draft = llm_jax.load(path, dtype=dtype, backend=backend)
    return llm_jax.Speculative(method="draft", draft_model=draft, num_tokens=k), path.name
