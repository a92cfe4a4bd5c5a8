"""The C kernels of :mod:`mmlora.backends.cpu_kernels` against float64 references written from their
docstrings; skipped where they are not built (no C compiler)."""

from __future__ import annotations

import pytest
import torch

from mmlora.backends import cpu_expand, cpu_kernels
from mmlora.backends.cpu_dense import live_rows

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels are not built here")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _expand_ref(y, h, E, slots, ranks, offs):  # noqa: ANN001, ANN202
    """float64: each adapter row adds its own slot's slices of h times the same rows of E."""
    out = y.double().clone()
    starts = [len(offs[1:]) * sum(ranks[:s]) for s in range(len(ranks))]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        r = ranks[s]
        for i in range(len(offs) - 1):
            lo, hi, c = offs[i], offs[i + 1], starts[s] + i * r
            delta = h[t, c : c + r].double() @ E[c : c + r, lo:hi].double()
            out[t, lo:hi] += delta.to(y.dtype).double() if y.dtype != torch.float32 else delta
    return out


@pytest.mark.parametrize("dtype", cpu_expand.EXPAND_DTYPES)
@pytest.mark.parametrize(
    ("rows", "widths", "ranks"),
    [(16, (256, 64, 64), [8, 16, 4, 1]), (13, (96, 96), [8, 2, 8]), (1, (80,), [16]), (70, (40,), [3, 0, 5])],
)
def test_lora_expand_matches_float64(rows: int, widths: tuple[int, ...], ranks: list[int], dtype) -> None:  # noqa: ANN001
    """y and h as the fused path passes them: two column ranges of one [T, out + K] tensor (strided rows);
    base-only rows and rows past the adapters' columns untouched."""
    g = torch.Generator().manual_seed(rows)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    out, K = offs[-1], len(widths) * sum(ranks)
    live = [s for s, r in enumerate(ranks) if r]
    slots = [live[t % len(live)] if t % 4 else -1 for t in range(rows)]
    yk = torch.randn(rows, out + K, generator=g).to(dtype)
    E = torch.randn(K, out, generator=g).to(dtype)
    y, h = yk[:, :out], yk[:, out:]
    want = _expand_ref(y, h, E, slots, ranks, offs)
    before = yk.clone()
    row_slices = cpu_expand.live_row_slices(len(widths), ranks)
    Ec, eoff = cpu_expand.compact_expand(E, row_slices, offs)
    assert Ec.numel() == sum(offs[i + 1] - offs[i] for i in row_slices)
    rows = cpu_expand.expand_rows(slots, ranks, len(widths))
    cpu_expand.lora_expand(y, h, Ec, eoff, rows, torch.tensor(offs))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol)
    assert torch.equal(yk[:, out:], before[:, out:])  # h is read, never written
    base = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(yk[base], before[base])


def test_expand_rows_follow_the_live_row_layout() -> None:
    """A token's first column is where :func:`live_rows` puts its slot's first rank row."""
    ranks, n = [4, 0, 8, 2], 3
    rows = live_rows(n, 8, ranks).tolist()
    got = cpu_expand.expand_rows([2, -1, 0, 3], ranks, n).tolist()
    assert got == [[rows.index(2 * n * 8), 8], [-1, 0], [0, 4], [rows.index(3 * n * 8), 2]]


def test_lora_expand_refuses_mismatched_tensors() -> None:
    y, h = torch.zeros(2, 8), torch.zeros(2, 4)
    E, eoff = cpu_expand.compact_expand(torch.zeros(4, 8), [0] * 4, [0, 8])
    rows, offs = cpu_expand.expand_rows([0, 0], [4], 1), torch.tensor([0, 8])
    with pytest.raises(ValueError, match="dtypes"):
        cpu_expand.lora_expand(y, h.double(), E, eoff, rows, offs)
    with pytest.raises(ValueError, match="shapes"):
        cpu_expand.lora_expand(y, h, E, eoff[:3], rows, offs)


