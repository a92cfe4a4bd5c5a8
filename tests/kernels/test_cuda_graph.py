"""CUDA-graph decode: the same greedy tokens with graphs on and off; Triton attention against the torch
reference inside the engine.

The GPU tests are skipped without CUDA. One CPU test runs the graph runner's static-buffer path
eagerly (``CudaGraphRunner(capture=False)``): buckets, padding rows, block tables and LoRA routing are
checked against the ordinary eager engine on any machine.
"""

from __future__ import annotations

import gc

import pytest
import torch
from graph_safety import KeyLog, assert_same_outputs

import mmlora
from mmlora.engine.cuda_graph import CudaGraphRunner, batch_buckets

PROMPTS = [
    [5, 9, 13, 2, 7],
    [31, 4, 4, 8, 19, 3, 6],
    [11, 12, 13],
    [40, 41, 2, 9, 9, 9],
    [7, 7],
    [8, 1, 2, 3],
]
LORAS = ["a", None, "b", "a", "b", None]
SAMPLING = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine(base, adapters, device: str, **kw) -> mmlora.Engine:
    opts = dict(
        model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=4, max_running_requests=5,
        block_size=4, max_kv_tokens=2048, device=device, dtype="float32",
        disable_cpu_graph=True,  # these tests put their own runner in (its padding page counted)
    )  # fmt: skip
    opts.update(kw)
    return mmlora.Engine(**opts)


def _generate(engine: mmlora.Engine) -> list:
    return engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=SAMPLING, return_logprob=True)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(200) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200]
    with pytest.raises(ValueError):
        batch_buckets(0)


#: Mostly one adapter: sorted by slot, a full decode step is runs of several rows, so triton-auto
#: replays its ``runs`` graphs (SGMV) for them, and its ``rows`` graphs (BGMV) for the last request alone.
RUN_LORAS = ["a", "a", None, "a", "a", "b"]


@pytest.mark.parametrize(
    ("lora_backend", "loras"),
    [("torch-gather", LORAS), ("triton-bgmv", LORAS), ("triton-sgmv", RUN_LORAS), ("triton-auto", RUN_LORAS)],
)
def test_static_buffer_path_matches_eager(tiny, lora_backend, loras):
    """The graph runner's inputs (padded buckets, pad page, LoRA routing in each of the backend's graph
    layouts) without capture (on CUDA when there is one: Triton on CPU needs the interpreter, which is
    only set without CUDA)."""
    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The backend's own layouts: no shrink stage (on CUDA it is on by default; its staged layouts would take
    # some of these steps, test_lora_stage_engine.py replays them).
    kw = dict(lora_backend=lora_backend, disable_cuda_graph=True, lora_stage_slots=0)

    def generate(engine: mmlora.Engine) -> list:
        return engine.generate(
            input_ids=PROMPTS, lora_paths=loras, sampling_params=SAMPLING, return_logprob=True
        )

    ref = generate(_engine(base, adapters, device, **kw))
    engine = _engine(base, adapters, device, **kw)
    runner = engine.runner
    graphs = runner.decode_graphs = CudaGraphRunner(runner, 5, engine.max_model_len, capture=False)
    assert engine.kv_cache.allocator.num_blocks == 2048 // 4 - 1  # the padding page is reserved
    graphs.graphs = KeyLog(graphs.graphs)
    assert_same_outputs(ref, generate(engine), 1e-4)
    used = {layout for _, bound, layout in graphs.graphs.used if bound}
    assert used == set(runner.lora.graph_layouts), used  # triton-auto: both layouts were replayed


