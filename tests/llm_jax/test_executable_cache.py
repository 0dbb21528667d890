"""The executable cache: programs stored whole, loaded by a later caller without tracing, lowering or
compiling, with the same results and the same donation; separate files for separate signatures; an
unreadable file compiled again."""

import jax
import numpy as np
import pytest

import llm_jax
from llm_jax import executable_cache
from llm_jax.compile_stats import measure_compilation
from llm_jax.config import ModelConfig
from llm_jax.kv_cache import init_cache
from llm_jax.model import init_params
from llm_jax.prefilling import pad_prompts, prefill

CONFIG = ModelConfig(vocab_size=67, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                     max_seq_len=64)
cached_prefill = executable_cache.cached(prefill)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=3)


@pytest.fixture
def store(tmp_path):
    """An enabled cache in a fresh folder; disabled again (and forgotten in memory) afterwards."""
    directory = executable_cache.enable(tmp_path / "executables")
    yield directory
    executable_cache.disable()


def forget_loaded():
    """What a new process starts with: nothing in memory, the files on disk."""
    executable_cache._loaded.clear()


def run_prefill(fn, params, prompts):
    tokens, lengths = pad_prompts(prompts, 16)
    cache = init_cache(CONFIG, len(prompts), 32)
    logits, new_cache = fn(params, CONFIG, tokens, lengths, cache)
    return logits, new_cache, cache


def test_a_stored_program_loads_without_compiling_and_gives_the_same_results(params, store):
    prompts = [[1, 5, 9, 2], [3, 4]]
    reference, reference_cache, jit_donated = run_prefill(prefill, params, prompts)
    with measure_compilation() as first:
        logits, new_cache, donated = run_prefill(cached_prefill, params, prompts)
    assert first.compilations >= 1
    assert len(list(store.glob("prefill-*.jaxexec"))) == 1
    np.testing.assert_array_equal(logits, reference)
    forget_loaded()
    with measure_compilation() as second:
        logits, new_cache, donated = run_prefill(cached_prefill, params, prompts)
    assert (second.compilations, second.seconds) == (0, 0.0)  # no tracing, lowering or compiling
    np.testing.assert_array_equal(logits, reference)
    for got, want in zip(jax.tree.leaves(new_cache), jax.tree.leaves(reference_cache)):
        np.testing.assert_array_equal(got, want)
    # The cache is donated as by jit: its keys and values are consumed in place.
    assert [leaf.is_deleted() for leaf in jax.tree.leaves(donated)] == \
        [leaf.is_deleted() for leaf in jax.tree.leaves(jit_donated)]
    assert donated.k_LBSKH.is_deleted() and donated.v_LBSKH.is_deleted()


def test_each_signature_and_static_argument_has_its_own_file(params, store):
    run_prefill(cached_prefill, params, [[1, 2, 3]])
    run_prefill(cached_prefill, params, [[1, 2, 3], [4, 5]])  # another batch size
    other = ModelConfig(**{**CONFIG.__dict__, "norm_eps": 1e-6})  # another static argument
    tokens, lengths = pad_prompts([[1, 2, 3]], 16)
    cached_prefill(params, other, tokens, lengths, init_cache(other, 1, 32))
    assert len(list(store.glob("prefill-*.jaxexec"))) == 3
    run_prefill(cached_prefill, params, [[7, 8, 9]])  # a signature seen before: no new file
    assert len(list(store.glob("prefill-*.jaxexec"))) == 3


def test_an_unreadable_file_is_compiled_again_and_replaced(params, store):
    reference, _, _ = run_prefill(prefill, params, [[1, 5, 9]])
    run_prefill(cached_prefill, params, [[1, 5, 9]])
    (path,) = store.glob("prefill-*.jaxexec")
    path.write_bytes(path.read_bytes()[:100])  # truncated
    forget_loaded()
    with pytest.warns(UserWarning, match="could not be loaded"):
        logits, _, _ = run_prefill(cached_prefill, params, [[1, 5, 9]])
    np.testing.assert_array_equal(logits, reference)
    forget_loaded()
    with measure_compilation() as again:
        logits, _, _ = run_prefill(cached_prefill, params, [[1, 5, 9]])
    assert again.compilations == 0
    np.testing.assert_array_equal(logits, reference)


def test_disabled_it_is_the_jitted_function(params, tmp_path):
    assert executable_cache.directory() is None
    reference, _, _ = run_prefill(prefill, params, [[2, 3]])
    logits, _, _ = run_prefill(cached_prefill, params, [[2, 3]])
    np.testing.assert_array_equal(logits, reference)
    assert not executable_cache._loaded


def test_generate_from_loaded_programs_matches_generate_without_them(params, store):
    model = llm_jax.Model(params=params, config=CONFIG, tokenizer=None, eos_ids=())
    kwargs = dict(max_new_tokens=9, ignore_eos=True)
    executable_cache.disable()
    reference = llm_jax.generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], **kwargs)
    executable_cache.enable(store)
    first = llm_jax.generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], **kwargs)
    names = sorted(p.name.split("-")[0] for p in store.glob("*.jaxexec"))
    assert names == ["decode", "prefill", "start"]
    forget_loaded()
    with measure_compilation() as loaded:
        second = llm_jax.generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], **kwargs)
    for want, *got in zip(reference, first, second):
        for result in got:
            assert result.output_ids == want.output_ids
    assert loaded.compilations <= 2  # small helpers (padding, row selection); none of the three programs
    assert sorted(p.name.split("-")[0] for p in store.glob("*.jaxexec")) == names



def test_a_program_in_xlas_cache_is_stored_complete(tmp_path):
    """XLA:CPU serializes a program it read from JAX's persistent cache (written by another process)
    without some of its kernels (the shipped stories260K checkpoint's prefill: 94 of 159 KB); loaded by
    a third process it failed with "Function broadcast_and_fusion not found". The cache compiles afresh
    instead. Here another fingerprint (an LLM_JAX_ variable) makes run 2 miss the executables of run 1
    while XLA's cache has its programs."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    def generate(**env):
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--prompt",
                               "Once upon a time", "--max-new-tokens", "12"],
                              env={**os.environ, "LLM_JAX_COMPILATION_CACHE": str(tmp_path / "cache"), **env},
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    first = generate(LLM_JAX_TEST_FINGERPRINT="another")
    assert generate() == first  # XLA's cache hit; the executables stored afresh
    assert generate() == first  # loaded: they run
    # Run 2's build replaced run 1's: one file per program.
    assert len(list((tmp_path / "cache" / "executables").glob("prefill-*.jaxexec"))) == 1
