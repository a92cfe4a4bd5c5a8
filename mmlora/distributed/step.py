"""Rank 0 -> workers: each command is one fixed-size int64 header broadcast, then its tensors.

A forward travels as one int64 payload (token ids, positions, attention metadata, logits rows and the
LoRA routing, concatenated; the header gives the lengths), plus the image features of a multimodal
step as one float tensor: tensors only, nothing pickled. Workers rebuild the same ForwardBatch.

Decode graphs: CAPTURE_GRAPHS makes every worker capture the same graphs as rank 0, in the same order
(captured collectives must pair up across ranks); REPLAY carries one graph step's static inputs as one
int64 payload, and its graph key, so that every rank replays the same graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from mmlora.distributed.state import IDLE_TIMEOUT_S, broadcast
from mmlora.forward import AttentionMetadata, ForwardBatch

HEADER_LEN = 16


class Command(enum.IntEnum):
    FORWARD = 1
    WRITE_SLOT = 2  # header: slot, adapter rank; then each worker's shard (mmlora.lora.shard)
    CLEAR_SLOT = 3  # header: slot
    STOP = 4
    CAPTURE_GRAPHS = 5  # header: max batch size, max_model_len, capture (0: run eagerly), padding page
    REPLAY = 6  # header: bucket, rank bound, layout index, block-table columns; then the static inputs


@dataclass
class StepRouting:
    """What the LoRA layers need besides the batch: per-request token counts and adapter slots."""

    seq_lens: list[int]
    seq_slots: list[int]


_device = torch.device("cpu")


def set_comm_device(device: torch.device) -> None:
    """Where headers and payloads live: the rank's GPU with NCCL, the CPU with gloo."""
    global _device
    _device = device


def send_capture_graphs(max_batch_size: int, max_model_len: int, capture: bool, pad_page: int) -> None:
    send_header(Command.CAPTURE_GRAPHS, max_batch_size, max_model_len, int(capture), pad_page)


def send_header(cmd: Command, *args: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(cmd)
    header[1 : 1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    broadcast(header.to(_device))


def recv_header() -> list[int]:
    """A worker's wait for rank 0's next command (as long as the server idles)."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=_device)
    return broadcast(header, timeout_s=IDLE_TIMEOUT_S).tolist()


def send_forward(batch: ForwardBatch, routing: StepRouting) -> None:
    attn = batch.attn
    parts = [
        batch.input_ids,
        batch.positions.reshape(-1),
        attn.query_start_loc,
        attn.seq_lens,
        attn.block_tables.reshape(-1),
        attn.slot_mapping,
        batch.logits_rows,
        torch.tensor(routing.seq_lens),
        torch.tensor(routing.seq_slots),
    ]
    n_embeds = 0 if batch.embed_rows is None else batch.embed_rows.numel()
    if n_embeds:
        parts.append(batch.embed_rows)
    send_header(
        Command.FORWARD,
        attn.num_tokens,
        attn.num_seqs,
        attn.block_tables.shape[1],
        batch.logits_rows.numel(),
        batch.positions.shape[0] if batch.positions.dim() == 2 else 1,
        n_embeds,
        attn.max_query_len,
        attn.max_seq_len,
    )
    broadcast(torch.cat([p.to(_device, torch.int64) for p in parts]))
    if n_embeds:
        broadcast(batch.input_embeds.contiguous())


def recv_forward(header: list[int], hidden_size: int, dtype: torch.dtype) -> tuple[ForwardBatch, StepRouting]:
    T, B, max_blocks, L, pos_rows, N, max_query_len, max_seq_len = header[1:9]
    sizes = [T, pos_rows * T, B + 1, B, B * max_blocks, T, L, B, B, N]
    payload = broadcast(torch.zeros(sum(sizes), dtype=torch.int64, device=_device))
    ids, pos, qsl, seq_lens, tables, slots, rows, lora_lens, lora_slots, embed_rows = payload.split(sizes)
    input_embeds = None
    if N:
        input_embeds = broadcast(torch.zeros(N, hidden_size, dtype=dtype, device=_device))
    host = payload[sum(sizes[:2]) : sum(sizes[:4])].tolist()  # query_start_loc and seq_lens, one sync
    qsl_host, seq_lens_host = host[: B + 1], host[B + 1 :]
    i32 = torch.int32
    attn = AttentionMetadata(
        query_start_loc=qsl.to(i32),
        seq_lens=seq_lens.to(i32),
        block_tables=tables.view(B, max_blocks).to(i32),
        slot_mapping=slots,
        num_seqs=B,
        num_tokens=T,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_lens_host=[b - a for a, b in zip(qsl_host, qsl_host[1:])],
        seq_lens_host=seq_lens_host,
    )
    batch = ForwardBatch(
        input_ids=ids,
        positions=pos if pos_rows == 1 else pos.view(pos_rows, T),
        attn=attn,
        logits_rows=rows,
        input_embeds=input_embeds,
        embed_rows=embed_rows if N else None,
    )
    routing = StepRouting(lora_lens.tolist(), lora_slots.tolist())
    return batch, routing


def send_replay(bucket: int, bound: int, layout: int, inputs: torch.Tensor) -> None:
    """One decode-graph step: ``inputs`` is the flat int64 payload of
    :meth:`mmlora.engine.cuda_graph.CudaGraphRunner.run` ([5, bucket] rows, then the [bucket, blocks]
    block table)."""
    blocks = (inputs.numel() - 5 * bucket) // bucket
    send_header(Command.REPLAY, bucket, bound, layout, blocks)
    broadcast(inputs.to(_device))


def recv_replay(header: list[int]) -> tuple[int, int, int, torch.Tensor]:
    """(bucket, rank bound, layout index, the flat int64 payload) of a REPLAY command."""
    bucket, bound, layout, blocks = header[1:5]
    payload = broadcast(torch.zeros(bucket * (5 + blocks), dtype=torch.int64, device=_device))
    return bucket, bound, layout, payload
