"""Check a whole configuration before any weight is read, so that a mistake costs seconds, not a load.

Every entry point (``mmlora.Engine`` and so ``mmlora.generate``, the server, the app, the demo and the
benchmarks) calls :func:`check_engine_config` first. Checks run cheapest first: option names that need
no import at all (LoRA and attention backends, ports, adapter folders and their configs), then those that
need the model's architecture, read from ``config.json``, the GGUF header or a preset (never from the
weights). Every refusal is a :class:`ConfigError` whose one-line message names the option.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from mmlora.config import ConfigError, EngineConfig, split_lora_spec

__all__ = ["ConfigError", "ModelFacts", "check_engine_config", "exit_on_config_error"]

# The backends mmlora registers itself; backends registered by user code are found in the registry
# (which user code must have imported to register one). A test keeps this list equal to the registry.
BUILTIN_LORA_BACKENDS = ("torch-gather", "triton-auto", "triton-bgmv", "triton-fused", "triton-sgmv")
BUILTIN_ATTENTION_BACKENDS = ("torch", "triton")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need to know about a model, read without its weights."""

    name: str
    architecture: str
    lora_module_names: tuple[str, ...]
    is_multimodal: bool


def check_engine_config(config: EngineConfig, *, images: Any = None) -> ModelFacts | None:
    """Every check of ``config`` (and of ``images``, if given) that needs no weights; raises ConfigError.

    Returns the model's facts, or None for a model given by hub id (not downloaded yet)."""
    check_backend_names(config)
    _check_device(config.model.device, config.model.dtype)
    paths = [_fetched_adapter(split_lora_spec(spec)[1], config) for spec in config.lora.lora_paths]
    for path in paths:  # the commonest mistake, found before torch is imported
        if not os.path.isdir(path):
            problem = "no such adapter folder" if not os.path.exists(path) else "is not a folder"
            raise ConfigError(f"lora_paths: LoRA adapter {path!r}: {problem}")
    adapter_configs = [_read_adapter_config(path, config) for path in paths]
    if config.model.gguf_file or _is_hub_id(config.model.model):
        return None  # the architecture is known once mmlora.hub has the config; the engine checks then
    facts = model_facts(config.model.model)
    for path, adapter_config in zip(paths, adapter_configs):
        _check_adapter_targets(path, adapter_config, facts)
    check_images(facts, images)
    return facts


def _fetched_adapter(path: str, config: EngineConfig) -> str:
    """A hub id's snapshot folder (fetched now, before torch is imported: a wrong id fails in seconds;
    the engine's own resolution is then a cache hit); a path passes as is."""
    if not _is_hub_id(path):
        return path
    from mmlora.hub import resolve_adapter  # its HubError is a ConfigError

    return resolve_adapter(
        path, download_dir=config.model.download_dir, allow_pickled=config.lora.allow_pickled_adapters
    )


def _is_hub_id(spec: str) -> bool:
    if os.path.exists(spec) or "/" not in spec:  # a path on disk, or not id-shaped: no hub import needed
        return False
    from mmlora.hub import parse_hub_ref

    return parse_hub_ref(spec) is not None


def check_images(facts: ModelFacts, images: Any) -> None:
    """Images for a text-only model are refused: ``images`` is None, or per prompt None or images."""
    if images is None:
        return
    given = [i for i in (images if isinstance(images, (list, tuple)) else [images]) if i not in (None, [])]
    if given and not facts.is_multimodal:
        raise ConfigError(
            f"images: the model {facts.name!r} ({facts.architecture}) is text-only and takes no images"
        )


