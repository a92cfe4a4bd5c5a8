"""The step inputs' host tensors (mmlora.forward.host_copy) and their pinned switch."""

from __future__ import annotations

import pytest
import torch

from mmlora.backends.tuning import parse_override
from mmlora.forward import host_copy
from mmlora.forward.host_copy import host_tensor, to_device
from mmlora.forward.lora import LoRABatchInfo

VALUES = [[3, -1, 7], [0, 2**40, 5]]


@pytest.mark.parametrize("pinned", [False, True])
def test_host_tensor_is_torch_tensor_of_the_values(monkeypatch: pytest.MonkeyPatch, pinned: bool) -> None:
    monkeypatch.setitem(host_copy.SETTINGS, "pinned", pinned)
    got = host_tensor(VALUES, torch.int64, torch.device("cpu"))
    assert got.device.type == "cpu" and got.dtype == torch.int64
    assert got.tolist() == VALUES
    assert to_device(range(4), torch.int32, torch.device("cpu")).tolist() == [0, 1, 2, 3]


def test_the_switch_is_a_named_override() -> None:
    table, knob, value = parse_override("host-copy:pinned=true")
    assert table is host_copy.SETTINGS and knob == "pinned" and value is True
    with pytest.raises(SystemExit, match="host-copy has no knob 'pinnned'"):
        parse_override("host-copy:pinnned=true")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_inputs_are_page_locked_and_route_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    infos = {}
    for pinned in (False, True):
        monkeypatch.setitem(host_copy.SETTINGS, "pinned", pinned)
        assert host_tensor(VALUES, torch.int64, cuda).is_pinned() == pinned
        assert not host_tensor(VALUES, torch.int64, torch.device("cpu")).is_pinned()
        info = infos[pinned] = LoRABatchInfo(16, 4, cuda, max_lora_rank=16)
        info.fill([3, 1, 4, 2], [0, 0, -1, 3])
        info.fill_rows([0, 0, 1, -1, 3], 16, "runs", segments=4)
    torch.cuda.synchronize()
    for name in ("seg_indptr", "seg_lens", "weight_indices", "token_slots"):
        assert torch.equal(getattr(infos[False], name), getattr(infos[True], name)), name
