"""Read and validate a PEFT LoRA checkpoint into a model-independent, in-memory form.

``load_adapter`` reads ``adapter_config.json`` and ``adapter_model.safetensors`` (or, only on request, a
pickled ``adapter_model.bin``), checks every tensor and every config field against what the base model
offers (a :class:`~mmlora.lora.spec.LoRAModelSpec`), and returns a :class:`LoadedAdapter` only when all
of it is valid: nothing partial ever reaches the adapter pool. Every refusal is an :class:`AdapterError`
whose message names the adapter path and the problem.

PEFT semantics honoured (peft/tuners/lora/{config,model,layer}.py, peft/utils/other.py):
  * a module's rank is ``rank_pattern[key]`` for the first pattern key matching its full name
    (``re.match(rf"(.*\\.)?({key})$", name)``), else ``r``; its alpha likewise from ``alpha_pattern``;
  * scaling is ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``;
  * ``target_modules`` (list: exact name or ``.name`` suffix; string: ``re.fullmatch``),
    ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern`` select the modules, as in
    ``peft.tuners.tuners_utils.check_target_module_exists``.
"""

from __future__ import annotations

import json
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

from mmlora.lora.spec import LoRAModelSpec

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_PEFT_PREFIX = "base_model.model."
MAX_CONFIG_RANK = 65536  # r and rank_pattern values; the tensors are checked against max_lora_rank too
MAX_LORA_ALPHA = 1e6  # lora_alpha and alpha_pattern values: scaling alpha / r stays far from overflow
# <module path>.lora_A[.<adapter name>].weight, as PEFT saves it (older files keep the adapter name)
_KEY_RE = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$"
)
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "wpe", "word_embeddings", "embed_in", "embed_out")
# init_lora_weights values whose adapters only work on a base model whose weights were changed at init
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# LoRA variants that change the forward (or add parameters) beyond x @ A.T @ B.T * scaling
_VARIANT_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "velora_config": "VeLoRA (velora_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}


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
    _check_target_names(config, spec, fail)

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
    config = _read_config(folder / CONFIG_NAME, fail)
    _check_config(config, fail)
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
    if not _is_targeted(config, module_path):
        raise fail(
            f"the weights hold module {module_path!r}, which the config's target_modules / "
            "exclude_modules / layers_to_transform do not select (config and weights disagree)"
        )
    want_r, alpha = _rank_and_alpha(config, module_path)
    if rank != want_r:
        raise fail(f"module {module_path!r} has rank {rank} in its tensors but the config implies r={want_r}")
    a, b = a.to(dtype=dtype, device="cpu").contiguous(), b.to(dtype=dtype, device="cpu").contiguous()
    for key, t in ((a_key, a), (b_key, b)):
        if not _all_finite(t):
            raise fail(f"tensor {key!r} holds NaN or Inf values (in {dtype})")
    return a, b, float(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)


