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


def decode_inputs(
    batch: int,
    context: int | list[int],
    hq: int,
    hkv: int,
    d: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
    table_width: int | None = None,
    max_seq_len: int | None = None,
) -> tuple:
    """(q, k, v, k_cache, v_cache, meta) of a decode step where request b already holds ``context[b] - 1``
    tokens and adds one (``context``: one int for every request), its pages a random permutation of the
    pool. ``table_width``: block-table columns (default: the longest request's pages; serving's decode
    graphs use ``cdiv(max_model_len, page)``); ``max_seq_len``: the metadata's (default: the longest
    context; serving's decode graphs pass ``max_model_len``)."""
    contexts = [context] * batch if isinstance(context, int) else list(context)
    if len(contexts) != batch or min(contexts) < 1:
        raise ValueError(f"need {batch} contexts >= 1, got {len(contexts)} (min {min(contexts, default=0)})")
    blocks = torch.tensor([-(-c // page) for c in contexts], device=device)
    width = table_width or int(blocks.max())
    if width < int(blocks.max()):
        raise ValueError(f"table_width {width} < the longest request's {int(blocks.max())} pages")
    num_blocks = int(blocks.sum())
    block_tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
    used = torch.arange(width, device=device)[None, :] < blocks[:, None]
    block_tables[used] = torch.randperm(num_blocks, device=device).to(torch.int32)  # row-major order
    k_cache = torch.randn(num_blocks, page, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    last = seq_lens.long() - 1
    slots = block_tables[torch.arange(batch, device=device), last // page].long() * page + last % page
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slots,
        num_seqs=batch,
        num_tokens=batch,
        max_query_len=1,
        max_seq_len=max_seq_len or max(contexts),
        query_lens_host=[1] * batch,
        seq_lens_host=contexts,
    )
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v, k_cache, v_cache, meta


def kv_bytes(meta: AttentionMetadata, k_cache: torch.Tensor) -> int:
    """K and V bytes a decode step must read: every request's context, all KV heads."""
    _, _, hkv, d = k_cache.shape
    return 2 * sum(meta.seq_lens_host) * hkv * d * k_cache.element_size()


def time_graph(fn, iters: int, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one ``fn`` call: ``repeat`` calls captured in one CUDA graph, replayed
    ``iters`` times, so neither launch nor graph-replay overhead is counted."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    for _ in range(warmup):
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
            inputs = decode_inputs(batch, context, hq, hkv, d, page, dtype, device)
            nbytes = kv_bytes(inputs[5], inputs[3])
            for n in splits:
                backend = TritonAttention(num_kv_splits=n)
                used = n or auto_num_kv_splits(batch, hkv, context, device)
                ms = time_graph(lambda b=backend, a=inputs: b.forward(*a, scale=d**-0.5), iters)
                row = {
                    "batch": batch,
                    "context": context,
                    "num_kv_splits": used,
                    "auto_splits": n is None,
                    "ms": round(ms, 4),
                    "kv_bytes": nbytes,
                    "kv_gb_per_s": round(nbytes / ms / 1e6, 1),
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
        ms = time_graph(lambda a=inputs: TritonAttention().forward(*a, scale=d**-0.5), iters)
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
