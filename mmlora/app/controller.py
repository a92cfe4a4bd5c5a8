"""What the Gradio app does, as plain Python over a ``BackgroundEngine`` (no Gradio imports here).

Every engine call goes through the background thread (``submit``/``run``), so any number of browser
tabs share one continuous batch. Bad input raises ``ValueError`` naming the field; the UI layer turns
it into a message in the browser.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmlora.engine.background import BackgroundEngine
from mmlora.engine.request_handle import RequestHandle
from mmlora.engine.sampling_params import RequestOutput, SamplingParams
from mmlora.lora.paths import confine_adapter_path

BASE = "base model"
"""The picker's label for "no adapter"; adapters may not take this name."""

MAX_COMPARE = 6
"""Most columns in compare mode (the UI builds this many output boxes)."""


@dataclass
class StreamView:
    """The display state of one streamed request: its text so far and its speed."""

    adapter: str
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> int:
        return len(self.output_ids)

    def update(self, out: RequestOutput) -> None:
        """Apply one increment; the shown text grows by the deltas (never a half-decoded character)."""
        self.text = out.text if out.finished else self.text + out.delta_text
        self.output_ids = list(out.output_ids)
        self.finish_reason = out.finish_reason
        self.error = out.error
        self.arrival_time = out.arrival_time
        self.first_token_time = out.first_token_time
        self.finish_time = out.finish_time

    def tokens_per_s(self, now: float | None = None) -> float | None:
        """Decode speed: tokens after the first over the time since the first (None before two tokens)."""
        if self.first_token_time is None or self.tokens < 2:
            return None
        end = self.finish_time if self.finish_time is not None else (now or time.monotonic())
        span = end - self.first_token_time
        return (self.tokens - 1) / span if span > 0 else None

    def summary(self, now: float | None = None) -> str:
        """One line: ``pirate · 42 tokens · 18.3 tok/s · first token 0.41 s · stop``."""
        parts = [self.adapter, f"{self.tokens} tokens"]
        tps = self.tokens_per_s(now)
        if tps is not None:
            parts.append(f"{tps:.1f} tok/s")
        if self.first_token_time is not None and self.arrival_time is not None:
            parts.append(f"first token {self.first_token_time - self.arrival_time:.2f} s")
        if self.error:
            parts.append(f"error: {self.error}")
        elif self.finish_reason:
            parts.append(self.finish_reason)
        else:
            parts.append("generating…")
        return " · ".join(parts)


