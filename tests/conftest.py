"""Shared test fixtures: where the read-only assets in ``../shared`` live."""

import gc
import os
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """torch runs on one thread in the tests: their models are tiny, and on a busy machine (two test
    workers on two cores) its thread pool only adds spin-waits, ten times slower than one thread."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def assets_dir() -> pathlib.Path:
    """``$LLM_JAX_ASSETS`` if set, else ``../shared`` next to the repository root."""
    return pathlib.Path(os.environ.get("LLM_JAX_ASSETS", REPO_ROOT.parent / "shared"))


def require_asset(relative: str) -> pathlib.Path:
    """Path to an asset; missing assets skip locally but fail on CI (``CI=true``)."""
    path = assets_dir() / relative
    if not path.exists():
        message = f"test asset {path} is missing (set LLM_JAX_ASSETS to the shared/ folder)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def stories260k_dir() -> pathlib.Path:
    return require_asset("models/stories260K")


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> pathlib.Path:
    return require_asset("tokenizers/llama2/tokenizer.model")


def _memory_mappings() -> tuple[int, int] | None:
    """(this process's memory mappings, the most Linux allows one: ``vm.max_map_count``), where readable."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            count = sum(1 for _ in maps)
        limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None
    return count, limit


@pytest.fixture(autouse=True)
def _compiled_programs_released():
    """JAX's compiled programs are released once they hold a third of the mappings a process may have.

    XLA:CPU maps every executable's code into a few memory regions of its own (~7), and jit keeps every
    program it compiled: a test worker running the whole suite reached Linux's default
    ``vm.max_map_count`` (65,530) and the next compilation aborted inside LLVM. Tests never rely on what
    an earlier test compiled, so clearing JAX's caches between tests only costs recompilation."""
    yield
    jax = sys.modules.get("jax")
    mappings = _memory_mappings()
    if jax is not None and mappings is not None and mappings[0] > mappings[1] // 3:
        gc.collect()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def _persistent_cache_left_as_found():
    """A command run in this process (``generate``'s ``main``) turns JAX's persistent compilation cache on
    for the whole process; after the test it is turned off again, so that later tests compile as they
    would alone and write nothing to the user's cache folder."""
    jax = sys.modules.get("jax")
    before = None if jax is None else jax.config.jax_compilation_cache_dir
    yield
    jax = sys.modules.get("jax")
    if jax is None or jax.config.jax_compilation_cache_dir == before:
        return
    from jax._src import compilation_cache

    from llm_jax import executable_cache

    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()
    executable_cache.disable()
