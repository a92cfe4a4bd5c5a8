"""Sharded LoRA through every backend, in one process: each rank's pool slot (its shard, written by the
pool) and the backend's add_lora on it, against the unsharded pool at tp_size 1.

Column-parallel (qkv, with one KV head replicated on both ranks): each rank's output is its rows of the
full delta. Row-parallel (o): the ranks' deltas on their input columns sum to the full delta. The
process-level tests (test_tensor_parallel.py) run the whole engine on torch-gather; this covers the
Triton backends (interpreted on the CPU) on the shapes a rank sees.
"""

from __future__ import annotations

import pytest
import torch

from mmlora.backends import get_backend
from mmlora.distributed import state
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights
from mmlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mmlora.lora.adapter import LoadedAdapter, LoRAModuleWeights
from mmlora.lora.pool import LoRAPool
from mmlora.lora.shard import AdapterSharder
from mmlora.lora.spec import LoRAModelSpec, LoRATarget

HIDDEN, HEAD, RANK, TP = 32, 8, 4, 2
QKV = ("q_proj", "k_proj", "v_proj")
SEQ_LENS, SEQ_SLOTS = [3, 1, 2, 1], [1, -1, 1, 1]  # prefill chunks, decode rows and a base row


def _modules(rank: int, size: int, monkeypatch) -> dict[str, torch.nn.Module]:
    monkeypatch.setattr(state, "_GROUP", state.TPGroup(rank, size))
    names = ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")
    return {
        "qkv_proj": ColumnParallelLinear(HIDDEN, ((4, HEAD), (1, HEAD), (1, HEAD)), False, names),
        "o_proj": RowParallelLinear((4, HEAD), 24, False, "num_attention_heads"),
    }


def _spec(modules: dict[str, torch.nn.Module]) -> LoRAModelSpec:
    qkv, o = modules["qkv_proj"], modules["o_proj"]
    targets = (
        LoRATarget("qkv_proj", QKV, qkv.in_features, qkv.output_sizes),
        LoRATarget("o_proj", ("o_proj",), o.in_features, (o.out_features,)),
    )
    return LoRAModelSpec(1, targets, "model.layers", {})


def _adapter() -> LoadedAdapter:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    qkv = LoRAModuleWeights(
        A=tuple(randn(RANK, HIDDEN) for _ in QKV),
        B=(randn(4 * HEAD, RANK), randn(HEAD, RANK), randn(HEAD, RANK)),
        scalings=(0.5, 2.0, 1.0),
    )
    o = LoRAModuleWeights(A=(randn(RANK, 4 * HEAD),), B=(randn(24, RANK),), scalings=(0.75,))
    return LoadedAdapter("random", RANK, {(0, "qkv_proj"): qkv, (0, "o_proj"): o}, {}, 0)


def _deltas(backend: str, spec: LoRAModelSpec, adapter: LoadedAdapter, x: dict[str, torch.Tensor]) -> dict:
    """Each target's delta for the batch, through a 2-slot pool holding ``adapter`` in slot 1."""
    info = LoRABatchInfo(16, 2, "cpu")
    pool = LoRAPool(spec, 2, 8, None, torch.float32, torch.device("cpu"), info.set_slot_rank)
    pool.write_slot(1, adapter)
    info.fill(SEQ_LENS, SEQ_SLOTS)
    out = {}
    for t in spec.targets:
        A, B, scalings = pool.buffers[(0, t.name)]
        delta = torch.zeros(sum(SEQ_LENS), sum(t.out_features))
        get_backend(backend).add_lora(delta, x[t.name], LoRAWeights(A, B, scalings, t.slice_offsets), info)
        out[t.name] = delta
    return out


@pytest.mark.parametrize("backend", ["torch-gather", "triton-sgmv", "triton-bgmv", "triton-auto"])
def test_rank_shards_add_up_to_the_full_delta(backend, monkeypatch):
    adapter = _adapter()
    g = torch.Generator().manual_seed(1)
    x = {"qkv_proj": torch.randn(7, HIDDEN, generator=g), "o_proj": torch.randn(7, 4 * HEAD, generator=g)}
    full = _deltas(backend, _spec(_modules(0, 1, monkeypatch)), adapter, x)
    o_sum = torch.zeros_like(full["o_proj"])
    for rank in range(TP):
        modules = _modules(rank, TP, monkeypatch)
        shard = AdapterSharder(modules).shard(adapter, rank)
        qkv, o = modules["qkv_proj"], modules["o_proj"]
        local = _deltas(
            backend, _spec(modules), shard, {"qkv_proj": x["qkv_proj"], "o_proj": o.shard_cols(x["o_proj"])}
        )
        expected = qkv.shard_rows(full["qkv_proj"].T, None).T  # this rank's rows of every slice
        torch.testing.assert_close(local["qkv_proj"], expected, atol=1e-5, rtol=1e-5)
        o_sum += local["o_proj"]
    torch.testing.assert_close(o_sum, full["o_proj"], atol=1e-5, rtol=1e-5)
    assert full["o_proj"].abs().max() > 0.1 and full["o_proj"][3].abs().max() == 0  # row 3 is base-only
