"""Compiling the kernels (``matmul.cc``, ``decode_attention.cc``, ``prefill_attention.cc``,
``paged_attention.cc``, ``argmax.cc``, ``glu.cc``, ``quant_matmul.cc``) once per machine and registering their handlers with
XLA; ``stream_read.cc`` and ``peak_flops.cc`` (the benchmark's bandwidth and arithmetic probes) are built
into the same library and called through ctypes.

The library is built on first use with the system C++ compiler (``$CXX``, else ``c++``) against the
XLA FFI headers that ship with jaxlib, for the host CPU (``-march=native``: 16-wide vectors where it has
AVX-512, else 8-wide; ``$LLM_JAX_KERNEL_FLAGS`` adds flags, e.g. ``-mno-avx512f`` for the 8-wide kernels
on an AVX-512 CPU), and kept in a cache folder keyed by everything that changes the binary: the sources,
the flags, the compiler, the jaxlib version and the CPU's instruction sets. Without a compiler (or with
``LLM_JAX_CPU_KERNELS=off``) nothing is built
and callers fall back to XLA's own matrix products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax

HERE = pathlib.Path(__file__).parent
SOURCES = (HERE / "matmul.cc", HERE / "decode_attention.cc", HERE / "prefill_attention.cc", HERE / "paged_attention.cc",
           HERE / "argmax.cc", HERE / "glu.cc", HERE / "quant_matmul.cc", HERE / "stream_read.cc", HERE / "peak_flops.cc")
HEADERS = (HERE / "common.h", HERE / "attention_tiles.h")
ENV = "LLM_JAX_CPU_KERNELS"  # "off" disables the kernels
CACHE_ENV = "LLM_JAX_KERNEL_CACHE"
FLAGS_ENV = "LLM_JAX_KERNEL_FLAGS"  # extra compiler flags, after FLAGS
HANDLERS = {  # registered target name → symbol in the library
    "llm_jax_matmul_kn_f32": "MatmulKnF32",
    "llm_jax_matmul_kn_bf16": "MatmulKnBF16",
    "llm_jax_matmul_nk_f32": "MatmulNkF32",
    "llm_jax_matmul_nk_bf16": "MatmulNkBF16",
    "llm_jax_matmul_panels_f32": "MatmulPanelsF32",
    "llm_jax_matmul_panels_bf16": "MatmulPanelsBF16",
    "llm_jax_matmul_panels_i8": "MatmulPanelsI8",
    "llm_jax_matmul_pairs_bf16": "MatmulPairsBF16",
    "llm_jax_matmul_quads_i8": "MatmulQuadsI8",
    "llm_jax_decode_attention_f32": "DecodeAttentionF32",
    "llm_jax_decode_attention_bf16": "DecodeAttentionBF16",
    "llm_jax_decode_attention_u16": "DecodeAttentionBits",
    "llm_jax_decode_attention_append_f32": "DecodeAttentionAppendF32",
    "llm_jax_decode_attention_append_bf16": "DecodeAttentionAppendBF16",
    "llm_jax_decode_attention_append_u16": "DecodeAttentionAppendBits",
    "llm_jax_prefill_attention_f32": "PrefillAttentionF32",
    "llm_jax_prefill_attention_bf16": "PrefillAttentionBF16",
    "llm_jax_prefill_attention_u16": "PrefillAttentionBits",
    "llm_jax_paged_attention_f32": "PagedAttentionF32",
    "llm_jax_paged_attention_bf16": "PagedAttentionBF16",
    "llm_jax_paged_attention_u16": "PagedAttentionBits",
    "llm_jax_paged_attention_i8": "PagedAttentionI8",
    "llm_jax_paged_attention_append_f32": "PagedAttentionAppendF32",
    "llm_jax_paged_attention_append_bf16": "PagedAttentionAppendBF16",
    "llm_jax_paged_attention_append_u16": "PagedAttentionAppendBits",
    "llm_jax_paged_attention_append_i8": "PagedAttentionAppendI8",
    "llm_jax_argmax_f32": "ArgmaxF32",
    "llm_jax_screened_argmax_f32": "ScreenedArgmaxF32",
    "llm_jax_screened_argmax_bf16": "ScreenedArgmaxBF16",
    "llm_jax_quads_argmax_f32": "QuadsArgmaxF32",
    "llm_jax_quads_argmax_bf16": "QuadsArgmaxBF16",
    "llm_jax_glu_silu_f32": "GluSiluF32",
    "llm_jax_glu_gelu_tanh_f32": "GluGeluTanhF32",
    "llm_jax_quant_matmul_i8": "QuantMatmulI8",
    "llm_jax_quant_matmul_i4": "QuantMatmulI4",
    "llm_jax_quant_matmul_i8_offsets": "QuantMatmulI8Offsets",
    "llm_jax_quant_matmul_i4_offsets": "QuantMatmulI4Offsets",
}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


def flags() -> tuple[str, ...]:
    return (*FLAGS, *os.environ.get(FLAGS_ENV, "").split())


def cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _cache_dir() -> pathlib.Path:
    base = os.environ.get(CACHE_ENV) or pathlib.Path(os.environ.get("XDG_CACHE_HOME") or
                                                     pathlib.Path.home() / ".cache") / "llm_jax" / "kernels"
    return pathlib.Path(base)


def compile_library(compiler: str) -> pathlib.Path:
    """Build (or find already built) the shared library; raises on a compiler error."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, version, jax.__version__, cpu_features(), *flags()])
                         .encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        subprocess.run([compiler, *flags(), "-w", f"-I{jax.ffi.include_dir()}", f"-I{HERE}", *map(str, SOURCES), "-o",
                        str(built)],
                       capture_output=True, text=True, check=True)
        os.replace(built, target)
    return target


