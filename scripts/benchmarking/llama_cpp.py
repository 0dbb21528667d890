"""The same workload on llama.cpp (``llama-cpp-python``), on a GGUF file of the very same weights.

``--compare llama.cpp`` writes the benchmarked model as GGUF (``llm_jax.weights.to_gguf``) in the type that
matches each row's weights (:func:`gguf_type`: float32 → F32, bfloat16 → BF16, int8 → Q8_0, int4 → Q4_0),
and runs three engines taking turns: llm_jax on its own weights, llm_jax on llama.cpp's file
(``llm_jax.load`` of it: literally the same weights, for the quantized types) and llama.cpp on that file.

llama.cpp decodes greedily one token per ``llama_decode`` call, its logits read in place and argmax taken
by numpy (tens of microseconds of a step of milliseconds): pure decode time, no sampler. It is a benchmark
dependency only (``pip install llama-cpp-python``, which builds llama.cpp from source); the library and
its tests never import it.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from llm_jax.cli.common import CliError
from llm_jax.config import ModelConfig

from benchmarking.llm_jax_engine import EagerEngine, Run, Workload, runner_up

INSTALL = "pip install llama-cpp-python"

# ``--quantize`` scheme → the GGUF type of the same kind (blocks of 32 along the input, float16 scales)
_BLOCK_TYPES = {"int8": "Q8_0", "int4": "Q4_0", "int4-asym": "Q4_1"}
_FLOAT_TYPES = {"float32": "F32", "bfloat16": "BF16"}


def require() -> None:
    """Import ``llama_cpp`` (raising, with how to install it, where it is not installed), its OpenMP threads
    set to sleep when they wait (``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise): spinning
    at every barrier of a step, they slow llama.cpp down several times over on cores shared with other work."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when llama.cpp's OpenMP runtime loads
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        raise CliError(f"--compare llama.cpp needs llama-cpp-python, which is not installed ({error}); install "
                         f"it with `{INSTALL}` (it builds llama.cpp from source, several minutes; "
                         "CMAKE_ARGS=-DGGML_NATIVE=ON builds for this CPU)") from None


def gguf_type(dtype: str) -> str:
    """The GGUF type holding a row's weights: "bfloat16" → BF16, "float32+int8" → Q8_0, "bfloat16+int4" → Q4_0."""
    float_dtype, _, scheme = dtype.partition("+")
    return _BLOCK_TYPES[scheme] if scheme else _FLOAT_TYPES[float_dtype]


def is_block_type(type_name: str) -> bool:
    return type_name in _BLOCK_TYPES.values()


class LlamaCppEngine(EagerEngine):
    """Runs a batch-1 :class:`Workload` with llama.cpp on the GGUF file ``path`` on ``threads`` threads; the
    same prompt ids as llm_jax's engine (``Workload.prompts``), no BOS added."""

    def __init__(self, path: pathlib.Path, config: ModelConfig, workload: Workload, *, threads: int, type_name: str):
        import llama_cpp

        if workload.batch != 1:
            raise ValueError(f"llama.cpp runs batch 1 here, got batch {workload.batch}")
        self.name = f"llama.cpp[{type_name}]"
        self.workload = workload
        self.prompt = workload.prompts(config.vocab_size)[0].tolist()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=workload.prompt_len + 1 + workload.decode_steps,
                                   n_batch=workload.prompt_len, n_threads=threads, n_threads_batch=threads,
                                   logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        if self.n_vocab != config.vocab_size:
            raise ValueError(f"{path}: llama.cpp reads a vocabulary of {self.n_vocab}, the model has {config.vocab_size}")

    def _logits(self) -> np.ndarray:
        """The last evaluated token's logits [V], in llama.cpp's buffer (valid until the next decode)."""
        import llama_cpp

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))

    def _generate(self, steps: int) -> Run:
        self.llm.reset()  # the next eval clears the KV cache from position 0
        t0 = time.perf_counter()
        self.llm.eval(self.prompt)
        token = int(np.argmax(self._logits()))
        ttft = time.perf_counter() - t0
        # Each step's second choice is read as it comes; its time is not the engine's, and is taken out.
        t_untimed = time.perf_counter()
        tokens, runners_up = [token], [runner_up(self._logits()[None])]
        untimed, step_s = time.perf_counter() - t_untimed, []
        for _ in range(steps):
            t_step = time.perf_counter()
            self.llm.eval([token])
            token = int(np.argmax(self._logits()))
            step_s.append(time.perf_counter() - t_step)
            t_untimed = time.perf_counter()
            tokens.append(token)
            runners_up.append(runner_up(self._logits()[None]))
            untimed += time.perf_counter() - t_untimed
        decode_s = time.perf_counter() - t0 - ttft - untimed
        return Run(ttft_s=ttft, decode_s=decode_s, step_s=tuple(step_s), decode_tokens=steps,
                   tokens=np.array([tokens]), runner_up=np.stack([ids for ids, _ in runners_up], axis=1),
                   runner_up_gap=np.stack([gaps for _, gaps in runners_up], axis=1))

