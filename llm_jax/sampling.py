"""Choosing the next token inside jit, per sequence: logits processors, then greedy or a filtered draw.

Every row of a batch carries its own settings (a :class:`SamplingParams` pytree of [B] arrays and
padded [B, X] tables) and its own randomness: the key for a row's n-th generated token is
``fold_in(fold_in(key(seed), sample), n)`` (``sample`` numbers the n > 1 completions of one prompt), so a
sequence draws the same tokens alone or in any batch, at any position.

Settings no row uses are None in :class:`SamplingParams` and cost nothing: plain greedy decoding runs
exactly the argmax it always did.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax import logits_processors as lp
from llm_jax.backends import Backend, Xla
from llm_jax.logits_processors import PAD_ID, History


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """One sequence's sampling settings (host side). ``temperature=0`` is greedy decoding.

    Processors (greedy and sampled rows), in ``transformers``' order: ``logit_bias`` (OpenAI; token id →
    additive bias), ``repetition_penalty`` (``transformers``: > 1 discourages tokens of the prompt and
    output), ``presence_penalty`` / ``frequency_penalty`` (OpenAI: subtracted per output occurrence),
    ``no_repeat_ngram_size``, ``suppress_tokens`` (banned ids) and ``bad_words_ids`` (banned sequences).
    Warpers (sampled rows only): temperature, ``top_k``, ``top_p``, ``min_p``, ``typical_p``.
    ``top_k=0``, ``top_p=1``, ``min_p=0``, ``typical_p=1``, ``repetition_penalty=1`` and penalties of 0
    disable their step.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    suppress_tokens: Sequence[int] = ()
    bad_words_ids: Sequence[Sequence[int]] = ()
    no_repeat_ngram_size: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0 (0 disables it), got {self.no_repeat_ngram_size}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
        if any(math.isnan(v) for v in bias.values()):
            raise ValueError(f"logit_bias values must not be NaN, got {bias}")
        object.__setattr__(self, "logit_bias", types.MappingProxyType(bias))  # read-only, like the rest
        object.__setattr__(self, "suppress_tokens", tuple(int(t) for t in self.suppress_tokens))
        words = tuple(tuple(int(t) for t in w) for w in self.bad_words_ids)
        if any(not w for w in words):
            raise ValueError(f"bad_words_ids entries must be non-empty token sequences, got {words}")
        object.__setattr__(self, "bad_words_ids", words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def token_ids(self) -> set[int]:
        """Every token id these settings name (for range checks against a vocabulary)."""
        return {*self.logit_bias, *self.suppress_tokens, *(t for w in self.bad_words_ids for t in w)}


GREEDY = Sampling()


def _static():
    return dataclasses.field(default=0, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Device-side settings, one row per sequence. Optional fields are None when no row uses them."""

    temperature_B: jax.Array  # float32; 0 = greedy
    top_k_B: jax.Array  # int32; 0 = off
    top_p_B: jax.Array  # float32; 1 = off
    min_p_B: jax.Array  # float32; 0 = off
    seed_B: jax.Array  # uint32
    sample_B: jax.Array  # int32: which of a prompt's n completions this row is
    typical_p_B: jax.Array | None = None  # float32; 1 = off
    repetition_penalty_B: jax.Array | None = None  # float32; 1 = off
    presence_penalty_B: jax.Array | None = None  # float32; 0 = off (set together with frequency)
    frequency_penalty_B: jax.Array | None = None  # float32; 0 = off
    bias_ids_BX: jax.Array | None = None  # int32, PAD_ID-padded
    bias_values_BX: jax.Array | None = None  # float32
    banned_BQJ: jax.Array | None = None  # int32: banned sequences, left-padded with PAD_ID
    no_repeat_ngram_B: jax.Array | None = None  # int32; 0 = off
    max_ngram_size: int = _static()  # static: the largest no_repeat_ngram_size of the batch
    # static: some row samples (temperature > 0). False: every row is greedy and ``sample`` is an argmax,
    # without the sampling filters in the program (less to trace, lower and run).
    sampled: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @classmethod
    def stack(cls, rows: Sequence[Sampling], *, vocab_size: int | None = None,
              samples: Sequence[int] | None = None) -> "SamplingParams":
        """Device settings for ``rows``; ``vocab_size`` checks the token ids they name."""
        if vocab_size is not None:
            for i, r in enumerate(rows):
                bad = sorted(t for t in r.token_ids() if not 0 <= t < vocab_size)
                if bad:
                    raise ValueError(f"sampling settings of row {i} name token ids {bad[:5]} outside the "
                                     f"vocabulary [0, {vocab_size})")

        def column(name: str, dtype, off) -> np.ndarray | None:
            values = np.array([getattr(r, name) for r in rows], dtype)
            return None if (values == off).all() else values

        presence = column("presence_penalty", np.float32, 0.0)
        frequency = column("frequency_penalty", np.float32, 0.0)
        if presence is not None or frequency is not None:
            presence = np.array([r.presence_penalty for r in rows], np.float32)
            frequency = np.array([r.frequency_penalty for r in rows], np.float32)
        bias_ids = bias_values = None
        if any(r.logit_bias for r in rows):
            bias_ids = _pad_rows([list(r.logit_bias) for r in rows], PAD_ID, np.int32)
            bias_values = _pad_rows([list(r.logit_bias.values()) for r in rows], 0.0, np.float32)
        banned = None
        sequences = [[(t,) for t in r.suppress_tokens] + list(r.bad_words_ids) for r in rows]
        if any(sequences):
            width = max(len(w) for ws in sequences for w in ws)
            banned = np.full((len(rows), max(map(len, sequences)), width), PAD_ID, np.int32)
            for i, ws in enumerate(sequences):
                for q, w in enumerate(ws):
                    banned[i, q, width - len(w):] = w
        ngram = column("no_repeat_ngram_size", np.int32, 0)
        return cls(temperature_B=np.array([r.temperature for r in rows], np.float32),
                   top_k_B=np.array([r.top_k for r in rows], np.int32),
                   top_p_B=np.array([r.top_p for r in rows], np.float32),
                   min_p_B=np.array([r.min_p for r in rows], np.float32),
                   seed_B=np.array([r.seed for r in rows], np.uint32),
                   sample_B=np.zeros(len(rows), np.int32) if samples is None else np.asarray(samples, np.int32),
                   typical_p_B=column("typical_p", np.float32, 1.0),
                   repetition_penalty_B=column("repetition_penalty", np.float32, 1.0),
                   presence_penalty_B=presence, frequency_penalty_B=frequency,
                   bias_ids_BX=bias_ids, bias_values_BX=bias_values, banned_BQJ=banned,
                   no_repeat_ngram_B=ngram, max_ngram_size=0 if ngram is None else int(ngram.max()),
                   sampled=any(r.temperature > 0 for r in rows))

    @classmethod
    def stack_fixed(cls, rows: Sequence[Sampling], *, bias_width: int, banned: tuple[int, int], max_ngram_size: int,
                    vocab_size: int | None = None, samples: Sequence[int] | None = None) -> "SamplingParams":
        """:meth:`stack` with every field of the serving engine's settings present whatever the rows use,
        in fixed shapes, so that any mix of rows shares one program: ``logit_bias`` in ``bias_width``
        columns, banned tokens and sequences (``suppress_tokens``, ``bad_words_ids``) in ``banned`` = (Q
        sequences, J tokens), ``no_repeat_ngram_size`` up to ``max_ngram_size``. Rows beyond them are
        refused."""
        Q, J = banned
        for i, r in enumerate(rows):
            problems = []
            if len(r.logit_bias) > bias_width:
                problems.append(f"{len(r.logit_bias)} logit_bias entries, at most {bias_width}")
            if len(r.suppress_tokens) + len(r.bad_words_ids) > Q:
                problems.append(f"{len(r.suppress_tokens) + len(r.bad_words_ids)} suppressed tokens and bad words, at "
                                f"most {Q}")
            if any(len(w) > J for w in r.bad_words_ids):
                problems.append(f"a bad word of {max(map(len, r.bad_words_ids))} tokens, at most {J}")
            if r.no_repeat_ngram_size > max_ngram_size:
                problems.append(f"no_repeat_ngram_size {r.no_repeat_ngram_size}, at most {max_ngram_size}")
            if problems:
                raise ValueError(f"sampling settings of row {i}: {'; '.join(problems)}")
        params = cls.stack(rows, vocab_size=vocab_size, samples=samples)
        B = len(rows)
        bias_ids = np.full((B, bias_width), PAD_ID, np.int32)
        bias_values = np.zeros((B, bias_width), np.float32)
        banned_BQJ = np.full((B, Q, J), PAD_ID, np.int32)
        for i, r in enumerate(rows):
            bias_ids[i, :len(r.logit_bias)] = list(r.logit_bias)
            bias_values[i, :len(r.logit_bias)] = list(r.logit_bias.values())
            for q, word in enumerate([(t,) for t in r.suppress_tokens] + list(r.bad_words_ids)):
                banned_BQJ[i, q, J - len(word):] = word  # left-padded: the last token is the one banned
        return dataclasses.replace(
            params, typical_p_B=np.array([r.typical_p for r in rows], np.float32),
            repetition_penalty_B=np.array([r.repetition_penalty for r in rows], np.float32),
            presence_penalty_B=np.array([r.presence_penalty for r in rows], np.float32),
            frequency_penalty_B=np.array([r.frequency_penalty for r in rows], np.float32),
            bias_ids_BX=bias_ids, bias_values_BX=bias_values, banned_BQJ=banned_BQJ,
            no_repeat_ngram_B=np.array([r.no_repeat_ngram_size for r in rows], np.int32),
            max_ngram_size=max_ngram_size, sampled=True)

    @property
    def needs_token_history(self) -> bool:
        """Whether a processor reads past tokens in order (n-grams, multi-token banned sequences)."""
        return self.no_repeat_ngram_B is not None or (self.banned_BQJ is not None and self.banned_BQJ.shape[-1] > 1)

    def new_history(self, prompts_BT: jax.Array, prompt_lengths_B: jax.Array, *, V: int,
                    capacity: int, tokens: bool = False) -> History:
        """The token history these settings need (``tokens``: the tokens themselves in any case), starting
        from the right-padded prompts."""
        return History.create(prompts_BT, prompt_lengths_B, V=V,
                              capacity=capacity if tokens or self.needs_token_history else None,
                              seen=self.repetition_penalty_B is not None,
                              counts=self.presence_penalty_B is not None)


def _pad_rows(rows: Sequence[Sequence], fill, dtype) -> np.ndarray:
    out = np.full((len(rows), max(1, max(map(len, rows)))), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def process_logits(scores_BV: jax.Array, params: SamplingParams, history: History, *,
                   num_generated_B: jax.Array, end_ids_BE: jax.Array | None = None,
                   min_new_tokens_B: jax.Array | None = None) -> jax.Array:
    """Apply every processor the batch uses, in ``transformers``' order, to float32 scores [B, V].

    ``end_ids_BE`` (EOS and stop ids) are banned while a row has fewer than ``min_new_tokens_B`` tokens.
    """
    scores_BV = scores_BV.astype(jnp.float32)
    V = scores_BV.shape[-1]
    if params.bias_ids_BX is not None:
        scores_BV = lp.logit_bias(scores_BV, params.bias_ids_BX, params.bias_values_BX)
    if params.repetition_penalty_B is not None:
        scores_BV = lp.repetition_penalty(scores_BV, params.repetition_penalty_B, history.seen_BV)
    if params.presence_penalty_B is not None:
        scores_BV = lp.presence_frequency_penalty(scores_BV, params.presence_penalty_B,
                                                  params.frequency_penalty_B, history.counts_BV)
    if params.no_repeat_ngram_B is not None:
        scores_BV = lp.ban(scores_BV, lp.no_repeat_ngram_mask(
            history.tokens_BS, history.length_B, params.no_repeat_ngram_B, max_ngram_size=params.max_ngram_size,
            V=V))
    if params.banned_BQJ is not None:
        scores_BV = lp.ban(scores_BV, lp.bad_words_mask(history.tokens_BS, history.length_B, params.banned_BQJ, V))
    if min_new_tokens_B is not None:
        scores_BV = lp.ban(scores_BV, lp.min_new_tokens_mask(end_ids_BE, num_generated_B, min_new_tokens_B, V))
    return scores_BV


def row_keys(seed_B: jax.Array, sample_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """One PRNG key per row, from its seed, which completion of its prompt it is, and its step."""
    def key(seed, sample, step):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample), step)

    return jax.vmap(key)(seed_B, sample_B, step_B)


def typical_filter(scores_BV: jax.Array, mass_B: jax.Array) -> jax.Array:
    """Locally typical sampling (Meister et al. 2023, ``TypicalLogitsWarper``): keep the tokens whose
    surprisal is closest to the entropy, in that order, until their mass reaches ``mass_B``."""
    logp_BV = jax.nn.log_softmax(scores_BV, axis=-1)
    p_BV = jnp.exp(logp_BV)
    entropy_B1 = -jnp.nansum(logp_BV * p_BV, axis=-1, keepdims=True)  # filtered tokens: -inf * 0 = nan
    shifted_BV = jnp.abs(-logp_BV - entropy_B1)
    order_BV = jnp.argsort(shifted_BV, axis=-1)
    sorted_shifted_BV = jnp.take_along_axis(shifted_BV, order_BV, axis=-1)
    mass_BV = jnp.cumsum(jax.nn.softmax(jnp.take_along_axis(scores_BV, order_BV, axis=-1), axis=-1), axis=-1)
    last_B1 = jnp.minimum(jnp.sum(mass_BV < mass_B[:, None], axis=-1, keepdims=True), scores_BV.shape[-1] - 1)
    cutoff_B1 = jnp.take_along_axis(sorted_shifted_BV, last_B1, axis=-1)
    remove_BV = (shifted_BV > cutoff_B1) & (mass_B[:, None] < 1)
    return jnp.where(remove_BV, -jnp.inf, scores_BV)


# How many of the largest logits top-k and top-p look at (lax.top_k): the first prefix where it decides
# every row, then the second; the whole vocabulary is sorted only for a batch with a row whose top-k is
# larger or whose nucleus is not inside either.
SHORT_NUCLEUS_PREFIX = 64
NUCLEUS_PREFIX = 1024


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled scores with tokens outside each row's top-k / top-p / min-p / typical-p set at
    -inf, in ``transformers``' order."""
    temperature_B1 = jnp.where(params.temperature_B > 0, params.temperature_B, 1.0)[:, None]
    logits_BV = logits_BV.astype(jnp.float32) / temperature_B1
    V = logits_BV.shape[-1]

    def threshold_from(top_BK: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each row's top-k / top-p threshold from its K largest logits in descending order (all V, or a
        prefix): (threshold [B, 1], whether the prefix decided it [B])."""
        K = top_BK.shape[-1]
        # top-k: keep logits >= the k-th largest.
        k_B = jnp.where(params.top_k_B > 0, jnp.minimum(params.top_k_B, V), V)
        # (Off, k = V: nothing is cut, whether or not the V-th largest is in the prefix.)
        kth_B1 = jnp.take_along_axis(top_BK, (jnp.minimum(k_B, K) - 1)[:, None], axis=-1)
        kth_B1 = jnp.where((k_B <= K)[:, None], kth_B1, -jnp.inf)
        top_BK = jnp.where(top_BK >= kth_B1, top_BK, -jnp.inf)
        # top-p (nucleus, Holtzman et al. 2020): the smallest prefix of the sorted distribution whose mass
        # reaches p; a token is kept when the mass before it is still below p (so the first always is).
        # The distribution is over every token top-k keeps, the prefix's and the rest's.
        max_B1 = top_BK[:, :1]
        total_B1 = jnp.sum(jnp.where(logits_BV >= kth_B1, jnp.exp(logits_BV - max_B1), 0), axis=-1, keepdims=True)
        probs_BK = jnp.exp(top_BK - max_B1) / total_B1
        mass_BK = jnp.cumsum(probs_BK, axis=-1)
        keep_BK = mass_BK - probs_BK < params.top_p_B[:, None]
        num_kept_B = jnp.sum(keep_BK, axis=-1)
        pth_B1 = jnp.take_along_axis(top_BK, (num_kept_B - 1)[:, None], axis=-1)
        threshold_B1 = jnp.maximum(kth_B1, jnp.where(params.top_p_B[:, None] < 1, pth_B1, -jnp.inf))
        # The prefix decides a row whose top-k is off or cuts inside it, and whose nucleus ends inside it
        # (or is cut there by top-k).
        decided_B = ((k_B <= K) | (k_B == V)) & ((params.top_p_B >= 1) | (num_kept_B < K) | (k_B <= K))
        return threshold_B1, decided_B

    def sorted_threshold(logits_BV):
        return threshold_from(-jnp.sort(-logits_BV, axis=-1))[0]

    def prefix_threshold(logits_BV, prefixes=(SHORT_NUCLEUS_PREFIX, NUCLEUS_PREFIX)):
        threshold_B1, decided_B = threshold_from(jax.lax.top_k(logits_BV, min(V, prefixes[0]))[0])
        if len(prefixes) == 1 or prefixes[0] >= V:
            longer = sorted_threshold
        else:
            longer = functools.partial(prefix_threshold, prefixes=prefixes[1:])
        return jax.lax.cond(jnp.all(decided_B), lambda _: threshold_B1, longer, logits_BV)

    def keep_all(logits_BV):
        return jnp.full((logits_BV.shape[0], 1), -jnp.inf, logits_BV.dtype)

    # A full sort of the vocabulary is slow on CPU (10 ms for one row of 32K, 160 ms for 16): rows that ask
    # for top-k or top-p take their thresholds from the 64 largest logits where those decide them (1.4 ms
    # for 16 rows), else from the 1,024 largest (8 ms), and from the whole sort only where neither does;
    # with neither asked, no sort. Each way gives the same threshold.
    needs_sort = jnp.any((params.top_k_B > 0) & (params.top_k_B < V)) | jnp.any(params.top_p_B < 1)
    threshold_B1 = jax.lax.cond(needs_sort, prefix_threshold, keep_all, logits_BV)

    # min-p (Nguyen et al. 2024): keep tokens with probability >= min_p * max probability, computed
    # on the distribution left by top-k and top-p.
    filtered_BV = jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)  # top-k and top-p always keep the largest
    min_p_logit_B1 = max_B1 + jnp.log(jnp.maximum(params.min_p_B[:, None], 1e-38))
    filtered_BV = jnp.where((params.min_p_B[:, None] > 0) & (filtered_BV < min_p_logit_B1), -jnp.inf,
                            filtered_BV)
    if params.typical_p_B is not None:  # a full sort: only when some row asks
        filtered_BV = jax.lax.cond(jnp.any(params.typical_p_B < 1), typical_filter, lambda scores_BV, _: scores_BV,
                                   filtered_BV, params.typical_p_B)
    return filtered_BV


def sample(scores_BV: jax.Array, params: SamplingParams, step_B: jax.Array, *, with_scores: bool = False,
           backend: Backend | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Next token per row [B] (int32) from processed scores: argmax for greedy rows (the ``backend``'s,
    ``jnp.argmax`` by default), a draw from the filtered distribution for the others. ``with_scores`` also
    returns the scores the token was chosen from (filtered and temperature-scaled for sampled rows), for
    log-probabilities."""
    greedy_B = (backend or Xla()).argmax(scores_BV)

    def draw(_):
        keys_B = row_keys(params.seed_B, params.sample_B, step_B)
        filtered_BV = filter_logits(scores_BV, params)
        drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
        sampled_B1 = params.temperature_B[:, None] > 0
        token_B = jnp.where(sampled_B1[:, 0], drawn_B, greedy_B)
        return (token_B, jnp.where(sampled_B1, filtered_BV, scores_BV)) if with_scores else token_B

    def argmax(_):
        return (greedy_B, scores_BV) if with_scores else greedy_B

    if not params.sampled:
        return argmax(None)
    # Skip the sort entirely when every row is greedy.
    return jax.lax.cond(jnp.any(params.temperature_B > 0), draw, argmax, None)
