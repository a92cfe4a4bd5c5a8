"""An adapter's ``adapter_config.json``: read it, refuse what cannot be served exactly, and answer which
modules it targets and with what rank and alpha, as PEFT would.

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
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmlora.lora.spec import LoRAModelSpec

CONFIG_NAME = "adapter_config.json"
MAX_CONFIG_RANK = 65536  # r and rank_pattern values; the tensors are checked against max_lora_rank too
MAX_LORA_ALPHA = 1e6  # lora_alpha and alpha_pattern values: scaling alpha / r stays far from overflow
#: How the checks report a problem: the caller's function that wraps it into its own error (naming the adapter).
Fail = Callable[[str], Exception]
EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "wpe", "word_embeddings", "embed_in", "embed_out")
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


def read_config(file: Path, fail: Fail) -> dict:
    """The config file's JSON object (a clear refusal if it is missing, not JSON or not an object)."""
    if not file.is_file():
        raise fail(f"missing {CONFIG_NAME}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"corrupt {CONFIG_NAME}: {e}") from e
    if not isinstance(config, dict):
        raise fail(f"corrupt {CONFIG_NAME}: expected a JSON object, got {type(config).__name__}")
    return config


def check_config(config: dict, fail: Fail) -> None:
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


def check_target_names(config: dict, spec: LoRAModelSpec, fail: Fail) -> None:
    """A target_modules list may only name modules this model takes LoRA on."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return
    names = [t.rsplit(".", 1)[-1] for t in targets]
    embeds = [n for n in names if n in EMBEDDING_NAMES]
    if embeds:
        raise fail(f"LoRA on embeddings / lm_head ({', '.join(embeds)}) is not supported yet")
    bad = [t for t, n in zip(targets, names) if n not in spec.module_names and t != "all-linear"]
    if bad:
        raise fail(
            f"target_modules {bad} cannot take LoRA on this model; supported: {', '.join(spec.module_names)}"
        )


def is_targeted(config: dict, key: str) -> bool:
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


def rank_and_alpha(config: dict, key: str) -> tuple[int, float]:
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


def _compile(pattern: str, field: str, fail: Fail) -> None:
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
