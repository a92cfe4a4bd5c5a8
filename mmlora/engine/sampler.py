"""Sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs of the model."""

from __future__ import annotations

import torch

from mmlora.engine.request import Request


class BadSamplingRows(ValueError):
    """Rows whose logits or sampling probabilities are NaN/Inf: ``rows`` maps a batch index to why;
    ``model_rows`` are those whose raw logits were already bad (the model's fault, not the request's).

    Raised before ``torch.multinomial`` sees them: on CUDA a NaN there is a device-side assert that
    poisons the whole process, not just the request.
    """

    def __init__(self, rows: dict[int, str], model_rows: set[int]) -> None:
        super().__init__("; ".join(f"row {i}: {why}" for i, why in rows.items()))
        self.rows = rows
        self.model_rows = model_rows


def _check_rows(logits: torch.Tensor, probs: torch.Tensor | None, requests: list[Request]) -> None:
    bad_logits = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1).tolist()
    model_rows = {i for i, bad in enumerate(bad_logits) if bad}
    rows = dict.fromkeys(model_rows, "the model produced NaN or Inf logits")
    if probs is not None:
        ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        for i, good in enumerate(ok.tolist()):
            if not good and i not in rows and not requests[i].sampling.greedy:
                rows[i] = _bad_probs_message(requests[i])
    if rows:
        raise BadSamplingRows(rows, model_rows)


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition penalty (HF style, over prompt + output) and OpenAI frequency / presence penalties (output)."""
    for i, req in enumerate(requests):
        sp = req.sampling
        if sp.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(req.all_ids)), device=logits.device, dtype=torch.long)
            vals = logits[i, ids]
            logits[i, ids] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if (sp.frequency_penalty or sp.presence_penalty) and req.output_ids:
            ids, counts = torch.tensor(req.output_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= sp.frequency_penalty * counts.to(logits.dtype) + sp.presence_penalty
    return logits


def _mask_stop_tokens(
    logits: torch.Tensor, requests: list[Request], eos_ids: frozenset[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-inf, in place, on the tokens that would end a request before its ``min_new_tokens``: its
    ``stop_token_ids``, and the model's EOS ids unless it ignores EOS (vLLM's ``min_tokens`` and
    SGLang's ``min_new_tokens``: such a token cannot be chosen, rather than chosen and not obeyed).
    Returns the logits and the (rows, columns) index [2, n] it masked (None when nothing)."""
    rows: list[int] = []
    cols: list[int] = []
    V = logits.shape[1]
    for i, req in enumerate(requests):
        sp = req.sampling
        if req.num_generated < sp.min_new_tokens:
            stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos_ids)
            ids = [t for t in stops if 0 <= t < V]
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return logits, None
    # One indexed write for the batch, not one per request.
    index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
    logits[index[0], index[1]] = float("-inf")
    return logits, index


