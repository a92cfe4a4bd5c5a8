"""``weight_layout="column-major"`` (an experiment, mmlora.layers.packed_linear.set_weight_layout): on CUDA
the base linears' weights become views of their contiguous transposes, and the engine gives the greedy
tokens and logprobs of the row-major engine (cuBLAS may sum in another order: logprobs within fp32
rounding), adapters and CUDA graphs included. On CPU the option changes nothing (checked here too)."""

from __future__ import annotations

import pytest
import torch

import mmlora
from mmlora.layers.packed_linear import PackedLinear

PROMPTS = [[5, 9, 13, 2, 7], [31, 4, 4, 8, 19, 3, 6], [11, 12, 13], [40, 41, 2, 9, 9, 9]]
LORAS = ["a", None, "b", "a"]
SAMPLING = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def _run(tiny, device: str, layout: str) -> tuple[mmlora.Engine, list]:
    base, adapters = tiny("llama")
    engine = mmlora.Engine(
        model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=4, max_running_requests=4,
        device=device, dtype="float32", weight_layout=layout,
    )  # fmt: skip
    outs = engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=SAMPLING, return_logprob=True)
    return engine, outs


def _linear_weights(engine: mmlora.Engine) -> list[torch.Tensor]:
    return [m.weight for m in engine.model.modules() if isinstance(m, PackedLinear)]


def _assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_column_major_weights_give_the_row_major_tokens_on_cuda(tiny) -> None:
    row, want = _run(tiny, "cuda", "row-major")
    assert all(w.is_contiguous() for w in _linear_weights(row))
    del row
    col, got = _run(tiny, "cuda", "column-major")
    weights = _linear_weights(col)
    assert any(not w.is_contiguous() and w.t().is_contiguous() for w in weights)
    _assert_same(got, want)


def test_the_layout_is_a_cuda_option(tiny) -> None:
    row, want = _run(tiny, "cpu", "row-major")
    col, got = _run(tiny, "cpu", "column-major")
    assert col.config.model.weight_layout == "column-major"
    assert all(w.is_contiguous() for w in _linear_weights(col))
    _assert_same(got, want)
