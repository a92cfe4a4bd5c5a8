"""Tensor parallelism on the CPU: 2 gloo processes (rank 0 here, rank 1 spawned) against tp_size 1.

Every family gets one batch mixing two adapters (one on all seven modules, one on q/v/o/down) and
base-only rows; tp=2 must give the same greedy tokens and chosen-token logprobs within 1e-4 (fp32).
Near ties: every greedy choice of the tp=1 run must lead the runner-up by more than 1e-3 (ten times
the tolerance), checked on its top-2 logprobs, so a tie cannot flip a token and hide behind the
tolerance. Qwen2 uses one KV head (replicated on both ranks); Gemma2 keeps its soft-caps and windows;
Qwen2-VL's vision tower runs on rank 0 and its features are broadcast. Then adapters are loaded and
unloaded while requests run (two slots for three adapters, so workers' slots are rewritten); decode
steps go through the graph runner on every rank; and a worker that dies, or stops answering, fails the
engine with a WorkerFailure naming it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from tiny_models import (
    ALL_SEVEN,
    PROMPTS,
    make_adapter,
    make_checkpoint,
    make_gemma2_checkpoint,
    make_qwen2_vl_checkpoint,
)

import mmlora
from mmlora.distributed import WorkerFailure

# MMLORA_TP_TEST_DEVICE=cuda runs the same tests through NCCL on GPUs 0 and 1 (benchmarks/h200x2_tp.sh).
DEVICE = os.environ.get("MMLORA_TP_TEST_DEVICE", "cpu")
MAX_NEW = 8
ADAPTERS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN),
    "qvod": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
}
ORDER = ["all7", None, "qvod", "all7", None, "qvod"]
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
BUILDERS = {
    "llama": lambda folder: make_checkpoint(folder, "llama"),
    "mistral": lambda folder: make_checkpoint(folder, "mistral"),
    "qwen2": lambda folder: make_checkpoint(folder, "qwen2", num_key_value_heads=1),
    "gemma2": lambda folder: make_gemma2_checkpoint(folder),
    "qwen2_vl": lambda folder: make_qwen2_vl_checkpoint(folder),
}
TEXT_ONLY = ["llama", "mistral", "qwen2", "gemma2"]


def _family(root: Path, arch: str, model_class: str = "AutoModelForCausalLM") -> tuple[Path, dict[str, str]]:
    base = BUILDERS[arch](root / arch)
    adapters = {
        name: str(make_adapter(base, root / f"{arch}-{name}", seed=i + 1, model_class=model_class, **kw))
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return base, adapters


def _engine(base: Path, adapters: dict[str, str], tp: int, **kwargs) -> mmlora.Engine:
    return mmlora.Engine(
        model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=8, dtype="float32",
        device=DEVICE, tp_size=tp, **kwargs,
    )  # fmt: skip


def _generate(engine: mmlora.Engine, **inputs) -> list:
    return engine.generate(
        lora_paths=ORDER, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2, **inputs
    )


def _tp1_and_tp2(base: Path, adapters: dict[str, str], **inputs) -> tuple[list, list]:
    outs = []
    for tp in (1, 2):
        engine = _engine(base, adapters, tp)
        try:
            outs.append(_generate(engine, **inputs))
        finally:
            engine.shutdown()
    return outs[0], outs[1]


def _assert_same(ref: list, got: list) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        margins = [top[0][1] - top[1][1] for top in a.top_logprobs]
        assert min(margins) > 1e-3, f"row {i}: the fixture has a near tie ({min(margins):.2e})"
        assert b.output_ids == a.output_ids, f"row {i} adapter {ORDER[i]}"
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), f"row {i} adapter {ORDER[i]}"


@pytest.mark.parametrize("arch", TEXT_ONLY)
def test_tp2_matches_tp1(arch, tmp_path):
    base, adapters = _family(tmp_path, arch)
    ref, got = _tp1_and_tp2(base, adapters, texts=PROMPTS)
    _assert_same(ref, got)


def test_qwen2_vl_tp2_matches_tp1(tmp_path):
    from PIL import Image

    base, adapters = _family(tmp_path, "qwen2_vl", "Qwen2VLForConditionalGeneration")
    rng = np.random.default_rng(0)
    image = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in [(56, 84), (28, 28)]]
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    texts = [f"Hello {slot} what", "The quick brown fox", f"{slot} and", "Paris is", f"Look {slot}", "0123"]
    images = [[image[0]], None, [image[1]], None, [image[0]], None]
    ref, got = _tp1_and_tp2(base, adapters, texts=texts, images=images)
    _assert_same(ref, got)


def test_decode_graph_steps_under_tp2_match_tp1(tmp_path):
    """Decode steps through the graph runner on every rank. On GPUs the graphs are captured (rank 0 tells
    the workers to capture alongside); on the CPU the runner's static-buffer forward runs eagerly
    (capture=False). Each step rank 0 broadcasts the static inputs and the graph key, and every worker
    replays the same graph: a worker on another graph, or with other inputs, would change the sums of
    the row-parallel layers and so rank 0's tokens."""
    base, adapters = _family(tmp_path, "llama")
    reference = _engine(base, adapters, 1, disable_cuda_graph=True)
    try:
        ref = _generate(reference, texts=PROMPTS)
    finally:
        reference.shutdown()
    engine = _engine(base, adapters, 2, max_running_requests=8)
    try:
        if DEVICE == "cpu":
            engine.runner.enable_cuda_graphs(8, engine.max_model_len, capture=False)
        graphs = engine.runner.decode_graphs
        got = _generate(engine, texts=PROMPTS)
        assert graphs.num_replays >= MAX_NEW - 1  # every decode step went through the graph runner
        assert graphs.last_key[0] == 8  # 6 rows padded to the bucket of 8
    finally:
        engine.shutdown()
    _assert_same(ref, got)


