"""The C panel GEMM of :mod:`mmlora.backends.cpu_gemm` against float64 references; its AVX2 build too (on an
AVX-512 machine, compiled without AVX-512); and the packed matmul dispatch that hands it the CPU decode
step's weights. Skipped where the C kernels are not built (no C compiler)."""

from __future__ import annotations

import pytest
import torch

from mmlora.backends import cpu_gemm, cpu_kernels, onednn

pytestmark = pytest.mark.skipif(not cpu_gemm.dtypes(), reason="the C kernels are not built here")

# (rows, in, out): one row; short row blocks of every size class; more rows than a block (two blocks, the
# second short); outputs not a multiple of the panel width; odd inputs (bf16 pads the last pair); SmolLM2's
# decode shapes.
SHAPES = [(1, 5, 3), (2, 16, 16), (3, 33, 17), (7, 64, 100), (12, 40, 31), (16, 576, 1056), (13, 1536, 79),
          (40, 96, 70), (33, 7, 200)]  # fmt: skip


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@pytest.mark.parametrize("dtype", cpu_gemm.dtypes())
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_matches_float64(rows: int, k: int, n: int, bias: bool, dtype: torch.dtype) -> None:
    """x a column range of a wider tensor (row stride > in), as the fused LoRA path passes its shrink."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    wide = torch.randn(rows, k + 5, generator=g).to(dtype)
    x = wide[:, 3 : 3 + k]
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = cpu_gemm.matmul(x, cpu_gemm.pack(w), b)
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), _ref(x, w, b), atol=2e-5 * k**0.5, rtol=1e-5)
    else:  # the fp32 sum rounded once to bf16: within one bf16 rounding of the exact value
        ref = _ref(x, w, b)
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6 * k).all()


def test_matmul_zero_rows_and_refusals() -> None:
    w = cpu_gemm.pack(torch.randn(8, 4))
    assert cpu_gemm.matmul(torch.randn(0, 4), w).shape == (0, 8)
    with pytest.raises(ValueError, match="cpu_gemm.matmul"):
        cpu_gemm.matmul(torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="cpu_gemm.matmul"):
        cpu_gemm.matmul(torch.randn(2, 4).double(), w)
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.matmul(torch.randn(2, 4), w, torch.randn(7))
    with pytest.raises(ValueError, match="cpu_gemm.pack"):
        cpu_gemm.pack(torch.randn(8, 4).double())


def test_avx2_build_matches_float64(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """The 8-wide panels and 8-row blocks of hosts without AVX-512, built here with AVX-512 switched off."""
    import ctypes
    import shutil
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if shutil.which("cc") is None or not cpuinfo.is_file() or "avx2" not in cpuinfo.read_text():
        pytest.skip("needs cc and an AVX2 CPU")
    monkeypatch.setenv("MMLORA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_FLAGS", [*cpu_kernels._FLAGS, "-mno-avx512f"])
    cpu_kernels._library.cache_clear()
    cpu_gemm._functions.cache_clear()
    try:
        fns = cpu_gemm._functions()
        assert fns is not None and fns[2] == 8 and fns[1] is None  # 8-wide panels, no bf16 kernel
        assert cpu_gemm.dtypes() == (torch.float32,)
        lib = cpu_kernels._library()
        assert isinstance(lib, ctypes.CDLL)
        for rows, k, n in SHAPES:
            g = torch.Generator().manual_seed(rows + k * n)
            x, w, b = (
                torch.randn(rows, k, generator=g),
                torch.randn(n, k, generator=g),
                torch.randn(n, generator=g),
            )
            got = cpu_gemm.matmul(x, cpu_gemm.pack(w), b)
            torch.testing.assert_close(got.double(), _ref(x, w, b), atol=2e-5 * k**0.5, rtol=1e-5)
        # The element-wise kernels' bf16 vectors take their portable form there: torch's bits.
        from mmlora.layers.fused_ops import rms_norm_ref
        from mmlora.layers.rotary_ops import apply_rotary_ref

        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(5, h, 64, generator=g).to(torch.bfloat16) for h in (4, 2))
        cos, sin = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
        for got, want in zip(cpu_kernels.rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin)):
            assert torch.equal(got, want)
        x, r, w = (torch.randn(n, 40, generator=g).to(torch.bfloat16) for n in (3, 3, 1))
        y, s = cpu_kernels.rms_norm(x, w[0], 1e-5, r)
        y_ref, s_ref = rms_norm_ref(x, w[0], 1e-5, residual=r)
        assert torch.equal(s, s_ref)
        torch.testing.assert_close(y.float(), y_ref.float(), atol=0, rtol=1e-2)
    finally:
        cpu_kernels._library.cache_clear()
        cpu_gemm._functions.cache_clear()


@pytest.mark.parametrize("dtype", cpu_gemm.dtypes())
def test_packed_matmul_dispatch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """pack_weight hands weights of the GEMM's dtypes to it while PANEL_GEMM is on (oneDNN's layout when off);
    packed_matmul gives F.linear's values either way, for contiguous and column-strided inputs."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(50, 24, generator=g).to(dtype), torch.randn(50, generator=g).to(dtype)
    x = torch.randn(16, 30, generator=g).to(dtype)[:, 2:26]
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    packed = onednn.pack_weight(w)
    assert isinstance(packed, cpu_gemm.PanelWeight) and packed.dtype == dtype
    torch.testing.assert_close(onednn.packed_matmul(x, packed, b), torch.nn.functional.linear(x, w, b), **tol)
    if onednn.onednn_linear_available():
        monkeypatch.setattr(onednn, "PANEL_GEMM", False)
        packed = onednn.pack_weight(w, 16)
        assert isinstance(packed, torch.Tensor) and packed.dtype == dtype
        torch.testing.assert_close(
            onednn.packed_matmul(x.contiguous(), packed, b), torch.nn.functional.linear(x, w, b), **tol
        )


def test_packed_linear_packs_without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch build without oneDNN's prepacked linear still packs for the C panel GEMM (and packs nothing
    once the panel GEMM is off too); the layer gives F.linear's values either way."""
    from mmlora.layers.packed_linear import PackedLinear

    monkeypatch.setattr(onednn, "onednn_linear_available", lambda: False)
    layer = PackedLinear(24, 40, bias=True)
    x = torch.randn(5, 24)
    assert onednn.packed_matmul_available() and layer.prepack() and layer.is_packed
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    monkeypatch.setattr(onednn, "PANEL_GEMM", False)
    assert not onednn.packed_matmul_available() and not layer.prepack()
