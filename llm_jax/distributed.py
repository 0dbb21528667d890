"""Several processes, one model: joining a multi-process run with ``jax.distributed``.

JAX runs multi-host programs multi-controller: every process runs the same script, loads the same
model and makes the same calls; ``jax.distributed.initialize`` connects the processes so that a mesh
(``llm_jax.sharding.make_mesh``) spans every device of every process, and XLA's collectives cross
process boundaries (NCCL on GPU, the TPU interconnect, gloo over TCP on CPU). Each process holds the
shards of its own devices only.

Call :func:`initialize` once, first: JAX must be connected before anything touches a device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # read by jax.distributed itself


class DistributedError(RuntimeError):
    """A multi-process run that cannot be joined as configured."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    """Where this process stands in the run."""

    process_id: int
    num_processes: int
    local_devices: int
    devices: int  # across every process

    @property
    def is_main(self) -> bool:
        """Process 0, the one that prints and writes files."""
        return self.process_id == 0


def process_info() -> ProcessInfo:
    return ProcessInfo(process_id=jax.process_index(), num_processes=jax.process_count(),
                       local_devices=jax.local_device_count(), devices=jax.device_count())


def requested(coordinator_address: str | None = None, num_processes: int | None = None,
              process_id: int | None = None) -> bool:
    """Whether these arguments or the environment (``JAX_COORDINATOR_ADDRESS``) ask for several processes."""
    given = (coordinator_address, num_processes, process_id)
    return any(v is not None for v in given) or bool(os.environ.get(COORDINATOR_ENV))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               timeout_s: int = 300) -> ProcessInfo:
    """Join the run: process ``process_id`` of ``num_processes``, meeting at ``coordinator_address``
    (``host:port`` of process 0). Blocks until every process has joined (at most ``timeout_s``).

    Arguments left out are found by JAX: ``JAX_COORDINATOR_ADDRESS`` and ``JAX_LOCAL_DEVICE_IDS``, or the
    cluster it runs in (Slurm, Open MPI, Kubernetes, Cloud TPU). On CPU the processes' collectives use
    gloo over TCP. Calling it again with the same arguments returns the same answer.
    """
    if jax.distributed.is_initialized():
        info = process_info()
        mismatched = ((num_processes is not None and num_processes != info.num_processes)
                      or (process_id is not None and process_id != info.process_id))
        if mismatched:
            raise DistributedError(f"already joined as process {info.process_id} of {info.num_processes}; "
                                   f"cannot join again as process {process_id} of {num_processes}")
        return info
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    # CPU collectives across processes (the default in recent JAX; older versions had none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   local_device_ids=local_device_ids, initialization_timeout=timeout_s)
    except ValueError as e:
        raise DistributedError(
            f"cannot join a multi-process run: {e} Give the coordinator address (host:port of process 0), "
            f"the number of processes and this process's id (or set {COORDINATOR_ENV} and run under a "
            "cluster JAX recognises: Slurm, Open MPI, Kubernetes, Cloud TPU)") from None
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise DistributedError("llm_jax.distributed.initialize must run before anything uses a device "
                                   "(a computation, jax.devices(), loading a model)") from None
        raise
    return process_info()
