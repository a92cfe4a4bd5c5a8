"""Prompt logprobs: the logprob of each prompt token given the tokens before it (SGLang's
``input_token_logprobs``, OpenAI's ``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``).

They are read off the hidden states of the prefill that computes the prompt, a chunk of rows at a time,
so a long prompt never holds a [T, vocab] fp32 matrix: at most ``CHUNK_ROWS`` rows of logits exist at
once. Chunked prefill and preemption are handled by position: a token's entry is written once, when
the forward that covers the position before it runs. The prefix cache may skip only positions whose
entries are not needed (``cacheable_prefix``), as SGLang caps a prefix match at ``logprob_start_len``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmlora.engine.request import Request
from mmlora.models.base import CausalLM

CHUNK_ROWS = 256


def start_prompt_logprobs(req: Request, logprob_start_len: int) -> None:
    """Ask for prompt logprobs from token ``logprob_start_len`` on (SGLang: -1 means the last prompt
    token only). Token 0 has no context: its entry is None."""
    n = len(req.prompt_ids)
    if not isinstance(logprob_start_len, int) or not -1 <= logprob_start_len < n:
        raise ValueError(f"logprob_start_len: must be -1 or in [0, {n}) for a prompt of {n} tokens")
    req.input_logprob_start = logprob_start_len if logprob_start_len >= 0 else n - 1
    if req.input_logprob_start == 0:
        req.input_logprobs.append(None)
        if req.top_logprobs_num:
            req.input_top_logprobs.append([])


def cacheable_prefix(req: Request) -> int | None:
    """How many leading tokens the prefix cache may supply without skipping a prompt logprob still to be
    recorded (token t's needs position t - 1 to run); None: no limit."""
    if req.input_logprob_start < 0:
        return None
    next_entry = req.input_logprob_start + len(req.input_logprobs)
    if next_entry >= len(req.prompt_ids):
        return None
    return max(next_entry - 1, 0)


def _rows_needed(
    requests: Sequence[Request], num_new: Sequence[int]
) -> tuple[list[int], list[int], list[Request]]:
    """(hidden row, target token, request) for each prompt token whose logprob this forward yields.

    Token t is predicted by the hidden state at position t - 1; a request's rows this step hold
    positions [num_computed, num_computed + n).
    """
    rows: list[int] = []
    targets: list[int] = []
    owners: list[Request] = []
    offset = 0
    for req, n in zip(requests, num_new):
        if req.input_logprob_start >= 0:
            start = req.num_computed
            first = max(req.input_logprob_start + len(req.input_logprobs), start + 1)
            for t in range(first, min(len(req.prompt_ids), start + n + 1)):
                rows.append(offset + t - 1 - start)
                targets.append(req.prompt_ids[t])
                owners.append(req)
        offset += n
    return rows, targets, owners


def record_prompt_logprobs(
    model: CausalLM, hidden: torch.Tensor, requests: Sequence[Request], num_new: Sequence[int]
) -> None:
    """Append this forward's prompt-token logprobs (and top-k, per ``top_logprobs_num``) to the requests.

    ``hidden`` [T, H] is the final hidden state of every token of the forward, requests in order.
    """
    rows, targets, owners = _rows_needed(requests, num_new)
    if not rows:
        return
    top_k = max(r.top_logprobs_num for r in owners)
    row_index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    target_index = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for lo in range(0, len(rows), CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, len(rows))
        logprobs = torch.log_softmax(model.compute_logits(hidden[row_index[lo:hi]]), dim=-1)
        chosen = logprobs.gather(1, target_index[lo:hi, None])[:, 0].tolist()
        tops = logprobs.topk(top_k, dim=-1) if top_k else None
        top_vals = tops.values.tolist() if tops is not None else None
        top_ids = tops.indices.tolist() if tops is not None else None
        for k in range(hi - lo):
            req = owners[lo + k]
            req.input_logprobs.append(chosen[k])
            if req.top_logprobs_num:
                n = req.top_logprobs_num
                req.input_top_logprobs.append(list(zip(top_ids[k][:n], top_vals[k][:n])))
