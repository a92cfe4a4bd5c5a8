"""The Triton launches of engines at the real presets' shapes, recorded on CPU for ``cuda_compile_check.py``.

Run under ``TRITON_INTERPRET=1`` with the recorder's ``execute=False`` (kernels recorded, not run). What
a CPU process would launch differs from what the H200 launches in a few device facts; they are set to
the H200's here (:func:`as_on_h200`): bf16 dots go to the tensor cores uncast, the expands are PDL
launches, the GPU has 132 SMs (split-K sizes), and the fused ops (RMSNorm, activations, RoPE), which the
engine runs in torch on CPU, are launched at the model's shapes directly.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton_specs

#: (preset, decoder layers kept): enough layers for every per-layer variant (Gemma2 alternates sliding
#: and global attention).
CASES = (("mistral-7b-v0.3", 1), ("llama-3-8b", 1), ("qwen2-7b", 1), ("gemma2-9b", 2))
BACKENDS = ("triton-auto", "triton-sgmv", "triton-bgmv", "triton-fused")
H200_SMS = 132
#: Prompts of a mixed batch (one longer than a 256-token step, so it is chunked next to decode rows).
PROMPT_LENS = (300, 20, 70, 5, 1)


@contextmanager
def as_on_h200() -> Iterator[None]:
    """Every loaded mmlora module's device-fact helpers answer as on an H200 while this is open."""
    from mmlora.backends import triton_common
    from mmlora.layers.attention import triton_common as attention_common

    facts = {
        triton_common.dot_upcast: lambda dtype: dtype == torch.float32,
        attention_common.dot_upcast: lambda dtype: False,
        triton_common.pdl_launch: lambda device, wanted: wanted,
        triton_common.sm_count: lambda device: H200_SMS,
    }
    patched: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("mmlora") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and value in facts:
                patched.append((module, attr, value))
                setattr(module, attr, facts[value])
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


def _fused_ops(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> None:
    from mmlora.layers import fused_ops, rotary_ops

    bf16 = dict(dtype=torch.bfloat16)
    for tokens in (1, 32, 256):
        x = torch.zeros(tokens, hidden, **bf16)
        w = torch.ones(hidden, **bf16)
        for offset in (0.0, 1.0):
            fused_ops.rms_norm_triton(x, w, 1e-6, offset, None)
            fused_ops.rms_norm_triton(x, w, 1e-6, offset, x.clone())
        gate_up = torch.zeros(tokens, 2 * intermediate, **bf16)
        fused_ops.silu_and_mul_triton(gate_up)
        fused_ops.gelu_tanh_and_mul_triton(gate_up)
        q = torch.zeros(tokens, heads, head_dim, **bf16)
        k = torch.zeros(tokens, kv_heads, head_dim, **bf16)
        cos = torch.ones(tokens, head_dim, **bf16)
        rotary_ops.apply_rotary_triton(q, k, cos, torch.zeros_like(cos))
    # decode attention at every split count the engine picks (1 up to 32, with the context length)
    from mmlora.layers.attention.triton_decode import decode_attention

    page, seqs = 16, 4
    cache = torch.zeros(seqs * 2, page, kv_heads, head_dim, **bf16)
    tables = torch.arange(seqs * 2, dtype=torch.int32).view(seqs, 2)
    lens = torch.full((seqs,), 2 * page, dtype=torch.int32)
    q = torch.zeros(seqs, heads, head_dim, **bf16)
    for splits in (1, 2, 3, 4, 8, 16, 32):
        for window, softcap in ((None, None), (4096, 50.0)):
            out = torch.zeros_like(q)
            decode_attention(
                q, cache, cache, tables, lens, out, seqs, splits, head_dim**-0.5, window, softcap
            )


def _engine_steps(preset: str, adapters: dict[str, str], backend: str) -> None:
    import mmlora
    from mmlora.engine.cuda_graph import CudaGraphRunner
    from mmlora.forward import stage_policy

    # The shrink stage is explicit here: on CUDA it is on by default (lora_stage_slots auto), on CPU it is not.
    # Backends without a staged expand leave it off (with a warning).
    engine = mmlora.Engine(
        model=f"dummy:{preset}", lora_paths=adapters, lora_backend=backend, attention_backend="triton",
        device="cpu", dtype="bfloat16", max_lora_rank=64, max_loras_per_batch=4, max_running_requests=8,
        max_num_batched_tokens=256, max_kv_tokens=4096, max_model_len=1024, lora_stage_slots=16,
    )  # fmt: skip
    saved = dict(stage_policy.SETTINGS)
    try:
        with as_on_h200():
            engine.lora.warm_up_kernels()
            runner = engine.runner
            names = [*adapters, None]
            prompts = [[(11 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
            # eager steps, then decode steps through the graph runner's buffers and routing (the backend's
            # own layouts, then the staged ones), then prefill and mixed steps through the mixed-step
            # runner's (no capture on CPU: the same launches)
            for mode in ("eager", "decode graphs", "staged decode graphs", "mixed graphs"):
                runner.decode_graphs = runner.mixed_graphs = None
                if mode == "staged decode graphs" and engine.lora.stage is None:
                    continue
                # Every decode step that fits takes the stage in its mode, none in the others.
                staged = mode == "staged decode graphs"
                stage_policy.SETTINGS.update(
                    min_fill=0.0, min_rows_per_adapter=0.0 if staged else float("inf")
                )
                if mode != "eager":
                    runner.decode_graphs = CudaGraphRunner(runner, 8, engine.max_model_len, capture=False)
                if mode == "mixed graphs":
                    if not engine.lora.mixed_graphs:
                        continue
                    runner.enable_mixed_graphs(256, 8, engine.max_model_len, capture=False)
                engine.generate(
                    input_ids=prompts,
                    lora_paths=[names[i % len(names)] for i in range(len(prompts))],
                    sampling_params={"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                )
    finally:
        stage_policy.SETTINGS.update(saved)
        engine.close()


def record_preset_shapes(
    path: str, cases: tuple[tuple[str, int], ...] = CASES, backends: tuple[str, ...] = BACKENDS
) -> None:
    """Record the launches of every case of ``cases`` ((preset, layers) as :data:`CASES`) on every
    backend of ``backends`` into ``path`` (kernels not run)."""
    from mmlora.bench.adapters import write_random_adapters
    from mmlora.models.arch_config import ArchConfig
    from mmlora.models.presets import PRESETS, preset_config

    uninstall = triton_specs.install(path, execute=False)
    try:
        for preset, layers in cases:
            name = f"{preset}-{layers}l"
            PRESETS[name] = {**PRESETS[preset], "num_hidden_layers": layers}
            cfg = ArchConfig.from_hf(preset_config(name))
            with as_on_h200():
                _fused_ops(
                    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                    cfg.head_dim,
                )  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp:
                made = write_random_adapters(name, tmp, 2, [16, 64], distinct=2)
                adapters = {m["name"]: m["path"] for m in made}
                for backend in backends:
                    print(f"  {name} {backend}", flush=True)
                    _engine_steps(name, adapters, backend)
    finally:
        uninstall()
    print(f"recorded {len(triton_specs.read([path]))} distinct launches to {os.path.basename(path)}")
