"""measure_compilation: counts every compilation once and never more time than the block took."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.compile_stats import _BACKEND, measure_compilation


def test_counts_a_compilation_and_nothing_for_a_cached_call():
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
    x = jnp.arange(7.0)
    t0 = time.perf_counter()
    with measure_compilation() as first:
        f(x).block_until_ready()
    wall = time.perf_counter() - t0
    assert first.compilations == 1
    assert 0 < first.seconds <= wall
    with measure_compilation() as second:
        f(x).block_until_ready()
    assert (second.compilations, second.seconds) == (0, 0.0)


def test_a_compilation_nested_in_tracing_counts_once():
    """An eager operation compiled while another function is traced lies inside that trace's span."""
    def outer(x):
        with jax.ensure_compile_time_eval():
            table = jnp.cumsum(jnp.arange(13.0) * 1.5)  # compiled and run eagerly during tracing
        return x + table

    x = jnp.ones(13)
    t0 = time.perf_counter()
    with measure_compilation() as stats:
        out = jax.jit(outer)(x).block_until_ready()
    wall = time.perf_counter() - t0
    np.testing.assert_allclose(out, 1 + np.cumsum(np.arange(13.0) * 1.5))
    assert stats.compilations >= 2  # the eager cumsum's program and outer's
    assert 0 < stats.seconds <= wall


def test_a_duration_longer_than_the_block_is_cut_at_its_start():
    """JAX measures its phases on the wall clock, which can step: the block's own span bounds them."""
    t0 = time.perf_counter()
    with measure_compilation() as stats:
        jax.monitoring.record_event_duration_secs(_BACKEND, 3600.0)  # as after a one-hour clock step
    wall = time.perf_counter() - t0
    assert stats.compilations == 1
    assert 0 <= stats.seconds <= wall


def test_nested_blocks_both_see_a_compilation():
    f, x = jax.jit(lambda x: x @ x.T), np.ones((5, 3), np.float32)
    with measure_compilation() as outer:
        with measure_compilation() as inner:
            f(x).block_until_ready()
    assert outer.compilations == inner.compilations == 1
    assert outer.seconds >= inner.seconds > 0