def _filter(probs_logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Mask logits outside top-k, top-p and min-p (each row its own settings)."""
    logits = probs_logits
    B, V = logits.shape
    top_k = torch.tensor(
        [r.sampling.top_k if r.sampling.top_k > 0 else V for r in requests], device=logits.device
    )
    top_p = torch.tensor([r.sampling.top_p for r in requests], device=logits.device, dtype=logits.dtype)
    min_p = torch.tensor([r.sampling.min_p for r in requests], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device).expand(B, V)
    remove = ranks >= top_k.clamp(max=V).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    remove |= (cum - probs) > top_p.unsqueeze(1)  # keep the smallest prefix reaching top_p
    remove |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    requests: list[Request],
    default_generator: torch.Generator,
    eos_ids: frozenset[int] = frozenset(),
) -> tuple[list[int], torch.Tensor]:
    """logits [B, V] fp32 -> (next token ids, log_softmax of the raw logits [B, V], or [B, 0] when no
    request returns logprobs). A request short of its ``min_new_tokens`` cannot draw a token that would
    end it (``eos_ids``, the model's, count unless it ignores EOS).

    Requests without a seed draw from ``default_generator`` (the engine's own, seeded from its config).
    Raises ``BadSamplingRows`` naming the rows with NaN/Inf logits or probabilities.
    """
    raw = logits
    want_logprobs = any(r.return_logprob or r.top_logprobs_num for r in requests)
    # Zero-width rows when no request reads them: a log_softmax over [B, V] each step for nothing.
    logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else raw.new_empty(len(requests), 0)
    penalised = any(r.sampling.penalised for r in requests)
    held = any(r.num_generated < r.sampling.min_new_tokens for r in requests)
    logits = raw.clone() if penalised or held else raw  # penalties and stop masks write in place
    if penalised:
        logits = _apply_penalties(logits, requests)
    masked = None
    if held:
        logits, masked = _mask_stop_tokens(logits, requests, eos_ids)
    greedy = [r.sampling.greedy for r in requests]
    tokens = logits.argmax(dim=-1)
    if all(greedy) and not penalised:
        # argmax picks a NaN (or else a +Inf) wherever a row has one, so the logit it chose tells whether
        # the row is bad: one gather and one transfer to the host, not three passes over [B, V] and two.
        # Stop tokens masked to -inf above hide their raw values from argmax: those are gathered too.
        top = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        bad_top = torch.isnan(top) | torch.isposinf(top)
        if masked is not None:
            stop = raw[masked[0], masked[1]]
            hits = (torch.isnan(stop) | torch.isposinf(stop)).to(torch.int32)
            bad_top |= torch.zeros_like(tokens, dtype=torch.int32).index_add_(0, masked[0], hits) > 0
        chosen = torch.where(bad_top, -1, tokens).tolist()
        bad = {i for i, t in enumerate(chosen) if t < 0}
        if bad:
            raise BadSamplingRows(dict.fromkeys(bad, "the model produced NaN or Inf logits"), bad)
        return chosen, logprobs
    if all(greedy):
        _check_rows(raw, None, requests)
    else:
        temps = torch.tensor(
            [1.0 if g else r.sampling.temperature for r, g in zip(requests, greedy)], device=logits.device
        )
        probs = _filter(logits / temps.unsqueeze(1), requests).softmax(dim=-1)
        _check_rows(raw, probs, requests)
        for i, req in enumerate(requests):
            if greedy[i]:
                continue
            tokens[i] = torch.multinomial(probs[i], 1, generator=req.generator or default_generator)[0]
    return tokens.tolist(), logprobs


#: What ``sample_on_device`` writes for a row it cannot sample: its raw logits hold NaN/+Inf (the model's
#: fault), or its sampling probabilities do (its sampling parameters' fault).
BAD_LOGITS, BAD_PROBS = -1, -2


def sample_on_device(
    logits: torch.Tensor,
    requests: list[Request],
    default_generator: torch.Generator,
    eos_ids: frozenset[int] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` without reading anything back: -> (token ids int64 [B] on the logits' device, logprobs
    as ``sample`` gives them). A row that cannot be sampled gets ``BAD_LOGITS`` or ``BAD_PROBS`` instead of
    a token, for the reader to fail that request; its draw never sees a NaN (on CUDA that is a
    device-side assert that would poison every request). Penalties are not applied here: the overlap
    scheduler that calls this steps synchronously for penalised requests, whose output ids it lacks."""
    if any(r.sampling.penalised for r in requests):
        raise ValueError("sample_on_device: penalised requests need their output ids; use sample()")
    raw = logits
    want_logprobs = any(r.return_logprob or r.top_logprobs_num for r in requests)
    logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else raw.new_empty(len(requests), 0)
    held = any(r.num_generated < r.sampling.min_new_tokens for r in requests)
    logits = _mask_stop_tokens(raw.clone(), requests, eos_ids)[0] if held else raw
    greedy = [r.sampling.greedy for r in requests]
    tokens = logits.argmax(dim=-1)
    bad_logits = (torch.isnan(raw) | torch.isposinf(raw)).any(dim=-1)
    if not all(greedy):
        temps = torch.tensor(
            [1.0 if g else r.sampling.temperature for r, g in zip(requests, greedy)], device=logits.device
        )
        probs = _filter(logits / temps.unsqueeze(1), requests).softmax(dim=-1)
        ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        # A bad row draws from a harmless stand-in; its token is replaced by BAD_PROBS below.
        probs = torch.where(ok.unsqueeze(1), probs, torch.ones_like(probs))
        for i, req in enumerate(requests):
            if not greedy[i]:
                tokens[i] = torch.multinomial(probs[i], 1, generator=req.generator or default_generator)[0]
        sampled = torch.tensor([not g for g in greedy], device=logits.device)
        tokens = torch.where(sampled & ~ok, BAD_PROBS, tokens)
    return torch.where(bad_logits, BAD_LOGITS, tokens), logprobs


def bad_row_message(code: int, req: Request) -> str:
    """Why ``sample_on_device`` could not sample ``req`` (``code``: BAD_LOGITS or BAD_PROBS), worded as
    the synchronous sampler's failures are."""
    return (
        "internal error: the model produced NaN or Inf logits"
        if code == BAD_LOGITS
        else _bad_probs_message(req)
    )


def _bad_probs_message(req: Request) -> str:
    sp = req.sampling
    return (
        "sampling probabilities are NaN or Inf with these sampling parameters "
        f"(temperature={sp.temperature:g}, repetition_penalty={sp.repetition_penalty:g})"
    )
