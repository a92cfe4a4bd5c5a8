"""Tiny random checkpoints and PEFT adapters made on the spot (no hub), shared by the test packages.

The tokenizer is a byte-level BPE trained on a few sentences, so a checkpoint is built in about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def make_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
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


def make_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A random fp32 checkpoint of a tiny ``arch`` ("llama", "mistral", "qwen2") with norms away from 1."""
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
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_adapter(
    base_folder: Path, out: Path, seed: int = 0, scale: float = 0.15, **lora_kwargs: Any
) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B, saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    lora_kwargs.setdefault("lora_dropout", 0.0)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
    model.save_pretrained(out, safe_serialization=True)
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
