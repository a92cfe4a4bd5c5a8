"""PackedLinear against F.linear: the oneDNN-prepacked path on CPU fp32 and the F.linear fallback
elsewhere (float64, autograd), over odd shapes, one row and many rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmlora.engine.cpu_decode import cpu_bf16_flags
from mmlora.layers.packed_linear import (
    PackedLinear,
    onednn_linear_available,
    prepack_linears,
    set_weight_layout,
)
from mmlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")
# (rows, in, out); past PACKED_MAX_ROWS rows oneDNN runs 64-row pieces (150: a padded last piece), the C
# panel GEMM one call.
SHAPES = [(1, 7, 13), (3, 64, 1), (17, 33, 65), (128, 96, 200), (150, 40, 72), (5, 576, 1536)]


def _layer(in_f: int, out_f: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> PackedLinear:
    torch.manual_seed(seed)
    return PackedLinear(in_f, out_f, bias=bias, dtype=dtype)


def _expected(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The oracle: F.linear in float64 on the layer's own parameters."""
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.weight.double(), bias)


@needs_onednn
@pytest.mark.parametrize("rows,in_f,out_f", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp32_matches_f_linear(rows: int, in_f: int, out_f: int, bias: bool) -> None:
    layer = _layer(in_f, out_f, bias, torch.float32)
    assert layer.prepack() and layer.is_packed
    x = torch.randn(rows, in_f)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_f)
    torch.testing.assert_close(got.double(), _expected(layer, x), atol=1e-4 * in_f**0.5, rtol=1e-4)


@needs_onednn
def test_packed_keeps_leading_dims_and_strided_input() -> None:
    layer = _layer(24, 40, True, torch.float32)
    layer.prepack(batch_size=16)
    x3 = torch.randn(2, 5, 24)
    strided = torch.randn(24, 9).t()  # rows 9, not contiguous
    with torch.inference_mode():
        for x in (x3, strided):
            torch.testing.assert_close(layer(x).double(), _expected(layer, x), atol=1e-4, rtol=1e-4)


def test_float64_is_not_packed_and_stays_exact() -> None:
    layer = _layer(33, 17, True, torch.float64)
    assert not layer.prepack() and not layer.is_packed
    x = torch.randn(9, 33, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _expected(layer, x), atol=1e-12, rtol=1e-12)


@needs_onednn
def test_converted_to_float64_after_packing_falls_back() -> None:
    """A layer packed in fp32 and then converted to float64 answers exactly, as F.linear would."""
    layer = _layer(21, 11, True, torch.float32)
    layer.prepack()
    x = torch.randn(4, 21, dtype=torch.float64)
    with torch.inference_mode():
        want = F.linear(x, layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(layer.double()(x), want, atol=1e-12, rtol=1e-12)


@needs_onednn
def test_autograd_uses_the_parameter() -> None:
    layer = _layer(10, 6, True, torch.float32)
    layer.prepack()
    layer(torch.randn(3, 10)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@needs_onednn
def test_weight_written_after_packing_is_repacked() -> None:
    layer = _layer(16, 8, False, torch.float32)
    layer.prepack()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 16))
    x = torch.randn(5, 16)
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got.double(), _expected(layer, x), atol=1e-4, rtol=1e-4)


@needs_onednn
def test_prepack_linears_packs_the_parallel_layers_and_row_partial_matches() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "qkv": ColumnParallelLinear(32, ((4, 8), (2, 8), (2, 8)), True, ("q", "k", "v")),
            "o": RowParallelLinear((4, 8), 32, True, "o"),
            "plain": torch.nn.Linear(32, 32),
        }
    )
    assert prepack_linears(model) == 2
    x = torch.randn(6, 32)
    with torch.inference_mode():
        for name in ("qkv", "o"):
            layer = model[name]
            assert layer.is_packed
            torch.testing.assert_close(layer(x).double(), _expected(layer, x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            model["o"].partial(x).double(), _expected(model["o"], x), atol=1e-4, rtol=1e-4
        )


def test_prepack_skips_other_devices_and_dtypes() -> None:
    layers = torch.nn.ModuleList([_layer(8, 8, False, torch.float64), _layer(8, 8, False, torch.bfloat16)])
    assert prepack_linears(layers) == 0
    assert not any(layer.is_packed for layer in layers)


@needs_onednn
@pytest.mark.skipif(not cpu_bf16_flags(), reason="CPU without native bf16 (avx512_bf16 / amx_bf16)")
@pytest.mark.parametrize("rows", [1, 16, 67])
def test_packed_bf16_matches_f_linear_where_asked(rows: int) -> None:
    layer = _layer(96, 130, True, torch.bfloat16)
    assert not layer.prepack()  # bf16 is packed only when the caller says the CPU has it
    assert layer.prepack(dtypes=(torch.float32, torch.bfloat16)) and layer.is_packed
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _expected(layer, x), atol=0.1, rtol=2e-2)


@needs_onednn
def test_packed_path_takes_decode_rows_in_power_of_two_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN caches a primitive (about 0.5 MB) per row count: only a few bucketed counts may reach it,
    prefill-sized inputs included (packed for oneDNN, not the C panel GEMM)."""
    import mmlora.layers.packed_linear as packed_linear
    from mmlora.backends import onednn

    monkeypatch.setattr(onednn, "PANEL_GEMM", False)

    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    class _Ops:
        @staticmethod
        def _linear_pointwise(x, *args):
            seen.append(x.shape[0])
            return real(x, *args)

    layer = _layer(32, 48, True, torch.float32)
    assert layer.prepack()
    monkeypatch.setattr(packed_linear.torch.ops, "mkldnn", _Ops(), raising=False)
    for rows in (1, 3, 17, 64, 65, 300):
        x = torch.randn(2, rows, 32)[1]  # a view, so the reshape path is exercised
        with torch.inference_mode():
            got = layer(x)
        torch.testing.assert_close(got.double(), _expected(layer, x), atol=1e-4, rtol=1e-4)
    # 65 and 300 rows (prefill) run in 64-row pieces, the last one padded to its bucket.
    assert seen == [1, 4, 32, 64, 64, 1, 64, 64, 64, 64, 64]


class _TiedModel(torch.nn.Module):
    """Two base linears and a head tied to the embedding (as SmolLM2's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(11, 24)
        self.up = PackedLinear(24, 40, bias=True)
        self.down = PackedLinear(40, 24, bias=False)
        self.head = PackedLinear(24, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def test_column_major_weights_keep_shapes_values_and_outputs() -> None:
    """set_weight_layout: the base linears' weights become views of their contiguous transposes (same
    shape, values and state dict), the tied head is left alone, outputs match the float64 oracle, a CPU
    packed copy is dropped, and the row-major layout comes back."""
    model = _TiedModel().eval()
    ids = torch.tensor([[1, 4, 9, 2]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model.double()(ids).float()
    model.float()
    model.up.prepack()
    assert set_weight_layout(model, True) == 0  # CUDA only by default
    assert set_weight_layout(model, True, device_types=("cpu",)) == 2
    assert set_weight_layout(model, True, device_types=("cpu",)) == 0  # already column-major
    for layer in (model.up, model.down):
        w = layer.weight
        assert w.stride() == (1, w.shape[0]) and w.t().is_contiguous()
    assert model.head.weight is model.embed.weight and model.head.weight.is_contiguous()
    assert not model.up.is_packed
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
    assert set_weight_layout(model, False, device_types=("cpu",)) == 2
    assert model.up.weight.is_contiguous() and model.down.weight.is_contiguous()
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
