"""Read and validate a PEFT LoRA checkpoint into a model-independent, in-memory form.

``load_adapter`` reads ``adapter_config.json`` and ``adapter_model.safetensors`` (or, only on request, a
pickled ``adapter_model.bin``), checks every tensor and every config field against what the base model
offers (a :class:`~mmlora.lora.spec.LoRAModelSpec`), and returns a :class:`LoadedAdapter` only when all
of it is valid: nothing partial ever reaches the adapter pool. Every refusal is an :class:`AdapterError`
whose message names the adapter path and the problem.

The config's PEFT semantics (targets, rank and alpha patterns, scaling) are in
:mod:`mmlora.lora.adapter_config`.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mmlora.lora.adapter_config import (
    CONFIG_NAME,
    EMBEDDING_NAMES,
    check_config,
    check_target_names,
    is_targeted,
    rank_and_alpha,
    read_config,
)
from mmlora.lora.spec import LoRAModelSpec

logger = logging.getLogger(__name__)

SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_PEFT_PREFIX = "base_model.model."
# <module path>.lora_A[.<adapter name>].weight, as PEFT saves it (older files keep the adapter name)
_KEY_RE = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter path and the problem."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One packed target of one layer, at the adapter's natural ranks.

    A         per slice: [r_i, in_features] (None when the adapter does not touch that slice)
    B         per slice: [out_i, r_i]
    scalings  per slice: lora_alpha_i / r_i (or / sqrt(r_i) with use_rslora); 0.0 where absent
    The slice's delta is ``x @ A.T @ B.T * scaling``.
    """

    A: tuple[torch.Tensor | None, ...]
    B: tuple[torch.Tensor | None, ...]
    scalings: tuple[float, ...]


@dataclass(frozen=True)
class LoadedAdapter:
    """A validated adapter. ``weights`` maps (layer index, target name, e.g. "qkv_proj") to its weights;
    ``rank`` is the largest rank over all modules; ``nbytes`` the host memory of all A and B tensors;
    ``staged``, when set, all A and B tensors back to back in a few page-locked blocks (set by the pool
    on CUDA): the tensors in ``weights`` are views of them, and a slot load copies each block to the
    device at once; ``staged_layout`` the id of that layout (``mmlora.lora.staging``), shared by every
    adapter staged alike, and ``staged_scalings`` the slices' scalings in one fp32 tensor."""

    path: str
    rank: int
    weights: dict[tuple[int, str], LoRAModuleWeights]
    config: dict
    nbytes: int
    staged: tuple[torch.Tensor, ...] | None = None
    staged_layout: int | None = None
    staged_scalings: torch.Tensor | None = None


