"""A decode step's matrix products one by one: llm_jax's CPU kernels against torch's on the same shapes.

Batched decode is bound by arithmetic, and most of its arithmetic is a layer's four products: the fused
q/k/v, o, the fused gate/up and down. Each runs here alone, x [rows, K] times every layer's weights in
turn, as a decode step runs it: llm_jax through :func:`cpu_kernels.matmul` on the weights in the form the
CPU backend prepares (:mod:`llm_jax.backends.cpu.forms`: panels where the output width takes them, else
[K, N]), torch through ``torch.nn.functional.linear`` on W [N, K] (the call ``transformers`` makes; x in
the weights' dtype, as ``transformers`` runs a bfloat16 model). Each is timed twice: over enough copies of
the weights that no cache holds them, so each call reads its weights from memory as in a step, and over
two copies, which stay in the caches: the products' arithmetic without waiting on memory. The share of
the arithmetic peak each reaches bounds how far batch B ÷ batch 1 can go on this machine.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from llm_jax.backends.cpu.forms import projection_dims, takes_panels
from llm_jax.config import ModelConfig

# A layer's products as the CPU kernels run them: q/k/v and gate/up fused (forms.GROUPS), o and down alone.
PRODUCTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
            "down": ("down_proj",)}
WEIGHT_BYTES = 96 << 20  # the copies' bytes: three times a large L3 (32 MiB)
MAX_COPIES = 512
CALLS = 480  # products per timing
REPEATS = 5  # timings, of which the median


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProductShape:
    name: str
    K: int
    N: int

    @property
    def panels(self) -> bool:
        """Whether the CPU backend's prepared weights hold this product's matrix as panels."""
        return takes_panels(self.N)


def product_shapes(config: ModelConfig) -> list[ProductShape]:
    """A layer's four products x [R, K] · W [K, N], a fused group's N the sum of its parts'."""
    out = []
    for name, parts in PRODUCTS.items():
        dims = [projection_dims(part, config) for part in parts]
        out.append(ProductShape(name=name, K=math.prod(dims[0][0]), N=sum(math.prod(outs) for _, outs in dims)))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProductTime:
    """Median seconds per product, weights read from memory (``*_s``: :data:`WEIGHT_BYTES` of copies) and
    from the caches (``*_cached_s``: two copies, which stay there between calls where two fit in the
    last-level cache); torch's None where it is not installed."""

    name: str
    dtype: str
    rows: int
    K: int
    N: int
    copies: int  # of the weights read from memory, in turn
    llm_jax_s: float
    llm_jax_cached_s: float
    torch_s: float | None
    torch_cached_s: float | None

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.K * self.N

    def gflops(self, seconds: float | None) -> float | None:
        return None if seconds is None else self.flops / seconds / 1e9

    def to_dict(self) -> dict:
        rates = {f"{field.removesuffix('_s')}_gflops": self.gflops(getattr(self, field))
                 for field in ("llm_jax_s", "llm_jax_cached_s", "torch_s", "torch_cached_s")}
        return {**dataclasses.asdict(self), "flops": self.flops, **rates}


def copies_for(shape: ProductShape, dtype: str, weight_bytes: int = WEIGHT_BYTES) -> int:
    """How many copies of the weight hold ``weight_bytes`` (at least 2, at most :data:`MAX_COPIES`)."""
    one = shape.K * shape.N * jnp.dtype(dtype).itemsize
    return min(MAX_COPIES, max(2, math.ceil(weight_bytes / one)))


def time_products(config: ModelConfig, *, rows: int, dtype: str, threads: int, calls: int = CALLS, repeats: int = REPEATS,
                  weight_bytes: int = WEIGHT_BYTES, log: Callable[[str], None] | None = None) -> list[ProductTime]:
    """Each of :func:`product_shapes` timed alone, ``calls`` products per timing, ``repeats`` timings
    (median), weights from memory and from the caches, llm_jax's and torch's taking turns. Random
    weights: only the shapes matter for speed."""
    rng = np.random.default_rng(0)
    out = []
    for shape in product_shapes(config):
        copies = copies_for(shape, dtype, weight_bytes)
        if log is not None:
            log(f"  {shape.name} [{rows}, {shape.K}] · [{shape.K}, {shape.N}] {dtype}, {copies} copies...")
        w_CKN = rng.standard_normal((copies, shape.K, shape.N), dtype=np.float32)
        x_RK = rng.standard_normal((rows, shape.K), dtype=np.float32)
        timers = {"llm_jax_s": _llm_jax_products(w_CKN, x_RK, dtype, shape.panels, calls),
                  "llm_jax_cached_s": _llm_jax_products(w_CKN[:2], x_RK, dtype, shape.panels, calls),
                  "torch_s": _torch_products(w_CKN, x_RK, dtype, calls, threads),
                  "torch_cached_s": _torch_products(w_CKN[:2], x_RK, dtype, calls, threads)}
        del w_CKN
        times: dict[str, list[float]] = {field: [] for field, timer in timers.items() if timer is not None}
        for _ in range(repeats):
            for field in times:
                times[field].append(timers[field]() / calls)
        medians = {field: statistics.median(times[field]) if field in times else None for field in timers}
        out.append(ProductTime(name=shape.name, dtype=dtype, rows=rows, K=shape.K, N=shape.N, copies=copies,
                               **medians))
        del timers
    return out


