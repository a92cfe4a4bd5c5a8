"""``python -m mmlora.launch_server`` as a user starts it: the seed's launch line and example script,
unknown flags, and SIGTERM draining."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from server_fixtures import free_port

import mmlora
from mmlora import launch_server

# The seed request's example client, verbatim except for the adapter paths and the port.
SEED_SCRIPT = """
import json
import requests

url = "http://127.0.0.1:{port}"
json_data = {{
        "text": ["prompt 1", "prompt 2", "prompt 3", "prompt 4", "prompt 5", "prompt 6", "prompt7"],
        "sampling_params": {{"max_new_tokens": 32}},
        "lora_path": ["{l0}", "{l1}", "{l2}", "{l3}", "{l4}", "{l0}", "{l1}"],
}}
response = requests.post(
        url + "/generate",
        json=json_data,
)
print(json.dumps(response.json()))
"""


@pytest.mark.parametrize(
    "argv", [["--no-such-flag"], ["--max-loras-per", "4"], ["--max-loras-per-batch", "0"]]
)
def test_unknown_flag_abbreviation_and_bad_values_are_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        launch_server.main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_seed_flags_parse():
    engine_cfg, server_cfg = launch_server.parse_args(
        ["--model-path", "m", "--tokenizer-path", "t", "--lora-paths", "x=/a", "/b", "--disable-radix",
         "--disable-cuda-graph", "--max-loras-per-batch", "4", "--mem-fraction-static", "0.5", "--random-seed", "3"]
    )  # fmt: skip
    assert engine_cfg.model.model == "m" and engine_cfg.model.tokenizer == "t" and engine_cfg.model.seed == 3
    assert engine_cfg.lora.lora_paths == ["x=/a", "/b"] and engine_cfg.lora.max_loras_per_batch == 4
    assert engine_cfg.scheduler.disable_cuda_graph and engine_cfg.cache.disable_radix
    assert engine_cfg.cache.mem_fraction_static == 0.5
    assert server_cfg.host == "127.0.0.1" and server_cfg.port == 30000 and server_cfg.api_key is None


@pytest.mark.parametrize(
    ("argv", "disabled"),
    [
        ([], False),  # the default since session 26's H200 runs
        (["--disable-mixed-cuda-graph"], True),
        (["--enable-mixed-cuda-graph"], False),  # the opt-in spelling of earlier scripts
        (["--disable-mixed-cuda-graph", "--enable-mixed-cuda-graph"], False),  # the last one wins
    ],
)
def test_mixed_step_graphs_are_on_unless_disabled(argv, disabled):
    engine_cfg, _ = launch_server.parse_args(["--model-path", "m", *argv])
    assert engine_cfg.scheduler.disable_mixed_cuda_graph is disabled


@pytest.fixture(scope="module")
def seed_server(tiny):
    port = free_port()
    loras = [str(tiny.adapters[f"a{i}"]) for i in range(5)]
    cmd = [sys.executable, "-m", "mmlora.launch_server", "--model-path", str(tiny.folder),
           "--tokenizer-path", str(tiny.folder), "--lora-paths", *loras, "--disable-radix",
           "--disable-cuda-graph", "--max-loras-per-batch", "4", "--mem-fraction-static", "0.5",
           "--random-seed", "0", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if requests.get(url + "/get_model_info", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.2)
    yield proc, url, port, loras
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_seed_example_equals_mmlora_generate(seed_server, tiny, tmp_path):
    proc, url, port, loras = seed_server
    script = tmp_path / "seed_client.py"
    script.write_text(SEED_SCRIPT.format(port=port, **{f"l{i}": p for i, p in enumerate(loras)}))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout)
    assert len(answers) == 7
    texts = ["prompt 1", "prompt 2", "prompt 3", "prompt 4", "prompt 5", "prompt 6", "prompt7"]
    paths = [loras[0], loras[1], loras[2], loras[3], loras[4], loras[0], loras[1]]
    expected = mmlora.generate(
        None, texts, paths, model=str(tiny.folder), tokenizer=str(tiny.folder), sampling_params={"max_new_tokens": 32},
        max_loras_per_batch=4, seed=0,
    )  # fmt: skip
    for answer, exp, path in zip(answers, expected, paths):
        assert answer["text"] == exp.text
        assert answer["output_ids"] == exp.output_ids
        assert answer["meta_info"]["lora_path"] == path
        assert answer["meta_info"]["completion_tokens"] == len(exp.output_ids)


def _start_post(port: int, path: str, body: dict) -> socket.socket:
    """A POST whose headers and all but the last byte of its body are sent now: the server has started
    the request (it passed the intake gate) and waits for the rest, which the caller sends later."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + data[:-1])
    return sock


def _refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def test_sigterm_stops_intake_and_drains(seed_server):
    proc, url, port, loras = seed_server
    lines: list[str] = []
    body = {"text": "Hello", "lora_path": loras[2], "stream": True,
            "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    late = _start_post(port, "/generate", {"text": "late", "sampling_params": {"max_new_tokens": 4}})

    def stream() -> None:
        with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line:
                    lines.append(line)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not lines:
        assert t.is_alive() and time.monotonic() < deadline, "the stream gave nothing within 60 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    # The server stops listening once it has stopped intake (DrainingServer.handle_exit, then uvicorn's
    # shutdown): from then on the late request, still open, must be answered 503 and never served.
    deadline = time.monotonic() + 30
    while not _refuses_connections(port):
        assert time.monotonic() < deadline, "the server still accepts connections 30 s after SIGTERM"
        time.sleep(0.05)
    late.sendall(json.dumps({"text": "late", "sampling_params": {"max_new_tokens": 4}}).encode()[-1:])
    answer = b""
    while chunk := late.recv(65536):  # the socket's 30 s timeout bounds each wait
        answer += chunk
    late.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"shutting down" in answer
    t.join(120)
    assert not t.is_alive(), "the draining stream did not finish within 120 s"
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: ") :])
    assert (
        final["meta_info"]["finish_reason"]["type"] == "length"
        and final["meta_info"]["completion_tokens"] == 120
    )
    assert proc.wait(60) == 0
