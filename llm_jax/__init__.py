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
cache in ``kv_cache``. The weight path: ``weights/from_hf``, ``weights/from_llama2c`` → ``loading``.
"""

# Configuration.
from llm_jax.config import Activation, AttentionImpl, ConfigError, DefaultRope, LinearRope, Llama3Rope, ModelConfig
# Loading models.
from llm_jax.loading import Model, load
# Text in and out.
from llm_jax.tokenizer import Tokenizer, TokenizerFormat, load_tokenizer
from llm_jax.detokenize import IncrementalDetokenizer
from llm_jax.stop_strings import StopStringMatcher
from llm_jax.chat_template import ChatTemplate, ChatTemplateError, encode_chat, load_chat_template
# The model as pure functions.
from llm_jax.model import forward, init_params
from llm_jax.kv_cache import KVCache, init_cache
# Jitted stages for research code.
from llm_jax.prefill import prefill
from llm_jax.decode import PAD_ID, DecodeControls, DecodeState, FinishReason, decode, start
from llm_jax.sampling import GREEDY, Sampling, SamplingParams
# Orchestration.
from llm_jax.generate import (GenerationMetrics, GenerationResult, GenerationStream, PromptTooLongError,
                              StreamEvent, generate, generate_stream)
# Running on many devices (more in ``llm_jax.sharding`` and ``llm_jax.distributed``).
from llm_jax.sharding import make_mesh

__all__ = [
    "Activation", "AttentionImpl", "ConfigError", "DefaultRope", "LinearRope", "Llama3Rope", "ModelConfig",
    "Model", "load", "Tokenizer", "TokenizerFormat", "load_tokenizer", "IncrementalDetokenizer",
    "StopStringMatcher", "ChatTemplate", "ChatTemplateError", "encode_chat", "load_chat_template",
    "forward", "init_params", "KVCache", "init_cache",
    "prefill", "PAD_ID", "DecodeControls", "DecodeState", "FinishReason", "decode", "start",
    "GREEDY", "Sampling", "SamplingParams",
    "GenerationMetrics", "GenerationResult", "GenerationStream", "PromptTooLongError", "StreamEvent",
    "generate", "generate_stream",
    "make_mesh",
]
