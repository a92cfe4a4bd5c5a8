"""The limits the worker pool checks before any work: the character bound, images per request, pixels
per image (from the header, before decoding), and that the work itself runs off the calling thread."""

from __future__ import annotations

import asyncio
import io
import threading
from types import SimpleNamespace

import pytest
from PIL import Image

from mmlora.server.config import ServerConfig
from mmlora.server.errors import APIError
from mmlora.server.preprocess import Preprocessor


class Vocab:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1, "ab": 2}  # at most 4 characters per token


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def pre():
    calls = []

    def prepare_prompt(prompt, input_ids, images):
        calls.append(threading.current_thread().name)
        return [1, 2, 3], None

    engine = SimpleNamespace(tokenizer=Vocab(), max_model_len=16, prepare_prompt=prepare_prompt)
    p = Preprocessor(engine, ServerConfig(max_images_per_request=2, max_image_pixels=100 * 100))
    p.calls = calls
    yield p
    p.shutdown()


def test_character_bound_refuses_before_tokenizing(pre):
    assert pre.max_chars == 16 * 4
    items = [{"prompt": "a" * 65}]
    with pytest.raises(APIError, match="65 characters cannot fit") as e:
        asyncio.run(pre.prepare(items, param="text"))
    assert e.value.status == 400 and e.value.param == "text" and pre.calls == []


def test_too_many_input_ids_are_refused_before_work(pre):
    with pytest.raises(APIError, match="input_ids: 16 tokens"):
        asyncio.run(pre.prepare([{"input_ids": list(range(16))}], param="input_ids"))
    assert pre.calls == []


def test_image_caps_are_checked_on_headers(pre):
    with pytest.raises(APIError, match="3 images, more than --max-images-per-request=2"):
        pre.check_images([png(2, 2)] * 3, "images")
    with pytest.raises(APIError, match=r"images\[1\]: image is 101x100, more than --max-image-pixels=10000"):
        pre.check_images([png(2, 2), png(101, 100)], "images")
    pre.check_images([png(100, 100), b"not an image"], "images")  # decoding names the corrupt one later


def test_prompts_are_prepared_on_the_pool_once_per_prompt(pre):
    prompt = "abcd" * 4
    items = [{"prompt": prompt}, {"prompt": prompt}]  # n = 2 copies of one prompt
    asyncio.run(pre.prepare(items, param="text"))
    assert pre.calls and all(name.startswith("mmlora-preprocess") for name in pre.calls)
    assert len(pre.calls) == 1
    assert [it["prepared"][0] for it in items] == [[1, 2, 3], [1, 2, 3]] and items[0]["prompt"] is None
    assert items[0]["prepared"][0] is not items[1]["prepared"][0]  # each request owns its ids
