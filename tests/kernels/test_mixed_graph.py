"""CUDA graphs for prefill and mixed steps (mmlora.engine.mixed_graph).

Their parts checked against the eager path on any machine (Triton under the interpreter on CPU): the
prefill attention over a fixed-size tile table against the batch-sized grid and fp64 attention; SGMV
over ``LoRABatchInfo.fill_graph``'s padded routing against ``fill``'s; the runner's static-buffer
forward (``capture=False``) against the ordinary eager engine, token for token. On CUDA, captured
graphs against eager steps.
"""

from __future__ import annotations

import gc

import pytest
import torch
from graph_safety import (
    KeyLog,
    LaunchLog,
    assert_same_outputs,
    assert_steps_replay_their_captures,
    persistent_storages,
    record_launches,
)
from test_attention import DEV, dense_attention, make_case
from tiny_models import ALL_SEVEN, make_adapter, make_checkpoint

import mmlora
from mmlora.backends import get_backend
from mmlora.engine.mixed_graph import MixedGraphRunner, token_buckets
from mmlora.forward.lora import GRAPH_TILE_SIZES, UNUSED_TILE, LoRABatchInfo, LoRAWeights
from mmlora.layers.attention.triton_backend import store_kv_triton
from mmlora.layers.attention.triton_prefill import (
    PrefillTiles,
    prefill_attention,
    prefill_tile_table,
    prefill_tile_tokens,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [
    [5, 9, 13, 2, 7] * 3,
    [31, 4, 4, 8, 19, 3, 6],
    [11, 12, 13] * 7,
    [40, 41, 2, 9, 9, 9],
    [7, 7],
    [8, 1] * 9,
]
LORAS = ["a", None, "b", "a", "b", None]
SAMPLING = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_token_buckets():
    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 768, 1024]
    with pytest.raises(ValueError):
        token_buckets(0)


def test_a_step_takes_the_smallest_bucket_with_room_for_its_tokens_and_adapters():
    class Runner:  # the parts of a MixedGraphRunner that bucket_of reads
        buckets = token_buckets(1000)
        max_seqs = 64
        segments = MixedGraphRunner.segments

    pick = MixedGraphRunner.bucket_of.__get__(Runner())
    assert pick(10, 3) == 16
    assert pick(10, 9) == 32  # 16 tokens hold 8 segments
    assert pick(300, 64) == 512
    assert pick(100, 65) is None  # more adapter runs than requests a bucket holds
    assert pick(1001, 1) is None


def test_prefill_tile_table_lists_every_tile_then_unused_entries():
    seq, t0 = prefill_tile_table([5, 0, 1, 9], tokens=4, count=8)
    assert list(zip(seq, t0)) == [(0, 0), (0, 4), (2, 0), (3, 0), (3, 4), (3, 8)] + [(0, UNUSED_TILE)] * 2
    with pytest.raises(ValueError, match="exceed"):
        prefill_tile_table([5, 9], tokens=4, count=4)
    assert prefill_tile_tokens(32, 8, 128) == 32  # Mistral-7B: 128 rows of 4 heads
    assert prefill_tile_tokens(8, 8, 256) == 64


