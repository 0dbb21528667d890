"""The kernels are built for the CPU's widest vectors (16 floats with AVX-512, else 8), and ``cpu_kernels.build``
reports which instruction paths the CPU and the build have: AMX's tiles and AVX-512's bfloat16 dot products
for bfloat16 products of many rows, AVX-512 VNNI for the LM head's int8 screen in quads. Whether a call takes
a path is its option (``amx``, ``bf16_dot``, ``int8_dot``: keyword arguments of the ``cpu_kernels``
functions, fields of ``CpuKernels``), carried to the kernels as attributes of each call.

The product and greedy-head tests run every path this CPU has, in process, through those options
(tests/cpu_kernels/paths.py). Here: the probes; the options' way into every kernel call, the backend's
calls and its screens; that each option takes another path where the CPU has it (so those tests are not
the same test again); greedy decode on every path; and the 8-wide build (a compile flag: a subprocess)
passing the product, attention and greedy tests."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from cpu_kernels import build
from llm_jax.backends import CpuKernels
from llm_jax.backends.cpu import greedy_head
from llm_jax.backends.cpu.forms import head_panels
from llm_jax.config import ModelConfig
from llm_jax.decoding import DecodeControls, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, init_params
from llm_jax.prefilling import pad_prompts, prefill
from llm_jax.sampling import GREEDY
from tests.conftest import REPO_ROOT
from tests.cpu_kernels.paths import ON, other_paths

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernels are not built "
                                "(test_matmul's first test checks that a compiler, where present, builds them)")

CONFIG = ModelConfig(vocab_size=160, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=80,
                     max_seq_len=64)


def _flags() -> set[str]:
    return set(os.environ.get(build.FLAGS_ENV, "").split())


def test_built_for_the_cpus_widest_vectors():
    features = build.cpu_features().split()
    assert build.vector_lanes() == (16 if "avx512f" in features and "-mno-avx512f" not in _flags() else 8)


def test_amx_where_the_cpu_and_linux_have_it():
    """A CPU with AMX can use it under Linux 5.16 or newer (which grants the tile state on request); a CPU
    without it, or an older kernel (which has no such request), cannot."""
    features = build.cpu_features().split()
    release = tuple(int(part) for part in os.uname().release.split(".")[:2] if part.isdigit())
    expected = ("amx_bf16" in features and not {"-mno-amx-tile", "-mno-amx-bf16"} & _flags()
                and sys.platform == "linux" and release >= (5, 16))
    assert build.amx() == expected


def test_bf16_dot_products_where_the_cpu_has_them():
    """A CPU with AVX512_BF16 (and a build that has it) can run bfloat16 products of many rows on vdpbf16ps."""
    features = build.cpu_features().split()
    assert build.bf16_dot() == ("avx512_bf16" in features and not {"-mno-avx512bf16", "-mno-avx512f"} & _flags())


def test_int8_dot_products_where_the_cpu_has_them():
    """A CPU with AVX512_VNNI and AVX512BW (and a build that has them) can run the LM head's int8 screen in
    quads on vpdpbusd."""
    features = build.cpu_features().split()
    built = "avx512_vnni" in features and not {"-mno-avx512vnni", "-mno-avx512f"} & _flags()
    assert build.int8_dot() == (built and "avx512bw" in features and "-mno-avx512bw" not in _flags())
    # the benchmark's probe of their peak: 12 chains of 16 lanes, four multiply-adds each, per iteration
    assert build.arithmetic_probe("int8")(10) == (10 * 12 * 16 * 4 * 2 if built else 0)


def _calls(lowered: str, target: str) -> list[str]:
    return [line for line in lowered.splitlines() if f"custom_call @{target}" in line]


def _attributes(amx: bool, bf16_dot: bool) -> str:
    return f"amx = {str(amx).lower()}, bf16_dot = {str(bf16_dot).lower()}"


@pytest.mark.parametrize("amx,bf16_dot", [(True, True), (False, True), (True, False), (False, False)])
def test_every_product_on_panels_carries_its_options(monkeypatch, amx, bf16_dot):
    """Products on panels (float32, bfloat16, int8; bfloat16 in pairs where the dot products run) are kernel
    calls whose attributes are the call's options: the kernel's path follows them. (Lowered only, with the
    dot products reported present, so that the pairs' call is made on any CPU.)"""
    monkeypatch.setattr(cpu_kernels, "pairs_available", lambda: True)
    x = jnp.ones((9, 32))
    panels = cpu_kernels.to_panels(jnp.ones((32, 48)))
    cases = {"llm_jax_matmul_panels_f32": (panels, {}), "llm_jax_matmul_panels_bf16": (panels.astype(jnp.bfloat16), {}),
             "llm_jax_matmul_panels_i8": (panels.astype(jnp.int8), {}),
             "llm_jax_matmul_pairs_bf16": (cpu_kernels.to_pairs(panels.astype(jnp.bfloat16)), dict(pairs=True))}
    for target, (w, layout) in cases.items():
        f = functools.partial(cpu_kernels.matmul, panels=True, amx=amx, bf16_dot=bf16_dot, **layout)
        calls = _calls(jax.jit(f).lower(x, w).as_text(), target)
        if target.startswith("llm_jax_matmul_pairs") and not bf16_dot:  # pairs need the dot products: XLA's
            assert calls == [], calls
        else:
            assert len(calls) == 1 and _attributes(amx, bf16_dot) in calls[0], (target, calls)
    # the layouts with one path take no options
    for transposed, target in [(False, "llm_jax_matmul_kn_f32"), (True, "llm_jax_matmul_nk_f32")]:
        f = functools.partial(cpu_kernels.matmul, transposed=transposed, amx=amx, bf16_dot=bf16_dot)
        calls = _calls(jax.jit(f).lower(x, jnp.ones((48, 32) if transposed else (32, 48))).as_text(), target)
        assert len(calls) == 1 and "amx" not in calls[0], calls


@pytest.mark.parametrize("int8_dot", [True, False])
def test_the_quads_follow_int8_dot(monkeypatch, int8_dot):
    """With VNNI reported present, the products on quads and the fused greedy head are kernel calls where
    ``int8_dot`` allows (the head with its product's options as attributes), XLA's product and the
    unscreened head where it does not. (Lowered only.)"""
    monkeypatch.setattr(cpu_kernels, "quads_available", lambda: True)
    x = jnp.ones((9, 32))
    quads = cpu_kernels.to_quads(cpu_kernels.to_panels(jnp.ones((32, 48), jnp.int8)))
    product = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, quads=True, int8_dot=int8_dot))
    assert len(_calls(product.lower(x, quads).as_text(), "llm_jax_matmul_quads_i8")) == int8_dot
    head = cpu_kernels.to_panels(jnp.ones((32, 48), jnp.bfloat16))
    V = jnp.ones((48,))
    fused = jax.jit(lambda *a: cpu_kernels.quads_argmax(*a, 0.1, 0.1, amx=False, bf16_dot=True, int8_dot=int8_dot))
    lowered = fused.lower(x, quads, head, V, V, V).as_text()
    calls = _calls(lowered, "llm_jax_quads_argmax_bf16")
    assert len(calls) == int8_dot and all(_attributes(False, True) in c for c in calls), calls
    if not int8_dot:  # every logit through the head's product, with the same options
        products = _calls(lowered, "llm_jax_matmul_panels_bf16")
        assert len(products) == 1 and _attributes(False, True) in products[0], lowered


