"""llm_jax: JAX/XLA inference for decoder-only LLMs.

Dimension key, used in array names (``x_BTD``, ``k_cache_LBSKH``) and einsums throughout:

    B  batch                         T  query tokens (this call)
    S  key / cache positions         D  model width (hidden size)
    F  MLP hidden width              V  vocabulary
    N  query heads                   K  key/value heads
    G  query heads per kv head (N/K) H  head dim
    L  layers

The run path, in pipeline order: ``tokenizer`` → ``prefill`` → ``decode`` (``sampling`` and stop
conditions inside) → ``detokenize``, orchestrated by ``generate``; the model is in ``model/`` and its
cache in ``kv_cache``. The weight path: ``weights/from_hf``, ``weights/from_llama2c`` → ``weights/checkpoint``
(orbax; ``weights/convert`` writes one) → ``loading``.

The public names below are imported on first use (PEP 562), so that ``import llm_jax.cli...`` and the
scripts' ``--help`` answer without starting JAX.
"""

import importlib
import sys
import types

# The public surface, grouped: submodule → the names it contributes.
_EXPORTS: dict[str, tuple[str, ...]] = {
    # Configuration.
    "config": ("Activation", "AttentionImpl", "ConfigError", "DefaultRope", "LinearRope", "Llama3Rope",
               "MatmulImpl", "ModelConfig"),
    # Loading models.
    "loading": ("Model", "load"),
    "weights.checkpoint": ("CheckpointError", "is_checkpoint", "load_checkpoint", "save_checkpoint"),
    "weights.convert": ("convert",),
    "weights.layout": ("WeightsError",),
    # Text in and out.
    "tokenizer": ("Tokenizer", "TokenizerFormat", "load_tokenizer"),
    "detokenize": ("IncrementalDetokenizer",),
    "stop_strings": ("StopStringMatcher",),
    "chat_template": ("ChatTemplate", "ChatTemplateError", "encode_chat", "load_chat_template"),
    # The model as pure functions.
    "model": ("LayerHooks", "forward", "init_params"),
    "kv_cache": ("KVCache", "init_cache"),
    # Jitted stages for research code.
    "prefill": ("prefill", "prefill_with_extras"),
    "decode": ("PAD_ID", "DecodeControls", "DecodeState", "Emitted", "FinishReason", "Logprobs", "decode", "start"),
    "sampling": ("GREEDY", "Sampling", "SamplingParams"),
    "beam_search": ("BeamSearch", "EarlyStopping", "beam_search"),
    "score": ("Score", "continuation_logprobs", "score"),
    # Orchestration.
    "generate": ("GenerationMetrics", "GenerationResult", "GenerationStream", "PromptTooLongError",
                 "StreamEvent", "generate", "generate_stream"),
    # Running on many devices (more in ``llm_jax.sharding`` and ``llm_jax.distributed``).
    "sharding": ("make_mesh",),
}

__all__ = [name for names in _EXPORTS.values() for name in names]
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing a submodule binds it on the package; ``decode``, ``prefill``, ``generate``,
        # ``beam_search`` and ``score`` are also public functions, and must stay the functions (as
        # ``from llm_jax import generate`` says).
        if name in _HOME and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
