"""The serving benchmark's HF + PEFT baseline: HF transformers + PEFT ``generate(adapter_names=...)`` and
mmlora on the same subset of requests (same prompts, adapters and token counts)."""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mmlora.models.arch_config import ArchConfig


def subset_requests(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Prompts of the HF + PEFT comparison: ``hf_batch`` random prompts of 8..128 tokens (fit max_model_len)."""
    rng = np.random.default_rng(args.seed + 7)
    hi = min(128, args.max_model_len - args.hf_tokens)
    if hi <= 8:
        raise ValueError(
            f"--max-model-len {args.max_model_len}: too short for the HF subset (--hf-tokens {args.hf_tokens})"
        )
    return [rng.integers(0, vocab, int(rng.integers(8, hi))).tolist() for _ in range(args.hf_batch)]


def hf_peft_subset(
    hf_config: Any,
    args: argparse.Namespace,
    adapters: list[dict[str, Any]],
    device: torch.device,
    dtype: torch.dtype,
    free: Callable[[], None],
) -> dict[str, Any]:
    """HF transformers + PEFT ``generate(adapter_names=...)`` on the subset: random weights of the same
    architecture, our generated adapters loaded with ``PeftModel.load_adapter``. Errors are recorded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts = subset_requests(args, ArchConfig.from_hf(hf_config).vocab_size)
    chosen = adapters[: args.hf_adapters]
    names = [chosen[i % len(chosen)]["name"] for i in range(len(prompts))]
    model = None
    try:
        t0 = time.perf_counter()
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
        model = PeftModel.from_pretrained(model, chosen[0]["path"], adapter_name=chosen[0]["name"])
        for a in chosen[1:]:
            model.load_adapter(a["path"], adapter_name=a["name"])
        model.eval()
        build_s = time.perf_counter() - t0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kw = dict(
            input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=args.hf_tokens,
            min_new_tokens=args.hf_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        with torch.inference_mode():
            model.generate(**{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(**kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
        tokens = (out.shape[1] - width) * len(prompts)
        return {
            "batch": len(prompts),
            "new_tokens_each": args.hf_tokens,
            "adapters": len(chosen),
            "seconds": seconds,
            "output_tok_per_s": tokens / seconds,
            "build_seconds": build_s,
        }
    except Exception as e:  # noqa: BLE001  (the other results must still be written)
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        del model
        free()


def mmlora_subset(engine: Any, args: argparse.Namespace, adapters: list[dict[str, Any]]) -> dict[str, Any]:
    """mmlora on exactly the HF + PEFT subset (same prompts, adapters, token counts)."""
    prompts = subset_requests(args, engine.model.arch.vocab_size)
    chosen = adapters[: args.hf_adapters]
    names = [chosen[i % len(chosen)]["name"] for i in range(len(prompts))]
    sp = {"max_new_tokens": args.hf_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts[:2], lora_paths=names[:2], sampling_params={**sp, "max_new_tokens": 2})
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, lora_paths=names, sampling_params=sp)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    return {
        "batch": len(prompts),
        "adapters": len(chosen),
        "seconds": seconds,
        "output_tok_per_s": tokens / seconds,
    }
