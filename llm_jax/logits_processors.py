"""Logits processors: pure functions that reshape each row's next-token scores inside jit.

Each takes scores [B, V] and per-row settings ([B] arrays, or padded [B, X] tables) and returns new
scores; a row whose setting is the "off" value (penalty 1, bias 0, ngram size 0, ...) comes out bit for
bit unchanged, so a row gets the same tokens in a batch that uses a processor as alone in one that
does not. Each matches the ``transformers`` processor named in its docstring; presence and frequency
penalties follow the OpenAI API's formula.

:func:`process_logits` applies them in ``transformers``' order (``GenerationMixin._get_logits_processor``):
logit bias (as ``sequence_bias``) → repetition penalty → presence/frequency penalties → no-repeat
n-grams → banned words → minimum new tokens. The sampling warpers (temperature, top-k, top-p, min-p,
typical-p) come after, in :mod:`llm_jax.sampling`.

Token history for the penalties lives in :class:`History`: only what the batch's settings need is
allocated (None fields cost nothing), so plain greedy decoding carries no history at all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

PAD_ID = -1  # padding in id tables and emitted by finished sequences


def _scatter_mask(ids_BX: jax.Array, V: int) -> jax.Array:
    """[B, V] bool: True at each row's ids; PAD_ID (and other out-of-range ids) marks nothing."""
    B = ids_BX.shape[0]
    ids_BX = jnp.where((ids_BX >= 0) & (ids_BX < V), ids_BX, V)
    mask_BV1 = jnp.zeros((B, V + 1), bool).at[jnp.arange(B)[:, None], ids_BX].set(True)
    return mask_BV1[:, :V]


def logit_bias(scores_BV: jax.Array, ids_BX: jax.Array, values_BX: jax.Array) -> jax.Array:
    """Add ``values_BX`` to the scores of ``ids_BX`` (OpenAI ``logit_bias``; ``transformers``'
    ``SequenceBiasLogitsProcessor`` with one-token sequences). Ids are unique per row, PAD_ID unused."""
    B, V = scores_BV.shape
    ids_BX = jnp.where(ids_BX >= 0, ids_BX, V)
    return scores_BV.at[jnp.arange(B)[:, None], ids_BX].add(values_BX.astype(scores_BV.dtype), mode="drop")


def repetition_penalty(scores_BV: jax.Array, penalty_B: jax.Array, seen_BV: jax.Array) -> jax.Array:
    """CTRL's penalty (Keskar et al. 2019, ``RepetitionPenaltyLogitsProcessor``): scores of tokens seen in
    the prompt or output are divided by the penalty when positive and multiplied by it when negative."""
    penalty_B1 = penalty_B[:, None].astype(scores_BV.dtype)
    penalized_BV = jnp.where(scores_BV < 0, scores_BV * penalty_B1, scores_BV / penalty_B1)
    return jnp.where(seen_BV, penalized_BV, scores_BV)


def presence_frequency_penalty(scores_BV: jax.Array, presence_B: jax.Array, frequency_B: jax.Array,
                               counts_BV: jax.Array) -> jax.Array:
    """OpenAI's ``mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty``, where ``c[j]`` counts
    token j in the generated output (not the prompt)."""
    counts_BV = counts_BV.astype(scores_BV.dtype)
    return (scores_BV - counts_BV * frequency_B[:, None]
            - (counts_BV > 0).astype(scores_BV.dtype) * presence_B[:, None])


def ban(scores_BV: jax.Array, banned_BV: jax.Array) -> jax.Array:
    return jnp.where(banned_BV, -jnp.inf, scores_BV)


def no_repeat_ngram_mask(tokens_BS: jax.Array, length_B: jax.Array, ngram_size_B: jax.Array, *,
                         max_ngram_size: int, V: int) -> jax.Array:
    """Tokens that would repeat an n-gram of the history (``NoRepeatNGramLogitsProcessor``): [B, V] bool.

    The history is ``tokens_BS[b, :length_B[b]]`` (prompt and output). A window whose first n-1 tokens
    equal the history's last n-1 bans its n-th token. ``ngram_size_B`` 0 bans nothing; at most
    ``max_ngram_size`` (static).
    """
    B, S = tokens_BS.shape
    n_B1, len_B1 = ngram_size_B[:, None], length_B[:, None]
    padded_BS = jnp.concatenate([tokens_BS, jnp.full((B, max_ngram_size), PAD_ID, tokens_BS.dtype)], axis=1)
    j_S = jnp.arange(S)
    match_BS = jnp.ones((B, S), bool)
    for k in range(max_ngram_size - 1):
        # Window token k against history token len - n + 1 + k, for rows whose n - 1 exceeds k.
        prefix_B1 = jnp.take_along_axis(padded_BS, jnp.clip(len_B1 - n_B1 + 1 + k, 0, S), axis=1)
        match_BS &= (k >= n_B1 - 1) | (padded_BS[:, k: k + S] == prefix_B1)
    next_BS = jnp.take_along_axis(padded_BS, jnp.clip(j_S + n_B1 - 1, 0, S + max_ngram_size - 1), axis=1)
    # A window is complete when its last token is in the history; a history shorter than n bans nothing.
    match_BS &= (n_B1 > 0) & (j_S <= len_B1 - n_B1)
    return _scatter_mask(jnp.where(match_BS, next_BS, PAD_ID), V)


