"""Gemma2 against HF ``Gemma2ForCausalLM`` + PEFT (fp32, CPU): greedy tokens identical, logprobs within 1e-3.

The tiny config makes every Gemma2 feature matter: norm weights away from 0 (Gemma stores w - 1),
``query_pre_attn_scalar`` different from head_dim, attention and final logit soft-capping small enough to
bite, alternating sliding-window layers with a window shorter than the prompts, tied embeddings.
One batch mixes adapters (all seven targets, a subset, rank patterns) with base-only rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import (
    ALL_SEVEN,
    PROMPTS,
    assert_same_greedy,
    hf_peft_greedy,
    make_adapter,
    make_gemma2_checkpoint,
    mmlora_greedy,
)
from transformers import AutoTokenizer

import mmlora

MAX_NEW = 10
WINDOW = 5
ADAPTERS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN),
    "attn": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(
        r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"], rank_pattern={"up_proj": 2}
    ),
}
ORDER = ["all7", None, "attn", "mlp", None, "all7"]
PROMPTS_USED = (PROMPTS * 2)[: len(ORDER)]


def make_gemma2(folder: Path, seed: int = 0) -> Path:
    return make_gemma2_checkpoint(folder, seed, window=WINDOW)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    base = make_gemma2(root / "base")
    adapters = {
        n: make_adapter(base, root / n, seed=i + 1, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())
    }
    tok = AutoTokenizer.from_pretrained(base)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS_USED]
    assert max(len(i) for i in ids) > WINDOW  # the window really cuts the context
    return base, adapters, hf_peft_greedy(base, adapters, ids, ORDER, MAX_NEW)


def _run_batch(base: Path, adapters: dict, **engine_kwargs) -> tuple[mmlora.Engine, list]:
    return mmlora_greedy(base, adapters, PROMPTS_USED, ORDER, MAX_NEW, **engine_kwargs)


def _check(outs, expected) -> None:
    assert_same_greedy(outs, expected, ORDER)


def test_gemma2_mixed_adapter_batch_matches_hf_peft(tiny_gemma2):
    base, adapters, expected = tiny_gemma2
    engine, outs = _run_batch(base, adapters, device="cpu")
    attn = [layer.self_attn for layer in engine.model.layers]
    assert [a.sliding_window for a in attn] == [WINDOW, None, WINDOW]
    assert all(a.logit_softcap == 2.0 for a in attn) and engine.model.arch.final_logit_softcap == 4.0
    _check(outs, expected)
    # Adapters really change the answers, so the comparison is not vacuous.
    assert outs[0].output_ids != outs[4].output_ids or outs[0].logprobs != pytest.approx(
        outs[4].logprobs, abs=1e-3
    )
    assert engine.kv_cache.allocator.usage == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora_backend", ["triton-sgmv", "triton-bgmv"])
def test_gemma2_9b_dummy_bf16_cuda_smoke(tmp_path, lora_backend):
    """The real Gemma2-9B shapes in bf16: a prompt longer than the 4096 window, 512-token prefill chunks."""
    from dummy_smoke import smoke_batch

    smoke_batch(
        "gemma2-9b", tmp_path, lengths=(37, 300, 5, 4500, 64, 900, 17, 250), device="cuda", dtype="bfloat16",
        lora_backend=lora_backend, max_loras_per_batch=4, max_lora_rank=32, max_num_batched_tokens=512,
        max_kv_tokens=8192,  # 6073 prompt tokens and 128 generated; 65536 took 22.5 GiB at these shapes
    )  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora_backend", ["torch-gather", "triton-sgmv", "triton-bgmv"])
def test_gemma2_cuda_triton_matches_hf_peft(tiny_gemma2, lora_backend):
    """On the GPU: Triton attention (soft-capping, sliding window) with every LoRA backend, fp32."""
    base, adapters, expected = tiny_gemma2
    _, outs = _run_batch(
        base,
        adapters,
        device="cuda",
        attention_backend="triton",
        lora_backend=lora_backend,
        max_kv_tokens=8192,
    )
    _check(outs, expected)


def test_gemma2_generate_api_and_chunked_prefill(tiny_gemma2):
    """``mmlora.generate`` on the folder, with prompts prefilled in 16-token chunks, equals HF + PEFT."""
    base, adapters, _ = tiny_gemma2
    prompt = " ".join(PROMPTS)
    outs = mmlora.generate(
        images=None,
        texts=[prompt, prompt],
        lora_paths=[str(adapters["all7"]), None],
        model=str(base),
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=16,
        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        return_logprob=True,
    )
    tok = AutoTokenizer.from_pretrained(base)(prompt, add_special_tokens=False)["input_ids"]
    assert len(tok) > 16
    expected = hf_peft_greedy(base, {"all7": adapters["all7"]}, [tok, tok], ["all7", None], 6)
    assert_same_greedy(outs, expected, ["all7", None])


def test_gemma2_bf16_rotary_matches_hf(tiny_gemma2):
    """In bf16 the RoPE frequencies stay fp32 (as in HF): cos/sin at far positions equal HF's bf16 values."""
    from transformers import AutoConfig
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

    base, _, _ = tiny_gemma2
    engine = mmlora.Engine(model=str(base), device="cpu", dtype="bfloat16")
    positions = torch.tensor([0, 7, 100, 255])
    cos, sin = engine.model.layers[0].self_attn.rotary.cos_sin(positions, torch.bfloat16)
    x = torch.zeros(1, dtype=torch.bfloat16)
    hf_cos, hf_sin = Gemma2RotaryEmbedding(AutoConfig.from_pretrained(base))(x, positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
