"""Kernel tests compile one interpreter program per shape; XLA's optimisations would only slow
the compiles down (the programs run once, on tiny shapes), so they are off for these tests."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _fast_compiles():
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