def test_the_backend_is_hashable_and_told_apart_by_its_options():
    assert CpuKernels() == CpuKernels(**ON) and hash(CpuKernels()) == hash(CpuKernels(**ON))
    assert len({CpuKernels(), CpuKernels(amx=False), CpuKernels(bf16_dot=False), CpuKernels(int8_dot=False)}) == 4
    assert CpuKernels(amx=False, int8_dot=False).instructions == dict(amx=False, bf16_dot=True, int8_dot=False)


@pytest.mark.parametrize("backend", [CpuKernels(), CpuKernels(amx=False, bf16_dot=False, int8_dot=False),
                                     CpuKernels(bf16_dot=False)], ids=["all-on", "all-off", "no-bf16-dot"])
def test_the_backend_passes_its_options_to_every_kernel_that_chooses(backend):
    """Every product on panels of a forward pass (prepared weights: panels and fused groups) and the greedy
    head's exact check carry the backend's options."""
    config = CONFIG.replace(param_dtype="bfloat16")
    weights = backend.prepare(init_params(config), config)
    tokens = jnp.zeros((9, 4), jnp.int32)
    lowered = jax.jit(forward, static_argnums=1, static_argnames="backend").lower(
        weights, config, tokens, backend=backend).as_text()
    products = _calls(lowered, "llm_jax_matmul_panels_bf16")
    assert len(products) >= 4, lowered  # q/k/v, o, gate/up, down (in the layers' loop) and the head
    assert all(_attributes(backend.amx, backend.bf16_dot) in call for call in products), products
    x = jnp.ones((3, config.d_model))
    greedy = jax.jit(backend.greedy_tokens, static_argnums=1).lower(weights, config, x).as_text()
    heads = _calls(greedy, "llm_jax_screened_argmax_bf16")
    assert len(heads) == 1 and _attributes(backend.amx, backend.bf16_dot) in heads[0], greedy


