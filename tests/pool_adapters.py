"""Adapters and pools for the adapter pool's tests: a two-layer spec (qkv and o), uniform and random
adapters, and the slot contents an adapter should leave (zeros wherever it has no weights)."""

from __future__ import annotations

import torch

from mmlora.forward.lora import LoRABatchInfo
from mmlora.lora import staging as staging_module
from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights
from mmlora.lora.pool import LoRAPool
from mmlora.lora.spec import LoRAModelSpec, LoRATarget

SPEC = LoRAModelSpec(
    num_layers=2,
    targets=(
        LoRATarget("qkv_proj", ("q_proj", "k_proj", "v_proj"), 8, (8, 4, 4)),
        LoRATarget("o_proj", ("o_proj",), 8, (8,)),
    ),
    layers_prefix="model.layers",
    module_parents={
        "q_proj": "self_attn",
        "k_proj": "self_attn",
        "v_proj": "self_attn",
        "o_proj": "self_attn",
    },
)


def adapter(rank: int, value: float) -> LoadedAdapter:
    weights = {}
    for layer in range(2):
        weights[(layer, "qkv_proj")] = LoRAModuleWeights(
            A=(torch.full((rank, 8), value), None, torch.full((rank, 8), -value)),
            B=(torch.full((8, rank), value), None, torch.full((4, rank), value)),
            scalings=(2.0, 0.0, 0.5),
        )
    return LoadedAdapter(path=f"/a/{value}", rank=rank, weights=weights, config={}, nbytes=0)


def make_pool(
    slots: int = 2, max_loaded: int | None = None, device: str = "cpu"
) -> tuple[LoRAPool, LoRABatchInfo]:
    info = LoRABatchInfo(16, slots, device)
    pool = LoRAPool(SPEC, slots, 4, max_loaded, torch.float32, torch.device(device), info.set_slot_rank)
    return pool, info


def mixed_rank_adapter(b_dtype: torch.dtype = torch.float32) -> LoadedAdapter:
    """Random weights at ranks below the pool's 4 (strided B slot views) and at 4 (contiguous ones), a
    slice left out, a module left out, and modules listed in another order than the pool's."""
    gen = torch.Generator().manual_seed(0)

    def module(ranks: tuple[int | None, ...], outs: tuple[int, ...]) -> LoRAModuleWeights:
        A = tuple(None if r is None else torch.randn(r, 8, generator=gen) for r in ranks)
        B = tuple(
            None if r is None else torch.randn(o, r, generator=gen).to(b_dtype) for r, o in zip(ranks, outs)
        )
        return LoRAModuleWeights(A, B, tuple(0.0 if r is None else 1.0 + r for r in ranks))

    weights = {
        (1, "qkv_proj"): module((2, 4, 1), (8, 4, 4)),
        (0, "o_proj"): module((4,), (8,)),
        (0, "qkv_proj"): module((1, None, 3), (8, 4, 4)),
    }
    return LoadedAdapter(path="/a/mixed", rank=4, weights=weights, config={}, nbytes=0)


def expected_slot(adapter: LoadedAdapter, R: int) -> dict[tuple[int, str], list[torch.Tensor]]:
    """The slot ``adapter`` should fill, built from its tensors: zeros wherever it has none."""
    out = {}
    for layer in range(SPEC.num_layers):
        for t in SPEC.targets:
            n = len(t.slices)
            A, B = torch.zeros(n * R, t.in_features), torch.zeros(sum(t.out_features), R)
            s = torch.zeros(n)
            w = adapter.weights.get((layer, t.name))
            row = 0
            for i in range(n):
                if w is not None and w.A[i] is not None:
                    r = w.A[i].shape[0]
                    A[i * R : i * R + r] = w.A[i].float()
                    B[row : row + t.out_features[i], :r] = w.B[i].float()
                    s[i] = w.scalings[i]
                row += t.out_features[i]
            out[(layer, t.name)] = [A, B, s]
    return out


def assert_slot_is(pool: LoRAPool, slot: int, expected: dict[tuple[int, str], list[torch.Tensor]]) -> None:
    for key, bufs in pool.buffers.items():
        for buf, want in zip(bufs, expected[key]):
            assert torch.equal(buf[slot], want), key


def count_plan_builds(monkeypatch) -> list[int]:
    """Spy on UploadPlan.build: one entry (the pair count) per plan built."""
    calls: list[int] = []
    build = staging_module.UploadPlan.build.__func__

    def spy(cls, pairs, *rest):  # noqa: ANN001, ANN002, ANN202
        calls.append(len(pairs))
        return build(cls, pairs, *rest)

    monkeypatch.setattr(staging_module.UploadPlan, "build", classmethod(spy))
    return calls


def random_adapter(rank: int, seed: int) -> LoadedAdapter:
    """Every slice of qkv_proj in both layers, every element distinct (a copy in the wrong order fails)."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        (layer, "qkv_proj"): LoRAModuleWeights(
            A=tuple(torch.randn(rank, 8, generator=g) for _ in range(3)),
            B=tuple(torch.randn(out, rank, generator=g) for out in (8, 4, 4)),
            scalings=(2.0, 1.0, 0.5),
        )
        for layer in range(2)
    }
    return LoadedAdapter(path=f"/r/{seed}", rank=rank, weights=weights, config={}, nbytes=0)
