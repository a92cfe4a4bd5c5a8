"""The independent oracle of the server tests: HF transformers + PEFT, greedy, fp32 on CPU."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=16)
def _model(folder: str, adapter: str | None) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


@torch.no_grad()
def hf_greedy(folder: Path, adapter: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of HF + PEFT (no EOS stop: tests use ignore_eos)."""
    model = _model(str(folder), None if adapter is None else str(adapter))
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):  # no KV cache: a plain recompute is the simplest oracle
        tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def tokenize(folder: Path, text: str) -> list[int]:
    """As the engine does: no special tokens added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def hf_prompt_logprobs(folder: Path, adapter: Path | None, ids: list[int]) -> list[float]:
    """log P(ids[t] | ids[:t]) for t = 1..len(ids)-1 from HF + PEFT (fp32), one full forward."""
    model = _model(str(folder), None if adapter is None else str(adapter))
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    return [float(logprobs[t - 1, ids[t]]) for t in range(1, len(ids))]
