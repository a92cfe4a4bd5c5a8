"""mmlora against HF transformers + PEFT (fp32, CPU): greedy tokens identical, logprobs within 1e-3.

Tiny random Llama (llama3 RoPE scaling), Mistral (sliding window shorter than the sequence) and Qwen2
(qkv bias, tied embeddings); one batch mixes a different adapter per prompt with base-only rows, mixed
ranks, rsLoRA, rank/alpha patterns, regex targets and layers_to_transform, with fewer slots than adapters.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    ALL_SEVEN,
    PROMPTS,
    assert_same_greedy,
    hf_peft_greedy,
    make_adapter,
    make_checkpoint,
    mmlora_greedy,
)

import mmlora

MAX_NEW = 12

ADAPTERS = {
    "plain8": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN),
    "rslora4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "patterns": dict(
        r=6,
        lora_alpha=12,
        target_modules=ALL_SEVEN,
        rank_pattern={"k_proj": 2, "layers.1.mlp.up_proj": 3},
        alpha_pattern={"o_proj": 3, "gate_proj": 20},
    ),
    "regex": dict(r=5, lora_alpha=5, target_modules=r".*\.(self_attn\.(k|o)_proj|mlp\.gate_proj)"),
    "layer1": dict(r=3, lora_alpha=9, target_modules=["q_proj", "up_proj"], layers_to_transform=[1]),
}
ORDER = ["plain8", None, "rslora4", "patterns", "regex", None, "layer1", "plain8"]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny_arch(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_checkpoint(root / "base", request.param)
    adapters = {
        name: make_adapter(base, root / name, seed=i + 1, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return request.param, base, adapters


@pytest.fixture(scope="module")
def expected(tiny_arch):
    """HF + PEFT's greedy tokens and logprobs for the mixed batch, one prompt at a time."""
    arch, base, adapters = tiny_arch
    engine = mmlora.Engine(model=str(base), device="cpu", dtype="float32")
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS_IN_BATCH]
    return hf_peft_greedy(base, adapters, ids, ORDER, MAX_NEW)


PROMPTS_IN_BATCH = (PROMPTS * 2)[: len(ORDER)]


def run_mixed_batch(tiny_arch, device: str = "cpu", **engine_kwargs):
    _, base, adapters = tiny_arch
    return mmlora_greedy(base, adapters, PROMPTS_IN_BATCH, ORDER, MAX_NEW, device=device, **engine_kwargs)


def assert_matches(arch, outs, expected):
    assert_same_greedy(outs, expected, ORDER, arch)


def test_mixed_adapter_batch_matches_hf_peft(tiny_arch, expected):
    engine, outs = run_mixed_batch(tiny_arch)
    assert_matches(tiny_arch[0], outs, expected)
    # The adapters really change the answers (so the comparison above is not vacuous).
    assert outs[0].output_ids != outs[1].output_ids or outs[0].logprobs != pytest.approx(
        outs[1].logprobs, abs=1e-3
    )
    assert engine.lora.slots_used <= 2
    assert engine.stats()["num_running"] == 0 and engine.kv_cache.allocator.usage == 0.0


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-bgmv", "triton-auto"])
def test_triton_backends_match_hf_peft(tiny_arch, expected, backend):
    """Either Triton backend alone runs the whole engine (prefill chunks and decode), on CPU in the
    Triton interpreter (on the GPU where there is one), with small prefill chunks so that segments span several requests."""
    if tiny_arch[0] != "llama":
        pytest.skip("one architecture is enough for the backends; the model code is shared")
    # On a GPU machine Triton needs CUDA tensors (the interpreter is only set without CUDA: conftest).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, outs = run_mixed_batch(tiny_arch, lora_backend=backend, max_num_batched_tokens=24, device=device)
    assert_matches(tiny_arch[0], outs, expected)
