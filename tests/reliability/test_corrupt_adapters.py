"""A matrix of broken adapters loaded at run time: each is refused with a clear 4xx naming the problem,
nothing of it reaches the registry or the pool, and the server keeps serving."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def edit_config(**changes) -> Callable[[Path, Path], None]:
    def apply(folder: Path, outside: Path) -> None:
        config = json.loads((folder / CONFIG).read_text())
        config.update(changes)
        (folder / CONFIG).write_text(json.dumps(config))  # NaN / Infinity written as JSON5-style tokens

    return apply


def edit_tensors(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path, Path], None]:
    def apply(folder: Path, outside: Path) -> None:
        tensors = load_file(folder / WEIGHTS)
        fn(tensors)
        save_file(tensors, folder / WEIGHTS)

    return apply


def truncate(folder: Path, outside: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def huge_header(folder: Path, outside: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", 2**60) + data[8:])


def transpose_one(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key].t().contiguous()


def nan_weight(tensors: dict[str, torch.Tensor]) -> None:
    key = next(iter(tensors))
    tensors[key][0, 0] = float("nan")


def dora(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key.replace("lora_B.weight", "lora_magnitude_vector")] = torch.ones(tensors[key].shape[0])


def pickled(folder: Path, outside: Path) -> None:
    torch.save(load_file(folder / WEIGHTS), folder / "adapter_model.bin")
    (folder / WEIGHTS).unlink()


def folder_link(folder: Path, outside: Path) -> None:
    shutil.rmtree(folder)
    os.symlink(outside, folder)


def file_link(folder: Path, outside: Path) -> None:
    (folder / WEIGHTS).unlink()
    os.symlink(outside / WEIGHTS, folder / WEIGHTS)


def garbage_config(folder: Path, outside: Path) -> None:
    (folder / CONFIG).write_text("{not json")


MATRIX = {  # case -> (how to break a copy of adapter a0, status, words the message must contain)
    "truncated_safetensors": (truncate, 400, "corrupt"),
    "huge_header_length": (huge_header, 400, "corrupt"),
    "alpha_nan": (edit_config(lora_alpha=float("nan")), 400, "lora_alpha"),
    "alpha_inf": (edit_config(lora_alpha=float("inf")), 400, "lora_alpha"),
    "alpha_1e300": (edit_config(lora_alpha=1e300), 400, "lora_alpha"),
    "alpha_negative": (edit_config(lora_alpha=-8), 400, "lora_alpha"),
    "alpha_string": (edit_config(lora_alpha="8"), 400, "lora_alpha"),
    "alpha_pattern_nan": (edit_config(alpha_pattern={"q_proj": float("nan")}), 400, "alpha_pattern"),
    "rank_pattern_zero": (edit_config(rank_pattern={"q_proj": 0}), 400, "rank_pattern"),
    "r_huge": (edit_config(r=2**40), 400, "config field r"),
    "r_float": (edit_config(r=4.0), 400, "config field r"),
    "r_bool": (edit_config(r=True), 400, "config field r"),
    "config_not_json": (garbage_config, 400, "corrupt"),
    "wrong_shape": (edit_tensors(transpose_one), 400, "shape"),
    "nan_in_weights": (edit_tensors(nan_weight), 400, "nan"),
    "dora_config": (edit_config(use_dora=True), 400, "dora"),
    "dora_tensor": (edit_tensors(dora), 400, "dora"),
    "pickle": (pickled, 400, "pickled"),
    "folder_symlink_out_of_root": (folder_link, 400, "outside"),
    "file_symlink_out_of_root": (file_link, 400, "outside"),
}


@pytest.fixture(scope="module")
def outside(tiny, tmp_path_factory):
    """A valid adapter outside the adapter root (the target of the symbolic links)."""
    folder = tmp_path_factory.mktemp("outside") / "adapter"
    shutil.copytree(tiny.adapters["a0"], folder)
    return folder


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_corrupt_adapter_is_refused_and_harmless(server, tiny, outside, case):
    breaker, status, words = MATRIX[case]
    folder = tiny.root / f"corrupt_{case}"
    shutil.copytree(tiny.adapters["a0"], folder)
    breaker(folder, outside)
    before = server.bg.run(lambda eng: sorted(a["name"] for a in eng.list_loras()))
    try:
        r = requests.post(
            server.url + "/load_lora_adapter", json={"lora_name": case, "lora_path": folder.name}, timeout=60
        )
        assert r.status_code == status, (case, r.status_code, r.text)
        err = r.json()["error"]
        assert words in err["message"].lower(), err
        assert err["type"] == "invalid_request_error" and (
            err["code"] is None or isinstance(err["code"], str)
        )
        # nothing registered; a request naming it is a 404; the neighbours still work
        assert server.bg.run(lambda eng: sorted(a["name"] for a in eng.list_loras())) == before
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
        assert (
            requests.post(server.url + "/generate", json={**body, "lora_path": case}, timeout=60).status_code
            == 404
        )
        assert (
            requests.post(server.url + "/generate", json={**body, "lora_path": "a0"}, timeout=60).status_code
            == 200
        )
    finally:
        if folder.is_symlink():
            folder.unlink()
        else:
            shutil.rmtree(folder)


def test_missing_folder_inside_the_root_is_404(server):
    r = requests.post(
        server.url + "/load_lora_adapter", json={"lora_name": "m", "lora_path": "no_such_folder"}, timeout=60
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found", r.text
