"""Engine configuration: frozen, documented dataclasses composed into one ``EngineConfig``.

Every field carries its help text in ``metadata["help"]``; the command line of the server and the app
is generated from these dataclasses (``add_cli_args`` / ``from_cli_args``), so a new option is added
in exactly one place. Unknown keyword arguments are errors that list the known ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line naming the option and the problem."""


def _f(default: Any, help: str, **extra: Any) -> Any:
    meta = {"help": help, **extra}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f(
        "smollm2",
        '"smollm2" (the embedded default), a Hugging Face Hub id "org/name", a HF checkpoint folder, a '
        '.gguf file, or "dummy:<preset>".',
        aliases=["--model-path"],
    )
    revision: str | None = _f(
        None, "Hub revision (branch, tag or commit) of a model given by hub id; defaults to main."
    )
    download_dir: str | None = _f(
        None,
        "Hub cache folder for models, tokenizers and adapters given by hub id; defaults to huggingface_hub's "
        "(HF_HUB_CACHE, else HF_HOME/hub).",
    )
    gguf_file: str | None = _f(
        None, "The .gguf file to load inside the model's hub repo or folder (as transformers' gguf_file)."
    )
    tokenizer: str | None = _f(
        None,
        'Tokenizer folder, GGUF file or hub id "org/name[@revision]"; defaults to the model\'s.',
        aliases=["--tokenizer-path"],
    )
    dtype: str = _f("auto", 'Weight and activation dtype: "auto", "float32", "float16" or "bfloat16".')
    device: str = _f("auto", 'Torch device: "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1".')
    seed: int = _f(
        0, "Seed for random (dummy) weights and the default sampling generator.", aliases=["--random-seed"]
    )
    served_model_name: str | None = _f(
        None, "Name of the base model in the OpenAI API; defaults to the model path."
    )
    max_model_len: int | None = _f(
        None, "Longest prompt + output in tokens; defaults to the model's context length."
    )
    weight_layout: str = _f(
        "row-major",
        'Layout of the base linears\' weights on CUDA: "row-major" (as checkpoints store them) or '
        '"column-major" (each a view of its contiguous transpose, same values; tied weights stay row-major). '
        "An experiment: on an H100, decode-shape GEMMs took 0.93-1.01x as long column-major, and issue 13's "
        "serving run gained 0.5% base-only with unchanged adapter ratios (benchmarks/results, session 32); "
        "on an H200, decode graphs at B=32-72 were 1-4% faster but at B=128 7.6-10.9% slower, and serving "
        "2.2% slower base-only (session 33).",
    )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "Tokens per KV-cache page.")
    mem_fraction_static: float = _f(
        0.85, "On GPU: fraction of device memory for weights, adapter slots and KV pages together."
    )
    max_kv_tokens: int | None = _f(
        None, "Cap on KV-cache tokens (pages x block size); on CPU the default is 32768."
    )
    disable_radix: bool = _f(
        False,
        "Turn the prefix cache off (KV pages reused across requests with the same adapter and prefix).",
        negated_aliases=["--enable-prefix-caching"],
    )


