"""Building an engine's parts: device and dtype, model and weights, LoRA pool, KV cache sized to memory."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mmlora.config import EngineConfig
from mmlora.distributed.state import all_reduce_min, tp_group
from mmlora.distributed.step import set_comm_device
from mmlora.engine.cpu_decode import auto_cpu_dtype
from mmlora.forward.device_memory import release_cached_memory
from mmlora.hub import resolve_lora_config, resolve_model_source, resolve_tokenizer
from mmlora.kvcache.allocator import KVCache
from mmlora.layers.attention import AttentionBackend, get_attention_backend
from mmlora.layers.packed_linear import set_weight_layout
from mmlora.lora.manager import LoRAManager
from mmlora.models.base import CausalLM
from mmlora.models.loader import ModelSource, iter_weights, load_config, load_tokenizer
from mmlora.models.registry import model_class_for
from mmlora.multimodal.prompt import ImagePrompts

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 32768
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    source: ModelSource
    hf_config: Any
    tokenizer: Any
    model: CausalLM
    lora: LoRAManager
    kv_cache: KVCache
    attention: AttentionBackend
    max_model_len: int
    eos_ids: set[int]
    multimodal: ImagePrompts | None  # a vision-language model's request work


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but CUDA is not available here")
    return device


def rank_device(name: str, rank: int) -> torch.device:
    """The device of tensor-parallel ``rank``: cuda:<rank> on CUDA (one GPU per rank), else the CPU."""
    device = resolve_device(name)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return auto_cpu_dtype()
    configured = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    return configured if configured in (torch.float16, torch.bfloat16) else torch.bfloat16


def build_engine_parts(config: EngineConfig) -> EngineParts:
    mc = config.model
    tp = tp_group()
    device = rank_device(mc.device, tp.rank) if tp.is_parallel else resolve_device(mc.device)
    set_comm_device(device)
    # Every hub id is resolved (and downloaded) before the weights are read: a bad id fails fast.
    source = resolve_model_source(mc)
    tokenizer_path = resolve_tokenizer(mc)
    if tp.rank > 0:  # adapters are read and validated on rank 0, which sends each worker its shards
        lora_config = dataclasses.replace(config.lora, lora_paths=[])
    else:
        lora_config = resolve_lora_config(config.lora, mc.download_dir)
    logger.info("loading %s ...", source.name)
    hf_config = load_config(source)
    cls = model_class_for(hf_config)
    dtype = resolve_dtype(mc.dtype, device, hf_config)
    tokenizer = load_tokenizer(source, tokenizer_path)
    torch.manual_seed(mc.seed)
    # Checkpoint weights overwrite every parameter (load_weights checks it), so their random
    # initialisation is skipped: 1 s of SmolLM2's CPU build. Dummy weights start from it.
    skip_init = _no_init_weights() if source.kind != "dummy" else contextlib.nullcontext()
    # Made in the serving dtype: made in fp32 and then cast, a bf16 7B model's start-up peaked at twice its
    # bf16 bytes (more than a 24 GB card holds). The cast stays for what a model makes explicitly in fp32.
    with torch.device(device), skip_init, _default_dtype(dtype):
        model = cls(hf_config).to(dtype)
    limit = model.arch.max_position_embeddings
    if mc.max_model_len is not None and mc.max_model_len > limit:
        # Refused before the weights load: the RoPE tables stop there, so a longer context would
        # fail every request that reaches it.
        raise ValueError(
            f"max_model_len: {mc.max_model_len} is more than the model's max_position_embeddings ({limit})"
        )
    max_model_len = mc.max_model_len or limit
    if source.kind == "dummy":
        model.init_dummy_weights(mc.seed)
    else:
        model.load_weights(iter_weights(source, hf_config))
    model.eval().requires_grad_(False)
    if mc.weight_layout == "column-major":  # before any CUDA graph holds the weights
        set_weight_layout(model, column_major=True)
    # The temporaries of loading are free now: hand their segments back, or the adapter slots are carved out
    # of them and the segments' rest stays reserved, lost to the KV cache.
    release_cached_memory(device)

    sched = config.scheduler
    max_tokens = max(sched.max_num_batched_tokens, sched.max_running_requests)
    attn0 = model.layers[0].self_attn
    per_token = KVCache.bytes_per_token(len(model.layers), attn0.num_kv_heads, attn0.head_dim, dtype)

    def stage_fits(nbytes: int) -> bool:
        return _stage_fits(config, device, per_token, max_tokens, model.arch.vocab_size, nbytes)

    lora = LoRAManager(model, lora_config, max_tokens, dtype, device, stage_fits=stage_fits)
    if device.type == "cuda":  # every LoRA kernel variant compiled now, none inside a serving step
        lora.warm_up_kernels()

    num_blocks = _plan_kv_blocks(config, device, per_token, max_tokens, model.arch.vocab_size)
    num_blocks = all_reduce_min(num_blocks, device)  # every rank pages the same blocks
    stage_bytes = lora.stage_nbytes()
    _warn_if_the_stage_crowds_the_kv_cache(
        config, stage_bytes, num_blocks * config.cache.block_size, per_token
    )
    kv_cache = KVCache(
        len(model.layers),
        num_blocks,
        config.cache.block_size,
        attn0.num_kv_heads,
        attn0.head_dim,
        dtype,
        device,
    )
    logger.info(
        "KV cache: %d tokens (%d pages of %d); adapter slots: %d x rank %d (%.1f MiB); shrink stage: %.1f MiB",
        num_blocks * config.cache.block_size,
        num_blocks,
        config.cache.block_size,
        config.lora.max_loras_per_batch,
        config.lora.max_lora_rank,
        lora.nbytes() / 2**20,
        stage_bytes / 2**20,
    )
    attention = get_attention_backend(sched.attention_backend, device)
    return EngineParts(
        device=device,
        dtype=dtype,
        source=source,
        hf_config=hf_config,
        tokenizer=tokenizer,
        model=model,
        lora=lora,
        kv_cache=kv_cache,
        attention=attention,
        max_model_len=max_model_len,
        eos_ids=_eos_ids(model.arch.eos_token_ids, tokenizer),
        multimodal=_image_prompts(model, hf_config.name_or_path),
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside the block (floating dtypes; others leave it)."""
    old = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' context that turns torch's parameter initialisers into no-ops."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def freeze_startup_objects() -> None:
    """Move every object alive now out of the cyclic collector's generations (``gc.freeze``), after a
    collection. A serving process keeps its start-up objects (modules, parameters' wrappers, imported
    libraries' state) for life, and each full collection would walk them all: its cost grows with what
    the process holds, not with what serving creates. vLLM and SGLang freeze after start-up too.
    Objects frozen here are still freed by reference counting; only cycles among them are never
    collected, so call it once the long-lived objects exist (``gc.unfreeze()`` undoes it)."""
    gc.collect()
    gc.freeze()