def make_sampling(
    max_new_tokens: Any = 128,
    temperature: Any = 0.0,
    top_p: Any = 1.0,
    top_k: Any = -1,
    repetition_penalty: Any = 1.0,
    seed: Any = None,
) -> SamplingParams:
    """SamplingParams from UI values (sliders give floats); a seed of None, "" or -1 means random."""

    def as_int(name: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{name}: expected an integer, got {value!r}")

    seed = None if seed in (None, "") else as_int("seed", seed)
    if seed == -1:
        seed = None
    return SamplingParams(
        max_new_tokens=as_int("max_new_tokens", max_new_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=as_int("top_k", top_k),
        repetition_penalty=float(repetition_penalty),
        seed=seed,
    )


def message_text(content: Any) -> str:
    """The text of a chat message's content: a string, or Gradio's list of typed parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", "")) if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "".join(message_text(part) for part in content)
    return ""


class AppController:
    """The app's actions over one shared ``BackgroundEngine``; safe to call from many threads at once.

    ``lora_root`` confines adapters loaded from the UI (``None`` disables loading by path).
    """

    def __init__(self, bg: BackgroundEngine, *, lora_root: str | None = None) -> None:
        self.bg = bg
        self.lora_root = os.path.realpath(lora_root) if lora_root else None
        engine = bg.engine  # read-only facts fixed at construction
        self.model_name: str = engine.model_name
        self.is_multimodal: bool = bool(engine.is_multimodal)
        self.has_chat_template = bool(getattr(engine.tokenizer, "chat_template", None))
        self.lora_backend: str = engine.lora_backend
        self.device = str(engine.device)
        self._lock = threading.Lock()
        self._owned: dict[str, set[RequestHandle]] = {}  # owner (a browser session) -> its live requests

    # ---- adapters -------------------------------------------------------------------------------

    def list_loras(self) -> list[dict[str, Any]]:
        return self.bg.run(lambda eng: eng.list_loras())

    def adapter_names(self, loras: list[dict[str, Any]] | None = None) -> list[str]:
        """Adapters that take requests (those being unloaded are left out); ``loras`` saves a round trip."""
        return [
            info["name"]
            for info in (loras if loras is not None else self.list_loras())
            if not info.get("unloading")
        ]

    def choices(self, loras: list[dict[str, Any]] | None = None) -> list[str]:
        """The picker's entries: the base model, then every registered adapter."""
        return [BASE, *self.adapter_names(loras)]

    def adapter_rows(self, loras: list[dict[str, Any]] | None = None) -> list[list[Any]]:
        """The adapter table: name, rank, pinned, in a device slot, in the host cache, requests, path."""
        return [
            [
                info["name"],
                info["rank"],
                "yes" if info["pinned"] else "",
                "yes" if info["in_gpu_slot"] else "",
                "yes" if info["in_host_cache"] else "",
                info["active_requests"],
                ("unloading " if info.get("unloading") else "") + str(info["path"]),
            ]
            for info in (loras if loras is not None else self.list_loras())
        ]

    def load_adapter(self, path: str, name: str | None = None, pinned: bool = False) -> str:
        """Load a PEFT adapter folder found under ``lora_root``; returns a confirmation message."""
        if not isinstance(path, str) or not path.strip():
            raise ValueError("path: give an adapter folder (relative to the adapter root)")
        if self.lora_root is None:
            raise ValueError("path: loading adapters is disabled (the app was started without --lora-root)")
        real = confine_adapter_path(path.strip(), self.lora_root, param="path")
        name = (name or "").strip() or os.path.basename(real.rstrip(os.sep))
        if name == BASE:
            raise ValueError(f"name: {BASE!r} is reserved for the base model")
        self.bg.run(lambda eng: eng.load_lora(name, real, pinned=bool(pinned)))
        return f"loaded adapter {name!r} from {real}" + (" (pinned)" if pinned else "")

    def unload_adapter(self, name: str | None) -> str:
        if not name or name == BASE:
            raise ValueError("name: pick an adapter to unload")
        self.bg.run(lambda eng: eng.unload_lora(name))
        return f"unloading adapter {name!r}: new requests are refused, it is freed when its requests end"

    def set_pinned(self, name: str | None, pinned: bool) -> str:
        """Pin (never evicted from its device slot or the host cache) or unpin a loaded adapter."""
        if not name or name == BASE:
            raise ValueError("name: pick an adapter")
        self.bg.run(lambda eng: eng.set_pinned(name, bool(pinned)))
        return f"{'pinned' if pinned else 'unpinned'} adapter {name!r}"

    def abort(self, owner: str) -> int:
        """Abort every running request started with ``owner``; returns how many were aborted."""
        with self._lock:
            handles = list(self._owned.pop(owner, ()))
        for h in handles:
            h.abort()
        return len(handles)

    def _track(self, owner: str | None, handles: list[RequestHandle]) -> None:
        if owner is not None:
            with self._lock:
                self._owned.setdefault(owner, set()).update(handles)

    def _untrack(self, owner: str | None, handles: list[RequestHandle]) -> None:
        if owner is not None:
            with self._lock:
                live = self._owned.get(owner)
                if live is not None:
                    live.difference_update(handles)
                    if not live:
                        del self._owned[owner]

    def _lora_of(self, choice: str | None) -> str | None:
        return None if choice in (None, "", BASE) else choice

    # ---- prompts --------------------------------------------------------------------------------

    def format_prompt(
        self, messages: list[dict[str, Any]], use_template: bool, with_image: bool = False
    ) -> str:
        """The prompt text: the chat template over ``messages``, or the last message's raw text."""
        if not messages or not message_text(messages[-1]["content"]).strip():
            raise ValueError("prompt: empty")
        if not use_template:
            return message_text(messages[-1]["content"])
        if not self.has_chat_template:
            raise ValueError(f"use chat template: the model {self.model_name!r} has no chat template")
        msgs = [{"role": m["role"], "content": message_text(m["content"])} for m in messages]
        if with_image:  # the template places the image marker; the model expands it
            msgs[-1]["content"] = [{"type": "image"}, {"type": "text", "text": msgs[-1]["content"]}]
        return self.bg.run(lambda eng: eng.apply_chat_template(msgs))

    def _images(self, image: Any) -> list[Any] | None:
        if image is None:
            return None
        if not self.is_multimodal:
            raise ValueError(f"image: the model {self.model_name!r} is text-only")
        return [image]

    # ---- generation -----------------------------------------------------------------------------

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        adapter: str | None,
        sampling: SamplingParams,
        *,
        image: Any = None,
        use_template: bool = True,
        owner: str | None = None,
    ) -> Iterator[StreamView]:
        """Stream the answer to the last user message of ``messages`` with one adapter (or the base).

        ``owner`` (e.g. a browser session) lets ``abort(owner)`` stop it from another thread.
        """
        prompt = self.format_prompt(messages, use_template, with_image=image is not None)
        view = StreamView(adapter or BASE)
        handle = self.bg.submit(
            prompt, sampling_params=sampling, lora=self._lora_of(adapter), images=self._images(image)
        )
        self._track(owner, [handle])
        try:
            for out in handle:
                view.update(out)
                yield view
        finally:
            self._untrack(owner, [handle])
            if not handle.finished:
                handle.abort()

    def compare_stream(
        self,
        prompt: str,
        adapters: Sequence[str],
        sampling: SamplingParams,
        *,
        image: Any = None,
        use_template: bool = True,
        interval_s: float = 0.05,
        owner: str | None = None,
    ) -> Iterator[list[StreamView]]:
        """Generate ``prompt`` with every adapter in ``adapters`` (``BASE`` for none), in one batch.

        The requests are submitted together, so the engine schedules them into the same steps. Yields
        the views of all columns whenever one changed (at most every ``interval_s``), last when all ended.
        """
        adapters = list(adapters or [])
        if not adapters:
            raise ValueError("adapters: pick at least one (the base model counts)")
        if len(adapters) > MAX_COMPARE:
            raise ValueError(f"adapters: at most {MAX_COMPARE} side by side, got {len(adapters)}")
        if len(set(adapters)) != len(adapters):
            raise ValueError("adapters: each adapter may appear once")
        text = self.format_prompt([{"role": "user", "content": prompt}], use_template, image is not None)
        images = self._images(image)
        handles = self.bg.submit_many(
            [
                {"prompt": text, "sampling_params": sampling, "lora": self._lora_of(a), "images": images}
                for a in adapters
            ]
        )
        views = [StreamView(a) for a in adapters]
        self._track(owner, handles)
        try:
            yield from _merge_streams(handles, views, interval_s)
        finally:
            self._untrack(owner, handles)


def _merge_streams(
    handles: list[RequestHandle], views: list[StreamView], interval_s: float
) -> Iterator[list[StreamView]]:
    """Read several handles at once (a thread each) and yield the views as they change."""
    updates: queue.Queue[tuple[int, RequestOutput]] = queue.Queue()

    def pump(i: int, handle: RequestHandle) -> None:
        for out in handle:
            updates.put((i, out))

    for i, h in enumerate(handles):
        threading.Thread(target=pump, args=(i, h), name=f"mmlora-app-stream-{i}", daemon=True).start()
    try:
        while not all(v.finished for v in views):
            i, out = updates.get()
            views[i].update(out)
            deadline = time.monotonic() + interval_s
            while True:  # gather what else arrives within interval_s into the same yield
                try:
                    i, out = updates.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                views[i].update(out)
                if all(v.finished for v in views):
                    break
            yield views
    finally:
        for h in handles:
            if not h.finished:
                h.abort()


__all__ = [
    "BASE",
    "MAX_COMPARE",
    "AppController",
    "StreamView",
    "make_sampling",
    "message_text",
]
