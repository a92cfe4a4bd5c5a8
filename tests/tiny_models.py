"""Tiny random checkpoints (Llama family, Qwen2-VL) and PEFT adapters made on the spot (no hub), and the
HF + PEFT greedy oracle with its mmlora counterpart, shared by the test packages.

The tokenizer is a byte-level BPE trained on a few sentences, so a checkpoint is built in about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Multi-LoRA serving batches many adapters on one base model.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paris is the capital of France; Rome is the capital of Italy.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
    "system user assistant tool prompt answer question pirate poem story",
]
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    "The quick brown fox",
    "Hello world! How are",
    "Paris is the capital of",
    "Multi-LoRA serving batches many adapters on one base model. Multi",
    "0123",
    "system user assistant",
]


DEFAULT_SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
QWEN2_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]


def make_tokenizer(
    folder: Path,
    *,
    specials: list[str] = DEFAULT_SPECIALS,
    vocab_size: int = 384,
    bos: str | None = "<s>",
    eos: str = "</s>",
    pad: str = "<pad>",
    chat_template: str | None = CHAT_TEMPLATE,
) -> Any:
    """A byte-level BPE trained on ``CORPUS`` with ``specials`` first (ids 0..), saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    names = {"bos_token": bos} if bos is not None else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, **names)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "mistral": dict(sliding_window=7, head_dim=24),
    "qwen2": dict(use_sliding_window=False, tie_word_embeddings=True),
}


def make_checkpoint(
    folder: Path, arch: str = "llama", seed: int = 0, *, perturb_vectors: bool = True, **overrides: Any
) -> Path:
    """A random fp32 checkpoint of a tiny ``arch`` ("llama", "mistral", "qwen2") with norms away from 1.

    ``overrides`` replace config values (also the per-arch ones); with ``perturb_vectors=False`` only the
    matrices are redrawn and norms and biases keep their default init.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer(folder)
    values = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    values.update(_ARCH_CONFIGS[arch])
    values.update(overrides)
    cfg = AutoConfig.for_model(arch, **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():  # larger than the default init so that adapters and norms visibly matter
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif not perturb_vectors:
                continue
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_gemma2_checkpoint(folder: Path, seed: int = 0, *, window: int = 5) -> Path:
    """A random fp32 Gemma2 (3 layers, sliding / full / sliding with ``window``, soft-capping that bites)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tok = make_tokenizer(folder)
    cfg = Gemma2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=24, vocab_size=len(tok), max_position_embeddings=256,
        sliding_window=window, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=2.0, final_logit_softcapping=4.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)  # (1 + w) in [0.5, 1.5]
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_qwen2_vl_checkpoint(
    folder: Path,
    seed: int = 0,
    *,
    vocab_size: int = 384,
    vision_depth: int = 2,
    max_pixels: int = 64 * 28 * 28,
    chat_template: str | None = None,
    perturb_vectors: bool = True,
) -> Path:
    """A random fp32 Qwen2-VL (2 text layers, ``vision_depth`` vision blocks) with a ``QWEN2_VL_SPECIALS``
    tokenizer and an image processor taking 28x28 .. ``max_pixels`` pixels; norms away from 1 unless
    ``perturb_vectors=False`` (then only the matrices are redrawn)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    eos = "<|endoftext|>"
    fast = make_tokenizer(
        folder, specials=QWEN2_VL_SPECIALS, vocab_size=vocab_size, bos=None, eos=eos, pad=eos,
        chat_template=chat_template,
    )  # fmt: skip
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels).save_pretrained(folder)
    tid = fast.convert_tokens_to_ids
    text = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(fast), max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=tid(eos), pad_token_id=tid(eos),
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )  # fmt: skip
    vision = dict(
        depth=vision_depth, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, spatial_merge_size=2
    )
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=tid("<|image_pad|>"), vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"), video_token_id=len(fast) - 1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # larger than the default init so that images, adapters and norms visibly matter
        for name, p in model.named_parameters():
            if perturb_vectors and "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif perturb_vectors:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_adapter(
    base_folder: Path,
    out: Path,
    seed: int = 0,
    scale: float = 0.15,
    *,
    safe: bool = True,
    model_class: str = "AutoModelForCausalLM",
    **lora_kwargs: Any,
) -> Path:
    """A PEFT LoRA adapter of the checkpoint in ``base_folder`` (loaded with transformers' ``model_class``)
    with random (non-zero) A and B, saved as safetensors (or, with ``safe=False``, as a pickle)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = getattr(transformers, model_class).from_pretrained(base_folder, dtype=torch.float32)
    lora_kwargs.setdefault("lora_dropout", 0.0)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
    model.save_pretrained(out, safe_serialization=safe)
    return out


def hf_peft_greedy(
    base_folder: Path,
    adapters: dict[str, Path],
    prompt_ids: list[list[int]],
    names: list[str | None],
    max_new: int,
) -> list[tuple[list[int], list[float]]]:
    """Oracle: HF transformers + PEFT, one prompt at a time, greedy; (tokens, chosen-token logprobs)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32, attn_implementation="eager")
    first, *rest = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    results = []
    for ids, name in zip(prompt_ids, names):
        x = torch.tensor([ids])
        kwargs = dict(
            max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        # ignore_eos: no EOS at all (min_new_tokens would instead forbid EOS from being chosen)
        kwargs.update(eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=x, **kwargs)
            else:
                model.set_adapter(name)
                out = model.generate(input_ids=x, **kwargs)
        tokens = out.sequences[0, len(ids) :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results


def mmlora_greedy(
    base_folder: Path,
    adapters: dict[str, Path],
    prompts: list[str],
    names: list[str | None],
    max_new: int,
    **engine_kwargs: Any,
) -> tuple[Any, list[Any]]:
    """The side under test for ``hf_peft_greedy``: one mixed batch through an fp32 ``mmlora.Engine`` with two
    adapter slots (fewer than adapters, so admission rotates them), greedy; (engine, outputs)."""
    import mmlora

    if torch.cuda.is_available():  # the KV cache would take most of the free GPU memory
        engine_kwargs.setdefault("max_kv_tokens", 4096)
    engine = mmlora.Engine(
        model=str(base_folder), lora_paths={n: str(p) for n, p in adapters.items()}, max_loras_per_batch=2,
        max_lora_rank=8, dtype="float32", **engine_kwargs,
    )  # fmt: skip
    outs = engine.generate(
        prompts, lora_paths=names, return_logprob=True,
        sampling_params={"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
    )  # fmt: skip
    return engine, outs


def assert_same_greedy(
    outs: list[Any], expected: list[tuple[list[int], list[float]]], names: list[str | None], label: str = ""
) -> None:
    """Tokens identical to the oracle's and chosen-token logprobs within 1e-3, row by row."""
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
        assert out.output_ids == tokens, f"{label} prompt {i} adapter {names[i]}"
        assert out.logprobs == pytest.approx(logprobs, abs=1e-3), f"{label} prompt {i} adapter {names[i]}"


def llama_with_two_ranks(root: Path) -> tuple[Path, dict[str, Path]]:
    """A tiny llama and two adapters of different ranks and targets: "a" (rank 4, all seven projections)
    and "b" (rank 2, q_proj and down_proj)."""
    base = make_checkpoint(root / "base", "llama")
    adapters = {
        "a": make_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=ALL_SEVEN),
        "b": make_adapter(
            base, root / "b", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]
        ),
    }
    return base, adapters
