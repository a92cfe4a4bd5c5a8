"""The overlap scheduler (mmlora.engine.overlap) changes when the host reads tokens, never which tokens.

Oracle: the same engine configuration stepping serially (``overlap_schedule="off"``). On a CPU
``"on"`` runs the same code paths as on CUDA (placeholders resolved on the device, read-back one step
later, dropped rows of finished requests); only the device runs nothing beside the host.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama_with_two_ranks

import mmlora
from mmlora.config import EngineConfig
from mmlora.engine.cuda_graph import CudaGraphRunner
from mmlora.engine.fault_isolation import FaultInjector
from mmlora.engine.overlap import placeholder, resolve_placeholders
from mmlora.engine.request import Request
from mmlora.engine.sampler import BAD_LOGITS, BAD_PROBS, sample, sample_on_device
from mmlora.engine.sampling_params import SamplingParams

PROMPTS = [[5, 9, 13, 2, 7], [31, 4, 4, 8, 19, 3, 6] * 5, [11, 12, 13], [40, 41, 2, 9, 9, 9], [7, 7, 3, 1]]
LORAS = ["a", None, "b", "a", "b"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llama_with_two_ranks(tmp_path_factory.mktemp("overlap"))


def _engine(tiny, overlap: str, **kw) -> mmlora.Engine:
    base, adapters = tiny
    opts = dict(
        model=str(base),
        lora_paths={n: str(p) for n, p in adapters.items()},
        max_loras_per_batch=2,
        max_lora_rank=4,
        block_size=4,
        max_num_batched_tokens=16,  # the long prompt prefills in chunks beside decode rows
        device="cpu",
        dtype="float32",
        overlap_schedule=overlap,
    )
    opts.update(kw)
    return mmlora.Engine(**opts)


def _params() -> list[dict]:
    return [
        {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True, "stop_token_ids": [31]},
        {"max_new_tokens": 7, "temperature": 0.9, "top_k": 20, "seed": 11, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0.0, "min_new_tokens": 4},  # may stop at EOS after 4
        {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.8, "seed": 5, "stop_token_ids": [3, 247]},
    ]


def _summary(outs) -> list[tuple]:
    return [
        (o.output_ids, [round(x, 5) for x in o.logprobs or []], o.finish_reason, o.matched_stop, o.text)
        for o in outs
    ]


def test_overlapped_steps_give_the_serial_tokens_logprobs_and_stops(tiny):
    results = {}
    for mode in ("off", "on"):
        with _engine(tiny, mode) as engine:
            assert engine.overlap is (mode == "on")
            outs = engine.generate(
                input_ids=PROMPTS, lora_paths=LORAS, sampling_params=_params(), return_logprob=True
            )
            results[mode] = _summary(outs)
            assert engine._inflight is None  # nothing left on the device once every request finished
    assert results["on"] == results["off"]
    # Two requests stop on a token while their next row is already launched: those rows are dropped.
    assert [r[2] for r in results["on"]].count("stop") == 2


def test_penalised_requests_step_serially_beside_overlapped_ones(tiny):
    params = _params()
    params[1] = {**params[1], "repetition_penalty": 1.3}
    params[3] = {"max_new_tokens": 6, "temperature": 0.0, "presence_penalty": 0.5, "ignore_eos": True}
    results = {}
    for mode in ("off", "on"):
        with _engine(tiny, mode) as engine:
            results[mode] = _summary(
                engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=params)
            )
    assert results["on"] == results["off"]


def test_no_row_is_wasted_on_requests_whose_last_token_is_pending(tiny):
    """ignore_eos requests end by length: the scheduler knows it and never launches a row past their end."""
    sp = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    rows = {}
    for mode in ("off", "on"):
        with _engine(tiny, mode) as engine:
            forward, count = engine.runner.forward, []

            def counting(sched, forward=forward, count=count):
                count.append(sched.num_tokens)
                return forward(sched)

            engine.runner.forward = counting
            outs = engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=sp)
            assert all(len(o.output_ids) == 5 for o in outs)
            rows[mode] = sum(count)
    assert rows["on"] == rows["off"]


def test_preemption_and_aborts_under_overlap(tiny):
    sp = {"max_new_tokens": 14, "temperature": 0.0, "ignore_eos": True}
    reference = _engine(tiny, "off").generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=sp)
    engine = _engine(tiny, "on", max_kv_tokens=48)  # too few pages for every request: preemption
    rids = [engine.add_request(input_ids=p, lora=lo, sampling_params=sp) for p, lo in zip(PROMPTS, LORAS)]
    victim = engine.add_request(input_ids=[9, 9, 9], sampling_params=sp)
    done, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 500
        for out in engine.step():
            if out.request_id == victim and len(out.output_ids) >= 2:
                engine.abort(victim)  # while its next token is on the device
            if out.finished:
                done[out.request_id] = out
    assert engine.stats()["num_preemptions_total"] > 0
    assert [done[r].output_ids for r in rids] == [o.output_ids for o in reference]
    assert done[victim].finish_reason == "abort" and 2 <= len(done[victim].output_ids) <= 3
    assert engine.kv_cache.allocator.num_free == engine.kv_cache.allocator.num_blocks  # every page back


def test_a_faulty_request_fails_alone_under_overlap(tiny):
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    reference = _engine(tiny, "off").generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=sp)
    engine = _engine(tiny, "on")
    rids = [engine.add_request(input_ids=p, lora=lo, sampling_params=sp) for p, lo in zip(PROMPTS, LORAS)]
    engine.step()
    engine.step_guard.faults = FaultInjector(sampling_rids={rids[2]})  # its sampling raises from now on
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rids[2]].finish_reason == "abort" and "InjectedFault" in done[rids[2]].error
    for k in (0, 1, 3, 4):
        assert done[rids[k]].output_ids == reference[k].output_ids


def test_decode_graph_runner_resolves_placeholders(tiny):
    """The CUDA-graph runner's static-buffer path (run eagerly here) reads pending tokens on the device."""
    sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    results = {}
    for mode in ("off", "on"):
        with _engine(tiny, mode) as engine:
            graphs = CudaGraphRunner(engine.runner, 8, engine.max_model_len, capture=False)
            engine.runner.decode_graphs = graphs
            outs = engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=sp)
            assert graphs.num_replays > 0
            results[mode] = [o.output_ids for o in outs]
    assert results["on"] == results["off"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_with_captured_graphs_gives_the_serial_tokens(tiny):
    """The real thing: decode graphs replayed with placeholders resolved into their static inputs, page-
    locked read-backs behind events, slot loads on their own stream."""
    results = {}
    for mode in ("off", "on"):
        with _engine(tiny, mode, device="cuda", max_running_requests=8) as engine:
            assert engine.runner.decode_graphs is not None and engine.overlap is (mode == "on")
            outs = engine.generate(
                input_ids=PROMPTS, lora_paths=LORAS, sampling_params=_params(), return_logprob=True
            )
            assert engine.runner.decode_graphs.num_replays > 0
            results[mode] = _summary(outs)
    assert results["on"] == results["off"]


def test_resolve_placeholders_against_a_python_reference():
    future = torch.tensor([101, 102, BAD_LOGITS, 104])
    ids = [7, placeholder(0), 3, placeholder(3), placeholder(2), placeholder(1)]
    got = resolve_placeholders(torch.tensor(ids), future).tolist()
    want = [t if t >= 0 else max(int(future[-1 - t]), 0) for t in ids]
    assert got == want == [7, 101, 3, 104, 0, 102]
    assert resolve_placeholders(torch.tensor([4, 5]), torch.empty(0, dtype=torch.long)).tolist() == [4, 5]


def test_token_slices_of_a_request_with_pending_tokens():
    req = Request("r", [1, 2, 3], SamplingParams(), None)
    req.output_ids = [4, 5]
    req.pending = [placeholder(7), placeholder(2)]
    assert req.num_tokens == 7 and req.num_known_tokens == 5 and req.num_generated == 4
    assert req.token_slice(0, 7) == [1, 2, 3, 4, 5, -8, -3]
    assert req.token_slice(4, 6) == [5, -8] and req.token_slice(6, 7) == [-3]
    assert [req.token_at(p) for p in range(7)] == req.token_slice(0, 7)


def _requests(params: list[dict]) -> list[Request]:
    return [Request(f"r{i}", [1, 2], SamplingParams.from_any(p), None) for i, p in enumerate(params)]


def test_sample_on_device_matches_sample_and_marks_bad_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 10, "seed": 3},
        {"temperature": 0.0, "min_new_tokens": 2},
        {"temperature": 1.2, "top_p": 0.7, "min_p": 0.05, "seed": 9},
    ]
    eos = frozenset({int(logits[2].argmax())})  # held back: row 2 must not pick it
    gen = torch.Generator().manual_seed(1)
    want, _ = sample(logits.clone(), _requests(params), gen, eos)
    gen = torch.Generator().manual_seed(1)
    got, _ = sample_on_device(logits.clone(), _requests(params), gen, eos)
    assert got.tolist() == want and got.dtype == torch.long and want[2] not in eos

    bad = logits.clone()
    bad[0, 5] = float("nan")
    bad[3] = float("-inf")  # every probability NaN after the softmax: its parameters' fault
    tokens, _ = sample_on_device(bad, _requests(params), torch.Generator().manual_seed(1), frozenset())
    assert tokens[0] == BAD_LOGITS and tokens[3] == BAD_PROBS and tokens[1] >= 0 and tokens[2] >= 0


def test_sample_on_device_refuses_penalties():
    with pytest.raises(ValueError, match="penalised"):
        sample_on_device(torch.zeros(1, 5), _requests([{"repetition_penalty": 1.2}]), torch.Generator())


def test_overlap_option_is_checked():
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig.from_kwargs(overlap_schedule="yes")
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig.from_kwargs(overlap_schedule="on", tp_size=2)
