"""Whole compiled programs on disk: a later process runs them without tracing or lowering them.

JAX's persistent compilation cache (:mod:`llm_jax.compilation`) skips XLA's compilation, but every
process still traces and lowers each program to find it there: most of a second CLI run's time to first
token. This cache keeps the
serialized executable itself (``jax.experimental.serialize_executable``) and loads it in a few tens of
milliseconds.

    cached(jitted) -> call   # calls ``jitted``; through this cache while it is enabled
    enable(directory) / disable() / directory()

A program is stored under a hash of everything it is built from: the function's name, the static
arguments (``repr``), the tree structure, shapes, dtypes and weak types of the array ones, the sources of
``llm_jax`` and ``cpu_kernels``, the jax and jaxlib versions, the devices and the CPU's instruction
sets, and the environment variables that start with ``JAX_``, ``XLA_`` or ``LLM_JAX_`` (read once per
process). Calls with a mesh, on more than one device, with an unhashable static argument, or with one
whose ``repr`` names a memory address (a function: a caller's logits processor), which no later process
could recognise, go through jit as usual. Files are written to a temporary name and renamed; one that
cannot be read is compiled again and replaced, and storing a program deletes its builds by other sources
or versions. Programs
are compiled for this cache with JAX's persistent cache switched off (see ``_fresh_compilation``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import pathlib
import pickle
import platform
import re
import tempfile
import warnings
from typing import Any, Callable

import jax
import jaxlib
import numpy as np

_FORMAT = 2  # bump when the file layout (or what goes in it) changes
_directory: pathlib.Path | None = None
_loaded: dict[Any, Any] = {}  # in-process: (function, signature) → compiled program
_IN_MEMORY = object()  # in ``_loaded``: a signature only this process can name; jit's own cache serves it
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def enable(directory: str | os.PathLike) -> pathlib.Path:
    """Store compiled programs in ``directory`` (created) and reuse them from there."""
    global _directory
    _directory = pathlib.Path(directory).expanduser()
    _directory.mkdir(parents=True, exist_ok=True)
    return _directory


def disable() -> None:
    global _directory
    _directory = None
    _loaded.clear()


def directory() -> pathlib.Path | None:
    return _directory


@functools.cache
def _build_fingerprint() -> str:
    """What every program depends on besides its arguments: sources, versions, devices, environment."""
    h = hashlib.sha256(f"format {_FORMAT}".encode())
    roots = [pathlib.Path(__file__).parent]
    try:
        import cpu_kernels
        from cpu_kernels.build import cpu_features

        roots.append(pathlib.Path(cpu_kernels.__file__).parent)
        h.update(cpu_features().encode())  # XLA:CPU compiles for this CPU's instruction sets
    except ImportError:
        h.update(platform.processor().encode())
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    h.update(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    h.update(repr([(d.platform, d.device_kind) for d in jax.devices()]).encode())
    for name in sorted(os.environ):
        if name.startswith(("JAX_", "XLA_", "LLM_JAX_")):
            h.update(f"{name}={os.environ[name]}".encode())
    for flag in ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl"):
        h.update(f"{flag}={getattr(jax.config, flag, None)}".encode())
    return h.hexdigest()


def _argument_key(value) -> tuple:
    """An argument as it decides the program: arrays by structure, shapes, dtypes and weak types; any
    other value (a static argument: a config, a step count, a mesh) by itself."""
    leaves, tree = jax.tree_util.tree_flatten(value)
    if all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves):
        return "arrays", tree, tuple((tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
                                     for x in leaves)
    return "value", value


def cached(jitted: Callable) -> Callable:
    """``jitted`` (a ``jax.jit`` function), loading and storing its compiled programs in this cache while
    it is enabled. Same arguments, same results, same donation. Which arguments are static is jit's
    to say: the program is called with the ones it takes (``args_info``)."""
    signature = inspect.signature(jitted)
    name = f"{jitted.__module__}.{getattr(jitted, '__qualname__', jitted.__name__)}"

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        if _directory is None or jax.device_count() != 1 or _serializer() is None:
            return jitted(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        if arguments.get("mesh") is not None:
            return jitted(*args, **kwargs)
        key = (name, tuple((k, _argument_key(v)) for k, v in arguments.items()))
        try:
            compiled = _loaded.get(key)
        except TypeError:  # an unhashable static argument
            return jitted(*args, **kwargs)
        if compiled is None:
            in_memory = _ADDRESS.search(repr(key)) is not None  # e.g. <function f at 0x7f...>: this process's
            compiled = _loaded[key] = _IN_MEMORY if in_memory else _load_or_compile(jitted, key, arguments)
        if compiled is _IN_MEMORY:
            return jitted(*args, **kwargs)
        return compiled(**{k: arguments[k] for k in compiled.args_info[1]})

    return call


def _serializer():
    """``jax.experimental.serialize_executable``, or None where this JAX has no such module."""
    try:
        from jax.experimental import serialize_executable
    except ImportError:
        return None
    return serialize_executable


def _load_or_compile(jitted, key, arguments):
    # <function>-<signature>-<build>: a program built by other sources or versions has the same first two
    # parts, and is replaced (deleted) when this one is stored.
    name = key[0]
    signature = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    prefix = f"{name.rsplit('.', 1)[-1]}-{signature}-"
    path = _directory / f"{prefix}{_build_fingerprint()[:20]}.jaxexec"
    if path.exists():
        try:
            return _load(path)
        except Exception as e:  # unreadable (truncated, another jaxlib): compile it again
            warnings.warn(f"llm_jax: compiled program {path} could not be loaded ({e}); compiling it again")
    lowered = jitted.lower(**arguments)
    with _fresh_compilation() as fresh:
        compiled = lowered.compile()
    if not fresh.ok:  # from XLA's cache after all: incomplete once serialized again, so not stored
        return compiled
    try:
        blob, in_tree, out_tree = _serializer().serialize(compiled)
        data = pickle.dumps((_FORMAT, blob, in_tree, out_tree))
    except Exception:  # a program this JAX cannot serialize runs all the same
        return compiled
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        for stale in _directory.glob(f"{prefix}*.jaxexec"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except OSError as e:
        warnings.warn(f"llm_jax: could not store compiled program in {path}: {e}")
        pathlib.Path(tmp).unlink(missing_ok=True)
    return compiled


class _Fresh:
    ok = True  # no compilation in the block came from JAX's persistent cache


_fresh_blocks: list[_Fresh] = []


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        for fresh in _fresh_blocks:
            fresh.ok = False


@functools.cache
def _listen() -> None:
    jax.monitoring.register_event_listener(_on_event)


@contextlib.contextmanager
def _fresh_compilation():
    """Compilations in the block skip JAX's persistent compilation cache: an executable that XLA:CPU
    read from that cache serializes without some of its kernels (stories260K's prefill: 94 KB instead
    of 159 KB) and, loaded again, fails with "Function ... not found". ``fresh.ok`` turns False if one
    was served from the cache all the same (the switch below is JAX's private state and may change)."""
    try:
        from jax._src import compilation_cache as jax_cache
    except ImportError:
        jax_cache = None
    _listen()
    fresh = _Fresh()
    _fresh_blocks.append(fresh)
    saved = getattr(jax_cache, "_cache_checked", None), getattr(jax_cache, "_cache_used", None)
    switch = None not in saved
    if switch:
        jax_cache._cache_checked, jax_cache._cache_used = True, False
    try:
        yield fresh
    finally:
        if switch:
            jax_cache._cache_checked, jax_cache._cache_used = saved
        _fresh_blocks.remove(fresh)


def _load(path: pathlib.Path):
    fmt, blob, in_tree, out_tree = pickle.loads(path.read_bytes())
    if fmt != _FORMAT:
        raise ValueError(f"file format {fmt}, expected {_FORMAT}")
    if jax.default_backend() == "cpu":
        import cpu_kernels  # a loaded program calls the kernels' handlers: register them first

        cpu_kernels.available()
    return _serializer().deserialize_and_load(blob, in_tree, out_tree)
