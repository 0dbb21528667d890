"""The kernels are built for the CPU's widest vectors: 16 floats with AVX-512, else 8; bfloat16
products of many rows run on the AMX tile unit where there is one, else on AVX-512's bfloat16 dot products
where the CPU has them; and the LM head's int8 screen in quads on AVX-512 VNNI where the CPU has it. Every path must pass the product, attention and activation tests, whichever CPU the suite runs
on: the 8-wide build is rebuilt here with ``LLM_JAX_KERNEL_FLAGS=-mno-avx512f``, and the 16-wide float32
tiles run bfloat16 with ``LLM_JAX_AMX=off LLM_JAX_BF16_DOT=off``, each in a subprocess (on a CPU without
AVX-512, AMX or AVX512_BF16 that is the default path, and the tests run a second time); AMX's CPUs also
have the dot products, which run the bfloat16 tests with ``LLM_JAX_AMX=off``."""

import os
import subprocess
import sys

import pytest

import cpu_kernels
from cpu_kernels import build
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernels are not built "
                                "(test_matmul's first test checks that a compiler, where present, builds them)")


def test_built_for_the_cpus_widest_vectors():
    features = build.cpu_features().split()
    flags = os.environ.get(build.FLAGS_ENV, "").split()
    assert build.vector_lanes() == (16 if "avx512f" in features and "-mno-avx512f" not in flags else 8)


def test_amx_where_the_cpu_and_linux_have_it():
    """A CPU with AMX uses it under Linux 5.16 or newer (which grants the tile state on request); a CPU
    without it, an older kernel (which has no such request), or AMX turned off, never does."""
    features = build.cpu_features().split()
    release = tuple(int(part) for part in os.uname().release.split(".")[:2] if part.isdigit())
    flags = os.environ.get(build.FLAGS_ENV, "").split()
    expected = ("amx_bf16" in features and os.environ.get("LLM_JAX_AMX") != "off"
                and not {"-mno-amx-tile", "-mno-amx-bf16"} & set(flags) and sys.platform == "linux"
                and release >= (5, 16))
    assert build.amx() == expected


def test_bf16_dot_products_where_the_cpu_has_them():
    """A CPU with AVX512_BF16 (and a build that has it) runs bfloat16 products of many rows on vdpbf16ps,
    unless they are turned off."""
    features = build.cpu_features().split()
    flags = os.environ.get(build.FLAGS_ENV, "").split()
    expected = ("avx512_bf16" in features and os.environ.get("LLM_JAX_BF16_DOT") != "off"
                and not {"-mno-avx512bf16", "-mno-avx512f"} & set(flags))
    assert build.bf16_dot() == expected


def test_int8_dot_products_where_the_cpu_has_them():
    """A CPU with AVX512_VNNI (and a build that has it) runs the LM head's int8 screen in quads on vpdpbusd,
    unless it is turned off."""
    features = build.cpu_features().split()
    flags = os.environ.get(build.FLAGS_ENV, "").split()
    built = "avx512_vnni" in features and not {"-mno-avx512vnni", "-mno-avx512f"} & set(flags)
    assert build.int8_dot() == (built and "avx512bw" in features and os.environ.get("LLM_JAX_INT8_DOT") != "off"
                                and "-mno-avx512bw" not in flags)
    # the benchmark's probe of their peak: 12 chains of 16 lanes, four multiply-adds each, per iteration
    assert build.arithmetic_probe("int8")(10) == (10 * 12 * 16 * 4 * 2 if built else 0)


def test_without_int8_dot_products_the_quads_and_the_screens_pass_their_tests():
    """Turned off (as on a CPU without VNNI): the products on quads are XLA's, greedy steps of many rows read
    the bfloat16 screen (a float32 head) or every logit (a bfloat16 one), and their tests pass."""
    env = {**os.environ, "LLM_JAX_INT8_DOT": "off", "PYTEST_ADDOPTS": ""}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/cpu_kernels/test_matmul_panels.py", "tests/llm_jax/backends/test_screen.py",
                            "tests/cpu_kernels/test_greedy_ties.py", "-k", "quads or screen or bounds or unscreened"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout


@pytest.mark.parametrize("env", [{"LLM_JAX_AMX": "off"}, {"LLM_JAX_AMX": "off", "LLM_JAX_BF16_DOT": "off"}],
                         ids=["dot-products", "float32-tiles"])
def test_bfloat16_products_without_amx_pass_the_product_tests(env):
    env = {**os.environ, **env, "PYTEST_ADDOPTS": ""}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/cpu_kernels/test_matmul_panels.py", "tests/cpu_kernels/test_matmul.py",
                            "tests/cpu_kernels/test_greedy_ties.py", "tests/cpu_kernels/test_argmax.py", "-k",
                            "bf16 or bfloat16"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout


def test_8_wide_build_passes_the_product_attention_and_greedy_tests():
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
