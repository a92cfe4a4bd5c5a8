"""ModelRunner: turns a ScheduledBatch into a ForwardBatch, runs the model, returns logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmlora.backends.onednn import packable_dtypes
from mmlora.distributed.state import tp_group
from mmlora.distributed.step import StepRouting, send_forward
from mmlora.engine.overlap import resolve_placeholders
from mmlora.engine.prompt_logprobs import record_prompt_logprobs
from mmlora.engine.request import Request
from mmlora.engine.scheduler import ScheduledBatch
from mmlora.forward import AttentionMetadata, ForwardBatch
from mmlora.forward.host_copy import to_device
from mmlora.kvcache.allocator import KVCache
from mmlora.layers.attention import AttentionBackend
from mmlora.layers.packed_linear import prepack_linears
from mmlora.lora.manager import LoRAManager
from mmlora.models.base import CausalLM
from mmlora.multimodal.features import batch_inputs


def adapter_order(sched: ScheduledBatch) -> list[int] | None:
    """The batch order that puts requests on one adapter slot side by side (stable), or None when they
    already are. The LoRA routing merges adjacent requests on a slot into one segment, so a mixed step's
    decode rows become runs and segment kernels read each adapter once per run, not once per row (H200,
    128 decode rows on 32 rank-16 adapters beside a 2048-token chunk: 368 -> 240 us of LoRA kernels per
    layer; ``benchmarks/scripts/decode_lora_anatomy.py``, mixed-sorted, 2026-12-03). Rows are
    independent in every layer but attention, which is per sequence, so the order changes no result."""
    slots = [r.slot for r in sched.requests]
    runs = sum(a != b for a, b in zip(slots, slots[1:])) + (len(slots) > 0)
    if runs <= len(set(slots)):  # every slot's requests are one run already
        return None
    return sorted(range(len(slots)), key=slots.__getitem__)


@dataclass
class StepRows:
    """One forward's rows in batch order, as host lists: each request's new tokens (ids, positions, the KV
    slot each is written to), ``query_start_loc`` and ``seq_lens`` per request, and the rows whose hidden
    state is turned into logits with the batch indices of their requests (those that sample)."""

    ids: list[int]
    positions: list[int]
    kv_slots: list[int]
    qsl: list[int]
    seq_lens: list[int]
    logits_rows: list[int]
    sampling: list[int]


def step_rows(requests: Sequence[Request], num_new: Sequence[int], block_size: int) -> StepRows:
    """The :class:`StepRows` of ``requests`` feeding ``num_new`` tokens each (their pages already hold them)."""
    rows = StepRows([], [], [], [0], [], [], [])
    for b, (req, n) in enumerate(zip(requests, num_new)):
        start = req.num_computed
        rows.ids.extend(req.token_slice(start, start + n))
        rows.positions.extend(range(start, start + n))
        rows.kv_slots.extend(
            req.blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)
        )
        rows.qsl.append(rows.qsl[-1] + n)
        rows.seq_lens.append(start + n)
        if start + n == req.num_tokens:
            rows.logits_rows.append(rows.qsl[-1] - 1)
            rows.sampling.append(b)
    return rows


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        attention: AttentionBackend,
        lora: LoRAManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.lora = lora
        self.device = device
        self.block_size = kv_cache.allocator.block_size
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            attn.backend = attention
            attn.k_cache, attn.v_cache = kv_cache.layer(i)
        self.attention = attention
        if device.type == "cpu":
            # Once: the packed weight layout (the C panel GEMM's, else oneDNN's) for every base linear and
            # the head (bf16 too where the CPU multiplies it natively; elsewhere bf16 stays on F.linear).
            prepack_linears(model, dtypes=packable_dtypes())
        # Decode steps replayed: a CudaGraphRunner (enable_cuda_graphs) or, on CPU, a CpuGraphRunner.
        self.decode_graphs = None
        # Prefill and mixed steps replayed per token bucket (enable_mixed_graphs): a MixedGraphRunner.
        self.mixed_graphs = None
        # Set by the overlap scheduler for one forward: the last launched step's sampled tokens, which
        # the placeholders among this step's token ids stand for (mmlora.engine.overlap).
        self.future: torch.Tensor | None = None

    def enable_cuda_graphs(self, max_batch_size: int, max_model_len: int, capture: bool = True) -> None:
        """Capture decode graphs per batch bucket; decode-only steps then replay them (mmlora.engine.cuda_graph).
        ``capture=False`` runs the graph steps' static-buffer forward eagerly instead, on any device
        (tests). Under tensor parallelism the workers capture alongside (rank 0 tells them)."""
        from mmlora.engine.cuda_graph import CudaGraphRunner, capture_decode_graphs

        if capture:
            self.decode_graphs = capture_decode_graphs(self, max_batch_size, max_model_len)
        else:
            self.decode_graphs = CudaGraphRunner(self, max_batch_size, max_model_len, capture=False)

    def enable_mixed_graphs(
        self, max_tokens: int, max_seqs: int, max_model_len: int, capture: bool = True
    ) -> None:
        """Capture prefill/mixed-step graphs per token bucket (mmlora.engine.mixed_graph), where this engine
        can; ``capture=False`` runs their static-buffer forward eagerly (tests, any device)."""
        from mmlora.engine.mixed_graph import capture_mixed_graphs

        self.mixed_graphs = capture_mixed_graphs(self, max_tokens, max_seqs, max_model_len, capture)

    def enable_cpu_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """On CPU: decode-only steps replay recorded C kernel plans (mmlora.engine.cpu_graph), where the C
        kernels are built and the engine is one process."""
        from mmlora.engine.cpu_graph import cpu_decode_graphs

        self.decode_graphs = cpu_decode_graphs(self, max_batch_size, max_model_len)

    def close(self) -> None:
        """Drop the decode graphs and the layers' views of the KV cache (the views alone keep it alive)."""
        for graphs in (self.decode_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.close()
        self.decode_graphs = self.mixed_graphs = None
        for layer in self.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = None

    def _i32(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int32, self.device)

    def build(self, sched: ScheduledBatch) -> tuple[ForwardBatch, list[int]]:
        """The ForwardBatch, and the batch indices of requests that sample this step."""
        rows = step_rows(sched.requests, sched.num_new, self.block_size)
        ids, seq_lens = rows.ids, rows.seq_lens
        max_blocks = max(len(r.blocks) for r in sched.requests)
        tables = [r.blocks + [0] * (max_blocks - len(r.blocks)) for r in sched.requests]
        attn = AttentionMetadata(
            query_start_loc=self._i32(rows.qsl),
            seq_lens=self._i32(seq_lens),
            block_tables=to_device(tables, torch.int32, self.device),
            slot_mapping=to_device(rows.kv_slots, torch.int64, self.device),
            num_seqs=len(sched),
            num_tokens=len(ids),
            max_query_len=max(sched.num_new),
            max_seq_len=max(seq_lens),
            query_lens_host=list(sched.num_new),
            seq_lens_host=seq_lens,
        )
        input_embeds = embed_rows = None
        if self.model.is_multimodal:
            # M-RoPE positions [3, T], and the image features of the rows this step covers.
            chunks = [(r.mm_inputs, r.num_computed, n) for r, n in zip(sched.requests, sched.num_new)]
            pos, input_embeds, embed_rows = batch_inputs(chunks, self.model.encode_images, self.device)
        else:
            pos = to_device(rows.positions, torch.long, self.device)
        input_ids = to_device(ids, torch.long, self.device)
        if self.future is not None and min(ids) < 0:
            input_ids = resolve_placeholders(input_ids, self.future)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=pos,
            attn=attn,
            logits_rows=to_device(rows.logits_rows, torch.long, self.device),
            input_embeds=input_embeds,
            embed_rows=embed_rows,
        )
        return batch, rows.sampling

    @torch.inference_mode()
    def forward(self, sched: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """fp32 logits [B', V] for the requests that sample (their batch indices second)."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(sched):
            return self.decode_graphs.run(sched, self.future)
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(sched):
            return self.mixed_graphs.run(sched, self.future)
        order = adapter_order(sched)
        if order is not None:
            sched = ScheduledBatch([sched.requests[b] for b in order], [sched.num_new[b] for b in order])
        batch, sampling = self.build(sched)
        if order is not None:
            sampling = [order[b] for b in sampling]
        routing = StepRouting(list(sched.num_new), [r.slot for r in sched.requests])
        if tp_group().is_parallel:
            send_forward(batch, routing)  # the workers run the same forward on their shards
        hidden = self.run_batch(batch, routing)
        record_prompt_logprobs(self.model, hidden, sched.requests, sched.num_new)
        if not sampling:
            return hidden.new_empty(0, 0, dtype=torch.float32), sampling
        return self.model.compute_logits(hidden[batch.logits_rows]), sampling

    def run_batch(self, batch: ForwardBatch, routing: StepRouting) -> torch.Tensor:
        """Hidden states [T, H] of one eager forward (every tensor-parallel rank runs this)."""
        with self.lora.activate(routing.seq_lens, routing.seq_slots):
            return self.model(batch)
