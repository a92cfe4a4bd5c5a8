"""Paged attention: the torch reference against dense fp64 attention, the Triton backend against both.

On CPU the Triton kernels run under TRITON_INTERPRET=1 in fp32 at tiny shapes; on CUDA the ``gpu``
tests run fp16/bf16 at real shapes (head_dim 64/128/256, GQA up to 7) and a CUDA-graph decode replay.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from mmlora.backends import cpu_kernels  # noqa: E402
from mmlora.forward import AttentionMetadata
from mmlora.layers.attention import get_attention_backend  # noqa: E402
from mmlora.layers.attention.triton_backend import TritonAttention, store_kv_triton  # noqa: E402
from mmlora.layers.attention.triton_decode import _decode_split_kernel  # noqa: E402

if not torch.cuda.is_available() and type(_decode_split_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "mmlora's Triton kernels were imported before TRITON_INTERPRET=1 was set, so they cannot run on "
        "this CPU-only machine: set TRITON_INTERPRET=1 before the first mmlora import (e.g. tests/conftest.py)"
    )

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if HAS_CUDA else CPU  # the small-shape tests run natively where CUDA exists
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] this forward's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # prefix already stored, junk elsewhere
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per request [L, Hkv, D], unpaged
    dense_v: list[torch.Tensor]
    specs: list[tuple[int, int]]


def make_case(
    specs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    page: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = DEV,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Case:
    """specs: (context_len, query_len) per request. Pages are a random permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in specs]
    nblk = [-(-n // page) for n in lens]
    total = sum(nblk) + spare_blocks
    perm = torch.randperm(total, generator=g)
    block_tables = torch.zeros(len(specs), max(max(nblk), 1) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(total, page, hkv, d, generator=g).to(dtype)  # junk where nothing is stored
    v_cache = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    dense_k = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    dense_v = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    slots, new_k, new_v = [], [], []
    for b, (ctx, n) in enumerate(specs):
        pos = torch.arange(ctx + n)
        flat = block_tables[b, pos // page].long() * page + pos % page
        k_cache.view(-1, hkv, d)[flat[:ctx]] = dense_k[b][:ctx]
        v_cache.view(-1, hkv, d)[flat[:ctx]] = dense_v[b][:ctx]
        slots.append(flat[ctx:])
        new_k.append(dense_k[b][ctx:])
        new_v.append(dense_v[b][ctx:])
    qlens = [n for _, n in specs]
    T = sum(qlens)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        num_seqs=len(specs),
        num_tokens=T,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_lens_host=qlens,
        seq_lens_host=lens,
    )
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    return Case(
        q.to(device),
        torch.cat(new_k).to(device),
        torch.cat(new_v).to(device),
        k_cache.to(device),
        v_cache.to(device),
        meta,
        dense_k,
        dense_v,
        specs,
    )


def dense_attention(case: Case, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Plain causal attention in fp64 on the unpaged K/V, one request at a time."""
    outs, start = [], 0
    for b, (ctx, n) in enumerate(case.specs):
        q = case.q[start : start + n].double().cpu()
        start += n
        group = q.shape[1] // case.dense_k[b].shape[1]
        k = case.dense_k[b].double().repeat_interleave(group, dim=1)
        v = case.dense_v[b].double().repeat_interleave(group, dim=1)
        s = torch.einsum("thd,jhd->htj", q, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = torch.arange(ctx, ctx + n)[:, None]
        j = torch.arange(ctx + n)[None, :]
        allowed = j <= p
        if window:
            allowed &= j > p - window
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("htj,jhd->thd", torch.softmax(s, -1), v))
    return torch.cat(outs)


def run_backend(backend, case: Case, scale: float, window, softcap):
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = backend.forward(
        case.q, case.k, case.v, kc, vc, case.meta, scale=scale, sliding_window=window, logit_softcap=softcap
    )
    return out, kc, vc


DECODE = [(0, 1), (2, 1), (16, 1), (32, 1)]  # seq lens 1, 3, 17, 33
PREFILL = [(0, 3), (0, 17), (0, 1), (0, 33)]
CHUNKED = [(16, 17), (5, 3), (32, 1), (1, 33)]
MIXED = [(0, 17), (2, 1), (16, 1), (13, 20), (32, 1)]
BATCHES = {"decode": DECODE, "prefill": PREFILL, "chunked": CHUNKED, "mixed": MIXED}
OPTIONS = {"plain": (None, None), "window": (5, None), "softcap": (None, 2.0), "both": (7, 1.5)}


@pytest.mark.parametrize("c_kernels", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_torch_reference_matches_dense_fp64(
    batch: str, option: str, c_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU, batches without softcap run through the C kernel where it is built (cpu_kernels; decode rows,
    and prefill chunks of sequences up to PREFILL_IN_PLACE_MAX_KEYS long, each token a row), else
    through torch."""
    if c_kernels and (option in ("softcap", "both") or not cpu_kernels.available()):
        pytest.skip("the C kernel takes batches without softcap, where it is built")
    monkeypatch.setattr(cpu_kernels, "ENABLED", c_kernels)
    window, softcap = OPTIONS[option]
    case = make_case(BATCHES[batch], hq=4, hkv=2, d=16, page=4, seed=1, device=CPU)
    scale = 0.7
    out, kc, _ = run_backend(get_attention_backend("torch", CPU), case, scale, window, softcap)
    torch.testing.assert_close(
        out.double(), dense_attention(case, scale, window, softcap), atol=2e-5, rtol=1e-5
    )


def _check_triton(case: Case, scale, window, softcap, atol, rtol, num_kv_splits=None) -> None:
    ref, ref_kc, ref_vc = run_backend(
        get_attention_backend("torch", case.q.device), case, scale, window, softcap
    )
    out, kc, vc = run_backend(TritonAttention(num_kv_splits), case, scale, window, softcap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(kc, ref_kc, atol=0, rtol=0)
    torch.testing.assert_close(vc, ref_vc, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    dense = dense_attention(case, scale, window, softcap)
    torch.testing.assert_close(out.double().cpu(), dense, atol=atol, rtol=rtol)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (4, 1)])
def test_triton_matches_reference(batch: str, option: str, hq: int, hkv: int) -> None:
    window, softcap = OPTIONS[option]
    case = make_case(BATCHES[batch], hq=hq, hkv=hkv, d=32, page=16 if hkv == 2 else 4, seed=hq + hkv)
    _check_triton(case, 32**-0.5, window, softcap, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_triton_decode_fixed_splits(splits: int) -> None:
    # 16 splits over 3- to 70-token contexts leaves some splits empty; they must weigh nothing
    case = make_case([(69, 1), (2, 1), (40, 1), (0, 1)], hq=6, hkv=2, d=24, page=8, seed=3)
    _check_triton(case, 0.3, None, None, atol=1e-5, rtol=1e-5, num_kv_splits=splits)
    _check_triton(case, 0.3, 9, 3.0, atol=1e-5, rtol=1e-5, num_kv_splits=splits)


def test_triton_long_context_short_window_matches_reference() -> None:
    # window much shorter than the context (that the pages before it are not read: the test below)
    for specs in ([(150, 1), (90, 1)], [(150, 20), (3, 1)]):
        case = make_case(specs, hq=3, hkv=1, d=16, page=2, seed=4)
        _check_triton(case, 0.25, 11, None, atol=1e-5, rtol=1e-5)


def _poison_before_window(case: Case, window: int, margin: int) -> None:
    """NaN K/V in the cache at every position of each request more than ``margin`` tokens before its
    first query's window: a kernel that reads any of them (even masked: 0 * NaN) returns NaN there."""
    page = case.k_cache.shape[1]
    flat_k = case.k_cache.view(-1, *case.k_cache.shape[2:])
    flat_v = case.v_cache.view(-1, *case.v_cache.shape[2:])
    for b, (ctx, _) in enumerate(case.specs):
        stale = torch.arange(max(ctx - window + 1 - margin, 0))
        slots = case.meta.block_tables[b, stale // page].long().cpu() * page + stale % page
        flat_k[slots.to(flat_k.device)] = float("nan")
        flat_v[slots.to(flat_v.device)] = float("nan")


@pytest.mark.parametrize("specs", [[(400, 20), (3, 5), (260, 70)], [(400, 1), (150, 1), (5, 1)]])
def test_triton_window_never_reads_pages_before_it(specs) -> None:
    """Prefill (key tiles of 64 rounded down from the window's start) and decode (from the window's
    first token) skip the context before the window: the K/V there is NaN and must never be loaded."""
    window, margin = 16, 128  # margin: the prefill kernel starts up to one key tile (<= 128) early
    case = make_case(specs, hq=3, hkv=1, d=16, page=4, seed=6)
    _poison_before_window(case, window, margin)
    assert case.k_cache.isnan().any()
    out, _, _ = run_backend(TritonAttention(), case, 0.25, window, None)
    assert not out.isnan().any(), "a page wholly before the sliding window was read"
    dense = dense_attention(case, 0.25, window, None)
    torch.testing.assert_close(out.double().cpu(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(dtype: torch.dtype) -> None:
    # fp16/bf16 at small shapes on either device (the interpreter path upcasts its dot operands)
    for specs in (MIXED, DECODE):
        case = make_case(specs, hq=4, hkv=2, d=32, page=4, dtype=dtype, seed=5)
        _check_triton(case, 32**-0.5, 6, 3.0, atol=2e-2, rtol=2e-2)


def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 16, device=DEV)
    v_cache = torch.zeros(3, 4, 2, 16, device=DEV)
    k, v = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 2, 16, device=DEV)
    store_kv_triton(k, v, k_cache, v_cache, torch.tensor([5, -1, 0], device=DEV))
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    torch.testing.assert_close(flat_k[5], k[0])
    torch.testing.assert_close(flat_v[0], v[2])
    assert flat_k.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [0, 5]


def test_padding_rows_are_zero() -> None:
    # a CUDA-graph bucket may hand more token rows than meta.num_tokens; the extras come back zero
    case = make_case(DECODE, hq=2, hkv=1, d=16, page=4)
    pad = lambda x: torch.cat([x, torch.ones_like(x[:2])])  # noqa: E731
    slots = torch.cat([case.meta.slot_mapping, torch.tensor([-1, -1], device=DEV)])
    meta = AttentionMetadata(**{**case.meta.__dict__, "slot_mapping": slots})
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = TritonAttention().forward(pad(case.q), pad(case.k), pad(case.v), kc, vc, meta, scale=0.25)
    ref, _, _ = run_backend(get_attention_backend("torch", DEV), case, 0.25, None, None)
    torch.testing.assert_close(out[: len(DECODE)], ref, atol=1e-5, rtol=1e-5)
    assert out[len(DECODE) :].abs().sum() == 0


@pytest.mark.parametrize("splits", [None, 4])
def test_decode_padded_request_is_zero(splits) -> None:
    # a CUDA-graph bucket pads the batch with requests of seq_len 0 writing to slot -1
    case = make_case(DECODE, hq=2, hkv=1, d=16, page=4)
    seq_lens, slots = case.meta.seq_lens.clone(), case.meta.slot_mapping.clone()
    seq_lens[1], slots[1] = 0, -1
    meta = AttentionMetadata(**{**case.meta.__dict__, "seq_lens": seq_lens, "slot_mapping": slots})
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = TritonAttention(splits).forward(case.q, case.k, case.v, kc, vc, meta, scale=0.25)
    ref, _, _ = run_backend(get_attention_backend("torch", DEV), case, 0.25, None, None)
    assert out[1].abs().sum() == 0
    keep = [0, 2, 3]
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)


def test_bad_input_raises_value_error() -> None:
    case = make_case(DECODE, hq=4, hkv=2, d=16, page=4)
    backend = TritonAttention()
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(case.q[:, :3], case.k, case.v, case.k_cache, case.v_cache, case.meta, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        backend.forward(
            case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, scale=1.0, sliding_window=0
        )
    with pytest.raises(ValueError, match="dtype"):
        backend.forward(case.q.double(), case.k, case.v, case.k_cache, case.v_cache, case.meta, scale=1.0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        TritonAttention(num_kv_splits=0)
    assert isinstance(get_attention_backend("triton", CPU), TritonAttention)
    if not HAS_CUDA:
        return
    with pytest.raises(ValueError, match="device"):  # CPU tensors with native (not interpreted) Triton
        backend.forward(
            case.q.cpu(),
            case.k.cpu(),
            case.v.cpu(),
            case.k_cache.cpu(),
            case.v_cache.cpu(),
            case.meta,
            scale=1.0,
        )


# ---------------------------------------------------------------- CUDA: real shapes, fp16/bf16


CUDA_SHAPES = [(32, 8, 128), (28, 4, 128), (16, 8, 256), (8, 8, 64)]  # Mistral, Qwen2 (GQA 7), Gemma2, MHA


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", CUDA_SHAPES)
@pytest.mark.parametrize("batch", ["decode", "chunked", "mixed"])
@pytest.mark.parametrize("option", ["plain", "window+softcap"])
def test_triton_cuda(dtype, hq, hkv, d, batch, option) -> None:
    specs = {
        "decode": [(1000, 1), (0, 1), (4095, 1), (37, 1), (2500, 1)],
        "chunked": [(0, 300), (512, 129), (2000, 64), (17, 1)],
        "mixed": [(0, 77), (900, 1), (3000, 1), (100, 256), (0, 1)],
    }[batch]
    window, softcap = (1024, 50.0) if option != "plain" else (None, None)
    case = make_case(specs, hq, hkv, d, page=16, dtype=dtype, device=torch.device("cuda"), seed=d)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    _check_triton(case, d**-0.5, window, softcap, atol=tol, rtol=tol)
    if batch == "decode":
        _check_triton(case, d**-0.5, window, softcap, atol=tol, rtol=tol, num_kv_splits=8)


@gpu
@pytest.mark.gpu
def test_triton_decode_cuda_graph_replay() -> None:
    """Capture one decode step with a fixed split count, replay it after the lengths grow."""
    dev = torch.device("cuda")
    case = make_case([(100, 1), (700, 1), (5, 1)], 32, 8, 128, page=16, dtype=torch.bfloat16, device=dev)
    longer = make_case([(300, 1), (1400, 1), (63, 1)], 32, 8, 128, page=16, dtype=torch.bfloat16, device=dev)
    backend = TritonAttention(num_kv_splits=8)
    m = case.meta
    static = [case.q.clone(), case.k.clone(), case.v.clone()]
    kc, vc = longer.k_cache.clone(), longer.v_cache.clone()  # big enough for both
    bt = torch.zeros_like(longer.meta.block_tables)
    bt[:, : m.block_tables.shape[1]] = m.block_tables
    meta = AttentionMetadata(**{**m.__dict__, "block_tables": bt, "seq_lens": m.seq_lens.clone()})
    meta.slot_mapping = m.slot_mapping.clone()
    backend.forward(*static, kc, vc, meta, scale=0.1)  # warm up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*static, kc, vc, meta, scale=0.1)
    lm = longer.meta
    for dst, new in zip(static, (longer.q, longer.k, longer.v)):
        dst.copy_(new)
    bt.copy_(lm.block_tables)
    meta.seq_lens.copy_(lm.seq_lens)
    meta.slot_mapping.copy_(lm.slot_mapping)
    kc.copy_(longer.k_cache)
    vc.copy_(longer.v_cache)
    graph.replay()
    ref, _, _ = run_backend(get_attention_backend("torch", dev), longer, 0.1, None, None)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
