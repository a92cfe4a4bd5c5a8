"""Random PEFT LoRA adapters for a preset's shapes, written to disk without building any model.

``write_random_adapters("mistral-7b-v0.3", out, n=32, ranks=[8, 16])`` writes ``out/lora-0000`` ...
each an ordinary PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<the model class's lora_layers_prefix>.{i}.{self_attn|mlp}.{q_proj..down_proj}.lora_{A|B}.weight``), loaded
by mmlora through its normal path. Only the config's shapes are used.

Host memory and disk: a rank-16 Mistral-7B adapter on all seven projections is ~84 MB in bf16, so 1000
distinct ones would be ~84 GB. ``distinct`` caps how many different weight files are made per rank
(default 16); further adapters hard-link (or, where links fail, symlink) one of those files into their
own folder under their own name. They are distinct adapters to the engine (own name, host-cache entry
and GPU slot, so the batch reads their bytes separately), but not distinct weights; say so when reporting.

CLI: ``python -m mmlora.bench adapters --preset mistral-7b-v0.3 --num 8 --ranks 8 16 --out DIR``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mmlora.bench.cli import make_parser, progress
from mmlora.models.arch_config import ArchConfig
from mmlora.models.registry import model_class_for

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_SEVEN = ATTN + MLP
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each of the seven projections of a Llama-family decoder layer."""
    cfg = ArchConfig.from_hf(hf_config)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_nbytes(hf_config: Any, rank: int, dtype: torch.dtype = torch.bfloat16, targets=ALL_SEVEN) -> int:
    """Bytes of one adapter's A and B over every layer (what a decode step reads for it)."""
    cfg = ArchConfig.from_hf(hf_config)
    shapes = projection_shapes(hf_config)
    per_layer = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    return per_layer * cfg.num_hidden_layers * torch.tensor([], dtype=dtype).element_size()


def _config_of(model: str | Any) -> Any:
    if not isinstance(model, str):
        return model
    from mmlora.models.presets import preset_config

    return preset_config(model.removeprefix("dummy:"))


def _weights(hf_config: Any, rank: int, targets: tuple[str, ...], dtype: torch.dtype, seed: int) -> dict:
    cfg = ArchConfig.from_hf(hf_config)
    shapes = projection_shapes(hf_config)
    model_class = model_class_for(hf_config)  # its facts name the layers (e.g. Qwen2-VL's language_model)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for t in targets:
            fin, fout = shapes[t]
            parent = model_class.lora_module_parents[t]
            key = f"base_model.model.{model_class.lora_layers_prefix}.{i}.{parent}.{t}"
            # A like PEFT's kaiming-uniform scale, B small and non-zero: a visible but modest delta.
            out[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) / fin**0.5).to(dtype)
            out[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * 0.01).to(dtype)
    return out


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(src.resolve(), dst)


def write_random_adapters(
    model: str | Any,
    out_dir: str | os.PathLike,
    num: int,
    ranks: list[int] | tuple[int, ...] = (16,),
    *,
    targets: tuple[str, ...] = ALL_SEVEN,
    dtype: str | torch.dtype = "bfloat16",
    distinct: int = 16,
    seed: int = 0,
    prefix: str = "lora-",
) -> list[dict[str, Any]]:
    """Write ``num`` adapters (ranks cycle through ``ranks``); returns [{name, path, rank, weights_file}].

    ``model`` is a preset name (``"mistral-7b-v0.3"`` or ``"dummy:mistral-7b-v0.3"``) or an HF config.
    At most ``distinct`` different weight files per rank are generated; the rest are links (see module doc).
    """
    if num < 1:
        raise ValueError(f"num: must be >= 1, got {num}")
    if not ranks or any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"ranks: must be positive integers, got {ranks!r}")
    if distinct < 1:
        raise ValueError(f"distinct: must be >= 1, got {distinct}")
    unknown = [t for t in targets if t not in ALL_SEVEN]
    if unknown:
        raise ValueError(f"targets: unknown projections {unknown}; choose from {list(ALL_SEVEN)}")
    torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    hf_config = _config_of(model)
    from safetensors.torch import save_file

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    made: dict[tuple[int, int], Path] = {}
    result = []
    for k in progress(range(num), "adapters"):
        rank = ranks[k % len(ranks)]
        name = f"{prefix}{k:04d}"
        folder = root / name
        folder.mkdir(exist_ok=True)
        weights = folder / "adapter_model.safetensors"
        if weights.exists() or weights.is_symlink():
            weights.unlink()
        variant = (k // len(ranks)) % distinct
        src = made.get((rank, variant))
        if src is None:
            save_file(_weights(hf_config, rank, targets, torch_dtype, seed + 7919 * k), str(weights))
            made[(rank, variant)] = weights
        else:
            _link(src, weights)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model) if isinstance(model, str) else "config",
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "target_modules": list(targets),
            "bias": "none",
            "use_rslora": False,
            "fan_in_fan_out": False,
            "inference_mode": True,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
        result.append({"name": name, "path": str(folder), "rank": rank, "weights_file": str(src or weights)})
    return result


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = make_parser("python -m mmlora.bench adapters", __doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="preset name, e.g. mistral-7b-v0.3 or tiny-llama")
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--targets", nargs="+", default=list(ALL_SEVEN))
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--distinct", type=int, default=16, help="distinct weight files per rank; the rest link")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    made = write_random_adapters(
        args.preset, args.out, args.num, args.ranks, targets=tuple(args.targets), dtype=args.dtype,
        distinct=args.distinct, seed=args.seed,
    )  # fmt: skip
    files = len({m["weights_file"] for m in made})
    print(f"wrote {len(made)} adapters ({files} distinct weight files) under {args.out}")
    return made