def test_without_a_compiler_the_kernels_are_off(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """No compiler (or a failing build): no library, and callers keep their torch path."""
    monkeypatch.setenv("MMLORA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_kernels._library.__wrapped__() is None
    assert not any(tmp_path.rglob("*.so"))


def test_the_fused_path_expands_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed decode-sized batch on the fused path calls the C expand (once per module call)."""
    from mmlora.backends import get_backend
    from mmlora.forward.lora import LoRABatchInfo, LoRAWeights

    calls = []
    real = cpu_expand.ExpandCall.__call__
    monkeypatch.setattr(cpu_expand.ExpandCall, "__call__", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(2, 8, 32, generator=g), torch.randn(2, 64, 8, generator=g)
    w = LoRAWeights(A, B, torch.ones(2, 1), (0, 64))
    info = LoRABatchInfo(8, 2, "cpu", max_lora_rank=8)
    for s in range(2):
        info.set_slot_rank(s, 8)
    info.fill([1, 1, 1], [0, -1, 1])
    weight, x = torch.randn(64, 32, generator=g), torch.randn(3, 32, generator=g)
    with torch.no_grad():
        got = get_backend("torch-gather").fused_linear(x, weight, None, w, info)
    assert got is not None and calls == [1]


def _attention_ref(q, kc, vc, tables, lens, scale, window):  # noqa: ANN001, ANN202
    """float64, request by request: keys at positions [lo, L) read from their pages, GQA by head index."""
    B, Hq, D = q.shape
    bs, Hkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        lo = max(0, L - window) if window else 0
        if L - lo <= 0:
            continue
        pos = torch.arange(lo, L)
        rows = tables[b, pos // bs].long() * bs + pos % bs
        k = kc.reshape(-1, Hkv, D)[rows].double()
        v = vc.reshape(-1, Hkv, D)[rows].double()
        for qh in range(Hq):
            h = qh // (Hq // Hkv)
            p = torch.softmax(k[:, h] @ q[b, qh].double() * scale, 0)
            out[b, qh] = p @ v[:, h]
    return out


@pytest.mark.parametrize("dtype", cpu_kernels.ATTENTION_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (4, 4, 16), (6, 1, 40)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_matches_float64(dtype, hq: int, hkv: int, d: int, window) -> None:  # noqa: ANN001
    """Pages in random order, lengths from 0 (no keys: zeros) past several pages, GQA groups 1-6, the
    head dims compiled with D known (64, 128) and others."""
    g = torch.Generator().manual_seed(hq * d)
    bs, lens = 4, torch.tensor([0, 1, 5, 17, 33], dtype=torch.int32)
    nb = -(-int(lens.max()) // bs) + 1
    blocks = len(lens) * nb + 2
    tables = torch.randperm(blocks, generator=g)[: len(lens) * nb].reshape(len(lens), nb).to(torch.int32)
    kc = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    got = cpu_kernels.decode_attention(q, kc, vc, tables, lens, int(lens.max()), 0.3, window)
    assert got.dtype == dtype and got.shape == q.shape
    atol, rtol = (2e-5, 2e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(
        got.double(), _attention_ref(q, kc, vc, tables, lens, 0.3, window), atol=atol, rtol=rtol
    )
    assert got[0].abs().sum() == 0


def test_decode_attention_refuses_mismatched_tensors() -> None:
    q, kc = torch.zeros(2, 4, 8), torch.zeros(3, 4, 2, 8)
    tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_kernels.decode_attention(q, kc.bfloat16(), kc, tables, lens, 1, 1.0)
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_kernels.decode_attention(q, kc, kc, tables.long(), lens, 1, 1.0)


@pytest.mark.parametrize("dtype", cpu_kernels.ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_reference(dtype, with_residual: bool) -> None:  # noqa: ANN001
    """As fused_ops.rms_norm_ref (Llama, offset 0): bf16 bit for bit, fp32 to a few ulp (the sum of squares
    is summed in another order), the residual sum exactly; x a column slice of a wider tensor."""
    from mmlora.layers.fused_ops import rms_norm_ref

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 2, 100, generator=g).to(dtype)
    x = wide[..., 10:90]  # rows of one stride, not contiguous
    residual = torch.randn(7, 2, 80, generator=g).to(dtype) if with_residual else None
    w = (torch.rand(80, generator=g) + 0.5).to(dtype)
    got, want = cpu_kernels.rms_norm(x, w, 1e-5, residual), rms_norm_ref(x, w, 1e-5, 0.0, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    xs = (x.double() + residual.double()).to(dtype).double() if with_residual else x.double()
    f64 = w.double() * (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(
        got.double(),
        f64,
        **({"atol": 1e-5, "rtol": 2e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}),
    )


@pytest.mark.parametrize("dtype", cpu_kernels.ELEMENTWISE_DTYPES)
def test_rotary_matches_the_torch_reference(dtype) -> None:  # noqa: ANN001
    """As rotary_ops.apply_rotary_ref on q and k viewed out of one packed qkv row (row stride past D * H):
    bit for bit in both dtypes (each product rounded before the sum, as torch)."""
    from mmlora.layers.rotary_ops import apply_rotary_ref

    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 9 * 32 + 2 * 3 * 32, generator=g).to(dtype)
    q, k = qkv[:, : 9 * 32].view(5, 9, 32), qkv[:, 9 * 32 : 12 * 32].view(5, 3, 32)
    cos, sin = torch.randn(5, 32, generator=g).to(dtype), torch.randn(5, 32, generator=g).to(dtype)
    got, want = cpu_kernels.rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin)
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.shape == b.shape
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="rotary"):
        cpu_kernels.rotary(q.transpose(1, 2), k, cos, sin)


def test_layers_take_the_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm and RotaryEmbedding call the C kernels (fp32 / bf16, CPU, no autograd) and agree with their
    torch path; with the kernels off they keep the torch path."""
    from mmlora.layers.norms import RMSNorm
    from mmlora.layers.rotary import RopeConfig, RotaryEmbedding

    calls = []
    for name in ("rms_norm_unchecked", "rotary_unchecked"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    norm, rope = RMSNorm(64, 1e-6), RotaryEmbedding(16, 128, RopeConfig())
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    q, k, pos = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.tensor([5, 0, 77])
    with torch.no_grad():
        on = (norm(x), *norm(x, r), *rope(pos, q, k))
        assert calls == ["rms_norm_unchecked", "rms_norm_unchecked", "rotary_unchecked"]
        monkeypatch.setattr(cpu_kernels, "ENABLED", False)
        off = (norm(x), *norm(x, r), *rope(pos, q, k))
    assert len(calls) == 3
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", cpu_kernels.ATTENTION_DTYPES)
def test_store_kv_rows_as_store_kv(dtype) -> None:  # noqa: ANN001
    """K and V rows viewed out of one packed qkv output land where base.store_kv puts them."""
    from mmlora.layers.attention.base import store_kv

    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(3, 4 * 8 + 2 * 2 * 8, generator=g).to(dtype)
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    caches = [torch.randn(5, 4, 2, 8, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    slots = torch.tensor([7, 0, 19])
    assert cpu_kernels.store_kv_layout_ok(k, v, *caches)
    cpu_kernels.store_kv_unchecked(k, v, *caches, slots)
    store_kv(k, v, *want, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


@pytest.mark.parametrize("dtype", cpu_kernels.ELEMENTWISE_DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 8), (16, 1536), (5, 37)])
def test_silu_and_mul_matches_float64_and_torch(rows: int, inter: int, dtype) -> None:  # noqa: ANN001
    """gate_up a column range of a wider tensor (strided rows, as a view of a GEMM's output); fp32 within a
    few ulp of the float64 value, bf16 bit for bit torch's F.silu(g) * u (each op rounded to bf16)."""
    g = torch.Generator().manual_seed(rows * inter)
    wide = (torch.randn(rows, 2 * inter + 3, generator=g) * 4).to(dtype)
    gate_up = wide[:, 1 : 1 + 2 * inter]
    got = cpu_kernels.silu_and_mul(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    gate, up = gate_up.double().split(inter, dim=-1)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), gate * torch.sigmoid(gate) * up, atol=1e-6, rtol=4e-6)
    else:
        ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="silu_and_mul"):
        cpu_kernels.silu_and_mul(gate_up.double())


def test_bf16_rounding_of_ties_infinities_and_nans_is_torchs() -> None:
    """The kernels' fp32 -> bf16 rounding (to nearest even, written as a select so that loops vectorize),
    through rotary: each product of two bf16 values has at most 16 significant bits, so thousands of random
    ones hold many exact ties, and torch rounds the same products; inf and NaN inputs give torch's inf and
    NaN, and denormal products stay denormal (where the kernels round with AVX-512 BF16's vcvtneps2bf16,
    which flushes them to zero, a vector holding one takes the exact bit arithmetic)."""
    from mmlora.layers.rotary_ops import apply_rotary_ref

    g = torch.Generator().manual_seed(0)
    T, H, D = 64, 4, 64
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(T, 1, D, generator=g).to(torch.bfloat16)
    q[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38])
    q[1:5, :, :8] = torch.randn(4, H, 8, generator=g) * 1e-39  # products below fp32's smallest normal
    cos = torch.randn(T, D, generator=g).to(torch.bfloat16)
    sin = torch.randn(T, D, generator=g).to(torch.bfloat16)
    sin[1:5] = 0  # those rows' outputs are x * cos alone: denormal where x is
    got, ref = cpu_kernels.rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin)
    products = (q.float() * cos.float()[:, None]).flatten()
    ties = (products.view(torch.int32) & 0xFFFF) == 0x8000
    assert ties.sum() > 100  # the case the rounding must get right is there
    assert (ref[0][1:5, :, :8] != 0).float().mean() > 0.5  # denormal outputs, which a flush would zero
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
