"""Block plans against brute force: no visible key is skipped, no visited block is all masked, and
blocks run without a mask really are fully visible. Pure integer arithmetic, so many shapes."""

import numpy as np
import pytest

from pallas_kernels import masking

# Plans are evaluated for arrays of this fixed size, so jax's eager ops compile once for all shapes.
_GRID = 128


def _padded_arange(n: int) -> np.ndarray:
    """0..n-1 padded with copies of n-1 to _GRID entries (int32)."""
    assert n <= _GRID
    return np.minimum(np.arange(_GRID), n - 1).astype(np.int32)


def _visible_TS(T, S, length, window):
    """Brute-force visibility [T, S] of one sequence, as the reference defines it."""
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    ok = (j <= i) & (j < length) & (i < length)
    if window is not None:
        ok &= i - j < window
    return ok


def _prefill_configs(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        T = int(rng.integers(1, 70))
        yield dict(T=T, S=T + int(rng.integers(0, 50)), block_q=int(rng.choice([5, 8, 12, 16, 32])),
                   block_k=int(rng.choice([7, 8, 16, 32, 128])),
                   window=rng.choice([None, int(rng.integers(1, T + 5))]))


@pytest.mark.parametrize("config", list(_prefill_configs(40, seed=0)), ids=str)
def test_prefill_key_blocks_cover_exactly_the_visible_keys(config):
    T, S, block_q, block_k, window = (config[k] for k in ("T", "S", "block_q", "block_k", "window"))
    num_q_blocks, num_k_blocks = -(-T // block_q), -(-S // block_k)
    lengths, q_blocks = np.arange(S + 2), np.arange(num_q_blocks)
    plan = masking.prefill_key_blocks(
        _padded_arange(num_q_blocks)[:, None], _padded_arange(S + 2)[None, :], block_q=block_q,
        block_k=block_k, num_queries=T, sliding_window=window)
    first, lo, hi, end = (np.broadcast_to(np.asarray(x), (_GRID, _GRID)) for x in plan)
    bound = masking.max_key_blocks_per_query_block(
        block_q=block_q, block_k=block_k, num_queries=T, num_keys=S, sliding_window=window)
    for li, length in enumerate(lengths):
        visible = _visible_TS(T, S, length, window)
        for qb in q_blocks:
            rows = slice(qb * block_q, min((qb + 1) * block_q, T))
            blocks_seen = {j // block_k for j in np.flatnonzero(visible[rows].any(axis=0))}
            f, a, b, e = first[qb, li], lo[qb, li], hi[qb, li], end[qb, li]
            assert f <= a <= b <= e <= num_k_blocks and e - f <= bound
            assert blocks_seen == set(range(f, e)), (qb, length)
            valid_rows = np.arange(T)[rows] < length
            for kb in range(a, b):
                keys = slice(kb * block_k, (kb + 1) * block_k)
                assert visible[rows][valid_rows, keys].all(), (qb, kb, length)


def _decode_configs(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield dict(S=int(rng.integers(1, _GRID)), block_k=int(rng.choice([7, 8, 16, 32, 128])),
                   num_splits=int(rng.choice([1, 2, 3, 7, 16])),
                   window=rng.choice([None, int(rng.integers(1, _GRID))]))


@pytest.mark.parametrize("config", list(_decode_configs(40, seed=1)), ids=str)
def test_decode_splits_partition_the_visible_keys(config):
    S, block_k, P, window = (config[k] for k in ("S", "block_k", "num_splits", "window"))
    lengths = np.arange(S + 1)
    keys = masking.decode_key_range(
        _padded_arange(S + 1)[:, None], _padded_arange(P)[None, :], num_keys=S, block_k=block_k,
        num_splits=P, sliding_window=window)
    kv_lo, kv_hi = (np.broadcast_to(np.asarray(x), (_GRID, _GRID))[:, 0] for x in keys[:2])
    first, end = (np.broadcast_to(np.asarray(x), (_GRID, _GRID))[:, :P] for x in keys[2:])
    per_split_bound = -(-(-(-S // block_k)) // P)  # the TPU grid's steps per split
    for length in lengths:
        visible = _visible_TS(length, S, length, window)[-1] if length else np.zeros(S, bool)
        assert (np.flatnonzero(visible) == np.arange(kv_lo[length], kv_hi[length])).all()
        covered = [kb for p in range(P) for kb in range(first[length, p], end[length, p])]
        assert len(covered) == len(set(covered)), "splits overlap"
        assert set(covered) == {j // block_k for j in np.flatnonzero(visible)}
        assert max(end[length] - first[length]) <= per_split_bound