@pytest.mark.parametrize("window,softcap", [(None, None), (9, 30.0)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
def test_tiled_prefill_attention_equals_the_batch_grid(hq, hkv, window, softcap):
    """The same tiles from a table (padded with unused entries, as a graph captures it) give the grid's
    output bit for bit, and fp64 attention's; also with a sliding window and a logit softcap (Gemma2)."""
    case = make_case([(0, 17), (2, 1), (16, 1), (13, 20), (32, 1)], hq=hq, hkv=hkv, d=32, page=8, seed=5)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    store_kv_triton(case.k, case.v, kc, vc, case.meta.slot_mapping)
    meta, scale = case.meta, 32**-0.5
    args = (kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    grid_out = torch.zeros_like(case.q)
    prefill_attention(case.q, *args, grid_out, meta.num_seqs, meta.max_query_len, scale, window, softcap)
    tokens = prefill_tile_tokens(hq, hkv, 32)
    count = 64
    seq, t0 = prefill_tile_table(meta.query_lens_host, tokens, count)
    table = torch.tensor([seq, t0], dtype=torch.int32, device=DEV)
    tiled_out = torch.zeros_like(case.q)
    tiles = PrefillTiles(table[0], table[1], count, tokens)
    prefill_attention(case.q, *args, tiled_out, meta.num_seqs, 10**6, scale, window, softcap, tiles)
    assert torch.equal(tiled_out, grid_out)
    torch.testing.assert_close(
        tiled_out.double().cpu(), dense_attention(case, scale, window, softcap), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="tokens a tile"):
        prefill_attention(
            case.q,
            *args,
            tiled_out,
            1,
            1,
            scale,
            None,
            None,
            PrefillTiles(table[0], table[1], count, tokens + 1),
        )


def _weights(n_slots: int, rank: int, in_f: int, widths: list[int], seed: int) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    out_f = sum(widths)
    A = torch.randn(n_slots, len(widths) * rank, in_f, generator=g) * 0.2
    B = torch.randn(n_slots, out_f, rank, generator=g) * 0.2
    scal = torch.rand(n_slots, len(widths), generator=g) + 0.5
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return LoRAWeights(A.to(DEV), B.to(DEV), scal.to(DEV), tuple(offsets))


@pytest.mark.parametrize("backend", ["triton-sgmv", "triton-auto"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_sgmv_over_fill_graph_equals_fill(backend, block_m, monkeypatch):
    """A mixed step's routing padded to a graph's bucket (tokens, segment entries, fixed tile tables):
    the real rows get the eager routing's result, padding rows are left alone."""
    from mmlora.backends import triton_sgmv

    monkeypatch.setitem(triton_sgmv.TUNING, "block_m", block_m)
    monkeypatch.setitem(triton_sgmv.TUNING, "shrink_block_m", block_m)
    rank, in_f, widths = 4, 24, [16, 8, 8]
    weights = _weights(3, rank, in_f, widths, seed=1)
    seq_lens, slots = [37, 1, 1, 2, 20], [0, 1, 1, -1, 2]
    T, bucket = sum(seq_lens), 96
    g = torch.Generator().manual_seed(2)
    x = torch.randn(bucket, in_f, generator=g).to(DEV)
    base = torch.randn(bucket, sum(widths), generator=g).to(DEV)

    def routed(graph: bool) -> torch.Tensor:
        info = LoRABatchInfo(bucket, 3, DEV, max_lora_rank=rank)
        for s in range(3):
            info.set_slot_rank(s, rank - s)
        if graph:
            info.fill_graph(seq_lens, slots, bucket, 24, rank)
            assert set(info.graph_tiles) == set(GRAPH_TILE_SIZES)
        else:
            info.fill(seq_lens, slots)
        out = base.clone() if graph else base[:T].clone()
        get_backend(backend, DEV).add_lora(out, x if graph else x[:T], weights, info)
        return out

    eager, graph = routed(False), routed(True)
    torch.testing.assert_close(graph[:T], eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(graph[T:], base[T:])
    with pytest.raises(ValueError, match="do not fit"):
        LoRABatchInfo(bucket, 3, DEV, max_lora_rank=rank).fill_graph(seq_lens, slots, 32, 24, rank)


def _engine(base, adapters, device: str, **kw) -> mmlora.Engine:
    opts = dict(
        model=str(base), lora_paths=adapters, max_loras_per_batch=2, max_lora_rank=4, max_running_requests=5,
        block_size=4, max_kv_tokens=2048, device=device, dtype="float32", attention_backend="triton",
        max_num_batched_tokens=24,  # chunked prefill next to decode rows: mixed steps
        disable_cpu_graph=True,
    )  # fmt: skip
    opts.update(kw)
    return mmlora.Engine(**opts)


def _generate(engine: mmlora.Engine) -> list:
    return engine.generate(input_ids=PROMPTS, lora_paths=LORAS, sampling_params=SAMPLING, return_logprob=True)


@pytest.mark.parametrize(
    ("arch", "lora_backend"),
    # Each arch once (llama on triton-sgmv as well took 32 s of the CI's CPU; SGMV's mixed steps are qwen2's
    # here, and the prompt-logprob and launch tests below run it on llama).
    [
        ("llama", "triton-auto"),
        ("mistral", "triton-auto"),
        ("qwen2", "triton-sgmv"),
        ("gemma2", "triton-auto"),
    ],
)
def test_static_buffer_path_matches_eager(tiny, arch, lora_backend):
    """Prefill and mixed steps through the runner's padded buckets, tile tables and LoRA routing (no
    capture) give the eager engine's tokens and logprobs: GQA, a sliding window and head_dim 24
    (mistral), qkv bias and tied embeddings (qwen2), softcaps, sandwich norms and alternating windows
    (gemma2)."""
    base, adapters = tiny(arch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(lora_backend=lora_backend, disable_cuda_graph=True)
    ref = _generate(_engine(base, adapters, device, **kw))
    engine = _engine(base, adapters, device, **kw)
    runner = engine.runner
    graphs = runner.mixed_graphs = MixedGraphRunner(runner, 24, 5, engine.max_model_len, capture=False)
    graphs.graphs = KeyLog(graphs.graphs)
    assert_same_outputs(ref, _generate(engine), 1e-4)
    assert graphs.num_replays > 0
    assert {bound for _, bound in graphs.graphs.used} == {0, 4}  # the pool rank 4 caps the bucket
    buckets = {bucket for bucket, _ in graphs.graphs.used}
    assert buckets <= {16, 24} and len(buckets) == 2, buckets


def test_prompt_logprobs_from_replayed_steps_equal_eager(tiny):
    """Prompt logprobs of every token come from the graph's hidden-state buffer, as eagerly."""
    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def generate(engine: mmlora.Engine) -> list:
        return engine.generate(
            input_ids=PROMPTS[:3], lora_paths=LORAS[:3], sampling_params={**SAMPLING, "max_new_tokens": 2},
            return_logprob=True, logprob_start_len=0,
        )  # fmt: skip

    kw = dict(disable_cuda_graph=True, lora_backend="triton-sgmv")
    ref = generate(_engine(base, adapters, device, **kw))
    engine = _engine(base, adapters, device, **kw)
    runner = engine.runner
    graphs = runner.mixed_graphs = MixedGraphRunner(runner, 24, 5, engine.max_model_len, capture=False)
    got = generate(engine)
    assert graphs.num_replays > 0
    for r, g in zip(ref, got):
        assert len(g.input_logprobs) == len(r.input_logprobs) > 5
        assert g.input_logprobs[0] is None and r.input_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(r.input_logprobs[1:], g.input_logprobs[1:])) < 1e-4


def test_torch_attention_engines_keep_mixed_steps_eager(tiny):
    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(base, adapters, device, disable_cuda_graph=True, attention_backend="torch")
    engine.runner.enable_mixed_graphs(24, 5, engine.max_model_len, capture=False)
    assert engine.runner.mixed_graphs is None


def test_running_out_of_memory_while_capturing_leaves_mixed_steps_eager(tiny, monkeypatch, caplog):
    """Mixed-step graphs are on by default, so a device without room for their captures gets eager mixed
    steps and a warning that says what to change, not an engine that fails to start."""
    from mmlora.engine import mixed_graph

    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(base, adapters, device, disable_cuda_graph=True, lora_backend="triton-sgmv")
    ref = _generate(engine)

    def no_room(*args, **kwargs):  # noqa: ANN002, ANN003
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(mixed_graph, "MixedGraphRunner", no_room)
    with caplog.at_level("WARNING", logger="mmlora.engine.mixed_graph"):
        engine.runner.enable_mixed_graphs(24, 5, engine.max_model_len, capture=False)
    assert engine.runner.mixed_graphs is None
    assert "out of device memory" in caplog.text and "--disable-mixed-cuda-graph" in caplog.text
    assert "Tried to allocate 512.00 MiB" in caplog.text
    engine.flush_cache()  # the same prompts again: computed, not read from the prefix cache
    assert_same_outputs(ref, _generate(engine), 1e-5)


@pytest.mark.parametrize("lora_backend", ["triton-sgmv", "triton-auto"])
def test_every_step_launches_what_its_bucket_captured(tiny, lora_backend, monkeypatch):
    """For every step the runner ran, its forward (real routing) and the forward a capture of its (bucket,
    rank bound) runs (no request, every row padding) make the same launches and torch ops: grids, scalars,
    and the same persistent buffers at the same offsets (graph_safety)."""
    base, adapters = tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(base, adapters, device, lora_backend=lora_backend, disable_cuda_graph=True)
    runner = engine.runner
    graphs = runner.mixed_graphs = MixedGraphRunner(runner, 24, 5, engine.max_model_len, capture=False)
    forward = graphs._forward
    with torch.inference_mode():  # a capture's warm-up: first-use tables (RoPE, tile buffers) are built first
        runner.lora.prepare_mixed_capture(16, graphs.segments(16), 4)
        forward(16)
    static = [(f"runner {n}", getattr(graphs, n)) for n in ("i64", "i32", "block_tables", "hidden")]
    log = LaunchLog(persistent_storages(engine, [*static, ("routing tiles", runner.lora.info._tile_buf)]))
    record_launches(monkeypatch, log)
    steps: list[tuple] = []

    def recorded(bucket: int) -> None:
        log.start()
        with log.mode:
            forward(bucket)
        log.on = False
        steps.append((graphs.last_key, log.calls))

    def capture(key: tuple[int, int]) -> None:
        bucket, bound = key
        runner.lora.prepare_mixed_capture(bucket, graphs.segments(bucket), bound)
        log.start()
        forward(bucket)

    graphs._forward = recorded
    _generate(engine)
    graphs._forward = forward
    assert len(steps) > 3 and {key[1] for key, _ in steps} == {0, 4}
    captured = assert_steps_replay_their_captures(log, steps, capture)
    lora_launches = [c[0] for (_, bound), calls in captured.items() if bound for c in calls]
    assert "_sgmv_shrink_kernel" in lora_launches and "_prefill_kernel" in lora_launches


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@cuda
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("lora_backend", ["triton-sgmv", "triton-auto"])
def test_captured_mixed_graphs_equal_eager(tmp_path, arch, lora_backend):
    base = make_checkpoint(tmp_path / "base", arch)
    adapters = {
        "a": str(make_adapter(base, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=ALL_SEVEN)),
        "b": str(
            make_adapter(
                base, tmp_path / "b", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]
            )
        ),
    }
    kw = dict(lora_backend=lora_backend)
    ref = _generate(_engine(base, adapters, "cuda", disable_mixed_cuda_graph=True, **kw))
    _free()
    engine = _engine(base, adapters, "cuda", **kw)  # mixed-step graphs are the default
    got = _generate(engine)
    replays = engine.runner.mixed_graphs.num_replays
    del engine
    _free()
    assert replays > 0, "no prefill or mixed step replayed a graph"
    assert_same_outputs(ref, got, 1e-4)
