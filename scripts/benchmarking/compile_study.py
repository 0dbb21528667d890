"""Compilation costs: how compile time grows with depth, and what the persistent cache saves the CLI.

``compile_vs_depth`` compiles prefill and decode of one shape at several layer counts. ``cli_ttft`` runs
the generate command line twice against a fresh compilation cache: the second run should find every
program compiled by the first (tracing and lowering remain, compilation does not).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Sequence

import jax

from llm_jax.backends import Backend
from llm_jax.compilation import CACHE_ENV
from llm_jax.model import init_params

from benchmarking.llm_jax_engine import LlmJaxEngine, Workload
from benchmarking.shapes import shape_config


@dataclasses.dataclass(frozen=True, kw_only=True)
class DepthCompile:
    shape: str
    n_layers: int
    prefill_s: float
    decode_s: float


def compile_vs_depth(shape: str, dtype: str, layer_counts: Sequence[int], workload: Workload,
                     backend: Backend) -> list[DepthCompile]:
    """Prefill's and decode's compile time on ``backend`` of ``shape`` at each of ``layer_counts``."""
    out = []
    for n_layers in layer_counts:
        # A program this process compiled before (the benchmark's own run of the same shape) would come
        # from JAX's in-memory caches and time as zero.
        jax.clear_caches()
        config = shape_config(shape, dtype=dtype, n_layers=n_layers)
        weights = backend.prepare(init_params(config), config)
        compiled = LlmJaxEngine(weights, config, workload, backend=backend).compile()
        out.append(DepthCompile(shape=shape, n_layers=n_layers, prefill_s=compiled.prefill_s,
                                decode_s=compiled.decode_s))
        del weights
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class CliTtft:
    first_ttft_s: float
    second_ttft_s: float
    first_compile_s: float
    second_compile_s: float

    @property
    def ratio(self) -> float:
        return self.second_ttft_s / self.first_ttft_s


GENERATE = "from llm_jax.cli.generate import entry; raise SystemExit(entry())"


def cli_ttft(model_path: str | pathlib.Path, *, prompt_ids: Sequence[int], max_new_tokens: int,
             dtype: str) -> CliTtft:
    """Time to first token of two runs of ``generate --json`` sharing a fresh compilation cache."""
    metrics = []
    with tempfile.TemporaryDirectory(prefix="llm_jax_xla_cache_") as cache_dir:
        env = {**os.environ, CACHE_ENV: cache_dir}
        command = [sys.executable, "-c", GENERATE, "--model", str(model_path), "--prompt-ids",
                   ",".join(map(str, prompt_ids)), "--max-new-tokens", str(max_new_tokens), "--ignore-eos",
                   "--dtype", dtype, "--json"]
        for _ in range(2):
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"generate CLI failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            metrics.append(json.loads(done.stdout.strip().splitlines()[-1])["metrics"])
    return CliTtft(first_ttft_s=metrics[0]["ttft_s"], second_ttft_s=metrics[1]["ttft_s"],
                   first_compile_s=metrics[0]["compile_s"], second_compile_s=metrics[1]["compile_s"])