@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16"])
def test_the_screens_follow_the_options(monkeypatch, head_dtype):
    """With every instruction reported present (the screens are built, not run): the quads where VNNI may run
    and AMX may not, the bfloat16 screen of a float32 head in pairs where the dot products may run, plain
    otherwise; ``CpuKernels.prepare`` builds them with its options, and a step reads the quads only where
    ``int8_dot`` allows."""
    for name in ("quads_available", "pairs_available"):
        monkeypatch.setattr(cpu_kernels, name, lambda: True)
    monkeypatch.setattr(cpu_kernels.build, "amx", lambda: True)
    config = CONFIG.replace(param_dtype=head_dtype)
    params = init_params(config)
    float32 = head_dtype == "float32"
    for options, quads, pairs in [(ON, False, float32),  # AMX reads the pairs
                                  (dict(ON, amx=False), True, False),
                                  (dict(ON, amx=False, int8_dot=False), False, float32),
                                  (dict(ON, bf16_dot=False), False, False),
                                  (dict(ON, amx=False, bf16_dot=False), True, False)]:
        screen = CpuKernels(**options).prepare(params, config)[greedy_head.SCREEN]
        assert (screen.int8_quads is not None, screen.bfloat16_pairs is not None) == (quads, pairs), options
        assert (screen.bfloat16 is not None) == (float32 and not quads and not pairs), options
        assert greedy_head.screen_for(screen, 9, int8_dot=options["int8_dot"]) == (
            "int8_quads" if quads else "bfloat16" if float32 else None)
    quads_screen = greedy_head.build(head_panels(CpuKernels().prepare(params, config), config), amx=False)
    assert greedy_head.screen_for(quads_screen, 9) == "int8_quads"
    assert greedy_head.screen_for(quads_screen, 9, int8_dot=False) is None  # the quads only: every logit


