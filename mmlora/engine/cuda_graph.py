"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed when a step is decode-only.

A decode step (every request feeds one token and samples) is a long chain of small kernels whose launch
cost rivals their run time; replaying a captured graph removes it. At start-up, for each bucket
(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ... up to ``max_running_requests``) we capture the model
forward plus ``compute_logits`` over static buffers:

  input_ids, positions, slot_mapping       int64 [max_bs]
  seq_lens                                  int32 [max_bs]
  query_start_loc                           int32 [max_bs + 1] (0, 1, 2, ...; constant)
  block_tables                              int32 [max_bs, ceil(max_model_len / block_size)]
  the LoRA manager's preallocated LoRABatchInfo, which the manager itself prepares for capture and
  replay (``LoRAManager.prepare_capture`` / ``prepare_replay``)

Host ints that shape kernel launches are fixed per bucket at capture: ``num_tokens = num_seqs =
num_segments = bucket`` (one segment per token: segments are never merged in a graph step),
``max_seq_len = max_model_len`` (so the Triton decode attention picks its split count from the bucket
and ``max_model_len``; the split lengths are computed on the device from ``seq_lens``), and the LoRA
rank bound. Graphs are keyed by (batch bucket, rank bound): one per rank bucket of the pool
(``LoRAManager.rank_buckets``: 16, 32, 64, ... up to ``max_lora_rank``), whose LoRA launches cover
ranks up to it (each slot's rank is still read on the device, and kernels stop there), and one with
bound 0, without the LoRA layers. A step replays the graph of the bucket of its largest rank, so a
batch of rank-8 adapters never pays the launch shape of a rank-64 one (issue 23). Each LoRA graph is
captured once per row layout the backend lists (``LoRABackend.graph_layouts``: per-row segments for
BGMV, runs of rows on one adapter for SGMV; triton-auto has both and picks per replay), so the key is
(batch bucket, rank bound, layout). Capture compiles every variant a decode step can launch, so none
compiles while serving.

Rows past the real batch are padding: they read token 0 at position 0 with ``seq_len`` 1 from a KV page
reserved for them at start-up (taken out of the allocator), write their K/V there, and have slot -1
(base model). Only the first ``n`` logits rows are returned.

Tensor parallelism: every rank captures the same graphs in the same order (the row-parallel layers'
all-reduces are captured too, and must pair up across ranks): rank 0 tells the workers to capture, with
its padding page, when it starts. Each replay on rank 0 first broadcasts the step's static inputs and
its graph key, so every rank replays the same graph (``mmlora.distributed.step``, REPLAY); a worker
checks that its own pool gives the same rank bound.

Multimodal models replay the same graphs: positions are 1-D (``mmlora.multimodal.mrope.decode_position``:
past the prompt the three M-RoPE axes of Qwen2-VL agree); a step holding a token whose axes differ runs
eagerly, as do steps that are not decode-only or larger than the largest bucket.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch

from mmlora.distributed.state import tp_group
from mmlora.distributed.step import send_capture_graphs, send_replay
from mmlora.engine.overlap import resolve_placeholders
from mmlora.engine.scheduler import ScheduledBatch
from mmlora.forward import AttentionMetadata, ForwardBatch
from mmlora.forward.host_copy import host_tensor
from mmlora.forward.lora import GRAPH_LAYOUTS
from mmlora.multimodal.mrope import decode_position

logger = logging.getLogger(__name__)

_BASE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 32 up to ``max_bs`` (always included)."""
    if max_bs < 1:
        raise ValueError(f"max batch size must be >= 1, got {max_bs}")
    sizes = [b for b in _BASE_BUCKETS if b < max_bs]
    b = 96
    while b < max_bs:
        sizes.append(b)
        b += 32
    sizes.append(max_bs)
    return sizes


# The torch reference attention gathers max_model_len positions per row inside a graph; past this it
# would take more memory than it saves time.
_TORCH_ATTENTION_MAX_LEN = 8192


def capture_decode_graphs(runner, max_batch_size: int, max_model_len: int) -> CudaGraphRunner | None:  # noqa: ANN001
    """A CudaGraphRunner, or None (with a warning saying why) when this engine cannot use graphs."""
    reason = None
    if runner.device.type != "cuda":
        reason = f"the engine runs on {runner.device}"
    elif getattr(runner.attention, "name", "") == "torch" and max_model_len > _TORCH_ATTENTION_MAX_LEN:
        reason = (
            f"the torch attention backend would gather max_model_len={max_model_len} positions per row; "
            f"use attention_backend='triton' or max_model_len <= {_TORCH_ATTENTION_MAX_LEN}"
        )
    if reason:
        logger.warning("CUDA graphs off: %s", reason)
        return None
    return CudaGraphRunner(runner, max_batch_size, max_model_len)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None when not capturing (CudaGraphRunner(capture=False))
    logits: torch.Tensor | None  # [bucket, V] fp32, written by every replay


class CudaGraphRunner:
    """Captures and replays decode graphs for a :class:`~mmlora.engine.model_runner.ModelRunner`."""

    #: Whether a step is padded up to its bucket (and so a KV page is reserved for padding rows): on a GPU
    #: the rows are nearly free and one graph serves many batch sizes; a CPU step costs per row
    #: (:class:`~mmlora.engine.cpu_graph.CpuGraphRunner`: a bucket per batch size, no padding page).
    pads_rows: ClassVar[bool] = True

    def __init__(
        self,
        runner,  # noqa: ANN001
        max_batch_size: int,
        max_model_len: int,
        capture: bool = True,
        pad_page: int | None = None,
    ) -> None:
        """``capture=False`` runs the same static-buffer forward eagerly at every step instead of
        replaying a graph: it exercises the buckets, padding and LoRA routing on any device (tests).
        ``pad_page``: the padding rows' KV page a tensor-parallel worker is told by rank 0 (rank 0, and
        a single device, reserve one of their own)."""
        self.capture = capture
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine runs on {runner.device}")
        # The runner's parts, not the runner: it holds this object (runner.decode_graphs), and a reference
        # back would make a cycle that keeps the KV cache alive after the engine is dropped.
        self.model = runner.model
        self.lora = runner.lora
        self.allocator = runner.kv_cache.allocator
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = max_model_len
        alloc = self.allocator
        if pad_page is None and self.pads_rows:
            if alloc.num_free < 2:
                raise ValueError("CUDA graphs: the KV cache is too small to reserve a padding page")
            # A page only padding rows write to; out of the allocator for good (num_blocks shrinks by one).
            pad_page = alloc.reserve_page()
        # Without padding rows the page only fills block-table columns no kernel reads (past seq_len).
        self.pad_page = 0 if pad_page is None else pad_page
        self.max_bs = min(max_batch_size, runner.lora.info.max_tokens)
        self.buckets = batch_buckets(self.max_bs) if self.pads_rows else list(range(1, self.max_bs + 1))
        self.max_blocks = -(-max_model_len // self.block_size)
        dev = dict(device=self.device)
        self.i64 = torch.zeros(3, self.max_bs, dtype=torch.int64, **dev)  # input_ids, positions, slot_mapping
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, **dev)
        self.block_tables = torch.full(
            (self.max_bs, self.max_blocks), self.pad_page, dtype=torch.int32, **dev
        )
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, **dev)
        self.logits_rows = torch.arange(self.max_bs, dtype=torch.int64, **dev)
        self.rank_bounds = (0, *runner.lora.rank_buckets)
        # (rank bound, layout) of every graph per bucket: the bound-0 graph has no LoRA, so no layout.
        self.variants = [(0, "rows")] + [
            (bound, layout) for bound in self.rank_bounds[1:] for layout in runner.lora.graph_layouts
        ]
        self.graphs: dict[tuple[int, int, str], _Graph] = {}
        self.num_replays = 0
        self.replays_by_layout: Counter[str] = Counter()  # LoRA graphs only (rank bound > 0)
        self.last_key: tuple[int, int, str] | None = None  # (bucket, rank bound, layout) of the last replay
        self.last_slots: list[int] = []  # its rows' adapter slots (-1: base or padding)
        self._pad_host(self.max_bs)
        group = tp_group()
        self.sends_replays = group.is_parallel and group.rank == 0
        if self.sends_replays:  # the workers capture alongside (their warm-up forwards meet ours)
            send_capture_graphs(max_batch_size, max_model_len, capture, self.pad_page)
        self._capture_all()

    # ---- static inputs --------------------------------------------------------------------------

    def _pad_host(self, bs: int) -> None:
        """Every row a padding row (used before capture)."""
        self.i64[0, :bs] = 0
        self.i64[1, :bs] = 0
        self.i64[2, :bs] = self.pad_page * self.block_size
        self.seq_lens[:bs] = 1

    def _batch(self, bs: int) -> ForwardBatch:
        attn = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.i64[2, :bs],
            num_seqs=bs,
            num_tokens=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * bs,
            seq_lens_host=[self.max_model_len] * bs,
        )
        return ForwardBatch(
            input_ids=self.i64[0, :bs],
            positions=self.i64[1, :bs],
            attn=attn,
            logits_rows=self.logits_rows[:bs],
        )

    @torch.inference_mode()
    def eager_forward(self, bs: int) -> torch.Tensor:
        """Bucket ``bs``'s forward run eagerly on the static inputs the last replay used (profiling:
        the same kernels as the graph, each visible to a profiler)."""
        return self._forward(bs)

    # ---- capture --------------------------------------------------------------------------------

    def _forward(self, bs: int) -> torch.Tensor:
        batch = self._batch(bs)
        with self.lora.prepared():
            hidden = self.model(batch)
            return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if not self.capture:
            self.graphs = {(bs, *v): _Graph(None, None) for bs in self.buckets for v in self.variants}
            return
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool memory
            for bound, layout in self.variants:
                self.lora.prepare_capture(bs, bound, layout)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile Triton kernels, build RoPE tables, settle the allocator
                        self._forward(bs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(bs)
                self.graphs[(bs, bound, layout)] = _Graph(graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: captured %d decode graphs (batch buckets %s x LoRA (rank bound, layout) %s) in %.1f s; "
            "KV page %d reserved for padding rows (%d pages left)",
            len(self.graphs),
            self.buckets,
            self.variants,
            time.monotonic() - t0,
            self.pad_page,
            self.allocator.num_blocks,
        )

    def close(self) -> None:
        """Free the graphs and their memory pool (the static buffers go with this object)."""
        for entry in self.graphs.values():
            if entry.graph is not None:
                entry.graph.reset()
        self.graphs.clear()

    # ---- replay ---------------------------------------------------------------------------------

    def can_run(self, sched: ScheduledBatch) -> bool:
        if not 0 < len(sched) <= self.max_bs:
            return False
        if not all(
            n == 1 and r.num_computed + 1 == r.num_tokens for r, n in zip(sched.requests, sched.num_new)
        ):
            return False
        model = self.model
        return not model.is_multimodal or all(
            decode_position(r.mm_inputs, r.num_computed) is not None for r in sched.requests
        )

    @torch.inference_mode()
    def run(
        self, sched: ScheduledBatch, future: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """fp32 logits [n, V] (a view of the graph's output, valid until the next replay) and the batch
        index of each row (rows are ordered by adapter slot). ``future``: the tokens the placeholders
        among the rows' token ids stand for (the overlap scheduler's last launched step)."""
        n = len(sched)
        bs = next(b for b in self.buckets if b >= n)
        bsz = self.block_size
        ids, pos, slots_kv, seq_lens, lora_slots, tables = [], [], [], [], [], []
        max_blocks = 1
        model = self.model
        # Rows that share an adapter side by side: neighbouring programs of the LoRA kernels then read the
        # same adapter (L2 hits rather than one DRAM read per row). Logits come back with batch indices.
        order = sorted(range(n), key=lambda b: sched.requests[b].slot)
        for req in (sched.requests[b] for b in order):
            p = req.num_computed
            ids.append(req.token_at(p))
            pos.append(decode_position(req.mm_inputs, p) if model.is_multimodal else p)
            slots_kv.append(req.blocks[p // bsz] * bsz + p % bsz)
            seq_lens.append(p + 1)
            lora_slots.append(req.slot)
            nb = -(-(p + 1) // bsz)
            tables.append(req.blocks[:nb])
            max_blocks = max(max_blocks, nb)
        pad = bs - n
        pad_slot = self.pad_page * bsz
        i64 = host_tensor(
            [ids + [0] * pad, pos + [0] * pad, slots_kv + [pad_slot] * pad], torch.int64, self.device
        )
        seq_lens += [1] * pad
        # Only the columns in use are refreshed: kernels never read a row past its seq_len, and the
        # stale entries left beyond it are valid page ids (the torch reference gathers, then masks).
        rows = [t + [self.pad_page] * (max_blocks - len(t)) for t in tables] + [
            [self.pad_page] * max_blocks
        ] * pad
        self.last_slots = lora_slots + [-1] * pad
        bound, layout = self.lora.prepare_replay(self.last_slots)
        if self.sends_replays:
            rest = torch.tensor(seq_lens + self.last_slots + [b for r in rows for b in r], dtype=torch.int64)
            # A REPLAY command names the layout by its index in GRAPH_LAYOUTS.
            send_replay(bs, bound, GRAPH_LAYOUTS.index(layout), torch.cat([i64.view(-1), rest]))
        self._load(
            bs,
            i64,
            host_tensor(seq_lens, torch.int32, self.device),
            host_tensor(rows, torch.int32, self.device),
        )
        if future is not None and min(ids) < 0:
            static_ids = self.i64[0, :n]
            static_ids.copy_(resolve_placeholders(static_ids, future))
        return self._replay(bs, bound, layout)[:n], order

    def replay_received(self, bucket: int, bound: int, layout: int, payload: torch.Tensor) -> torch.Tensor:
        """A worker's replay of the graph step rank 0 broadcast (:func:`mmlora.distributed.step.recv_replay`):
        the same static inputs and graph. Returns the logits [bucket, V] (rank 0 samples from its own)."""
        rows = payload[: 5 * bucket].view(5, bucket)
        row_slots = rows[4].tolist()
        got, layout_name = self.lora.prepare_replay(row_slots, GRAPH_LAYOUTS[layout])
        if got != bound:
            raise RuntimeError(
                f"tensor-parallel rank {tp_group().rank}: a decode graph step's LoRA rank bound is {got} "
                f"here but {bound} on rank 0 (the ranks' adapter pools disagree)"
            )
        self.last_slots = row_slots
        self._load(bucket, rows[:3], rows[3], payload[5 * bucket :].view(bucket, -1))
        return self._replay(bucket, bound, layout_name)

    def _load(self, bs: int, i64: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor) -> None:
        """Copy a step's inputs into the static buffers: ``i64`` [3, bs] (token ids, positions, KV slots),
        ``seq_lens`` [bs] and the first ``tables.shape[1]`` block-table columns."""
        self.i64[:, :bs].copy_(i64, non_blocking=True)
        self.seq_lens[:bs].copy_(seq_lens, non_blocking=True)
        self.block_tables[:bs, : tables.shape[1]].copy_(tables, non_blocking=True)

    def _replay(self, bs: int, bound: int, layout: str) -> torch.Tensor:
        """Logits [bs, V] of graph (``bs``, ``bound``, ``layout``) over the static buffers' inputs."""
        entry = self.graphs[(bs, bound, layout)]
        self.num_replays += 1
        if bound:
            self.replays_by_layout[layout] += 1
        self.last_key = (bs, bound, layout)
        if entry.graph is None:
            return self._forward(bs)
        entry.graph.replay()
        return entry.logits
