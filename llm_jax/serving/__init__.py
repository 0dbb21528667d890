"""The serving engine's host side: a paged KV cache's blocks and prefix cache (``blocks``) and the
continuous-batching scheduler that plans each device step (``scheduler``). Plain Python and numpy; the
device step consumes a ``StepPlan``.

Array names follow the dimension key of ``llm_jax``, read over a step's flat ragged batch: B the step's
sequences (its batch), T its tokens, flat over all sequences, X a block table's width (blocks per
sequence, padded with ``NULL_BLOCK``).
"""

from llm_jax.serving.blocks import NULL_BLOCK, BlockPool, KVBlockManager, hash_block
from llm_jax.serving.scheduler import FinishReason, Request, RequestStatus, Scheduler, SchedulerStats, StepPlan

__all__ = [
    "NULL_BLOCK", "BlockPool", "KVBlockManager", "hash_block",
    "FinishReason", "Request", "RequestStatus", "Scheduler", "SchedulerStats", "StepPlan",
]