def find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built and loaded library, once per process; None (after one warning) if impossible."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    compiler = find_compiler()
    if compiler is None:
        warnings.warn("cpu_kernels: no C++ compiler found (set CXX); using XLA's matrix products, which are "
                      "slower for decode and much slower with bfloat16 weights", RuntimeWarning, stacklevel=4)
        return None
    try:
        return ctypes.cdll.LoadLibrary(str(compile_library(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        lines = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or ["no message"]
        error = next((line for line in lines if "error" in line), lines[-1]).strip()[:300]
        warnings.warn(f"cpu_kernels: building the kernels with {compiler} failed, using XLA's matrix products: "
                      f"{error}", RuntimeWarning, stacklevel=4)
        return None


@functools.cache
def load() -> bool:
    """Build, load and register the kernels once per process; False (after one warning) if impossible."""
    lib = library()
    if lib is None:
        return False
    for name, symbol in HANDLERS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def vector_lanes() -> int | None:
    """Floats per vector in the built matrix products (16: AVX-512, 8: AVX2 and others); None when the
    library cannot be built."""
    lib = library()
    return None if lib is None else int(lib.LlmJaxVectorLanes())


# What the CPU and the build can do. Whether a call uses it is that call's option (``amx``, ``bf16_dot``,
# ``int8_dot`` of ``cpu_kernels.matmul`` and the greedy heads; the fields of llm_jax.backends.CpuKernels).

def amx() -> bool:
    """Whether bfloat16 products of many rows can run on the CPU's AMX tile unit in this process (an Intel
    CPU with AMX, a build that has it and Linux granting its state)."""
    lib = library()
    return lib is not None and bool(lib.LlmJaxAmx())


def bf16_dot() -> bool:
    """Whether bfloat16 products of many rows can run on AVX-512's bfloat16 dot products (vdpbf16ps), those
    AMX does not take (a CPU with AVX512_BF16 and a build that has it)."""
    lib = library()
    return lib is not None and bool(lib.LlmJaxBf16Dot())


def int8_dot() -> bool:
    """Whether the LM head's int8 screen in quads of rows can run on AVX-512 VNNI (vpdpbusd) (a CPU with
    AVX512_VNNI and AVX512BW, and a build that has them)."""
    lib = library()
    return lib is not None and bool(lib.LlmJaxInt8Dot())


def stream_read():
    """``read(a)``: the sum of a contiguous float32 NumPy array, read once by compiled code (GIL released);
    None when the library cannot be built."""
    lib = library()
    if lib is None:
        return None
    fn = lib.LlmJaxStreamRead
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64]

    def read(a):
        assert a.dtype == "float32" and a.flags.c_contiguous, "stream_read: contiguous float32 only"
        return fn(a.ctypes.data, a.size)

    return read


def arithmetic_probe(kind: str):
    """``run(iterations)`` → the operations one thread did in chains of float32 multiply-adds
    (``kind="float32"``), of bfloat16 dot products (``"bfloat16"``) or of AVX-512 VNNI's int8 dot products
    (``"int8"``; these two 0 where the CPU or the build lacks them), GIL released; None when the library
    cannot be built."""
    lib = library()
    if lib is None:
        return None
    fn = {"float32": lib.LlmJaxMultiplyAddFlops, "bfloat16": lib.LlmJaxBf16DotFlops, "int8": lib.LlmJaxInt8DotOps}[kind]
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64]
    return fn