#: A shrink stage above this share of the KV cache's bytes is worth a warning: its memory came out of the
#: KV cache. On an 80 GB H100 beside 128 rank-64 slots, 80 positions of Mistral-7B (3.2 GB) cut the requests
#: decoded at once from 73 to 49 (benchmarks/results/h100-2026-12-06-session38); on a 141 GB H200 the same
#: engine lost none (session 37).
STAGE_KV_SHARE_WARNING = 0.1


def _warn_if_the_stage_crowds_the_kv_cache(
    config: EngineConfig, stage_bytes: int, kv_tokens: int, per_token: int
) -> None:
    kv_bytes = kv_tokens * per_token
    # Auto (None) stages only what fits (STAGE_AUTO_KV_SHARE), or memory a capped KV cache leaves unused.
    explicit = config.lora.lora_stage_slots is not None
    if explicit and stage_bytes > STAGE_KV_SHARE_WARNING * kv_bytes:
        logger.warning(
            "lora_stage_slots=%d: the shrink stage takes %.2f GiB, %.0f%% of the KV cache's %.2f GiB "
            "(%d tokens) it was taken from; fewer positions leave room for more requests at once",
            config.lora.lora_stage_slots,
            stage_bytes / 2**30,
            100 * stage_bytes / kv_bytes,
            kv_bytes / 2**30,
            kv_tokens,
        )


