"""The app's Python functions: sampling from UI values, streaming chat and compare (checked against HF +
PEFT greedy decoding), abort by session, adapter admin with a confined root, live stats, the command line."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from app_fixtures import ADAPTERS
from tiny_models import hf_peft_greedy

from mmlora.app import BASE, MAX_COMPARE, AppController, StatsMonitor, StreamView, make_sampling
from mmlora.app.controller import message_text
from mmlora.app.stats import StatsSample, summary_markdown
from mmlora.engine.sampling_params import RequestOutput, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def ctl(bg: Any, tiny_app: Any) -> AppController:
    return AppController(bg, lora_root=str(tiny_app.root))


# ---- pure helpers --------------------------------------------------------------------------------


def test_make_sampling_converts_ui_values() -> None:
    sp = make_sampling(32.0, 0.7, 0.9, -1.0, 1.1, 7.0)
    assert sp == SamplingParams(
        max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=-1, repetition_penalty=1.1, seed=7
    )
    for random_seed in (None, "", -1, -1.0):
        assert make_sampling(seed=random_seed).seed is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"seed": 2.5}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_make_sampling_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_sampling(**kwargs)


def test_message_text_reads_strings_and_gradio_parts() -> None:
    assert message_text("hi") == "hi"
    assert message_text([{"type": "text", "text": "a"}, {"type": "file", "file": "x.png"}, "b"]) == "ab"
    assert message_text({"type": "text", "text": "c"}) == "c"
    assert message_text(None) == ""


def test_stream_view_speed_and_summary() -> None:
    view = StreamView("pirate")
    out = RequestOutput("r", 3, "pirate", text="Arr", output_ids=[1, 2, 3, 4, 5], arrival_time=10.0,
                        first_token_time=10.5, finish_time=12.5, finish_reason="length")  # fmt: skip
    view.update(out)
    assert view.tokens == 5 and view.finished
    assert view.tokens_per_s() == pytest.approx(4 / 2.0)
    assert view.summary() == "pirate · 5 tokens · 2.0 tok/s · first token 0.50 s · length"
    running = StreamView("base")
    running.update(RequestOutput("r", 3, None, output_ids=[1], arrival_time=1.0, first_token_time=1.2))
    assert running.tokens_per_s() is None  # one token: no decode interval yet
    assert running.summary().endswith("generating…")


# ---- generation ------------------------------------------------------------------------------------


def _prompt_ids(bg: Any, text: str) -> list[int]:
    return bg.engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_compare_streams_one_batch_matching_hf_peft(ctl: AppController, bg: Any, tiny_app: Any) -> None:
    together: list[set[str]] = []
    engine = bg.engine
    step = engine.step

    def recording_step() -> Any:
        together.append({r.lora_name or BASE for r in engine.scheduler.running})
        time.sleep(0.01)  # slower than the tiny model's steps, so the stream has visible increments
        return step()

    engine.step = recording_step
    picks = ["alpha", BASE, "beta"]
    snapshots = [
        [v.text for v in views] for views in ctl.compare_stream("Hello world", picks, GREEDY, interval_s=0.0)
    ]
    final = snapshots[-1]
    assert len(snapshots) > 1, "compare mode yielded only the final state: it did not stream"
    for snap in snapshots:
        assert all(f.startswith(s) for f, s in zip(final, snap)), (
            "a streamed text is not a prefix of the final"
        )
    assert any(set(picks) <= running for running in together), "the adapters were not generated in one batch"

    prompt = ctl.format_prompt([{"role": "user", "content": "Hello world"}], use_template=True)
    ids = _prompt_ids(bg, prompt)
    names = [None if p == BASE else p for p in picks]
    oracle = hf_peft_greedy(tiny_app.folder, {n: tiny_app.adapters[n] for n in ADAPTERS}, [ids] * 3, names, 8)
    results = list(ctl.compare_stream("Hello world", picks, GREEDY))[-1]
    assert [v.output_ids for v in results] == [tokens for tokens, _ in oracle]
    assert len({tuple(v.output_ids) for v in results}) == 3, "the two adapters and the base should differ"
    for v in results:
        assert v.finish_reason == "length" and v.tokens == 8 and v.tokens_per_s() is not None


def test_chat_uses_the_template_over_the_history(ctl: AppController, bg: Any, tiny_app: Any) -> None:
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "How are you today?"}]},  # Gradio's parts
        {"role": "user", "content": "Paris is the capital of"},
    ]
    prompt = ctl.format_prompt(history, use_template=True)
    flat = [{"role": m["role"], "content": message_text(m["content"])} for m in history]
    expected = bg.engine.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert prompt == expected
    counts = []
    for view in ctl.chat_stream(history, "beta", GREEDY):
        counts.append(view.tokens)
    oracle = hf_peft_greedy(tiny_app.folder, {"beta": tiny_app.adapters["beta"]}, [_prompt_ids(bg, prompt)],
                            ["beta"], 8)  # fmt: skip
    assert view.output_ids == oracle[0][0] and view.finish_reason == "length"
    assert counts[-1] == 8 and counts == sorted(counts)
    # without the template only the last message is sent, as raw text
    assert ctl.format_prompt(history, use_template=False) == "Paris is the capital of"


def test_abort_by_owner_stops_the_stream(ctl: AppController) -> None:
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    views = ctl.chat_stream([{"role": "user", "content": "Hello"}], "alpha", long, owner="tab-1")
    first = next(views)
    assert not first.finished
    threading.Thread(target=ctl.abort, args=("tab-1",)).start()
    last = list(views)[-1]
    assert last.finish_reason == "abort" and last.tokens < 400
    assert ctl.abort("tab-1") == 0  # nothing left under that owner


@pytest.mark.parametrize(
    ("prompt", "picks", "message"),
    [
        ("hi", [], "adapters: pick at least one"),
        ("hi", [BASE, BASE], "adapters: each adapter may appear once"),
        ("hi", [BASE] + [f"x{i}" for i in range(MAX_COMPARE)], f"at most {MAX_COMPARE}"),
        ("hi", ["nope"], "unknown adapter 'nope'"),
        ("   ", [BASE], "prompt: empty"),
    ],
)
def test_compare_refuses_bad_input(ctl: AppController, prompt: str, picks: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(ctl.compare_stream(prompt, picks, GREEDY))


def test_images_refused_for_a_text_model(ctl: AppController) -> None:
    assert not ctl.is_multimodal
    with pytest.raises(ValueError, match="image: .* text-only"):
        list(ctl.chat_stream([{"role": "user", "content": "hi"}], BASE, GREEDY, image=object()))


# ---- adapter admin ---------------------------------------------------------------------------------


def test_adapter_admin_load_pin_unload(ctl: AppController, tiny_app: Any) -> None:
    assert ctl.choices() == [BASE, *ADAPTERS]
    assert ctl.load_adapter("gamma", "", pinned=False).startswith("loaded adapter 'gamma'")
    assert ctl.choices() == [BASE, *ADAPTERS, "gamma"]
    rows = {r[0]: r for r in ctl.adapter_rows()}
    assert rows["gamma"][1] == 4 and rows["gamma"][4] == "yes"  # rank, in the host cache
    ctl.set_pinned("gamma", True)
    assert {i["name"]: i["pinned"] for i in ctl.list_loras()}["gamma"] is True
    ctl.set_pinned("alpha", True)
    with pytest.raises(ValueError, match="at most max_loras_per_batch - 1 = 2"):
        ctl.set_pinned("beta", True)
    ctl.set_pinned("alpha", False)
    assert not {i["name"]: i["pinned"] for i in ctl.list_loras()}["alpha"]
    # the pinned adapter serves requests
    assert list(ctl.chat_stream([{"role": "user", "content": "hi"}], "gamma", GREEDY))[-1].tokens == 8
    ctl.unload_adapter("gamma")
    assert "gamma" not in ctl.choices()
    with pytest.raises(ValueError, match="gamma"):
        list(ctl.chat_stream([{"role": "user", "content": "hi"}], "gamma", GREEDY))
    ctl.load_adapter(str(tiny_app.root / "gamma"), "gamma2", pinned=True)  # absolute, but inside the root
    assert {i["name"]: i["pinned"] for i in ctl.list_loras()}["gamma2"] is True


@pytest.mark.parametrize(
    ("path", "name", "message"),
    [
        ("../model", "", "outside the allowed adapter root"),
        ("/etc", "", "outside the allowed adapter root"),
        ("missing", "", "not an adapter folder"),
        ("", "", "path: give an adapter folder"),
        ("alpha", "", "already registered"),
        ("gamma", BASE, "reserved for the base model"),
    ],
)
def test_load_adapter_refusals(ctl: AppController, path: str, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ctl.load_adapter(path, name)


def test_load_adapter_refuses_symlinks_out_of_the_root(
    ctl: AppController, tiny_app: Any, tmp_path: Path
) -> None:
    link = tiny_app.root / "escape"
    if not link.exists():
        link.symlink_to(tiny_app.folder)
    with pytest.raises(ValueError, match="outside the allowed adapter root"):
        ctl.load_adapter("escape")


def test_loading_disabled_without_a_root(bg: Any) -> None:
    with pytest.raises(ValueError, match="disabled"):
        AppController(bg, lora_root=None).load_adapter("alpha")
    for bad in ("", BASE, None):
        with pytest.raises(ValueError, match="name: pick an adapter"):
            AppController(bg).unload_adapter(bad)
    with pytest.raises(ValueError, match="unknown adapter 'zeta'"):
        AppController(bg).set_pinned("zeta", True)


# ---- live stats ------------------------------------------------------------------------------------


def test_stats_monitor_counts_tokens_and_rate_limits(ctl: AppController, bg: Any) -> None:
    monitor = StatsMonitor(bg, min_interval_s=0.0)
    first = monitor.poll()
    assert first is not None and first.stats["num_running"] == 0
    list(ctl.compare_stream("Hello", ["alpha", "beta"], GREEDY))
    second = monitor.poll()
    made = second.stats["generation_tokens_total"] - first.stats["generation_tokens_total"]
    assert made == 16
    assert second.tokens_per_s == pytest.approx(made / (second.t - first.t))
    slow = StatsMonitor(bg, min_interval_s=60.0)
    a = slow.poll()
    assert slow.poll() is a  # within the interval: the same sample, no engine round trip
    series = monitor.series(now=second.t)
    assert set(series) == {"tokens/s", "in flight", "running", "waiting"}
    xs, ys = series["tokens/s"]
    assert xs[-1] == 0 and ys[-1] == pytest.approx(second.tokens_per_s, abs=0.01)
    assert all(len(v[0]) == 2 and not any(math.isnan(y) for y in v[1]) for v in series.values())
    text = summary_markdown(second)
    assert "**in flight** 0 · **running** 0" in text and "**adapter slots**" in text and "/3" in text
    hits, queried = second.stats["prefix_cache_hits_total"], second.stats["prefix_cache_queries_total"]
    assert queried > 0 and f"**prefix cache** hit rate {100 * hits / queried:.0f}% ({hits}/{queried}" in text
    assert "waiting for the engine" in summary_markdown(None)


def test_stats_chart_breaks_its_lines_at_gaps_and_shows_no_empty_axes(bg: Any) -> None:
    monitor = StatsMonitor(bg, min_interval_s=0.0)
    assert monitor.frames() == (None, None)  # no samples: no chart axes, not an empty "0.000000" axis
    start = monitor.poll(now=0.0).t
    monitor.poll(now=start + 0.1)
    with monitor._lock:  # a sample long after the others, as after a time with no tab open
        last = monitor._samples[-1]
        monitor._samples.append(StatsSample(last.t + 30.0, dict(last.stats), 0.0))
    xs, ys = monitor.series(now=last.t + 30.0)["running"]
    assert len(xs) == 4 and math.isnan(ys[2]) and xs[1] < xs[2] < xs[3]
    _, reqs = monitor.frames(now=last.t + 30.0)
    running = reqs[reqs["series"] == "running"]
    assert list(running["seconds"]) == xs and running["value"].isna().tolist() == [False, False, True, False]
    assert set(reqs["series"]) == {"in flight", "running", "waiting"}


def test_in_flight_counts_a_request_while_it_runs(bg: Any) -> None:
    monitor = StatsMonitor(bg, min_interval_s=0.0)
    handle = bg.submit("Hello", sampling_params=SamplingParams(max_new_tokens=400, ignore_eos=True))
    assert monitor.poll().stats["num_in_flight"] >= 1  # accepted, not finished: counted wherever it is
    handle.abort()
    handle.result(timeout=60)
    deadline = time.monotonic() + 30
    while monitor.poll().stats["num_in_flight"]:
        assert time.monotonic() < deadline, "the aborted request stayed in flight"
        time.sleep(0.05)


# ---- command line ----------------------------------------------------------------------------------


def test_cli_defaults_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mmlora.app import cli

    args = cli.parse_args([])
    assert args.model == "smollm2" and args.share is False and args.lora_paths is None
    assert args.server_name is None and args.server_port is None  # Gradio reads GRADIO_SERVER_* itself
    (tmp_path / "pirate").mkdir()
    (tmp_path / "pirate" / "adapter_config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no adapter_config.json: not an adapter
    monkeypatch.setattr(cli, "DEMO_ADAPTERS", tmp_path)
    assert cli.engine_config(cli.parse_args([])).lora.lora_paths == [f"pirate={tmp_path / 'pirate'}"]
    cfg = cli.engine_config(
        cli.parse_args(["--model", "x", "--lora-backend", "triton-sgmv", "--device", "cpu"])
    )
    assert cfg.model.model == "x" and cfg.lora.lora_paths == [] and cfg.lora.lora_backend == "triton-sgmv"
    assert cfg.model.device == "cpu"
    cfg = cli.engine_config(cli.parse_args(["--lora-paths", "a=/p/a", "/p/b", "--share"]))
    assert cfg.lora.lora_paths == ["a=/p/a", "/p/b"]
    assert cli.parse_args(["--share"]).share is True
    with pytest.raises(SystemExit):
        cli.parse_args(["--max-in-flight", "0"])


def test_demo_adapter_specs_lists_adapter_folders(tmp_path: Path) -> None:
    from mmlora.app.cli import demo_adapter_specs

    for name in ("caps", "pirate"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "readme.txt").write_text("x")
    assert demo_adapter_specs(tmp_path) == [f"caps={tmp_path / 'caps'}", f"pirate={tmp_path / 'pirate'}"]
    assert demo_adapter_specs(tmp_path / "absent") == []


# ---- a vision-language model -----------------------------------------------------------------------


def test_images_reach_a_vision_language_model(tiny_vl: Path) -> None:
    import numpy as np
    from PIL import Image

    from mmlora import Engine
    from mmlora.engine.background import BackgroundEngine

    def picture(seed: int) -> Image.Image:  # different sizes, so different numbers of image tokens too
        size = (56, 84) if seed == 1 else (84, 56)
        return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))

    engine = Engine(model=str(tiny_vl), device="cpu", dtype="float32", max_kv_tokens=2048)
    expected = [
        o.output_ids
        for o in engine.generate(["Describe it."] * 2, None, [[picture(1)], [picture(2)]], GREEDY)
    ]
    assert expected[0] != expected[1]
    bg = BackgroundEngine(engine)
    try:
        ctl = AppController(bg)
        assert ctl.is_multimodal and not ctl.has_chat_template
        msgs = [{"role": "user", "content": "Describe it."}]
        got = [
            list(ctl.chat_stream(msgs, BASE, GREEDY, image=picture(s), use_template=False))[-1]
            for s in (1, 2)
        ]
        assert [v.output_ids for v in got] == expected
        cols = list(ctl.compare_stream("Describe it.", [BASE], GREEDY, image=picture(2), use_template=False))[
            -1
        ]
        assert cols[0].output_ids == expected[1]
        with pytest.raises(ValueError, match="no chat template"):
            list(ctl.chat_stream(msgs, BASE, GREEDY, image=picture(1), use_template=True))
        assert _image_inputs_visible(ctl) == [True, True]  # chat and compare both take an image
    finally:
        bg.shutdown(drain=False, timeout=10)


def _image_inputs_visible(ctl: AppController) -> list[bool]:
    gr = pytest.importorskip("gradio")
    from mmlora.app.ui import build_ui

    demo = build_ui(ctl)
    return [bool(b.visible) for b in demo.blocks.values() if isinstance(b, gr.Image)]


def test_text_model_page_has_no_image_input(ctl: AppController) -> None:
    assert _image_inputs_visible(ctl) == [False, False]