def load_adapter(
    path: str | os.PathLike,
    spec: LoRAModelSpec,
    *,
    max_lora_rank: int,
    allow_pickled: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LoadedAdapter:
    """Read, validate and return the PEFT LoRA adapter in folder ``path`` as CPU tensors of ``dtype``.

    Raises AdapterError (a ValueError) for anything that cannot be served exactly as HF + PEFT would
    run it on this base model; all validation completes before anything is returned.
    """
    folder = Path(path)
    where = str(path)

    def fail(problem: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {where!r}: {problem}")

    config = check_adapter_config(path, allow_pickled=allow_pickled)
    tensors = _read_tensors(folder, fail)
    if not tensors:
        raise fail("the weights file holds no tensors")

    pairs = _parse_keys(tensors, spec, fail)  # module path -> {"lora_A": key, "lora_B": key}
    check_target_names(config, spec, fail)

    weights: dict[tuple[int, str], dict[str, list]] = {}
    max_rank = nbytes = 0
    for module_path, (layer, target, slice_idx, kinds) in sorted(pairs.items()):
        a, b, scaling = _module_weights(
            config, tensors, module_path, target, slice_idx, kinds, max_lora_rank, dtype, fail
        )
        n = len(target.slices)
        entry = weights.setdefault((layer, target.name), {"A": [None] * n, "B": [None] * n, "s": [0.0] * n})
        entry["A"][slice_idx], entry["B"][slice_idx], entry["s"][slice_idx] = a, b, scaling
        max_rank = max(max_rank, a.shape[0])
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()

    _warn_untouched(config, spec, pairs, where)
    return LoadedAdapter(
        path=where,
        rank=max_rank,
        weights={
            k: LoRAModuleWeights(tuple(v["A"]), tuple(v["B"]), tuple(v["s"])) for k, v in weights.items()
        },
        config=config,
        nbytes=nbytes,
    )


def check_adapter_config(path: str | os.PathLike, *, allow_pickled: bool = False) -> dict:
    """The checks of :func:`load_adapter` that need no tensor: folder, files and config; returns the config."""
    folder, where = Path(path), str(path)

    def fail(problem: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {where!r}: {problem}")

    if not folder.is_dir():
        raise fail("no such adapter folder" if not folder.exists() else "is not a folder")
    config = read_config(folder / CONFIG_NAME, fail)
    check_config(config, fail)
    if not (folder / SAFETENSORS_NAME).is_file():
        if not (folder / PICKLE_NAME).is_file():
            raise fail(f"missing weights file: neither {SAFETENSORS_NAME} nor {PICKLE_NAME} is present")
        if not allow_pickled:
            raise fail(
                f"pickled adapters ({PICKLE_NAME}) are refused because unpickling can run code; opt in with "
                f"allow_pickled_adapters=True / --allow-pickled-adapters, or convert it to {SAFETENSORS_NAME}"
            )
    return config


# Exponent bits of half-precision floats: all ones means Inf or NaN. Checking them on an int16 view is
# several times faster on CPU than torch.isfinite, which has no fast half-precision path there.
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _all_finite(t: torch.Tensor) -> bool:
    mask = _EXP_MASK.get(t.dtype)
    if mask is None:
        return bool(torch.isfinite(t).all())
    return not bool(((t.view(torch.int16) & mask) == mask).any())


def _module_weights(config, tensors, module_path, target, slice_idx, kinds, max_lora_rank, dtype, fail):
    """Validate one module's A/B pair against the base model and the config -> (A, B, scaling)."""
    missing = [k for k in ("lora_A", "lora_B") if k not in kinds]
    if missing:
        raise fail(f"module {module_path!r} has {', '.join(kinds)} but no {missing[0]} (incomplete A/B pair)")
    a_key, b_key = kinds["lora_A"], kinds["lora_B"]
    a, b = tensors[a_key], tensors[b_key]
    for key, t in ((a_key, a), (b_key, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise fail(f"tensor {key!r} must be a 2-D matrix, got {shape}")
        if not t.is_floating_point():
            raise fail(f"tensor {key!r} has dtype {t.dtype}; LoRA weights must be floating point")
    rank, rank_b = a.shape[0], b.shape[1]
    if rank != rank_b:
        raise fail(f"rank mismatch for {module_path!r}: lora_A has rank {rank}, lora_B has rank {rank_b}")
    in_f, out_f = target.in_features, target.out_features[slice_idx]
    if a.shape[1] != in_f:
        raise fail(
            f"tensor {a_key!r} does not fit the base model: expected [{rank}, {in_f}], got {list(a.shape)}"
        )
    if b.shape[0] != out_f:
        raise fail(
            f"tensor {b_key!r} does not fit the base model: expected [{out_f}, {rank}], got {list(b.shape)}"
        )
    if rank < 1:
        raise fail(f"module {module_path!r} has rank 0")
    if rank > max_lora_rank:
        raise fail(f"module {module_path!r} has rank {rank}, above max_lora_rank={max_lora_rank}")
    if not is_targeted(config, module_path):
        raise fail(
            f"the weights hold module {module_path!r}, which the config's target_modules / "
            "exclude_modules / layers_to_transform do not select (config and weights disagree)"
        )
    want_r, alpha = rank_and_alpha(config, module_path)
    if rank != want_r:
        raise fail(f"module {module_path!r} has rank {rank} in its tensors but the config implies r={want_r}")
    a, b = a.to(dtype=dtype, device="cpu").contiguous(), b.to(dtype=dtype, device="cpu").contiguous()
    for key, t in ((a_key, a), (b_key, b)):
        if not _all_finite(t):
            raise fail(f"tensor {key!r} holds NaN or Inf values (in {dtype})")
    return a, b, float(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)


def _read_tensors(folder: Path, fail) -> dict[str, Any]:
    """The weights file that ``check_adapter_config`` found and allowed: safetensors, else the pickle."""
    st_file, bin_file = folder / SAFETENSORS_NAME, folder / PICKLE_NAME
    if st_file.is_file():
        try:
            return load_file(str(st_file), device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise fail(f"corrupt {SAFETENSORS_NAME}: {e}") from e
    try:
        state = torch.load(str(bin_file), weights_only=True, map_location="cpu")
    except Exception as e:  # any unpickling failure means the file is unusable
        raise fail(f"corrupt {PICKLE_NAME}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise fail(f"corrupt {PICKLE_NAME}: expected a dict of named tensors")
    return state


def _parse_keys(tensors: dict[str, Any], spec: LoRAModelSpec, fail) -> dict[str, tuple]:
    """Map every tensor key to (layer, target, slice index) of its module; refuse any other key."""
    supported = ", ".join(spec.module_names)
    layer_re = re.compile(rf"^{re.escape(spec.layers_prefix)}\.(\d+)\.(.+)$")
    pairs: dict[str, tuple] = {}
    for key in tensors:
        if not key.startswith(_PEFT_PREFIX):
            raise fail(
                f"tensor {key!r} is not a recognised PEFT LoRA key ({_PEFT_PREFIX}<module>.lora_A|lora_B.weight)"
            )
        name = key[len(_PEFT_PREFIX) :]
        for prefix, reason in spec.refused_prefixes:
            if name == prefix or name.startswith(prefix + "."):
                raise fail(f"LoRA on {prefix!r} ({reason}) is not supported (tensor {key!r})")
        embeds = [p for p in name.split(".") if p in EMBEDDING_NAMES or p.startswith("lora_embedding_")]
        if embeds:
            raise fail(f"LoRA on embeddings / lm_head ({embeds[0]}) is not supported yet (tensor {key!r})")
        if ".lora_magnitude_vector" in name:
            raise fail(f"DoRA is not supported (tensor {key!r})")
        m = _KEY_RE.match(name)
        if m is None:
            raise fail(
                f"tensor {key!r} is not a recognised PEFT LoRA key ({_PEFT_PREFIX}<module>.lora_A|lora_B.weight)"
            )
        module_path = m["module"]
        module = module_path.rsplit(".", 1)[-1]
        if m["param"] == "bias":
            raise fail(f"a bias on {m['kind']} (lora_bias) is not supported (tensor {key!r})")
        lm = layer_re.match(module_path)
        found = spec.find_slice(module)
        if found is None:
            raise fail(
                f"target module {module!r} is not supported by this model (tensor {key!r}); supported: {supported}"
            )
        if lm is None:
            raise fail(
                f"tensor {key!r} is outside the decoder layers ({spec.layers_prefix}.<i>); not supported"
            )
        layer, rest = int(lm[1]), lm[2]
        expected = f"{spec.module_parents.get(module, '<parent>')}.{module}"
        if rest != expected:
            raise fail(
                f"tensor {key!r} is not a recognised module path (expected ...{spec.layers_prefix}.{layer}.{expected})"
            )
        if layer >= spec.num_layers:
            raise fail(f"tensor {key!r} is for layer {layer} but the base model has {spec.num_layers} layers")
        target, slice_idx = found
        kinds = pairs.setdefault(module_path, (layer, target, slice_idx, {}))[3]
        if m["kind"] in kinds:
            raise fail(f"module {module_path!r} has two {m['kind']} tensors ({kinds[m['kind']]!r}, {key!r})")
        kinds[m["kind"]] = key
    return pairs


def _warn_untouched(config: dict, spec: LoRAModelSpec, pairs: dict, where: str) -> None:
    """Modules the config selects but the file lacks keep PEFT's init (a zero B by default): no delta."""
    if not config.get("target_modules"):
        return
    every = (
        f"{spec.layers_prefix}.{i}.{spec.module_parents[m]}.{m}"
        for i in range(spec.num_layers)
        for m in spec.module_names
        if m in spec.module_parents
    )
    missing = [k for k in every if k not in pairs and is_targeted(config, k)]
    if missing:
        logger.warning(
            "LoRA adapter %r: config selects %d module(s) with no weights, e.g. %s; they get no delta",
            where, len(missing), missing[0],
        )  # fmt: skip
