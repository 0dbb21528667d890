"""Compiled programs kept on disk across processes: JAX's persistent compilation cache, and
:mod:`llm_jax.executable_cache` for the programs ``llm_jax.generate`` runs.

A process that compiles ``prefill`` and ``decode`` stores them on disk; the next process running the same
model with the same buckets loads them instead of compiling (and, for generate's programs, instead of
tracing and lowering them too). Command-line programs turn it on with :func:`enable_persistent_cache`;
library users decide for themselves (it is process-wide state).
"""

from __future__ import annotations

import os
import pathlib

import jax

from llm_jax import executable_cache

CACHE_ENV = "LLM_JAX_COMPILATION_CACHE"  # a folder, or "off"
_OFF = ("", "0", "off", "false", "none")


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "llm_jax" / "xla"


def enable_persistent_cache(directory: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Store and reuse compiled programs in ``directory`` (whole executables of generate's programs in its
    ``executables`` subfolder); returns the folder, or None when disabled.

    The folder is, in order: ``directory``; ``$LLM_JAX_COMPILATION_CACHE`` (``off`` disables the
    cache); a folder already configured in JAX (``JAX_COMPILATION_CACHE_DIR``); ``~/.cache/llm_jax/xla``.
    Call it before the first compilation: JAX opens the cache once, on first use.
    """
    if directory is None:
        env = os.environ.get(CACHE_ENV)
        if env is not None and env.strip().lower() in _OFF:
            return None
        directory = env or jax.config.jax_compilation_cache_dir or default_cache_dir()
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program: on CPU each compiles in well under JAX's default threshold of one second,
    # yet together they are most of a short run's time to first token.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    executable_cache.enable(path / "executables")
    return path