def check_port(host: str, port: int, *, option: str = "port") -> None:
    """The port is a TCP port that can be bound on ``host`` now (0 asks the system for a free one)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{option}: {port!r} is not a TCP port (0-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{option}: cannot listen on {host}:{port}: {e.strerror or e}") from None


def model_facts(model: str) -> ModelFacts:
    """Architecture, LoRA target names and modality of ``model``, from its config or GGUF header only."""
    from mmlora.models.loader import resolve_model

    try:
        source = resolve_model(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if source.kind == "dummy":
        from mmlora.models.presets import preset_config

        try:
            cfg = preset_config(source.path)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"model: {e}") from None
        hf = SimpleNamespace(architectures=cfg.architectures, model_type=cfg.model_type)
    elif source.kind == "gguf":
        hf = SimpleNamespace(architectures=None, model_type=gguf_architecture(source.path))
    else:
        hf = _read_config_json(os.path.join(source.path, "config.json"))
    from mmlora.models.families import family_for

    try:
        family = family_for(hf)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    arch = (hf.architectures or [hf.model_type])[0]
    return ModelFacts(source.name, str(arch), tuple(family.lora_module_parents), family.is_multimodal)


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file, read from its first metadata entries (no tensor data)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ConfigError(f"model: {path!r} is not a GGUF file")
        (count,) = struct.unpack_from("<Q", head, 16)
        for _ in range(count):
            key = _read_gguf_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and value_type == 8:
                return _read_gguf_string(f)
            _skip_gguf_value(f, value_type)
    raise ConfigError(f"model: GGUF file {path!r} has no general.architecture")


_GGUF_WIDTH = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}


def _read_gguf_string(f: Any) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", "replace")


def _skip_gguf_value(f: Any, value_type: int) -> None:
    if value_type in _GGUF_WIDTH:
        f.seek(_GGUF_WIDTH[value_type], os.SEEK_CUR)
    elif value_type == 8:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == 9:
        element_type, count = struct.unpack("<IQ", f.read(12))
        if element_type in _GGUF_WIDTH:
            f.seek(_GGUF_WIDTH[element_type] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, element_type)
    else:
        raise ConfigError(f"model: GGUF metadata value of unknown type {value_type}")


def _read_config_json(file: str) -> SimpleNamespace:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model: cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model: {file} is not a JSON object")
    return SimpleNamespace(architectures=data.get("architectures"), model_type=data.get("model_type"))


def check_backend_names(config: EngineConfig) -> None:
    """The LoRA and attention backend names are registered ones (or auto)."""
    lora_backend = config.lora.lora_backend
    registry = sys.modules.get("mmlora.backends.registry")
    known = {*BUILTIN_LORA_BACKENDS, *(registry.available_backends() if registry else ())}
    if lora_backend != "auto" and lora_backend not in known:
        raise ConfigError(
            f"unknown lora_backend {lora_backend!r}; registered backends: auto, {', '.join(sorted(known))}"
        )
    attention = config.scheduler.attention_backend
    if attention != "auto" and attention not in BUILTIN_ATTENTION_BACKENDS:
        raise ConfigError(
            f"unknown attention_backend {attention!r}; registered: auto, {', '.join(BUILTIN_ATTENTION_BACKENDS)}"
        )


def _check_device(device: str, dtype: str) -> None:
    if device in ("auto", "cpu"):
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device: {device!r} is not a torch device: {e}") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ConfigError(f"device: {device!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} asked for, but CUDA is not available here")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device: {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype: bfloat16 is not supported on {device}; use float16 or float32")


def _read_adapter_config(path: str, config: EngineConfig) -> dict:
    """An adapter's folder, config and weights file exist, its config is servable, its rank fits."""
    from mmlora.lora.adapter import AdapterError, check_adapter_config

    try:
        adapter_config = check_adapter_config(path, allow_pickled=config.lora.allow_pickled_adapters)
    except AdapterError as e:
        raise ConfigError(f"lora_paths: {e}") from None
    rank = max(_ranks(adapter_config))
    if rank > config.lora.max_lora_rank:
        raise ConfigError(
            f"lora_paths: LoRA adapter {path!r} has rank {rank}, above max_lora_rank={config.lora.max_lora_rank}"
        )
    return adapter_config


def _ranks(adapter_config: dict) -> Iterable[int]:
    yield adapter_config.get("r", 8)
    yield from (adapter_config.get("rank_pattern") or {}).values()


def _check_adapter_targets(path: str, adapter_config: dict, facts: ModelFacts) -> None:
    targets = adapter_config.get("target_modules")
    if not isinstance(targets, list):
        return  # a regex or all-linear: the weights file is the record, checked when it is read
    bad = [t for t in targets if t.rsplit(".", 1)[-1] not in facts.lora_module_names and t != "all-linear"]
    if bad:
        raise ConfigError(
            f"lora_paths: LoRA adapter {path!r}: target_modules {bad} cannot take LoRA on {facts.architecture}; "
            f"supported: {', '.join(facts.lora_module_names)}"
        )


def first_line(error: BaseException) -> str:
    """The one line a command-line entry point prints for a refused configuration."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def exit_on_config_error(check: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``check``; a ConfigError (or ValueError) becomes one line on stderr and exit status 2."""
    try:
        return check(*args, **kwargs)
    except (ValueError, TypeError) as e:
        sys.stderr.write(f"error: {first_line(e)}\n")
        raise SystemExit(2) from None


__all__: Sequence[str] = (
    "ConfigError",
    "ModelFacts",
    "check_engine_config",
    "check_images",
    "check_port",
    "exit_on_config_error",
    "model_facts",
)