@dataclass(frozen=True)
class LoRAConfig:
    lora_paths: list[str] = _f(
        [],
        'Adapters registered at start: "name=path" or a bare path (then the path is the name); a path may '
        'be a hub id "org/name[@revision]", downloaded once into the hub cache.',
        nargs="*",
    )
    max_loras_per_batch: int = _f(8, "GPU slots for adapters: the most distinct adapters in one batch.")
    max_lora_rank: int = _f(64, "Largest adapter rank the slots hold; bigger adapters are refused.")
    lora_page_rank: int | None = _f(
        None,
        "Page the adapter pool by this many ranks (a divisor of max_lora_rank, e.g. 16): an adapter takes "
        "the pages its rank needs (rounded up to a power of two) out of the pool's max_loras_per_batch x "
        "max_lora_rank, so adapters of smaller ranks leave room for more in a batch, and one of at most "
        "that rank reads one contiguous page. max_lora_rank: a max_lora_rank slot each (unpaged). None "
        "(default): 16 on CUDA when max_lora_rank is 16 times a power of two above one (32, 64, ...; on "
        "an H200 rank-16 adapters then run the LoRA kernels of a rank-16 pool), else unpaged.",
    )
    max_loaded_loras: int | None = _f(
        None, "Adapters kept in the host cache (LRU beyond it); defaults to unlimited."
    )
    lora_backend: str = _f(
        "auto",
        'LoRA kernel backend: "auto" (triton-auto on CUDA, torch-gather otherwise) or one of '
        "mmlora.backends.available_backends().",
    )
    disable_lora_overlap: bool = _f(
        False,
        "On CUDA, run each LoRA module's shrink on the main stream after the base GEMM instead of on a "
        "second stream alongside it (both read the module's input).",
    )
    lora_side_max_tokens: int = _f(
        32,
        "On CUDA with the second stream on: in decode batches of at most this many rows, one row per "
        "segment, each module's whole LoRA (shrink, then expand into a zeroed buffer) runs on the second "
        "stream beside the base GEMM and the main stream adds the buffer to the base output, instead of "
        "only the shrink running there. H200, Mistral-7B, 32 adapters: decode graph replay 0.96x at 32 "
        "rows; 1.06x at 128 rows on 128 adapters, and 1.06-1.15x for segment (SGMV) batches, so those "
        "never take it. 0: never.",
    )
    disable_async_uploads: bool = _f(
        False,
        "On CUDA, load adapters into slots on the main stream, the step waiting for the copies, instead "
        "of on a stream of their own while requests whose adapters are resident run.",
    )
    cpu_fused_lora: bool = _f(
        True,
        "On CPU (torch-gather, fp32 or native bf16), run each LoRA module's base GEMM and its adapters' "
        "shrink as one packed matmul (the C panel GEMM, else oneDNN's) over the base weight with every "
        "slot's live rank rows of A stacked "
        "under it (one packed copy: it replaces the base layer's own). On issue 21's 2-core CPU a decode "
        "forward with adapters is 6-12% faster, one without adapters 2-6% slower (it computes the stacked "
        "columns too), and each slot load repacks the modules' weights (about 90 ms for SmolLM2 in fp32).",
    )
    lora_stage_slots: int | None = _f(
        None,
        "On CUDA, decode graphs whose adapters fit this many stage positions take the LoRA shrink from the "
        "base GEMM: each LoRA module's weight gets the positions' A rows stacked under it (mmlora.lora.stage; "
        "adapters are copied in as they enter a batch), so a decode step runs one expand a module instead "
        "of a shrink and an expand. A position holds one adapter of an unpaged pool, or one page "
        "(lora_page_rank ranks) of a paged one, where an adapter takes its slot's pages (CUDA's default "
        "rank-64 pool paged by 16: one for ranks up to 16, four for 64). A step's GEMM reads the first quarter, "
        "half or all of them, the narrowest that can hold its batch's adapters (they are placed there, an "
        "adapter staged further out copied again), and they take GPU memory from the KV cache (Mistral-7B: "
        "40 MB a rank-16 position; on an 80 GB card beside a 128-slot rank-64 pool, an engine with 80 "
        "positions decoded issue 23's base-only run in batches of 49 requests against 73; start-up warns past "
        "a tenth of the KV cache's bytes). One device only. 0: off. None (auto): 32 positions (at most one a "
        "pool page) on one CUDA device with decode CUDA graphs and a backend that has a staged expand, where "
        "they take at most 5% of the memory the KV cache would have without them (or, with max_kv_tokens, fit "
        "in what the capped cache leaves); else off.",
    )
    allow_pickled_adapters: bool = _f(
        False, "Accept adapter_model.bin (read with torch.load(weights_only=True)); safetensors otherwise."
    )
    allow_hub_adapters: bool = _f(
        False,
        "Let adapters loaded at run time (/load_lora_adapter) be hub ids: the server then downloads on "
        "request (off the engine thread). Start-up adapters may always be hub ids.",
    )


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = _f(64, "Most requests decoding at once.")
    max_num_batched_tokens: int = _f(2048, "Token budget of one forward (prefill chunks + decode tokens).")
    max_queued_requests: int = _f(4096, "Waiting requests beyond which new ones are refused.")
    disable_cuda_graph: bool = _f(False, "Run decode steps eagerly instead of replaying CUDA graphs.")
    disable_mixed_cuda_graph: bool = _f(
        False,
        "Run prefill and mixed steps eagerly instead of replaying CUDA graphs captured per token bucket "
        "(mmlora.engine.mixed_graph: CUDA, the triton attention backend, triton-sgmv or triton-auto, a text "
        "model, one process; other engines run them eagerly anyway). On the H200 the graphs lifted 32 "
        "adapters from 0.67-0.78x to 0.81x base-only tok/s and cost about 1 GB of graph memory at 4096 "
        "tokens a step.",
        negated_aliases=["--enable-mixed-cuda-graph"],
    )
    disable_cpu_graph: bool = _f(
        False,
        "On CPU, run decode steps eagerly instead of replaying their recorded C kernel calls "
        "(mmlora.engine.cpu_graph).",
    )
    schedule_policy: str = _f(
        "fcfs",
        'Admission order: "fcfs" (arrival order) or "vtc" (the Virtual Token Counter: the least-served '
        "client first, where a client is a request's client_id / OpenAI user, else its adapter).",
    )
    vtc_prefill_weight: float = _f(1.0, "VTC: service charged per prompt token admitted.")
    vtc_decode_weight: float = _f(2.0, "VTC: service charged per generated token.")
    max_running_per_client: int = _f(0, "Most running requests per client (0: no limit).")
    max_queued_per_client: int = _f(
        0, "Most waiting requests per client; more are refused with 429 (0: no limit)."
    )
    client_limits_file: str | None = _f(
        None, 'JSON file of per-client limits: {"client": {"max_running": n, "max_queued": m}, ...}.'
    )
    attention_backend: str = _f(
        "auto", 'Attention kernels: "auto" (triton on CUDA, torch otherwise), "torch", "triton".'
    )
    overlap_schedule: str = _f(
        "auto",
        'Schedule and launch step N+1 while the device runs step N (the overlap scheduler): "auto" (on '
        'for CUDA with tp_size 1), "on" (also on CPU: the same outputs, no gain), "off" (serial steps).',
    )


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = _f(
        1,
        "Tensor-parallel ranks (one process and device each; rank 0 schedules and serves). CUDA ranks "
        "use cuda:0..tp_size-1 with NCCL; CPU ranks use gloo.",
        aliases=["--tensor-parallel-size"],
    )
    dist_timeout_s: float = _f(
        120.0, "Seconds a tensor-parallel collective may wait for a rank before the engine fails."
    )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        lora, sched, cache = self.lora, self.scheduler, self.cache
        _check(lora.max_loras_per_batch >= 1, "max_loras_per_batch", "must be >= 1")
        _check(lora.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        _check(
            lora.lora_page_rank is None
            or (lora.lora_page_rank >= 1 and lora.max_lora_rank % lora.lora_page_rank == 0),
            "lora_page_rank",
            f"must be a divisor of max_lora_rank ({lora.max_lora_rank}), or None",
        )
        _check(
            lora.max_loaded_loras is None or lora.max_loaded_loras >= lora.max_loras_per_batch,
            "max_loaded_loras",
            f"must be >= max_loras_per_batch ({lora.max_loras_per_batch})",
        )
        _check(lora.lora_side_max_tokens >= 0, "lora_side_max_tokens", "must be >= 0")
        _check(
            lora.lora_stage_slots is None or lora.lora_stage_slots >= 0,
            "lora_stage_slots",
            "must be >= 0 or None",
        )
        _check(cache.block_size >= 1, "block_size", "must be >= 1")
        mml = self.model.max_model_len
        _check(mml is None or mml >= 2, "max_model_len", "must be >= 2 (a prompt token and one to generate)")
        _check(self.parallel.tp_size >= 1, "tp_size", "must be >= 1")
        _check(self.parallel.dist_timeout_s > 0, "dist_timeout_s", "must be > 0")
        _check(0.0 < cache.mem_fraction_static <= 1.0, "mem_fraction_static", "must be in (0, 1]")
        _check(sched.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        _check(sched.max_num_batched_tokens >= 16, "max_num_batched_tokens", "must be >= 16")
        _check(sched.schedule_policy in ("fcfs", "vtc"), "schedule_policy", 'must be "fcfs" or "vtc"')
        _check(
            sched.vtc_prefill_weight > 0 and sched.vtc_decode_weight > 0,
            "vtc_prefill_weight / vtc_decode_weight",
            "must be > 0",
        )
        _check(sched.max_running_per_client >= 0, "max_running_per_client", "must be >= 0")
        _check(
            sched.overlap_schedule in ("auto", "on", "off"),
            "overlap_schedule",
            'must be "auto", "on" or "off"',
        )
        _check(
            sched.overlap_schedule != "on" or self.parallel.tp_size == 1,
            "overlap_schedule",
            "\"on\" needs tp_size 1 (the workers take each step's token ids from rank 0's host)",
        )
        _check(sched.max_queued_per_client >= 0, "max_queued_per_client", "must be >= 0")
        _check(
            self.model.dtype in ("auto", "float32", "float16", "bfloat16"),
            "dtype",
            f"unknown {self.model.dtype!r}",
        )
        _check(
            self.model.weight_layout in ("row-major", "column-major"),
            "weight_layout",
            f'must be "row-major" or "column-major", got {self.model.weight_layout!r}',
        )
        gguf = self.model.gguf_file
        _check(gguf is None or gguf.endswith(".gguf"), "gguf_file", f"{gguf!r} is not a .gguf file name")
        _check(
            gguf is None or not self.model.model.endswith(".gguf"),
            "gguf_file",
            "give either --model <file>.gguf or --model <repo or folder> --gguf-file <name>.gguf",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``max_loras_per_batch=4, device="cpu"``)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            section = _FIELD_SECTION.get(key)
            if section is None:
                raise TypeError(
                    f"unknown engine option {key!r}; known options: {', '.join(sorted(_FIELD_SECTION))}"
                )
            parts[section][key] = value
        if "lora_paths" in parts["lora"]:
            parts["lora"]["lora_paths"] = normalize_lora_paths(parts["lora"]["lora_paths"])
        return cls(**{name: _SECTIONS[name](**values) for name, values in parts.items()})

    def replace(self, **kwargs: Any) -> EngineConfig:
        flat = {
            f.name: getattr(getattr(self, s), f.name)
            for s, c in _SECTIONS.items()
            for f in dataclasses.fields(c)
        }
        flat.update(kwargs)
        return EngineConfig.from_kwargs(**flat)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "lora": LoRAConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
}
_FIELD_SECTION = {f.name: s for s, c in _SECTIONS.items() for f in dataclasses.fields(c)}


def normalize_lora_paths(lora_paths: Any) -> list[str]:
    """Accept ``{name: path}``, ``["name=path", "path"]`` or one string; return ``["name=path", ...]``."""
    if lora_paths is None:
        return []
    if isinstance(lora_paths, str):
        lora_paths = [lora_paths]
    if isinstance(lora_paths, dict):
        return [f"{name}={path}" for name, path in lora_paths.items()]
    out = []
    for item in lora_paths:
        if not isinstance(item, str) or not item:
            raise ValueError(f"lora_paths: each entry must be a non-empty string, got {item!r}")
        out.append(item)
    return out


def split_lora_spec(spec: str) -> tuple[str, str]:
    """``"name=path"`` -> (name, path); a bare path is its own name."""
    name, sep, path = spec.partition("=")
    if sep and name and path:
        return name, path
    return spec, spec


# ---- command line generated from the dataclasses -------------------------------------------------


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_cli_args(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Add one ``--flag`` per dataclass field (underscores become dashes)."""
    for cls in classes:
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group(cls.__name__)
        for f in dataclasses.fields(cls):
            tp, _ = _unwrap_optional(hints[f.name])
            flags = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", [])]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            # argparse %-formats help strings: a documented "6-12%" must reach it as "%%".
            help_text = f.metadata.get("help", "").replace("%", "%%")
            kwargs: dict[str, Any] = {"dest": f.name, "help": help_text, "default": default}
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
                for alias in f.metadata.get("negated_aliases", []):  # another spelling of the opposite
                    opposite = dict(dest=f.name, default=argparse.SUPPRESS, help=f"inverse of {flags[0]}")
                    group.add_argument(alias, action="store_false", **opposite)
                    group.add_argument(f"--no-{alias[2:]}", action="store_true", **opposite)
            elif get_origin(tp) is list:
                kwargs["nargs"] = f.metadata.get("nargs", "*")
                kwargs["type"] = get_args(tp)[0]
            else:
                kwargs["type"] = tp
            group.add_argument(*flags, **kwargs)


def from_cli_args(args: argparse.Namespace, cls: type) -> Any:
    """Instantiate one dataclass from the parsed flags of its fields."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def engine_config_from_cli(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: from_cli_args(args, cls) for name, cls in _SECTIONS.items()})


ENGINE_SECTIONS: tuple[type, ...] = tuple(_SECTIONS.values())