def _llm_jax_products(w_CKN: np.ndarray, x_RK: np.ndarray, dtype: str, panels: bool, calls: int):
    """A timer of ``calls`` products x · W_c (c = 0, 1, ... in turn) in one jitted loop, as decode's scan
    over layers runs them: seconds for all."""
    w = jnp.asarray(w_CKN).astype(dtype)
    stack = cpu_kernels.to_panels(w) if panels else w
    del w
    x = jnp.asarray(x_RK)
    copies = w_CKN.shape[0]

    @jax.jit
    def loop(stack, x):
        def body(total, c):
            y_RN = cpu_kernels.matmul(x, stack, panels=panels, layer=c)
            return total + y_RN[0, 0], None

        return jax.lax.scan(body, jnp.float32(0), jnp.arange(calls, dtype=jnp.int32) % copies)[0]

    jax.block_until_ready(loop(stack, x))  # compiled and warm

    def timed() -> float:
        start = time.perf_counter()
        jax.block_until_ready(loop(stack, x))
        return time.perf_counter() - start

    return timed


def _torch_products(w_CKN: np.ndarray, x_RK: np.ndarray, dtype: str, calls: int, threads: int):
    """The same with torch: ``F.linear(x, W_c)``, W_c [N, K], x in the weights' dtype; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    w = torch.from_numpy(np.ascontiguousarray(w_CKN.transpose(0, 2, 1))).to(torch_dtype)
    x = torch.from_numpy(x_RK).to(torch_dtype)
    copies = w.shape[0]
    linear = torch.nn.functional.linear

    def timed() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            for i in range(calls):
                linear(x, w[i % copies])
            return time.perf_counter() - start

    timed()  # warm
    return timed


def table(times: Sequence[ProductTime], peak_gflops: float | None, n_layers: int) -> str:
    """The products side by side, each cell "weights from memory / from the caches", with the share of
    ``peak_gflops`` (None: not measured) each reaches, and a step's products in all (``n_layers`` of each)."""
    def pair(a, b, fmt: str) -> str:
        return " / ".join("—" if v is None else format(v, fmt) for v in (a, b))

    def share(t: ProductTime, seconds: float | None) -> float | None:
        gflops = t.gflops(seconds)
        return None if gflops is None or not peak_gflops else 100 * gflops / peak_gflops

    def ratio(a: float | None, b: float) -> float | None:
        return None if a is None else a / b

    head = (f"  {'product':8} {'K':>5} {'N':>6} {'rows':>5}  {'llm_jax µs':>15}  {'% peak':>9}  {'torch µs':>15}  "
            f"{'% peak':>9}  {'× torch':>11}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for t in times:
        lines.append(f"  {t.name:8} {t.K:5d} {t.N:6d} {t.rows:5d}  "
                     f"{pair(t.llm_jax_s * 1e6, t.llm_jax_cached_s * 1e6, '.1f'):>15}  "
                     f"{pair(share(t, t.llm_jax_s), share(t, t.llm_jax_cached_s), '.0f'):>9}  "
                     f"{pair(t.torch_s and t.torch_s * 1e6, t.torch_cached_s and t.torch_cached_s * 1e6, '.1f'):>15}  "
                     f"{pair(share(t, t.torch_s), share(t, t.torch_cached_s), '.0f'):>9}  "
                     f"{pair(ratio(t.torch_s, t.llm_jax_s), ratio(t.torch_cached_s, t.llm_jax_cached_s), '.2f'):>11}")
    step = lambda field: n_layers * sum(getattr(t, field) for t in times) * 1e3
    summary = f"  a step's products ({n_layers} layers): llm_jax {step('llm_jax_s'):.2f} / {step('llm_jax_cached_s'):.2f} ms"
    if all(t.torch_s is not None for t in times):
        summary += f", torch {step('torch_s'):.2f} / {step('torch_cached_s'):.2f} ms"
    return "\n".join([*lines, summary, "  (each cell: weights read from memory / from the caches)"])
