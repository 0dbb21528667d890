"""Serving many requests at once: continuous batching over a paged KV cache.

``blocks`` (a paged cache's blocks and prefix cache), ``scheduler`` (which tokens of which requests the
next step computes), ``batching`` (a plan padded to a compiled shape, as the step's inputs) and ``live``
(each running request's sampling, end conditions and text) are the host side, plain Python and numpy;
``step`` is the device step over a flat, ragged batch; ``engine`` ties them to a model (:class:`Engine`).

Array names follow the dimension key of ``llm_jax``, read over a step's flat ragged batch: B the step's
sequences (its batch), T its tokens, flat over all sequences, X a block table's width (blocks per
sequence, padded with ``NULL_BLOCK``); P the paged cache's pages of Z tokens each.
"""

import importlib

from llm_jax.serving.blocks import NULL_BLOCK, BlockPool, KVBlockManager, hash_block
from llm_jax.serving.scheduler import FinishReason, Request, RequestStatus, Scheduler, SchedulerStats, StepPlan

__all__ = [
    "NULL_BLOCK", "BlockPool", "KVBlockManager", "hash_block",
    "FinishReason", "Request", "RequestStatus", "Scheduler", "SchedulerStats", "StepPlan",
    "Engine", "RequestOutput",
]


def __getattr__(name: str):  # the engine imports JAX: only when asked for
    if name in ("Engine", "RequestOutput"):
        return getattr(importlib.import_module("llm_jax.serving.engine"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
