"""Time the Triton paged decode attention on CUDA and report the KV bandwidth it achieves.

``python -m mmlora.bench.attention --out attn.json`` times one decode attention call (store of the
new token's K/V, split kernel, reduce) at Mistral-7B's head layout (32 query heads, 8 KV heads,
head_dim 128, bf16, pages of 16 tokens on randomly permuted blocks) for each batch size and context
length, with 20 calls captured in one CUDA graph so launch and replay overheads are not counted. KV
bandwidth is the K and V bytes the step must read (batch x context x Hkv x D x 2 x dtype size) over
the time.
``--prefill`` also times the prefill kernel (from scratch and on a cached prefix) in TFLOP/s.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from datetime import datetime, timezone

import torch

from mmlora.bench.cli import make_parser, progress
from mmlora.forward.attention import AttentionMetadata
from mmlora.layers.attention.triton_backend import TritonAttention, auto_num_kv_splits

logger = logging.getLogger(__name__)


def _decode_inputs(batch: int, context: int, hq: int, hkv: int, d: int, page: int, dtype, device):
    """A decode step where every request already holds ``context - 1`` tokens and adds one."""
    blocks_per_seq = -(-context // page)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    k_cache = torch.randn(num_blocks, page, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    last = context - 1
    slots = block_tables[:, last // page].long() * page + last % page
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slots,
        num_seqs=batch,
        num_tokens=batch,
        max_query_len=1,
        max_seq_len=context,
        query_lens_host=[1] * batch,
        seq_lens_host=[context] * batch,
    )
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v, k_cache, v_cache, meta


def _time_graph(fn, iters: int, repeat: int = 20) -> float:
    """Median milliseconds of one ``fn`` call: ``repeat`` calls captured in one CUDA graph, replayed
    ``iters`` times, so neither launch nor graph-replay overhead is counted."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeat)
    return sorted(times)[len(times) // 2]


def bench_decode(
    batches: list[int], contexts: list[int], splits: list[int | None], iters: int = 50
) -> list[dict]:
    """One row per (batch, context, split count); split ``None`` is the backend's automatic choice."""
    device = torch.device("cuda")
    hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.bfloat16
    rows = []
    for batch in progress(batches, "decode batches"):
        for context in contexts:
            inputs = _decode_inputs(batch, context, hq, hkv, d, page, dtype, device)
            kv_bytes = 2 * batch * context * hkv * d * inputs[3].element_size()
            for n in splits:
                backend = TritonAttention(num_kv_splits=n)
                used = n or auto_num_kv_splits(batch, hkv, context, device)
                ms = _time_graph(lambda b=backend, a=inputs: b.forward(*a, scale=d**-0.5), iters)
                row = {
                    "batch": batch,
                    "context": context,
                    "num_kv_splits": used,
                    "auto_splits": n is None,
                    "ms": round(ms, 4),
                    "kv_bytes": kv_bytes,
                    "kv_gb_per_s": round(kv_bytes / ms / 1e6, 1),
                }
                logger.info("%s", row)
                rows.append(row)
            del inputs
            torch.cuda.empty_cache()
    return rows


def _prefill_inputs(
    num_seqs: int, context: int, chunk: int, hq: int, hkv: int, d: int, page: int, dtype, device
):
    """``num_seqs`` requests each adding ``chunk`` tokens on top of ``context`` cached ones."""
    seq = context + chunk
    blocks_per_seq = -(-seq // page)
    block_tables = torch.randperm(num_seqs * blocks_per_seq, device=device).to(torch.int32)
    block_tables = block_tables.view(num_seqs, blocks_per_seq)
    k_cache = torch.randn(num_seqs * blocks_per_seq, page, hkv, d, device=device, dtype=dtype)
    pos = torch.arange(context, seq, device=device)
    slots = (block_tables[:, pos // page].long() * page + pos % page).flatten()
    T = num_seqs * chunk
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * chunk,
        seq_lens=torch.full((num_seqs,), seq, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=slots,
        num_seqs=num_seqs,
        num_tokens=T,
        max_query_len=chunk,
        max_seq_len=seq,
        query_lens_host=[chunk] * num_seqs,
        seq_lens_host=[seq] * num_seqs,
    )
    q = torch.randn(T, hq, d, device=device, dtype=dtype)
    k = torch.randn(T, hkv, d, device=device, dtype=dtype)
    return q, k, torch.randn_like(k), k_cache, torch.randn_like(k_cache), meta


def bench_prefill(shapes: list[tuple[int, int, int]], iters: int = 20) -> list[dict]:
    """(num_seqs, cached context, chunk) per row; FLOPs count the causal pairs only (QK and PV)."""
    device = torch.device("cuda")
    hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.bfloat16
    rows = []
    for num_seqs, context, chunk in progress(shapes, "prefill shapes"):
        inputs = _prefill_inputs(num_seqs, context, chunk, hq, hkv, d, page, dtype, device)
        pairs = num_seqs * (chunk * context + chunk * (chunk + 1) // 2)
        flops = 4 * pairs * hq * d
        ms = _time_graph(lambda a=inputs: TritonAttention().forward(*a, scale=d**-0.5), iters)
        row = {"num_seqs": num_seqs, "context": context, "chunk": chunk, "ms": round(ms, 4)}
        row["tflop_per_s"] = round(flops / ms / 1e9, 1)
        logger.info("%s", row)
        rows.append(row)
        del inputs
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, run the decode timings, write JSON to ``--out`` and return it."""
    parser = make_parser("python -m mmlora.bench attention", __doc__)
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[768, 4096])
    parser.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=[],
        help="fixed num_kv_splits to time besides the automatic choice",
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--prefill", action="store_true", help="also time the prefill kernel (TFLOP/s)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mmlora.bench.attention needs a CUDA device (the kernels are timed on the GPU)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = bench_decode(args.batches, args.contexts, [None, *args.splits], args.iters)
    prefill = bench_prefill([(8, 0, 512), (4, 0, 2048), (8, 2048, 256)]) if args.prefill else []
    report = {
        "benchmark": "triton paged decode attention (Mistral-7B heads: Hq 32, Hkv 8, D 128, bf16, page 16)",
        "command": " ".join(
            ["python -m mmlora.bench.attention", *(argv if argv is not None else sys.argv[1:])]
        ),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "results": rows,
        "prefill": prefill,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