def test_decode_replays_the_graph_of_its_rank_bucket(tiny):
    """A rank-64 pool serving rank-4 and rank-2 adapters: decode steps replay the (bucket, 16) graphs (or
    the no-LoRA ones), never those shaped for rank 32 or 64 (issue 23), with the eager tokens."""
    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(lora_backend="torch-gather", disable_cuda_graph=True, max_lora_rank=64)
    ref = _generate(_engine(base, adapters, device, **kw))
    engine = _engine(base, adapters, device, **kw)
    graphs = engine.runner.decode_graphs = CudaGraphRunner(
        engine.runner, 5, engine.max_model_len, capture=False
    )
    assert set(graphs.graphs) == {(b, r, "rows") for b in graphs.buckets for r in (0, 16, 32, 64)}
    graphs.graphs = KeyLog(graphs.graphs)
    assert_same_outputs(ref, _generate(engine), 1e-4)
    assert {r for _, r, _ in graphs.graphs.used} == {0, 16}  # 0: steps left with base-only rows


def test_a_broadcast_graph_step_replays_the_same_step(tiny, monkeypatch):
    """What a tensor-parallel worker does with rank 0's REPLAY command, in one process: the broadcast
    payload and graph key of a step, replayed, give that step's logits again; a worker whose pool gives
    another rank bound fails instead of replaying another graph."""
    from mmlora.engine import cuda_graph

    base, adapters = tiny()
    engine = _engine(base, adapters, "cpu", disable_cuda_graph=True)
    graphs = engine.runner.decode_graphs = CudaGraphRunner(
        engine.runner, 5, engine.max_model_len, capture=False
    )
    sent, logits = [], []
    monkeypatch.setattr(cuda_graph, "send_replay", lambda *args: sent.append(args))
    graphs.sends_replays = True
    replay = graphs._replay
    monkeypatch.setattr(graphs, "_replay", lambda *key: logits.append(replay(*key).clone()) or logits[-1])
    engine.generate(
        input_ids=PROMPTS[:3], lora_paths=LORAS[:3], sampling_params={**SAMPLING, "max_new_tokens": 3}
    )
    assert len(sent) == 2 and sent[-1][:3] == (4, 4, 0)  # 3 rows in bucket 4, rank bound 4, layout rows
    graphs._pad_host(graphs.max_bs)  # the step's inputs must come from the payload alone
    graphs.block_tables.fill_(graphs.pad_page)
    torch.testing.assert_close(graphs.replay_received(*sent[-1]), logits[-2], rtol=0, atol=0)
    bucket, _, layout, payload = sent[-1]
    with pytest.raises(RuntimeError, match="rank bound is 4 here but 0 on rank 0"):
        graphs.replay_received(bucket, 0, layout, payload)


@cuda
def test_graphs_are_on_by_default_and_can_be_disabled(tiny):
    base, adapters = tiny()
    engine = _engine(base, adapters, "cuda")
    graphs = engine.runner.decode_graphs
    assert graphs is not None, "CUDA graphs were not captured on a CUDA engine"
    assert graphs.buckets == [1, 2, 4, 5]
    # One graph per (batch bucket, LoRA rank bound, layout): bound 0 (no LoRA) and the rank-4 pool's
    # one rank bucket in each of the default backend's layouts.
    layouts = engine.runner.lora.graph_layouts
    assert set(graphs.graphs) == {(b, 0, "rows") for b in graphs.buckets} | {
        (b, 4, layout) for b in graphs.buckets for layout in layouts
    }
    del engine, graphs
    _free()
    off = _engine(base, adapters, "cuda", disable_cuda_graph=True)
    assert off.runner.decode_graphs is None
    del off
    _free()


# Every LoRA backend and both attention backends, each architecture at least once (kept short for CI).
COMBOS = [
    ("llama", "torch-gather", "triton"),
    ("llama", "triton-bgmv", "triton"),
    ("llama", "triton-sgmv", "triton"),
    ("mistral", "triton-bgmv", "triton"),
    ("qwen2", "triton-sgmv", "triton"),
    ("llama", "triton-bgmv", "torch"),
    ("mistral", "torch-gather", "torch"),
    ("qwen2", "triton-bgmv", "torch"),
]


