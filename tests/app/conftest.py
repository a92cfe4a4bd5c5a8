"""Fixtures of the app tests: a tiny random Llama with two adapters that answer differently, an engine
running on a background thread, and the app's controller over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from app_fixtures import ADAPTERS, TinyApp, tiny_engine
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint


@pytest.fixture(scope="session")
def tiny_app(tmp_path_factory: pytest.TempPathFactory) -> TinyApp:
    base = tmp_path_factory.mktemp("app_tiny")
    folder = make_checkpoint(base / "model")
    root = base / "loras"
    adapters = {}
    for name, seed in {**ADAPTERS, "gamma": 3}.items():
        adapters[name] = make_adapter(
            folder, root / name, seed=seed, scale=0.3, r=4, lora_alpha=8, target_modules=ALL_SEVEN
        )
    return TinyApp(folder, root, adapters)


@pytest.fixture
def bg(tiny_app: TinyApp) -> Iterator[Any]:
    from mmlora.engine.background import BackgroundEngine

    engine = BackgroundEngine(tiny_engine(tiny_app))
    try:
        yield engine
    finally:
        engine.shutdown(drain=False, timeout=10)


VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL checkpoint (no chat template) with its tokenizer and image processor."""
    import torch
    from tiny_models import CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers import Qwen2VLImageProcessorPil as ImageProcessor

    folder = tmp_path_factory.mktemp("app_vl")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=VL_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    ImageProcessor(min_pixels=28 * 28, max_pixels=16 * 28 * 28).save_pretrained(folder)
    tid = fast.convert_tokens_to_ids
    text = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(fast), max_position_embeddings=512, bos_token_id=None, eos_token_id=tid("<|endoftext|>"),
        pad_token_id=tid("<|endoftext|>"),
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, spatial_merge_size=2)
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=tid("<|image_pad|>"), vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"), video_token_id=len(fast) - 1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger than the default init: images visibly matter
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.05)
    model.save_pretrained(folder)
    return folder
