"""Images through the server on a tiny random Qwen2-VL: chat ``image_url`` parts (data URL, local file under
the allowed root) and /generate ``image_data`` give what the engine gives for the same prompt and image."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import torch
from server_fixtures import CORPUS, serve

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]
SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + SLOT + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def make_tiny_vl(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                                            initial_alphabet=alphabet))  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = VL_TEMPLATE
    fast.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=16 * 28 * 28).save_pretrained(folder)
    tid = fast.convert_tokens_to_ids
    text = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(fast), max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=tid("<|endoftext|>"), pad_token_id=tid("<|endoftext|>"),
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, spatial_merge_size=2)
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=tid("<|image_pad|>"), vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"), video_token_id=len(fast) - 1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # large enough that the image visibly changes the answer
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def png(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from mmlora import Engine

    root = tmp_path_factory.mktemp("vl")
    folder = make_tiny_vl(root / "model")
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(1))
    engine = Engine(
        model=str(folder), device="cpu", dtype="float32", served_model_name="vl", max_kv_tokens=4096
    )
    assert engine.is_multimodal
    for served in serve(engine, allowed_local_media_path=str(media)):
        yield served, media


def engine_answer(served, prompt: str, image: bytes) -> list[int]:
    outs = served.bg.run(lambda eng: eng.generate(prompt, images=[[image]], sampling_params=GREEDY))
    return outs[0].output_ids


def test_chat_image_url_as_data_url_and_local_file(vl):
    served, media = vl
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60)
    tok = served.engine.tokenizer
    image = (media / "cat.png").read_bytes()
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    prompt = served.engine.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    )
    expected = tok.decode(engine_answer(served, prompt, image), skip_special_tokens=True)
    other = tok.decode(engine_answer(served, prompt, png(2)), skip_special_tokens=True)
    assert expected != other  # the image matters, so equality below means it was passed through
    for url in (data_url, str(media / "cat.png"), "file://" + str(media / "cat.png")):
        content = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}}]
        res = client.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert res.choices[0].message.content == expected, url
    bad = [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]
    with pytest.raises(openai.BadRequestError, match="outside"):
        client.chat.completions.create(model="vl", messages=[{"role": "user", "content": bad}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="remote"):
        bad = [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]
        client.chat.completions.create(model="vl", messages=[{"role": "user", "content": bad}], max_tokens=2)


def test_generate_image_data_batch(vl):
    served, _ = vl
    a, b = png(3), png(4, (28, 56))
    texts = [f"What is {SLOT}?", "No image here", f"{SLOT} then"]
    body = {"text": texts, "sampling_params": GREEDY,
            "image_data": ["data:image/png;base64," + base64.b64encode(a).decode(), None,
                           base64.b64encode(b).decode()]}  # fmt: skip
    r = requests.post(served.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = [item["output_ids"] for item in r.json()]
    expected = served.bg.run(lambda eng: eng.generate(texts, images=[[a], None, [b]], sampling_params=GREEDY))
    assert got == [o.output_ids for o in expected]
    r = requests.post(served.url + "/generate", json={**body, "image_data": [None, None]}, timeout=60)
    assert r.status_code == 400 and "image_data" in r.json()["error"]["message"]
