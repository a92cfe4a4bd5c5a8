"""``lora_side_max_tokens``: in small batches each LoRA module's whole delta (shrink and expand into a
zeroed buffer) runs on the second CUDA stream beside the base GEMM, and the main stream adds it, in
decode batches of one row per segment.

On a GPU: a chain of LoRA layers (the next layer reads the previous output) gives, eager and in a CUDA
graph replayed with new inputs, the float64 reference and, within one bf16 rounding, what the shrink-only
split gives; rows without an adapter are the base output bit for bit; the backend really ran on the side
stream for batches up to the limit and not past it. On CPU the option is accepted and changes nothing."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from lora_pools import assert_replays_match, lora_reference_f64  # noqa: E402
from torch import nn  # noqa: E402

from mmlora.backends import get_backend  # noqa: E402
from mmlora.forward import LoRABatchInfo, LoRAWeights  # noqa: E402
from mmlora.lora.layer import LoRAContext, LoRALinear  # noqa: E402

CUDA = torch.cuda.is_available()


def test_the_option_is_validated() -> None:
    from mmlora.config import EngineConfig

    with pytest.raises(ValueError, match="lora_side_max_tokens"):
        EngineConfig.from_kwargs(lora_side_max_tokens=-1)
    assert EngineConfig.from_kwargs(lora_side_max_tokens=64).lora.lora_side_max_tokens == 64


S, R, HIDDEN, OFFS = 4, 16, 512, (0, 512, 640, 768)  # slots, pool rank, in_features, q/k/v-like slices


def _info(lens: list[int], slots: list[int], dev: torch.device) -> LoRABatchInfo:
    info = LoRABatchInfo(sum(lens), S, dev)
    for s, r in enumerate((16, 8, 16, 4)):
        info.set_slot_rank(s, r)
    info.fill(lens, slots)
    return info


def _chain_of_layers(n: int, ctx: LoRAContext, g: torch.Generator):  # noqa: ANN202
    """``n`` bf16 LoRA layers on ``ctx``, and the chain running them (each reads the previous output)."""
    dev, dt = g.device, torch.bfloat16
    layers = []
    for _ in range(n):
        base = nn.Linear(HIDDEN, OFFS[-1], bias=False, device=dev, dtype=dt)
        with torch.no_grad():
            base.weight.copy_(torch.randn(OFFS[-1], HIDDEN, device=dev, generator=g) / 24)
        A = (torch.randn(S, 3 * R, HIDDEN, device=dev, generator=g) / 16).to(dt)
        B = (torch.randn(S, OFFS[-1], R, device=dev, generator=g) / 4).to(dt)
        layers.append(LoRALinear(base, LoRAWeights(A, B, torch.full((S, 3), 0.5, device=dev), OFFS), ctx))

    @torch.inference_mode()
    def chain(x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for layer in layers:
            outs.append(layer(x))
            x = outs[-1][:, :HIDDEN].contiguous()
        return outs

    return layers, chain


class _StreamSpy:
    """The backend, recording which stream each ``add_lora`` was launched on."""

    def __init__(self, backend) -> None:  # noqa: ANN001
        self.backend, self.streams = backend, []

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.backend, name)

    def add_lora(self, out, x, weights, info) -> None:  # noqa: ANN001
        self.streams.append(torch.cuda.current_stream(out.device))
        self.backend.add_lora(out, x, weights, info)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "name,lens,slots",
    [
        ("triton-auto", [1] * 24, [i % 5 - 1 for i in range(24)]),  # decode rows (BGMV), some base rows
        ("triton-bgmv", [1] * 7, [2, -1, 0, 3, 0, -1, 1]),  # no two neighbours share a slot
        ("triton-sgmv", [1] * 9, [3, 1, -1, 0, 1, 2, 3, -1, 0]),
    ],
)
def test_side_delta_chain_matches_the_reference_eager_and_replayed(name, lens, slots) -> None:  # noqa: ANN001
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    info = _info(lens, slots, dev)
    T = info.num_tokens
    side = torch.cuda.Stream(dev)
    ctx = LoRAContext(backend=_StreamSpy(get_backend(name)), info=info, side_stream=side, side_max_tokens=T)
    layers, chain = _chain_of_layers(5, ctx, g)

    x0 = torch.randn(T, HIDDEN, device=dev, generator=g).to(dt)
    ctx.backend.streams.clear()
    delta = chain(x0)
    assert ctx.backend.streams == [side] * len(layers), "the LoRA did not run on the side stream"
    base_rows = torch.tensor([s < 0 for s in info.token_slots.tolist()], device=dev)
    x = x0
    with torch.inference_mode():
        for layer, out in zip(layers, delta):
            base = layer.base(x)
            torch.testing.assert_close(
                out.double(), lora_reference_f64(base, x, layer.weights, info), rtol=2e-2, atol=2e-2
            )
            assert torch.equal(out[base_rows], base[base_rows])
            # Past the limit only the shrink runs beside the GEMM; from the same input the two differ by
            # one bf16 rounding at most (the side delta is rounded before the add).
            ctx.side_max_tokens = T - 1
            ctx.backend.streams.clear()
            split = layer(x)
            assert side not in ctx.backend.streams
            ctx.side_max_tokens = T
            torch.testing.assert_close(out, split, rtol=1e-2, atol=1.6e-2)
            x = out[:, :HIDDEN].contiguous()

    # A batch of segments (decode runs) never takes the side delta, whatever the limit.
    ctx.info, ctx.backend.streams = _info([3, 2, 3], [0, -1, 2], dev), []
    layers[0](torch.randn(8, HIDDEN, device=dev, generator=g).to(dt))
    assert side not in ctx.backend.streams
    ctx.info = info

    # Captured and replayed with new inputs: the eager bits.
    assert_replays_match(chain, x0, lambda: torch.randn(T, HIDDEN, device=dev, generator=g).to(dt), chain, 3)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_sgmv_prefill_shrink_beside_the_gemm_gives_the_bits_of_one_stream(monkeypatch) -> None:  # noqa: ANN001
    """SGMV's split (``TUNING["side_min_tokens"]``, forced to 1): the shrink of prefill segments on the
    side stream, the expand after the GEMM; the same kernels as one stream, so the same bits, eager and
    replayed, and the float64 reference."""
    from mmlora.backends import triton_sgmv

    monkeypatch.setitem(triton_sgmv.TUNING, "side_min_tokens", 1)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    info = _info([70, 5, 50], [2, -1, 0], dev)
    side = torch.cuda.Stream(dev)
    ctx = LoRAContext(backend=get_backend("triton-sgmv"), info=info, side_stream=side, side_max_tokens=0)
    layers, chain = _chain_of_layers(4, ctx, g)

    assert ctx.backend.splits_work(info)
    x0 = torch.randn(125, HIDDEN, device=dev, generator=g).to(dt)
    beside = chain(x0)
    ctx.side_stream = None
    one_stream = chain(x0)
    ctx.side_stream = side
    x = x0
    with torch.inference_mode():
        for layer, a, b in zip(layers, beside, one_stream):
            assert torch.equal(a, b)
            ref = lora_reference_f64(layer.base(x), x, layer.weights, info)
            torch.testing.assert_close(a.double(), ref, rtol=2e-2, atol=2e-2)
            x = a[:, :HIDDEN].contiguous()

    def one_stream(static: torch.Tensor) -> list[torch.Tensor]:
        ctx.side_stream = None
        want = chain(static)
        ctx.side_stream = side
        return want

    assert_replays_match(
        chain, x0, lambda: torch.randn(125, HIDDEN, device=dev, generator=g).to(dt), one_stream, 2
    )