def _read_config(file: Path, fail) -> dict:
    if not file.is_file():
        raise fail(f"missing {CONFIG_NAME}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"corrupt {CONFIG_NAME}: {e}") from e
    if not isinstance(config, dict):
        raise fail(f"corrupt {CONFIG_NAME}: expected a JSON object, got {type(config).__name__}")
    return config


def _check_config(config: dict, fail) -> None:
    """Refuse config features we cannot serve, and malformed fields, before reading any tensor."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise fail(f"unsupported peft_type {peft_type!r}; only LORA adapters are supported")
    for field, what in _VARIANT_FIELDS.items():
        if config.get(field):
            raise fail(f"{what} is not supported")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save={config['modules_to_save']!r} is not supported (only LoRA weights are)")
    if config.get("bias", "none") != "none":
        raise fail(f"bias={config['bias']!r} is not supported; only bias='none'")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise fail(
            f"init_lora_weights={init!r} adapters need the base weights changed at init; convert it with "
            "PEFT's save_pretrained(path_initial_model_for_weight_conversion=...) first"
        )
    r = config.get("r", 8)
    if not _is_rank(r):
        raise fail(f"config field r must be a positive integer (at most {MAX_CONFIG_RANK}), got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not _is_alpha(alpha):
        raise fail(
            f"config field lora_alpha must be a number, finite and in (0, {MAX_LORA_ALPHA:g}], got {alpha!r}"
        )
    for field, value_ok, what in (
        ("rank_pattern", _is_rank, f"integers in [1, {MAX_CONFIG_RANK}]"),
        ("alpha_pattern", _is_alpha, f"finite numbers in (0, {MAX_LORA_ALPHA:g}]"),
    ):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(
            isinstance(k, str) and value_ok(v) for k, v in pattern.items()
        ):
            raise fail(f"config field {field} must map module-name patterns to {what}, got {pattern!r}")
        for key in pattern:
            _compile(key, field, fail)
    for field in ("target_modules", "exclude_modules"):
        value = config.get(field)
        if isinstance(value, str):
            _compile(value, field, fail)
        elif not (value is None or _is_str_list(value)):
            raise fail(f"config field {field} must be a list of names or a regex string, got {value!r}")
    layers = config.get("layers_to_transform")
    if layers is not None and not (
        _is_int(layers) or (isinstance(layers, list) and all(_is_int(i) for i in layers))
    ):
        raise fail(f"config field layers_to_transform must be an integer or a list of them, got {layers!r}")
    pats = config.get("layers_pattern")
    if pats is not None and not (isinstance(pats, str) or _is_str_list(pats)):
        raise fail(f"config field layers_pattern must be a string or a list of them, got {pats!r}")
    # LoraConfig.__post_init__ refuses these combinations; so do we, rather than guess
    for field in ("layers_to_transform", "layers_pattern"):
        if isinstance(config.get("target_modules"), str) and config.get(field) is not None:
            raise fail(f"config field {field} cannot be used when target_modules is a regex string")
    if pats and layers is None:
        raise fail("config field layers_pattern is set but layers_to_transform is not")


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
        embeds = [p for p in name.split(".") if p in _EMBEDDING_NAMES or p.startswith("lora_embedding_")]
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


def _check_target_names(config: dict, spec: LoRAModelSpec, fail) -> None:
    """A target_modules list may only name modules this model takes LoRA on."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return
    names = [t.rsplit(".", 1)[-1] for t in targets]
    embeds = [n for n in names if n in _EMBEDDING_NAMES]
    if embeds:
        raise fail(f"LoRA on embeddings / lm_head ({', '.join(embeds)}) is not supported yet")
    bad = [t for t, n in zip(targets, names) if n not in spec.module_names and t != "all-linear"]
    if bad:
        raise fail(
            f"target_modules {bad} cannot take LoRA on this model; supported: {', '.join(spec.module_names)}"
        )


def _is_targeted(config: dict, key: str) -> bool:
    """peft.tuners.tuners_utils.check_target_module_exists, for one module's full name."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    targets = config.get("target_modules")
    if targets is None or targets == "all-linear" or (isinstance(targets, list) and "all-linear" in targets):
        return True  # PEFT resolved these from the model; the weights file is the record
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    patterns = config.get("layers_pattern")
    match = None
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    if match is None:
        return False
    idx = int(match["idx"])
    return idx == layers if isinstance(layers, int) else idx in layers


def _rank_and_alpha(config: dict, key: str) -> tuple[int, float]:
    """PEFT's LoraModel._create_and_replace: rank and alpha from the first matching pattern key."""
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r_key, a_key = _pattern_key(rank_pattern, key), _pattern_key(alpha_pattern, key)
    return rank_pattern.get(r_key, config.get("r", 8)), alpha_pattern.get(a_key, config.get("lora_alpha", 8))


def _pattern_key(patterns: dict, key: str) -> str:
    """peft.utils.other.get_pattern_key."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


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
    missing = [k for k in every if k not in pairs and _is_targeted(config, k)]
    if missing:
        logger.warning(
            "LoRA adapter %r: config selects %d module(s) with no weights, e.g. %s; they get no delta",
            where, len(missing), missing[0],
        )  # fmt: skip


def _compile(pattern: str, field: str, fail) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise fail(f"config field {field} has an invalid regex {pattern!r}: {e}") from e


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_rank(v: Any) -> bool:
    return _is_int(v) and 1 <= v <= MAX_CONFIG_RANK


def _is_alpha(v: Any) -> bool:
    """Finite and positive: NaN, Inf or 1e300 would make every output of the adapter NaN or Inf."""
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and 0 < v <= MAX_LORA_ALPHA
    )


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)