#: ``lora_stage_slots`` None (auto) stages where the positions take at most this share of the memory the KV
#: cache would have without them. On an 80 GB H100, issue 13's 128 rank-16 slots leave the KV cache 41 GiB:
#: 32 positions' 1.19 GiB are 2.9% of it, and the stage lifted 32 adapters from 0.841x to 0.853x of base-only
#: (benchmarks/results/h100-2026-12-06-session42); beside issue 23's 128 rank-64 slots it has 11.3 GiB, the
#: same stage is 10.5% of it, and there it cut base-only's decode batches from 73 to 60 requests
#: (h100-2026-12-06-session41).
STAGE_AUTO_KV_SHARE = 0.05


def _stage_fits(
    config: EngineConfig, device: torch.device, per_token: int, max_tokens: int, vocab: int, nbytes: int
) -> bool:
    """Whether a shrink stage of ``nbytes`` may be taken from the KV cache's memory: at most
    :data:`STAGE_AUTO_KV_SHARE` of it, or (``max_kv_tokens`` set) out of what the capped cache leaves. Never
    off CUDA or without decode CUDA graphs, the only steps that read the stage."""
    if device.type != "cuda" or config.scheduler.disable_cuda_graph:
        return False
    budget = _kv_budget_bytes(config, device, max_tokens, vocab)
    cap = config.cache.max_kv_tokens
    spare = budget - cap * per_token if cap is not None else 0
    return nbytes <= max(STAGE_AUTO_KV_SHARE * budget, spare)


def _kv_budget_bytes(config: EngineConfig, device: torch.device, max_tokens: int, vocab: int) -> int:
    """GPU memory the KV cache may take: ``mem_fraction_static`` of the device less what is in use (this
    engine's weights and adapter slots, and anything else there) and the largest forward's activations."""
    # An engine's own parts make no reference cycle, but one dropped earlier may still sit in a cycle
    # made outside it (a traceback, a wrapper of its methods): collect those first. Engine.close()
    # frees its memory whatever still references it.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Activations of the largest forward: logits in fp32 plus a margin for the hidden states.
    reserve = max_tokens * vocab * 4 + (1 << 30)
    return int(total * config.cache.mem_fraction_static) - (total - free) - reserve


def _plan_kv_blocks(
    config: EngineConfig, device: torch.device, per_token: int, max_tokens: int, vocab: int
) -> int:
    """Pages that fit: on GPU what ``mem_fraction_static`` leaves after weights and adapter slots."""
    block_size = config.cache.block_size
    if device.type == "cuda":
        tokens = _kv_budget_bytes(config, device, max_tokens, vocab) // per_token
        if tokens < block_size:
            free, total = torch.cuda.mem_get_info(device)
            raise ValueError(
                f"mem_fraction_static={config.cache.mem_fraction_static}: no room left for the KV cache: "
                f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB are in use on {device} (this "
                "engine's weights and adapter slots, plus anything else there: another engine still referenced "
                "in this process, or other processes); raise mem_fraction_static or free the device"
            )
    else:
        tokens = CPU_DEFAULT_KV_TOKENS
    if config.cache.max_kv_tokens is not None:
        tokens = min(tokens, config.cache.max_kv_tokens)
    return max(1, tokens // block_size)


def _image_prompts(model: CausalLM, folder: str | None) -> ImagePrompts | None:
    if model.arch.vision is None:
        return None
    # The checkpoint folder (the config's name_or_path) may hold the image processor's settings.
    return ImagePrompts(model.arch.vision, model.arch.vocab_size, folder)


def _eos_ids(config_eos: tuple[int, ...], tokenizer: Any) -> set[int]:
    ids = set(config_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
