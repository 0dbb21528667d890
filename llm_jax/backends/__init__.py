"""The one place that decides how the model's operations run.

    choose("auto" | "xla" | "cpu" | "pallas" | Backend, *, mesh=None) -> Backend

:class:`Xla` (XLA's own operations: the reference, and sharded runs), :class:`CpuKernels` (the C++
kernels of ``cpu_kernels`` on one CPU device) and :class:`Pallas` (the attention kernels of
``pallas_kernels`` on GPU and TPU). ``"auto"`` picks the CPU kernels on one CPU device where they build,
Pallas on GPU and TPU, XLA otherwise. The model calls the backend's methods (:class:`Backend`); the
weights a backend's kernels read are derived once from the canonical params by :meth:`Backend.prepare`.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from llm_jax.backends.base import Backend, Xla
from llm_jax.backends.cpu import CpuKernels
from llm_jax.backends.pallas import Pallas

__all__ = ["CHOICES", "Backend", "BackendError", "CpuKernels", "Pallas", "Xla", "choose", "default"]

CHOICES = ("auto", "xla", "cpu", "pallas")


class BackendError(ValueError):
    """A backend that cannot run here, or an unknown name."""


def choose(choice: "str | Backend" = "auto", *, mesh: Mesh | None = None) -> Backend:
    """The backend for ``choice`` on this process' platform and ``mesh`` (None: one device)."""
    if isinstance(choice, Backend):
        if isinstance(choice, CpuKernels):
            _check_cpu_kernels(mesh)
        return choice
    name = str(choice).lower()
    platform = jax.default_backend()
    match name:
        case "auto":
            if platform in ("gpu", "tpu"):
                return Pallas()
            if platform == "cpu" and mesh is None and jax.device_count() == 1 and _cpu_kernels_build():
                return CpuKernels()
            return Xla()
        case "xla":
            return Xla()
        case "cpu":
            _check_cpu_kernels(mesh)
            return CpuKernels()
        case "pallas":
            return Pallas()
        case _:
            raise BackendError(f"unknown backend {choice!r}; choose one of {', '.join(map(repr, CHOICES))}")


@functools.cache
def default() -> Backend:
    """``choose("auto")`` for one device: what a stage called without a backend runs on."""
    return choose("auto")


def _cpu_kernels_build() -> bool:
    import cpu_kernels

    return cpu_kernels.available()


def _check_cpu_kernels(mesh: Mesh | None) -> None:
    platform = jax.default_backend()
    if platform != "cpu":
        raise BackendError(f"the cpu backend runs on the CPU; this process' platform is {platform!r}")
    if mesh is not None or jax.device_count() != 1:
        raise BackendError(f"the cpu backend runs on one device (its kernels are single-device calls); got "
                           f"{jax.device_count()} devices{' and a mesh' if mesh is not None else ''}: use 'xla'")
    if not _cpu_kernels_build():
        raise BackendError("the cpu backend's kernels did not build here (cpu_kernels needs a C++ compiler); "
                           "use 'xla'")
