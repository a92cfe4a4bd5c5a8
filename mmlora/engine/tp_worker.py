"""A tensor-parallel worker rank: builds its shard of the model, KV cache and adapter pool, then runs
what rank 0 broadcasts (forwards, decode-graph capture and replays, adapter slot writes) until told to
stop or its group fails."""

from __future__ import annotations

import logging
import sys

import torch

from mmlora.config import EngineConfig
from mmlora.distributed.state import all_reduce_min, init_tp, shutdown_tp
from mmlora.distributed.step import Command, recv_forward, recv_header, recv_replay
from mmlora.engine.cuda_graph import CudaGraphRunner
from mmlora.engine.model_runner import ModelRunner
from mmlora.engine.setup import EngineParts, build_engine_parts, rank_device

logger = logging.getLogger(__name__)


def join_group(rank: int, size: int, port: int, config: EngineConfig) -> torch.device:
    """Join the group on this rank's device (rank 0 runs this in the engine's process)."""
    device = rank_device(config.model.device, rank)
    init_tp(rank, size, port, device, config.parallel.dist_timeout_s)
    return device


def worker_main(rank: int, size: int, port: int, config: EngineConfig) -> None:
    """Entry point of a spawned worker (see mmlora.distributed.launch.Workers)."""
    logging.basicConfig(level=logging.INFO, format=f"[tp{rank}] %(levelname)s %(name)s: %(message)s")
    try:
        join_group(rank, size, port, config)
        serve(config)
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        sys.exit(1)
    finally:
        shutdown_tp()


def serve(config: EngineConfig) -> None:
    parts = build_engine_parts(config)
    runner = ModelRunner(parts.model, parts.kv_cache, parts.attention, parts.lora, parts.device)
    all_reduce_min(0, parts.device)  # ready: rank 0 waits for this before it serves
    try:
        with torch.inference_mode():
            run_commands(parts, runner)
    finally:
        runner.close()


def run_commands(parts: EngineParts, runner: ModelRunner) -> None:
    hidden_size = parts.model.arch.hidden_size
    while True:
        header = recv_header()
        cmd = Command(header[0])
        if cmd is Command.FORWARD:
            batch, routing = recv_forward(header, hidden_size, parts.dtype)
            runner.run_batch(batch, routing)
        elif cmd is Command.WRITE_SLOT:
            parts.lora.receive_slot(header[1], header[2])
        elif cmd is Command.CLEAR_SLOT:
            parts.lora.clear_slot(header[1])
        elif cmd is Command.CAPTURE_GRAPHS:
            max_bs, max_model_len, capture, pad_page = header[1:5]
            runner.decode_graphs = CudaGraphRunner(runner, max_bs, max_model_len, bool(capture), pad_page)
        elif cmd is Command.REPLAY:
            runner.decode_graphs.replay_received(*recv_replay(header))
        else:
            return