@cuda
@pytest.mark.parametrize(("arch", "lora_backend", "attention"), COMBOS)
def test_graph_tokens_equal_eager(tiny, arch, lora_backend, attention):
    base, adapters = tiny(arch)
    kw = dict(lora_backend=lora_backend, attention_backend=attention)
    ref = _generate(_engine(base, adapters, "cuda", disable_cuda_graph=True, **kw))
    _free()
    engine = _engine(base, adapters, "cuda", **kw)
    got = _generate(engine)
    replays = engine.runner.decode_graphs.num_replays
    del engine
    _free()
    assert replays > 0, "no decode step replayed a graph"
    assert_same_outputs(ref, got, 1e-4)


@cuda
@pytest.mark.parametrize("lora_backend", ["triton-sgmv", "triton-auto"])
def test_graphs_in_the_runs_layout_equal_eager(tiny, lora_backend):
    """Captured graphs whose LoRA segments are runs of rows on one adapter (SGMV), and for triton-auto
    also per-row graphs (BGMV) picked per replay: the eager tokens, and every layout replayed."""
    base, adapters = tiny()

    def generate(engine: mmlora.Engine) -> list:
        return engine.generate(
            input_ids=PROMPTS, lora_paths=RUN_LORAS, sampling_params=SAMPLING, return_logprob=True
        )

    ref = generate(_engine(base, adapters, "cuda", disable_cuda_graph=True, lora_backend=lora_backend))
    _free()
    # The backend's own layouts: no shrink stage (on by default on CUDA; test_lora_stage_engine.py has it).
    engine = _engine(base, adapters, "cuda", lora_backend=lora_backend, lora_stage_slots=0)
    graphs = engine.runner.decode_graphs
    graphs.graphs = KeyLog(graphs.graphs)
    got = generate(engine)
    used = {layout for _, bound, layout in graphs.graphs.used if bound}
    layouts = set(engine.runner.lora.graph_layouts)
    del engine, graphs
    _free()
    assert_same_outputs(ref, got, 1e-4)
    assert used == layouts, used


@cuda
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("graphs", [False, True])
def test_triton_attention_matches_torch_reference_in_engine(tiny, arch, graphs):
    """Prefill (whole and chunked), decode, sliding window (mistral), qkv bias (qwen2): fp32, eager or graphs."""
    base, adapters = tiny(arch)
    kw = dict(disable_cuda_graph=not graphs, max_num_batched_tokens=16)  # 16-token budget: chunked prefill
    ref = _generate(_engine(base, adapters, "cuda", attention_backend="torch", **kw))
    _free()
    got = _generate(_engine(base, adapters, "cuda", attention_backend="triton", **kw))
    _free()
    assert_same_outputs(ref, got, 1e-3)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_on_dummy_preset_with_random_adapters(tmp_path, dtype):
    """SmolLM2-135M shapes (dummy weights) with generated rank-8/16 adapters through the normal loading path."""
    from mmlora.bench.adapters import write_random_adapters

    made = write_random_adapters("smollm2-135m", tmp_path, 4, [8, 16], dtype=dtype)
    loras = {m["name"]: m["path"] for m in made}
    names = [*loras, None]
    per_row = [names[i % len(names)] for i in range(20)]
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(5 + i % 7)] for i in range(20)]
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    opts = dict(
        model="dummy:smollm2-135m", lora_paths=loras, max_loras_per_batch=4, max_lora_rank=16,
        max_running_requests=16, max_kv_tokens=8192, device="cuda", dtype=dtype, lora_backend="triton-bgmv",
    )  # fmt: skip
    ref = mmlora.Engine(**opts, disable_cuda_graph=True).generate(
        input_ids=prompts, lora_paths=per_row, sampling_params=sp, return_logprob=True
    )
    _free()
    engine = mmlora.Engine(**opts)
    got = engine.generate(input_ids=prompts, lora_paths=per_row, sampling_params=sp, return_logprob=True)
    assert engine.runner.decode_graphs.num_replays > 0
    del engine
    _free()
    if dtype == "float32":
        assert_same_outputs(ref, got, 1e-3)
        return
    # bf16: kernel split counts differ between graph and eager, so near-ties of random weights may flip.
    # The first token comes from the same eager prefill; the second of the first 16 rows from a graph
    # replay: mostly the same token, with a close logprob where it is the same.
    same = 0
    for r, g in zip(ref, got):
        assert g.output_ids[0] == r.output_ids[0]
        if g.output_ids[1] == r.output_ids[1]:
            same += 1
            assert abs(g.logprobs[1] - r.logprobs[1]) < 0.1
    assert same >= len(ref) // 2, f"only {same}/{len(ref)} rows agree on the first graph-decoded token (bf16)"