def _rounding_case(R: int, K: int, N: int):
    """x [R, K] of constant rows and W [K, N] whose columns are permutations of one vector of widely spread
    magnitudes, both bfloat16 values: every exact logit of a row is the same, and the float32 ones differ
    by the order of their sums alone."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, K) * 2.0 ** rng.integers(-16, 1, K)
    W = jnp.asarray(np.stack([rng.permutation(w) for _ in range(N)], axis=1), jnp.bfloat16)
    x = jnp.asarray(rng.uniform(0.5, 2, (R, 1)) * np.ones((R, K)), jnp.bfloat16).astype(jnp.float32)
    return x, cpu_kernels.to_panels(W)


@pytest.mark.parametrize("options", other_paths(int8=False))
def test_each_option_takes_another_path_where_the_cpu_has_it(options):
    """A bfloat16 product of 32 rows (K a multiple of 32: AMX takes it where it runs) sums in another order
    on each path: the logits differ in some last places from all on's, within float32's rounding. (Only
    where the CPU has AMX or AVX512_BF16.)"""
    x, panels = _rounding_case(32, 256, 512)
    on = np.asarray(cpu_kernels.matmul(x, panels, panels=True))
    other = np.asarray(cpu_kernels.matmul(x, panels, panels=True, **options))
    assert (on != other).any()
    np.testing.assert_allclose(other, on, rtol=1e-5, atol=1e-6 * np.abs(on).max())


PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 23, 8, 4]]


def _greedy(weights, config, backend, rows: int) -> np.ndarray:
    prompts = (PROMPTS * 3)[:rows]
    tokens, lengths = pad_prompts(prompts, 16)
    controls = DecodeControls.create([GREEDY] * rows, eos_ids=[()] * rows, stop_ids=[()] * rows,
                                     max_new_tokens=[100] * rows)
    logits, cache = prefill(weights, config, tokens, lengths, init_cache(config, rows, 32), backend=backend)
    state, first = start(logits, tokens, cache, controls, backend=backend)
    cache, state, out = decode(weights, config, cache, state, controls, num_steps=10, backend=backend)
    return np.concatenate([first.tokens_BS, out.tokens_BS], axis=1)


@pytest.mark.parametrize("options", other_paths())
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_greedy_decode_on_every_path_takes_the_unscreened_tokens(param_dtype, options):
    """Greedy decode on a backend with other options (only where the CPU has a path they leave out): through
    its screens, the tokens of its own unscreened head, at 3 rows (the int8 screen) and 9 (the many-row
    screens). All on: tests/llm_jax/backends/test_screen.py."""
    backend = CpuKernels(**options)
    config = CONFIG.replace(param_dtype=param_dtype)
    # larger weights than the default init, so greedy continuations vary instead of repeating one token
    weights = backend.prepare(jax.tree.map(lambda a: a * 8 if a.ndim > 1 else a, init_params(config, seed=2)), config)
    unscreened = {k: v for k, v in weights.items() if k != greedy_head.SCREEN}
    for rows in (3, 9):
        screened = _greedy(weights, config, backend, rows)
        np.testing.assert_array_equal(screened, _greedy(unscreened, config, backend, rows))
        assert len(set(screened[0].tolist())) > 2, "degenerate continuation; the test would prove little"


def test_8_wide_build_passes_the_product_attention_and_greedy_tests():
    if cpu_kernels.available() and build.vector_lanes() == 8:
        pytest.skip("the suite's own build is 8-wide on this CPU (no AVX-512): these tests ran on it already")
    env = {**os.environ, build.FLAGS_ENV: "-mno-avx512f", "PYTEST_ADDOPTS": ""}
    lanes = subprocess.run([sys.executable, "-c", "from cpu_kernels import build; print(build.vector_lanes())"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert lanes.stdout.strip() == "8", lanes.stderr[-2000:]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/cpu_kernels/test_matmul_panels.py", "tests/cpu_kernels/test_matmul.py",
                            "tests/cpu_kernels/test_prefill_attention.py", "tests/cpu_kernels/test_decode_attention.py",
                            "tests/cpu_kernels/test_glu.py", "tests/cpu_kernels/test_greedy_ties.py",
                            "-k", "numpy or several or stacked or panels or rows or tile or matches or large or "
                                  "unscreened or rounding or duplicated or apart"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout
