"""The Gradio page: chat, compare, adapters and live stats, wired to an ``AppController``.

Layout only: every action is a method of ``AppController`` or ``StatsMonitor``; this module maps their
values to components and their bad-input errors to messages shown in the browser. Streaming events
run with no concurrency limit, so requests from every tab meet in the engine's continuous batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from mmlora.app.controller import BASE, MAX_COMPARE, AppController, StreamView, make_sampling
from mmlora.app.stats import StatsMonitor, summary_markdown
from mmlora.engine.background import EngineUnavailableError, QueueFullError

ADAPTER_HEADERS = ["adapter", "rank", "pinned", "in device slot", "in host cache", "requests", "path"]
USER_ERRORS = (ValueError, OverflowError, QueueFullError, EngineUnavailableError)


def shown_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Show bad-input errors in the browser (``gr.Error``) instead of a generic failure."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            raise gr.Error(str(e), print_exception=False) from None

    return wrapper


def _session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None)


@dataclass
class Pickers:
    """The components that list adapters, refreshed together after a load or unload."""

    chat: gr.Dropdown
    compare: gr.CheckboxGroup
    manage: gr.Dropdown
    known: gr.State  # the list this session's pickers show

    def outputs(self) -> list[Any]:
        return [self.chat, self.compare, self.manage, self.known]

    @staticmethod
    def updates(choices: list[str]) -> list[Any]:
        return [
            gr.update(choices=choices),
            gr.update(choices=choices),
            gr.update(choices=choices[1:]),
            choices,
        ]


def _sampling_panel(c: AppController) -> tuple[list[Any], gr.Checkbox]:
    gr.Markdown("### Sampling")
    sampling = [
        gr.Slider(1, 1024, value=128, step=1, label="max new tokens", elem_id="max-new-tokens"),
        gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0: greedy)", elem_id="temperature"),
        gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top p"),
        gr.Number(value=-1, precision=0, label="top k (-1: off)"),
        gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="repetition penalty"),
        gr.Number(value=-1, precision=0, label="seed (-1: random)"),
    ]
    use_template = gr.Checkbox(
        value=c.has_chat_template,
        interactive=c.has_chat_template,
        label="use the chat template" if c.has_chat_template else "no chat template: raw prompt",
    )
    return sampling, use_template


def _chat_tab(c: AppController, choices: list[str]) -> dict[str, Any]:
    chatbot = gr.Chatbot(height=360, elem_id="chatbot", label="Chat")
    with gr.Row():
        adapter = gr.Dropdown(
            choices, value=BASE, label="Adapter for the next answer", elem_id="chat-adapter"
        )
        image = gr.Image(type="pil", label="Image", visible=c.is_multimodal, height=160)
    msg = gr.Textbox(label="Message", placeholder="Ask something…", elem_id="chat-input")
    with gr.Row():
        send = gr.Button("Send", variant="primary", elem_id="chat-send")
        stop = gr.Button("Stop", elem_id="chat-stop")
        clear = gr.Button("Clear", elem_id="chat-clear")
    info = gr.Markdown(elem_id="chat-info")
    return dict(
        chatbot=chatbot, adapter=adapter, image=image, msg=msg, send=send, stop=stop, clear=clear, info=info
    )


def _compare_tab(c: AppController, choices: list[str]) -> dict[str, Any]:
    prompt = gr.Textbox(label="Prompt", lines=2, elem_id="compare-prompt")
    adapters = gr.CheckboxGroup(
        choices,
        value=[BASE],
        label=f"Adapters side by side (up to {MAX_COMPARE}), generated together in one batch",
        elem_id="compare-adapters",
    )
    image = gr.Image(type="pil", label="Image", visible=c.is_multimodal, height=160)
    with gr.Row():
        run = gr.Button("Generate", variant="primary", elem_id="compare-run")
        stop = gr.Button("Stop", elem_id="compare-stop")
    cols, boxes, infos = [], [], []
    with gr.Row():
        for i in range(MAX_COMPARE):
            with gr.Column(visible=i == 0, min_width=220) as col:
                label = BASE if i == 0 else f"#{i + 1}"
                boxes.append(gr.Textbox(label=label, lines=10, interactive=False, elem_id=f"compare-out-{i}"))
                infos.append(gr.Markdown(elem_id=f"compare-info-{i}"))
            cols.append(col)
    return dict(
        prompt=prompt, adapters=adapters, image=image, run=run, stop=stop, cols=cols, boxes=boxes, infos=infos
    )


def _adapters_tab(c: AppController) -> dict[str, Any]:
    table = gr.Dataframe(
        value=c.adapter_rows(),
        headers=ADAPTER_HEADERS,
        interactive=False,
        wrap=True,  # adapter paths are long: wrapped in full, never cut
        column_widths=["14%", "7%", "9%", "12%", "12%", "10%", "36%"],
        label="Registered adapters: device slots and host cache",
        elem_id="adapter-table",
    )
    root = c.lora_root or "(disabled: start the app with --lora-root)"
    gr.Markdown(f"Load a PEFT adapter folder (safetensors) from under the adapter root `{root}`.")
    with gr.Row():
        path = gr.Textbox(label="Folder (relative to the root)", elem_id="load-path")
        name = gr.Textbox(label="Name (default: the folder's name)", elem_id="load-name")
        pinned = gr.Checkbox(label="Pin", value=False)
        load = gr.Button("Load", variant="primary", elem_id="load-btn")
    with gr.Row():
        manage = gr.Dropdown(c.adapter_names(), label="Adapter", elem_id="manage-adapter")
        unload = gr.Button("Unload", elem_id="unload-btn")
        pin = gr.Button("Pin", elem_id="pin-btn")
        unpin = gr.Button("Unpin", elem_id="unpin-btn")
    msg = gr.Markdown(elem_id="admin-msg")
    return dict(table=table, path=path, name=name, pinned=pinned, load=load, manage=manage, unload=unload,
                pin=pin, unpin=unpin, msg=msg)  # fmt: skip


def build_ui(
    controller: AppController, monitor: StatsMonitor | None = None, *, stats_interval_s: float = 1.0
) -> gr.Blocks:
    """Build the page (not launched). One ``controller`` serves every tab and session."""
    c = controller
    monitor = monitor or StatsMonitor(c.bg)
    choices = c.choices()
    with gr.Blocks(title=f"mmlora · {c.model_name}") as demo:
        gr.Markdown(
            f"## mmlora · `{c.model_name}`\nLoRA backend `{c.lora_backend}` on `{c.device}`"
            + (" · vision-language model: images accepted" if c.is_multimodal else "")
            + ". Every tab shares one engine: all requests run in one continuous batch."
        )
        with gr.Row():
            with gr.Column(scale=4), gr.Tabs():
                with gr.Tab("Chat", id="chat"):
                    chat = _chat_tab(c, choices)
                with gr.Tab("Compare", id="compare"):
                    cmp = _compare_tab(c, choices)
                with gr.Tab("Adapters", id="adapters"):
                    adm = _adapters_tab(c)
            with gr.Column(scale=1, min_width=240):
                sampling, use_template = _sampling_panel(c)
        gr.Markdown("### Live stats")
        stats_md = gr.Markdown(summary_markdown(None), elem_id="stats")
        with gr.Row():
            tps_plot = gr.LinePlot(
                x="seconds", y="value", color="series", title="tokens/s", height=200, elem_id="tps-plot"
            )
            req_plot = gr.LinePlot(
                x="seconds", y="value", color="series", title="requests", height=200, elem_id="req-plot"
            )
        timer = gr.Timer(stats_interval_s)
        pickers = Pickers(chat["adapter"], cmp["adapters"], adm["manage"], gr.State(choices))

        def stop(request: gr.Request) -> None:
            # Abort this session's requests in the engine rather than cancelling the Gradio event, so the
            # open streams end normally and show "abort" with what was generated so far.
            c.abort(_session(request))

        _wire_chat(c, chat, sampling, use_template, stop)
        _wire_compare(c, cmp, sampling, use_template, stop)
        _wire_adapters(c, adm, pickers)

        def tick(known: list[str]) -> list[Any]:
            sample = monitor.poll()
            tps, reqs = monitor.frames()
            loras = c.list_loras()  # one round trip to the engine thread for the table and the pickers
            new = c.choices(loras)
            picks = [gr.skip()] * 4 if new == known else Pickers.updates(new)
            return [summary_markdown(sample), tps, reqs, c.adapter_rows(loras), *picks]

        timer.tick(
            tick,
            pickers.known,
            [stats_md, tps_plot, req_plot, adm["table"], *pickers.outputs()],
            show_progress="hidden",
            queue=False,
        )
    return demo


def _wire_chat(
    c: AppController, w: dict[str, Any], sampling: list[Any], use_template: Any, stop: Any
) -> None:
    def chat(message: str, history: list, adapter: str, image: Any, template: bool, max_new: Any, temperature: Any,
             top_p: Any, top_k: Any, rep: Any, seed: Any, request: gr.Request) -> Iterator[tuple[list, str, str]]:  # fmt: skip
        history = list(history or [])
        if not (message or "").strip():
            raise gr.Error("message: empty", print_exception=False)
        params = shown_errors(make_sampling)(max_new, temperature, top_p, top_k, rep, seed)
        messages = [*history, {"role": "user", "content": message}]
        shown = [*messages, {"role": "assistant", "content": ""}]
        yield shown, "", f"{adapter or BASE}: waiting for the engine…"
        view: StreamView | None = None
        try:
            for view in c.chat_stream(
                messages, adapter, params, image=image, use_template=template, owner=_session(request)
            ):
                shown[-1] = {"role": "assistant", "content": view.text}
                yield shown, "", view.summary()
        except USER_ERRORS as e:
            yield history, message, f"error: {e}"  # put the message back to edit and resend
            raise gr.Error(str(e), print_exception=False) from None
        if view is not None and view.error:
            raise gr.Error(view.error, print_exception=False)

    inputs = [w["msg"], w["chatbot"], w["adapter"], w["image"], use_template, *sampling]
    gr.on([w["send"].click, w["msg"].submit], chat, inputs, [w["chatbot"], w["msg"], w["info"]],
           concurrency_limit=None)  # fmt: skip
    w["stop"].click(stop, None, None, queue=False)  # the stream then ends with finish_reason "abort"
    w["clear"].click(lambda: ([], ""), None, [w["chatbot"], w["info"]], queue=False)


def _wire_compare(
    c: AppController, w: dict[str, Any], sampling: list[Any], use_template: Any, stop: Any
) -> None:
    def show_columns(selected: list[str]) -> list[Any]:
        selected = list(selected or [])[:MAX_COMPARE]
        cols = [gr.update(visible=i < max(1, len(selected))) for i in range(MAX_COMPARE)]
        labels = [
            gr.update(label=selected[i] if i < len(selected) else f"#{i + 1}") for i in range(MAX_COMPARE)
        ]
        return cols + labels

    w["adapters"].change(show_columns, w["adapters"], w["cols"] + w["boxes"], queue=False)

    def compare(prompt: str, selected: list[str], image: Any, template: bool, max_new: Any, temperature: Any,
                top_p: Any, top_k: Any, rep: Any, seed: Any, request: gr.Request) -> Iterator[list[Any]]:  # fmt: skip
        selected = list(selected or [])[:MAX_COMPARE]
        blank = [""] * (MAX_COMPARE - len(selected))
        yield [""] * MAX_COMPARE + [f"{a}: waiting for the engine…" for a in selected] + blank
        try:
            params = make_sampling(max_new, temperature, top_p, top_k, rep, seed)
            for views in c.compare_stream(
                prompt, selected, params, image=image, use_template=template, owner=_session(request)
            ):
                texts = [v.text for v in views] + blank
                yield texts + [v.summary() for v in views] + blank
        except USER_ERRORS as e:
            raise gr.Error(str(e), print_exception=False) from None

    inputs = [w["prompt"], w["adapters"], w["image"], use_template, *sampling]
    gr.on([w["run"].click, w["prompt"].submit], compare, inputs, w["boxes"] + w["infos"],
           concurrency_limit=None)  # fmt: skip
    w["stop"].click(stop, None, None, queue=False)  # the stream then ends with finish_reason "abort"


def _wire_adapters(c: AppController, w: dict[str, Any], pickers: Pickers) -> None:
    def refreshed(message: str) -> list[Any]:
        return [message, c.adapter_rows(), *Pickers.updates(c.choices())]

    outputs = [w["msg"], w["table"], *pickers.outputs()]
    w["load"].click(
        shown_errors(lambda p, n, pin: refreshed(c.load_adapter(p, n, pin))),
        [w["path"], w["name"], w["pinned"]],
        outputs,
    )
    w["unload"].click(shown_errors(lambda n: refreshed(c.unload_adapter(n))), w["manage"], outputs)
    w["pin"].click(shown_errors(lambda n: refreshed(c.set_pinned(n, True))), w["manage"], outputs)
    w["unpin"].click(shown_errors(lambda n: refreshed(c.set_pinned(n, False))), w["manage"], outputs)
