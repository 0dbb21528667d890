"""llm_jax: JAX/XLA inference for decoder-only LLMs.

Dimension key, used in array names (``x_BTD``, ``k_cache_LBSKH``) and einsums throughout:

    B  batch (sequences)             T  query tokens (this call; flat over sequences in a serving step)
    S  key / cache positions         D  model width (hidden size)
    F  MLP hidden width              V  vocabulary
    N  query heads                   K  key/value heads
    G  query heads per kv head (N/K) H  head dim
    L  layers                        P  pages of the paged KV cache
    Z  tokens per page               X  a padded table's width (stop ids, logit bias, a block table)
    C  a classifier's classes        E  experts of a mixture-of-experts MLP
    U  experts each token uses (top-k)

The run path, in pipeline order: ``tokenizer`` → ``prefilling`` → ``decoding`` (``sampling`` and stop
conditions inside) → ``detokenize``, orchestrated by ``generation``; the model is in ``model/``, its cache
in ``kv_cache``, and ``backends/`` decides how its operations run (XLA, the CPU kernels, Pallas). The
weight path: ``weights/from_hf``, ``weights/from_llama2c`` → ``weights/checkpoint`` (orbax;
``weights/convert`` writes one) → ``loading``.

The public names below are imported on first use (PEP 562), so that ``import llm_jax.cli...`` and the
scripts' ``--help`` answer without starting JAX.
"""

import importlib

# The public surface, grouped: submodule → the names it contributes.
_EXPORTS: dict[str, tuple[str, ...]] = {
    # Configuration.
    "config": ("Activation", "Classifier", "ConfigError", "DefaultRope", "Experts", "LinearRope", "Llama3Rope",
               "LongRope", "ModelConfig", "NoLanguageModelHead", "Problem", "QKNormScope", "Quantization",
               "QuantScheme", "YarnRope"),
    # Integer weights.
    "quantization": ("QuantizedArray", "quantize", "quantize_params"),
    # How the model runs: the backend seam.
    "backends": ("Backend", "BackendError", "CpuKernels", "Pallas", "Xla"),
    # Loading models.
    "loading": ("Model", "load", "load_lora"),
    # LoRA adapters (PEFT folders): merged, or many per batch.
    "lora": ("LoraAdapter", "LoraBatch", "LoraWeights", "merge_lora"),
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
    "prefilling": ("prefill", "prefill_with_extras"),
    "decoding": ("PAD_ID", "DecodeControls", "DecodeState", "Emitted", "FinishReason", "Logprobs", "LogitsProcessor",
                 "decode", "start"),
    "sampling": ("GREEDY", "Sampling", "SamplingParams"),
    "beams": ("BeamSearch", "EarlyStopping", "beam_search"),
    "speculative": ("Speculative",),
    "scoring": ("Score", "continuation_logprobs", "score"),
    "pooling": ("Classification", "class_probabilities", "classifier_logits", "classify", "embed_texts",
                "pooled_hidden"),
    # Orchestration.
    "generation": ("GenerationMetrics", "GenerationResult", "GenerationStream", "PromptTooLongError",
                 "StreamEvent", "generate", "generate_stream"),
    # Running on many devices (more in ``llm_jax.sharding`` and ``llm_jax.distributed``).
    "sharding": ("make_mesh",),
}

__all__ = [name for names in _EXPORTS.values() for name in names]
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}


# Submodules reached as attributes (``llm_jax.guided.Json``) without an import of their own.
_SUBMODULES = frozenset({"guided"})


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

