"""Helpers of the server tests: a tiny Llama checkpoint with its own tokenizer (and a chat
template), tiny PEFT adapters made with peft itself, and a uvicorn server on a free loopback port.

The tokenizer is a byte-level BPE trained in the fixture on a few sentences (no hub, no GGUF parse:
that takes ~16 s here), so the whole checkpoint is built in about a second.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
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
ADAPTER_SPECS = {  # name -> (rank, alpha, targets, seed); different ranks and targets on purpose
    "a0": (4, 8, ALL_SEVEN, 1),
    "a1": (8, 16, ["q_proj", "v_proj"], 2),
    "a2": (2, 4, ["o_proj", "down_proj", "up_proj"], 3),
    "a3": (4, 4, ALL_SEVEN, 4),
    "a4": (8, 8, ["k_proj", "gate_proj"], 5),
}


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


def make_checkpoint(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(folder)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init so that adapters visibly matter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)


def make_adapter(
    base_folder: Path | None,
    out: Path,
    rank: int,
    alpha: int,
    targets: list[str],
    seed: int,
    *,
    safe: bool = True,
    hidden: int | None = None,
) -> None:
    """A PEFT adapter of ``base_folder`` (or, with ``hidden``, of a differently shaped random Llama)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden is not None:
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=384)  # fmt: skip
        base = LlamaForCausalLM(cfg)
    else:
        base = LlamaForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out, safe_serialization=safe)


@dataclass
class TinyModel:
    folder: Path
    adapters: dict[str, Path]
    root: Path  # the folder holding the adapters (a --lora-root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving ``app`` on a thread, on a free loopback port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Served:
    url: str
    bg: Any
    engine: Any
    app: Any


def serve(engine: Any, **server_kwargs: Any) -> Iterator[Served]:
    from mmlora.engine.background import BackgroundEngine
    from mmlora.server.app import build_app
    from mmlora.server.config import ServerConfig

    bg = BackgroundEngine(engine)
    app = build_app(bg, ServerConfig(**server_kwargs))
    live = LiveServer(app)
    try:
        yield Served(live.url, bg, engine, app)
    finally:
        live.stop()
        bg.shutdown(drain=False, timeout=10)


def tiny_engine(tiny: TinyModel, **kwargs: Any) -> Any:
    from mmlora import Engine

    opts = {
        "model": str(tiny.folder),
        "lora_paths": {name: str(p) for name, p in tiny.adapters.items()},
        "max_loras_per_batch": 4,
        "max_lora_rank": 8,
        "device": "cpu",
        "dtype": "float32",
        "served_model_name": "tiny",
        "max_kv_tokens": 8192,
    }
    opts.update(kwargs)
    return Engine(**opts)