def bad_words_mask(tokens_BS: jax.Array | None, length_B: jax.Array, words_BQJ: jax.Array, V: int) -> jax.Array:
    """Last tokens of banned sequences whose other tokens end the history (``NoBadWordsLogitsProcessor``).

    ``words_BQJ`` holds each row's Q banned sequences **left-padded** with PAD_ID to J tokens: the last
    entry is the token to ban, the ones before it the prefix the history must end with (padding matches
    anything, so a one-token sequence is always banned). Returns [B, V] bool. With one-token sequences
    only (J = 1) no history is read (``tokens_BS`` may be None).
    """
    J = words_BQJ.shape[-1]
    if J == 1:
        return _scatter_mask(words_BQJ[:, :, 0], V)
    S = tokens_BS.shape[1]
    # The history's last J - 1 tokens, PAD_ID before its start (a pad never equals a real prefix token).
    positions_BJ = length_B[:, None] - (J - 1) + jnp.arange(J - 1)
    suffix_BJ = jnp.where(positions_BJ >= 0,
                          jnp.take_along_axis(tokens_BS, jnp.clip(positions_BJ, 0, S - 1), axis=1), PAD_ID)
    prefix_BQJ = words_BQJ[:, :, :-1]
    match_BQ = jnp.all((prefix_BQJ == PAD_ID) | (prefix_BQJ == suffix_BJ[:, None, :]), axis=-1)
    return _scatter_mask(jnp.where(match_BQ, words_BQJ[:, :, -1], PAD_ID), V)


def min_new_tokens_mask(end_ids_BE: jax.Array, num_generated_B: jax.Array, min_new_tokens_B: jax.Array,
                        V: int) -> jax.Array:
    """End-of-sequence ids, banned while a row has generated fewer than ``min_new_tokens_B`` tokens
    (``MinNewTokensLengthLogitsProcessor``)."""
    return _scatter_mask(end_ids_BE, V) & (num_generated_B < min_new_tokens_B)[:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    """What the penalties need to know about each row's tokens; a None field is not tracked.

    ``tokens_BS`` holds prompt and output at slot = position (``length_B`` valid); ``seen_BV`` marks
    tokens of prompt and output (repetition penalty); ``counts_BV`` counts output tokens (presence and
    frequency penalties).
    """

    length_B: jax.Array  # int32: prompt + generated tokens so far
    tokens_BS: jax.Array | None = None  # int32
    seen_BV: jax.Array | None = None  # bool
    counts_BV: jax.Array | None = None  # int32

    @classmethod
    def create(cls, prompts_BT: jax.Array, prompt_lengths_B: jax.Array, *, V: int, capacity: int | None,
               seen: bool, counts: bool) -> "History":
        """History holding the right-padded prompts; ``capacity`` None keeps no token buffer."""
        B, T = prompts_BT.shape
        prompts_BT = jnp.where(jnp.arange(T) < prompt_lengths_B[:, None], prompts_BT, PAD_ID).astype(jnp.int32)
        tokens_BS = None
        if capacity is not None:
            if capacity < T:
                raise ValueError(f"history capacity {capacity} is below the prompt block of {T} tokens")
            tokens_BS = jnp.full((B, capacity), PAD_ID, jnp.int32).at[:, :T].set(prompts_BT)
        return cls(length_B=prompt_lengths_B.astype(jnp.int32), tokens_BS=tokens_BS,
                   seen_BV=_scatter_mask(prompts_BT, V) if seen else None,
                   counts_BV=jnp.zeros((B, V), jnp.int32) if counts else None)

    def append(self, token_B: jax.Array, active_B: jax.Array) -> "History":
        """The history after each active row produced ``token_B``."""
        B = token_B.shape[0]
        rows_B = jnp.arange(B)
        tokens_BS, seen_BV, counts_BV = self.tokens_BS, self.seen_BV, self.counts_BV
        if tokens_BS is not None:
            slot_B = jnp.where(active_B, self.length_B, tokens_BS.shape[1])  # inactive rows: dropped
            tokens_BS = tokens_BS.at[rows_B, slot_B].set(token_B, mode="drop")
        if seen_BV is not None:
            seen_BV = seen_BV.at[rows_B, jnp.where(active_B, token_B, seen_BV.shape[1])].set(True, mode="drop")
        if counts_BV is not None:
            counts_BV = counts_BV.at[rows_B, jnp.where(active_B, token_B, counts_BV.shape[1])].add(1, mode="drop")
        return History(length_B=self.length_B + active_B.astype(jnp.int32), tokens_BS=tokens_BS,
                       seen_BV=seen_BV, counts_BV=counts_BV)
