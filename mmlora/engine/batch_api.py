"""The one-call side of the engine: ``generate`` (a batch to completion) and ``stream`` (one request's
increments), both over ``add_request`` / ``step`` / ``abort``; mixed into :class:`~mmlora.engine.engine.Engine`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from mmlora.engine.sampling_params import RequestOutput, SamplingParams


class BatchAPI:
    """``generate`` and ``stream`` for an engine that has ``add_request``, ``step``, ``abort``, the
    ``_requests`` it holds and an ``_ids`` counter."""

    def generate(
        self,
        texts: str | Sequence[str] | None = None,
        lora_paths: str | Sequence[str | None] | None = None,
        images: Sequence[Any] | None = None,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> list[RequestOutput]:
        """Run a batch to completion: one output per prompt (``n`` consecutive outputs when n > 1)."""
        prompts: list[Any] = [texts] if isinstance(texts, str) else list(texts) if texts is not None else []
        if input_ids is not None:
            if prompts:
                raise ValueError("give texts or input_ids, not both")
            prompts = [None] * len(input_ids)
        count = len(prompts)
        loras = per_prompt(lora_paths, count, "lora_paths")
        imgs = per_prompt(images, count, "images", list_is_per_prompt=True)
        params = per_prompt(sampling_params, count, "sampling_params")
        rids: list[str] = []
        try:
            for i in range(count):
                for one in SamplingParams.from_any(params[i]).samples():
                    rid = self.add_request(
                        prompts[i],
                        input_ids=input_ids[i] if input_ids is not None else None,
                        sampling_params=one,
                        lora=loras[i],
                        images=_as_list(imgs[i]),
                        request_id=f"gen-{next(self._ids)}",
                        return_logprob=return_logprob,
                        top_logprobs_num=top_logprobs_num,
                        logprob_start_len=logprob_start_len,
                    )
                    rids.append(rid)
        except Exception:
            for rid in rids:
                self.abort(rid)
            while any(r in self._requests for r in rids):
                self.step()
            raise
        results: dict[str, RequestOutput] = {}
        while len(results) < len(rids):
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in rids]

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[RequestOutput]:
        """Add one request and yield its increments until it finishes (drives the other requests too)."""
        rid = self.add_request(prompt, **kwargs)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            if rid in self._requests:
                self.abort(rid)
                while rid in self._requests:
                    self.step()


def _as_list(value: Any) -> list[Any] | None:
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def per_prompt(value: Any, count: int, name: str, list_is_per_prompt: bool = False) -> list[Any]:
    """One value for all prompts, or a list aligned with them (its length is checked). A string is one
    value; with ``list_is_per_prompt`` any list is per prompt (images: a list of lists)."""
    if isinstance(value, (list, tuple)) and (list_is_per_prompt or not isinstance(value, str)):
        if len(value) != count:
            raise ValueError(f"{name}: has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
