"""Images through the server on a tiny random Qwen2-VL: chat ``image_url`` parts (data URL, local file under
the allowed root) and /generate ``image_data`` give what the engine gives for the same prompt and image."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import requests
from server_fixtures import serve
from tiny_models import make_qwen2_vl_checkpoint

SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + SLOT + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


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
    folder = make_qwen2_vl_checkpoint(  # only the matrices redrawn: large enough that the image matters
        root / "model",
        vision_depth=1,
        max_pixels=16 * 28 * 28,
        chat_template=VL_TEMPLATE,
        perturb_vectors=False,
    )
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
    outs = served.bg.run(
        lambda eng: eng.generate(prompt, images=[[image]], sampling_params=GREEDY), timeout=120
    )
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
    expected = served.bg.run(
        lambda eng: eng.generate(texts, images=[[a], None, [b]], sampling_params=GREEDY), timeout=120
    )
    assert got == [o.output_ids for o in expected]
    r = requests.post(served.url + "/generate", json={**body, "image_data": [None, None]}, timeout=60)
    assert r.status_code == 400 and "image_data" in r.json()["error"]["message"]