def _run(engine: mmlora.Engine, rids: list[str], outputs: dict, steps: int | None = None) -> None:
    for _ in range(steps if steps is not None else 10_000):
        for out in engine.step():
            outputs[out.request_id] = out
        if steps is None and all(outputs.get(r) and outputs[r].finish_reason for r in rids):
            return


@pytest.mark.parametrize("page_rank", [None, 4])
def test_load_and_unload_while_requests_run(tmp_path, page_rank):
    """Adapters loaded and unloaded while requests run under tp_size 2; with ``page_rank`` 4 the pools are
    paged (the rank-6 adapter takes two pages, reusing the unloaded one's) on rank 0 and the worker."""
    base, adapters = _family(tmp_path, "llama")
    third = str(make_adapter(base, tmp_path / "third", seed=7, r=6, lora_alpha=6, target_modules=ALL_SEVEN))
    plan = [(PROMPTS[0], "all7"), (PROMPTS[1], None), (PROMPTS[2], "qvod"), (PROMPTS[3], "third")]
    reference = _engine(base, {**adapters, "third": third}, 1)
    expected = reference.generate(
        [p for p, _ in plan], [a for _, a in plan], sampling_params=GREEDY, return_logprob=True
    )

    engine = _engine(base, {"all7": adapters["all7"]}, 2, lora_page_rank=page_rank)
    try:
        outputs: dict = {}

        def add(i: int) -> str:
            prompt, lora = plan[i]
            return engine.add_request(prompt, lora=lora, sampling_params=GREEDY, return_logprob=True)

        rids = [add(0), add(1)]
        _run(engine, rids, outputs, steps=3)
        engine.load_lora("qvod", adapters["qvod"])
        rids.append(add(2))
        _run(engine, rids, outputs, steps=2)
        engine.unload_lora("all7")  # its request still runs; the slot is freed when it finishes
        with pytest.raises(ValueError, match="being unloaded"):
            engine.add_request("x", lora="all7")
        engine.load_lora("third", third)  # needs all7's slot: admitted once all7's request is done
        rids.append(add(3))
        _run(engine, rids, outputs)
        assert "all7" not in [e["name"] for e in engine.list_loras()]
        for rid, exp in zip(rids, expected, strict=True):
            assert outputs[rid].output_ids == exp.output_ids
            assert outputs[rid].logprobs == pytest.approx(exp.logprobs, abs=1e-4)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_worker_fails_the_engine_with_a_clear_error(how, tmp_path):
    base = make_checkpoint(tmp_path / "llama", "llama")
    engine = _engine(base, {}, 2, dist_timeout_s=5.0)
    try:
        assert engine.generate("Hello", sampling_params=GREEDY)[0].output_ids  # the group works
        worker = engine._workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        expected = (
            r"rank 1 \(exit code -9\)" if how == "killed" else "no worker exited; one stopped answering"
        )
        with pytest.raises(WorkerFailure, match=expected):
            engine.generate("Hello again", sampling_params=GREEDY)
        if how == "stopped":
            os.kill(worker.pid, signal.SIGKILL)
    finally:
        engine.shutdown()
