"""Starting and stopping the worker ranks (1 .. tp_size - 1) as spawned processes of this program."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from mmlora.distributed.state import WorkerFailure, free_port

logger = logging.getLogger(__name__)


class Workers:
    """The spawned worker processes of one engine. ``port`` is the group's rendezvous port."""

    def __init__(self, target: Callable[..., None], size: int, *args: Any) -> None:
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=target, args=(rank, size, self.port, *args), daemon=True, name=f"mmlora-tp{rank}"
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()

    def dead(self) -> list[str]:
        """Workers that exited, as 'rank R (exit code C)'."""
        return [
            f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()
        ]

    def failure(self, exc: BaseException, grace_s: float = 5.0) -> WorkerFailure:
        """``exc`` of a collective, restated with the workers that are gone (a crashing worker may take
        up to ``grace_s`` to exit after its peers saw its connection close)."""
        for p in self.procs:
            p.join(grace_s)
        dead = self.dead()
        where = f"worker {', '.join(dead)} exited" if dead else "no worker exited; one stopped answering"
        return WorkerFailure(f"tensor-parallel engine failed: {where}: {exc}")

    def join(self, timeout_s: float) -> None:
        """Wait for the workers to exit (after STOP); kill those that do not."""
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                logger.warning("tensor-parallel %s did not stop within %.0f s; killing it", p.name, timeout_s)
                p.kill()
                p.join()