@cuda
def test_graphs_per_rank_bound_match_eager_in_a_rank_64_pool(tmp_path):
    """Issue 23 on real captures: rank-8 and rank-64 adapters in a rank-64 pool. Steps with only rank-8
    rows replay the (bucket, 16) graphs, steps with a rank-64 row the (bucket, 64) ones; tokens and
    logprobs equal the eager engine's (fp32)."""
    from mmlora.bench.adapters import write_random_adapters

    made = write_random_adapters("smollm2-135m", tmp_path, 4, [8, 64], dtype="float32")
    loras = {m["name"]: m["path"] for m in made}
    low = [m["name"] for m in made if m["rank"] == 8]
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(5 + i % 7)] for i in range(12)]
    rows = {
        "rank-8 only": [[*low, None][i % 3] for i in range(12)],
        "mixed": [[*loras, None][i % 5] for i in range(12)],
    }
    sp = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    opts = dict(
        model="dummy:smollm2-135m", lora_paths=loras, max_loras_per_batch=4, max_lora_rank=64,
        max_running_requests=16, max_kv_tokens=8192, device="cuda", dtype="float32", lora_backend="triton-auto",
    )  # fmt: skip
    eager = mmlora.Engine(**opts, disable_cuda_graph=True)
    ref = {
        k: eager.generate(input_ids=prompts, lora_paths=r, sampling_params=sp, return_logprob=True)
        for k, r in rows.items()
    }
    del eager
    _free()
    engine = mmlora.Engine(**opts)
    graphs = engine.runner.decode_graphs
    graphs.graphs = KeyLog(graphs.graphs)
    bounds = {}
    for k, r in rows.items():
        graphs.graphs.used.clear()
        got = engine.generate(input_ids=prompts, lora_paths=r, sampling_params=sp, return_logprob=True)
        bounds[k] = {b for _, b, _ in graphs.graphs.used}
        assert_same_outputs(ref[k], got, 1e-3)
    del engine, graphs
    _free()
    assert 16 in bounds["rank-8 only"] <= {0, 16}  # 0: a step whose rows are all base-only
    assert 64 in bounds["mixed"] and 32 not in bounds["mixed"]


def test_prepare_replay_picks_a_layout_or_takes_one_that_fits(tiny):
    """triton-auto's pick for a step's rows (runs only when rows >= 2 x runs), a layout forced for timing
    (the benchmark replays each), and a forced runs layout refused when its graph cannot hold the runs."""
    base, adapters = tiny()
    engine = _engine(base, adapters, "cpu", lora_backend="triton-auto", disable_cuda_graph=True)
    lora = engine.lora
    a, b = (lora.entry(n) for n in ("a", "b"))
    lora.admit(a, set())
    lora.admit(b, {a.uid})
    sa, sb = lora._pool.slot_of(a.uid), lora._pool.slot_of(b.uid)
    assert lora.prepare_replay([sa, sa, sa, -1]) == (4, "runs") and lora.info.num_segments == 2
    assert lora.prepare_replay([sa, sb, -1, -1]) == (4, "rows") and lora.info.num_segments == 4
    assert lora.prepare_replay([sa, sa, sa, -1], "rows") == (4, "rows")
    with pytest.raises(ValueError, match="3 runs need segments"):
        lora.prepare_replay([sa, sb, -1, -1], "runs")
