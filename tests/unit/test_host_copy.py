"""mmlora.forward.host_copy: a step's host values onto its device, staged through pinned memory on CUDA."""

from __future__ import annotations

import pytest
import torch

from mmlora.forward import host_copy


@pytest.mark.parametrize("pinned", [True, False])
def test_to_device_and_copy_give_the_values(pinned: bool, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(host_copy, "PINNED", pinned)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        t = host_copy.to_device([[1, 2, 3], [4, 5, -6]], torch.int32, device)
        assert t.device.type == device.type and t.dtype == torch.int32
        assert t.cpu().tolist() == [[1, 2, 3], [4, 5, -6]]
        dst = torch.zeros(5, dtype=torch.int64, device=device)
        host_copy.copy_to_device(dst[1:4], torch.tensor([7, 8, 9]))
        host_copy.copy_to_device(dst[:1], torch.tensor([3], device=device))  # device to device as well
        assert dst.cpu().tolist() == [3, 7, 8, 9, 0]
