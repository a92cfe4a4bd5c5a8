"""CUDA graphs for prefill and mixed steps: one graph per token bucket, replayed for steps that are not
decode-only.

An eager step of a 7B model launches about 400 kernels, plus two per LoRA module, through Python. On a
slow host that takes as long as the GPU needs for a step of a few thousand tokens (issue 13: an eager
mixed step spent 16-40 ms launching, and each LoRA ``add_lora`` call about 50-66 us more), so the GPU
waits for the host. Replaying a captured graph launches the whole step at once.

Graphs are captured at start-up for token buckets 16, 32, 64, 128, then every 256 up to
``max_num_batched_tokens``, each once without LoRA and once per rank bucket of the pool (as decode graphs
are). A step runs in the smallest bucket that holds its tokens and, one segment entry each, its adapters
(a bucket has one entry per request up to half its tokens); the rest are padding rows (token 0 at
position 0, KV slot -1 so nothing is stored, LoRA slot -1, in no request). What shapes a launch is fixed
per bucket and filled per step into buffers of fixed address:

  input_ids, positions, slot_mapping   int64 [max_tokens]
  query_start_loc, seq_lens            int32 [max_seqs + 1], [max_seqs] (requests past the step: no tokens)
  block_tables                         int32 [max_seqs, ceil(max_model_len / block_size)]
  the prefill attention's query tiles  (``triton_prefill.PrefillTiles``: a table of a fixed size)
  the LoRA routing                     (``LoRABatchInfo.fill_graph``: segments, token tiles, rank bound)

Each graph writes the final hidden states into one shared buffer, and the logits of the rows that sample
are computed after the replay, so a graph keeps no output of its own. Requests are ordered by adapter
slot first, as eager steps are (``model_runner.adapter_order``), so each adapter is one segment.

The shared buffer holds every row's final hidden state, so prompt logprobs are taken from it as an
eager step takes them. Where a step cannot replay, it runs eagerly: more requests or tokens than
captured, more adapter runs than a bucket's segment entries; multimodal models run every such step
eagerly. Needs the triton attention backend, a LoRA backend whose launches a graph can hold for any batch
(``LoRABackend.mixed_graphs``), and one process (no tensor parallelism).
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from mmlora.distributed.state import tp_group
from mmlora.engine.model_runner import adapter_order, step_rows
from mmlora.engine.overlap import resolve_placeholders
from mmlora.engine.prompt_logprobs import record_prompt_logprobs
from mmlora.engine.scheduler import ScheduledBatch
from mmlora.forward import AttentionMetadata, ForwardBatch
from mmlora.forward.host_copy import host_tensor, to_device
from mmlora.layers.attention.triton_prefill import PrefillTiles, prefill_tile_table, prefill_tile_tokens

logger = logging.getLogger(__name__)

_SMALL_BUCKETS = (16, 32, 64, 128)
_BUCKET_STEP = 256


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then multiples of 256 up to ``max_tokens`` (always included)."""
    if max_tokens < 1:
        raise ValueError(f"max tokens must be >= 1, got {max_tokens}")
    sizes = [b for b in _SMALL_BUCKETS if b < max_tokens]
    b = _BUCKET_STEP
    while b < max_tokens:
        sizes.append(b)
        b += _BUCKET_STEP
    return [*sizes, max_tokens]


def mixed_graph_refusal(runner, tp_parallel: bool) -> str | None:  # noqa: ANN001
    """Why this engine cannot replay mixed steps (None when it can), but for the device."""
    if getattr(runner.attention, "name", "") != "triton":
        return "the attention backend is not 'triton' (the only one with a fixed-grid prefill kernel)"
    if not runner.lora.mixed_graphs:
        return f"the LoRA backend {runner.lora.backend_name!r} has no fixed-grid launches for mixed steps"
    if runner.model.is_multimodal:
        return "the model is multimodal (image rows are eager)"
    if tp_parallel:
        return "tensor parallelism (replays are not broadcast to the workers)"
    return None


