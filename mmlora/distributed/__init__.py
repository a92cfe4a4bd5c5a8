"""Tensor parallelism: the process group of one engine's ranks, its collectives (with timeouts), the
step broadcast from rank 0 to the workers, and starting the workers."""

from mmlora.distributed.state import TPGroup, WorkerFailure, tp_group

__all__ = ["TPGroup", "WorkerFailure", "tp_group"]
