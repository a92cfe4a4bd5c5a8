"""Tokenization, chat templates and image decoding in a worker pool: off the engine thread and the loop.

A 20 MB prompt tokenized on the engine thread stalls every request for a minute; on the event loop it
stalls every connection. Here each request's prompt is prepared (``Engine.prepare_prompt``: token ids,
decoded images) on a small thread pool, and cheap limits are checked first, before any work:

* a character bound: a prompt longer than ``max_model_len`` times the longest token's characters cannot
  fit the context, so it is refused without tokenizing it;
* images per request and pixels per image (read from the image header, before decoding).

Structured-output grammars (JSON schema, regex, EBNF) are compiled on the same pool into the engine's
cache (``Engine.grammars``), so the engine thread only finds them there.
The engine thread then only queues the prepared ids. Fast tokenizers release the GIL while encoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from mmlora.engine.sampling_params import SamplingParams
from mmlora.server.config import ServerConfig
from mmlora.server.errors import APIError

T = TypeVar("T")


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (an upper bound: byte-level tokens spell each byte
    with one character, SentencePiece each space with one)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None and hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocab), default=0)


class Preprocessor:
    """Prepare prompts on ``config.preprocess_workers`` threads, with limits checked before work."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        per_token = longest_token_chars(engine.tokenizer)
        self.max_chars = int(engine.max_model_len) * per_token if per_token else None
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.preprocess_workers, thread_name_prefix="mmlora-preprocess"
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool; a ValueError it raises stays a ValueError (the caller maps it)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_text(self, text: str, param: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise APIError(
                400,
                f"{param}: {len(text)} characters cannot fit in max_model_len={self.engine.max_model_len} "
                f"tokens (at most {self.max_chars} characters)",
                param=param,
            )

    def check_images(self, images: list[bytes] | None, param: str) -> None:
        if not images:
            return
        if len(images) > self.config.max_images_per_request:
            raise APIError(
                400,
                f"{param}: {len(images)} images, more than --max-images-per-request="
                f"{self.config.max_images_per_request}",
                param=param,
            )
        for i, data in enumerate(images):
            if isinstance(data, bytes):
                self._check_pixels(data, f"{param}[{i}]")

    def _check_pixels(self, data: bytes, param: str) -> None:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as img:  # the header only
                width, height = img.size
        except Exception:
            return  # not an image PIL can read: decoding says why, with the field named
        if width * height > self.config.max_image_pixels:
            raise APIError(
                400,
                f"{param}: image is {width}x{height}, more than --max-image-pixels={self.config.max_image_pixels}",
                param=param,
            )

    async def prepare(self, items: list[dict[str, Any]], param: str) -> None:
        """Fill each engine request's ``prepared`` (ids, images) in place; copies of one prompt (``n``)
        share one preparation. Raises APIError(400) naming ``param`` for a prompt that is refused."""
        done: dict[tuple[int, int], Any] = {}
        for item in items:
            prompt, input_ids, images = item.get("prompt"), item.get("input_ids"), item.get("images")
            key = (id(prompt if prompt is not None else input_ids), id(images))
            if key not in done:
                if prompt is not None:
                    self.check_text(prompt, param)
                elif input_ids is not None and len(input_ids) >= self.engine.max_model_len:
                    raise APIError(
                        400,
                        f"{param}: {len(input_ids)} tokens leave no room in max_model_len={self.engine.max_model_len}",
                        param=param,
                    )
                self.check_images(images, "images")
                try:
                    done[key] = await self.run(self.engine.prepare_prompt, prompt, input_ids, images)
                except (ValueError, TypeError) as e:
                    message = str(e)
                    raise APIError(
                        400, message if ":" in message else f"{param}: {message}", param=param
                    ) from None
            ids, mm_inputs = done[key]
            item.update(prompt=None, input_ids=None, images=None, prepared=(list(ids), mm_inputs))

    async def compile_grammars(self, params: Iterable[SamplingParams], param: str) -> None:
        """Compile every constraint of ``params`` into the engine's grammar cache; a bad one is a 400
        naming it (``sampling_params`` in the message becomes ``param``)."""
        for constraint in {sp.constraint for sp in params if sp.constraint is not None}:
            try:
                await self.run(self.engine.grammars.compile, *constraint)
            except ValueError as e:
                message = str(e)
                field = message.partition(":")[0]
                raise APIError(400, message, param=field.replace("sampling_params", param)) from None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