class MixedGraphRunner:
    """Captures and replays mixed-step graphs for a :class:`~mmlora.engine.model_runner.ModelRunner`.
    ``capture=False`` runs the same static-buffer forward eagerly at every step (tests on any device)."""

    def __init__(
        self,
        runner,  # noqa: ANN001
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine runs on {runner.device}")
        self.capture = capture
        # The runner's parts, not the runner (which holds this object): no reference cycle.
        self.model = runner.model
        self.lora = runner.lora
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = max_model_len
        self.max_tokens = min(max_tokens, self.lora.info.max_tokens)
        self.max_seqs = max_seqs
        self.buckets = token_buckets(self.max_tokens)
        self.max_blocks = -(-max_model_len // self.block_size)
        attn = self.model.layers[0].self_attn
        self.tile_tokens = prefill_tile_tokens(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        dev = dict(device=self.device)
        self.i64 = torch.zeros(3, self.max_tokens, dtype=torch.int64, **dev)
        self.i64[2].fill_(-1)
        # query_start_loc | seq_lens | the attention's tile table (request, first token) in one buffer
        self.tile_entries = self._attention_tiles(self.max_tokens)
        self.i32 = torch.zeros(2 * self.max_seqs + 1 + 2 * self.tile_entries, dtype=torch.int32, **dev)
        self.block_tables = torch.zeros(self.max_seqs, self.max_blocks, dtype=torch.int32, **dev)
        hidden = self.model.arch.hidden_size
        dtype = next(self.model.parameters()).dtype
        self.hidden = torch.zeros(self.max_tokens, hidden, dtype=dtype, **dev)
        self.rank_bounds = (0, *self.lora.rank_buckets)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self.pool_bytes = 0  # device memory the captures reserved
        self.num_replays = 0
        self.last_key: tuple[int, int] | None = None
        self._capture_all()

    # ---- shapes ---------------------------------------------------------------------------------

    def _attention_tiles(self, tokens: int) -> int:
        n = -(-tokens // self.tile_tokens) + self.max_seqs
        return -(-n // 16) * 16

    def segments(self, bucket: int) -> int:
        """LoRA segment entries of a bucket: one per request at most, and at most half the tokens (so
        triton-auto takes its segment kernels)."""
        return max(1, min(self.max_seqs, bucket // 2))

    def _batch(self, bucket: int) -> ForwardBatch:
        s = self.max_seqs
        tiles = self.i32[2 * s + 1 :].view(2, self.tile_entries)
        attn = AttentionMetadata(
            query_start_loc=self.i32[: s + 1],
            seq_lens=self.i32[s + 1 : 2 * s + 1],
            block_tables=self.block_tables,
            slot_mapping=self.i64[2, :bucket],
            num_seqs=s,
            num_tokens=bucket,
            max_query_len=bucket,
            max_seq_len=self.max_model_len,
            query_lens_host=[],
            seq_lens_host=[],
            prefill_tiles=PrefillTiles(tiles[0], tiles[1], self._attention_tiles(bucket), self.tile_tokens),
        )
        # Logits are taken after the replay (run), from the rows that sample: none inside the graph.
        return ForwardBatch(self.i64[0, :bucket], self.i64[1, :bucket], attn, logits_rows=self.i64[0, :0])

    def _forward(self, bucket: int) -> None:
        batch = self._batch(bucket)
        with self.lora.prepared():
            self.hidden[:bucket].copy_(self.model(batch))

    # ---- capture --------------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if not self.capture:
            self.graphs = {(b, r): None for b in self.buckets for r in self.rank_bounds}
            return
        t0 = time.monotonic()
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        for bucket in reversed(self.buckets):  # largest first: later graphs reuse its pool memory
            for bound in self.rank_bounds:
                self.lora.prepare_mixed_capture(bucket, self.segments(bucket), bound)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile Triton kernels, settle the allocator
                        self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(bucket)
                self.graphs[(bucket, bound)] = graph
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.info(
            "CUDA graphs: captured %d mixed-step graphs (token buckets %s x LoRA rank bounds %s) in %.1f s, "
            "%.2f GiB of graph memory",
            len(self.graphs),
            self.buckets,
            self.rank_bounds,
            time.monotonic() - t0,
            self.pool_bytes / 2**30,
        )

    def close(self) -> None:
        for graph in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()

    # ---- replay ---------------------------------------------------------------------------------

    def bucket_of(self, tokens: int, num_slots: int) -> int | None:
        """The smallest bucket with room for ``tokens`` tokens on ``num_slots`` distinct adapter slots
        (one segment each once rows are ordered by slot), or None."""
        return next((b for b in self.buckets if b >= tokens and self.segments(b) >= num_slots), None)

    def _bucket(self, sched: ScheduledBatch) -> int | None:
        n, tokens = len(sched), sum(sched.num_new)
        if not (0 < n <= self.max_seqs and 0 < tokens <= self.max_tokens):
            return None
        return self.bucket_of(tokens, len({r.slot for r, k in zip(sched.requests, sched.num_new) if k > 0}))

    def can_run(self, sched: ScheduledBatch) -> bool:
        return self._bucket(sched) is not None

    @torch.inference_mode()
    def run(
        self, sched: ScheduledBatch, future: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """fp32 logits [B', V] of the requests that sample, and their batch indices (as
        ``ModelRunner.forward``). ``future``: the tokens the placeholders among the token ids stand for."""
        bucket = self._bucket(sched)
        order = adapter_order(sched) or list(range(len(sched)))
        requests = [sched.requests[b] for b in order]
        num_new = [sched.num_new[b] for b in order]
        step = step_rows(requests, num_new, self.block_size)
        ids, pos, kv_slots, qsl, seq_lens = step.ids, step.positions, step.kv_slots, step.qsl, step.seq_lens
        rows, sampling = step.logits_rows, [order[b] for b in step.sampling]
        max_blocks = max(len(r.blocks) for r in requests)
        tokens, n = len(ids), len(requests)
        slots = [r.slot for r in requests]
        pad = bucket - tokens
        bound = self.lora.prepare_mixed(num_new, slots, bucket, self.segments(bucket))
        seqs = self.max_seqs
        tile_seq, tile_t0 = prefill_tile_table(num_new, self.tile_tokens, self.tile_entries)
        i32 = qsl + [tokens] * (seqs - n) + seq_lens + [0] * (seqs - n) + tile_seq + tile_t0
        self.i32.copy_(host_tensor(i32, torch.int32, self.device), non_blocking=True)
        i64 = host_tensor([ids + [0] * pad, pos + [0] * pad, kv_slots + [-1] * pad], torch.int64, self.device)
        self.i64[:, :bucket].copy_(i64, non_blocking=True)
        tables = [r.blocks + [0] * (max_blocks - len(r.blocks)) for r in requests]
        self.block_tables[:n, :max_blocks].copy_(
            host_tensor(tables, torch.int32, self.device), non_blocking=True
        )
        if future is not None and min(ids) < 0:
            static_ids = self.i64[0, :tokens]
            static_ids.copy_(resolve_placeholders(static_ids, future))
        self.num_replays += 1
        self.last_key = (bucket, bound)
        graph = self.graphs[(bucket, bound)]
        if graph is None:
            self._forward(bucket)
        else:
            graph.replay()
        record_prompt_logprobs(self.model, self.hidden[:tokens], requests, num_new)
        if not sampling:
            return self.hidden.new_empty(0, 0, dtype=torch.float32), sampling
        index = to_device(rows, torch.long, self.device)
        return self.model.compute_logits(self.hidden[index]), sampling


def capture_mixed_graphs(
    runner,  # noqa: ANN001
    max_tokens: int,
    max_seqs: int,
    max_model_len: int,
    capture: bool = True,
) -> MixedGraphRunner | None:
    """A MixedGraphRunner, or None (logging why) when this engine cannot use one or the device has no room
    for the captures: they are on by default, so running out of memory there turns them off instead of
    failing the engine's start. ``capture=False``: the static-buffer path run eagerly, on any device
    (tests)."""
    reason = mixed_graph_refusal(runner, tp_group().is_parallel)
    if reason is None and capture and runner.device.type != "cuda":
        reason = f"the engine runs on {runner.device}"
    if reason is not None:
        logger.info("CUDA graphs for mixed steps off: %s", reason)
        return None
    try:
        return MixedGraphRunner(runner, max_tokens, max_seqs, max_model_len, capture)
    except torch.cuda.OutOfMemoryError as exc:
        error = (str(exc).strip() or "CUDA out of memory").splitlines()[0]
    gc.collect()  # the partly built runner and its graphs, then their pool's blocks
    torch.cuda.empty_cache()
    logger.warning(
        "CUDA graphs for mixed steps off: out of device memory while capturing them (%s); prefill and "
        "mixed steps run eagerly. Leave more memory outside mem_fraction_static, lower "
        "max_num_batched_tokens, or pass --disable-mixed-cuda-graph to skip the capture",
        error,
    )
    return None
