"""The tensor-parallel group of this process: rank, size, and collectives that fail instead of hanging.

One engine per process may be tensor-parallel. Model layers read the group while they are built
(:func:`tp_group`); a process that never joined one sees rank 0 of 1, where every collective is a no-op.
A collective that fails (a peer died, or it waited past ``dist_timeout_s``) raises :class:`WorkerFailure`.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    timeout_s: float = 120.0

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def shard(self, full: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal part of ``full`` items; ``what`` names them in errors."""
        if full % self.size:
            raise ValueError(f"tp_size={self.size} does not divide {what} ({full})")
        n = full // self.size
        return self.rank * n, n


_GROUP = TPGroup()


def tp_group() -> TPGroup:
    return _GROUP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Building a rank's model (reading a large checkpoint) takes longer than a collective may in serving.
STARTUP_TIMEOUT_S = 900.0
# A worker waits this long for rank 0's next command: an idle server sends none (rank 0 dying closes
# the connection, which ends the wait at once). Every other wait is bounded by ``dist_timeout_s``.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


def init_tp(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the group of ``size`` ranks rendezvousing on localhost:``port`` (blocks until all joined);
    collectives then wait at most ``timeout_s`` (setup steps: ``STARTUP_TIMEOUT_S``; a worker's wait for
    the next command: ``IDLE_TIMEOUT_S``)."""
    global _GROUP
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel engine already runs in this process; shut it down (Engine.shutdown) first"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
    except Exception as exc:  # the store times out when a rank never arrives
        raise WorkerFailure(f"tensor-parallel rank {rank}/{size}: the group did not form: {exc}") from exc
    _GROUP = TPGroup(rank, size, timeout_s)
    return _GROUP


def shutdown_tp() -> None:
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TPGroup()


def _checked(what: str, start, *args, timeout_s: float | None = None, **kwargs) -> None:
    """Run the asynchronous collective ``start`` and wait for it at most ``timeout_s`` (default: the
    group's), raising WorkerFailure when it fails or times out."""
    timeout = _GROUP.timeout_s if timeout_s is None else timeout_s
    try:
        start(*args, **kwargs).wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise WorkerFailure(
            f"tensor-parallel {what} failed on rank {_GROUP.rank}/{_GROUP.size} (a rank died or waited "
            f"more than {timeout:g} s): {exc}"
        ) from exc


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks, in place; returns it. Inside a CUDA graph capture the collective is
    only enqueued (captured): a bounded wait on it would poll work that runs at replay. A peer lost
    during a replay is then found by the next command's broadcast, which is bounded."""
    if _GROUP.is_parallel:
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            dist.all_reduce(t)
        else:
            _checked("all-reduce", dist.all_reduce, t, async_op=True)
    return t


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (a setup step: waits up to ``STARTUP_TIMEOUT_S``); also
    the barrier after which every rank has built its parts."""
    if not _GROUP.is_parallel:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    _checked("setup", dist.all_reduce, t, op=dist.ReduceOp.MIN, async_op=True, timeout_s=STARTUP_TIMEOUT_S)
    return int(t.item())


def broadcast(t: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
    """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype everywhere), in place."""
    if _GROUP.is_parallel:
        _checked("broadcast", dist.broadcast, t, src=0, async_op=True, timeout_s=timeout_s)
    return t


def send(t: torch.Tensor, dst: int) -> None:
    _checked(f"send to rank {dst}", dist.isend, t, dst)


def recv(t: torch.Tensor) -> torch.Tensor:
    _checked("receive from rank 0", dist.irecv, t, 0)
    return t
