"""Models and adapters by Hugging Face Hub id, resolved offline from a hub cache built with the layout
huggingface_hub writes (``hub_cache``): by id equals by folder (and HF + PEFT), revisions pick their
snapshot, only loading's files are asked for, errors are one line, and no socket leaves the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from hub_cache import add_snapshot, go_offline, refuse_network
from tiny_models import (
    ALL_SEVEN,
    PROMPTS,
    assert_same_greedy,
    hf_peft_greedy,
    make_adapter,
    make_checkpoint,
    make_qwen2_vl_checkpoint,
    mmlora_greedy,
)

import mmlora
from mmlora.config import EngineConfig, ModelConfig
from mmlora.hub import (
    HubError,
    HubRef,
    hub_root,
    parse_hub_ref,
    resolve_adapter,
    resolve_model_source,
    resolve_tokenizer,
)

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
# Files a real repo has but loading must never ask for (offline, asking for one is an error).
NOT_NEEDED = {
    "pytorch_model.bin": b"pickle",
    "consolidated.safetensors": b"duplicate weights",
    "original/params.json": b"{}",
    "model.pth": b"pickle",
}


class Hub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache = root / "hub"
        self.folders: dict[str, Path] = {}
        self.commits: dict[str, str] = {}

    def add(self, repo_id: str, key: str, folder: Path, **kwargs) -> None:
        self.folders[key] = folder
        self.commits[key] = add_snapshot(self.cache, repo_id, folder, **kwargs)


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Hub:
    from transformers import AutoModelForCausalLM

    h = Hub(tmp_path_factory.mktemp("hubtest"))
    old = make_checkpoint(h.root / "llama-old", seed=7)
    h.add("tiny-org/llama", "llama-old", old, refs=("v0.1",))
    new = make_checkpoint(h.root / "llama", seed=0)
    # Sharded, as large checkpoints are: only the shards named by the index may be fetched.
    model = AutoModelForCausalLM.from_pretrained(new)
    (new / "model.safetensors").unlink()
    model.save_pretrained(new, max_shard_size="150KB")
    assert (new / "model.safetensors.index.json").is_file() and not (new / "model.safetensors").exists()
    h.add("tiny-org/llama", "llama", new, remote_only=NOT_NEEDED)
    for key, seed, kw in [
        ("sql-old", 5, dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
        ("sql", 1, dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN)),
    ]:
        refs = ("v1",) if key == "sql-old" else ("main",)
        h.add("tiny-org/sql-lora", key, make_adapter(new, h.root / key, seed, **kw), refs=refs)
    poem = make_adapter(new, h.root / "poem", 2, r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"])
    h.add("tiny-org/poem-lora", "poem", poem, remote_only={"adapter_model.bin": b"pickle"})
    pickled = make_adapter(new, h.root / "pickled", 3, safe=False, r=2, target_modules=["q_proj"])
    h.add("tiny-org/pickled-lora", "pickled", pickled)
    vl = make_qwen2_vl_checkpoint(h.root / "qwen2-vl")
    h.add("tiny-org/qwen2-vl", "qwen2-vl", vl, remote_only=NOT_NEEDED)
    gguf = h.root / "gguf"
    gguf.mkdir()
    (gguf / "tiny.Q8_0.gguf").write_bytes(b"GGUF not parsed by the resolution test")
    h.add("tiny-org/tiny-gguf", "gguf", gguf)
    return h


@pytest.fixture(autouse=True)
def offline(hub, monkeypatch) -> None:
    go_offline(monkeypatch, hub.cache)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    attempts = refuse_network(monkeypatch)
    yield attempts
    assert attempts == [], f"network access attempted: {attempts}"


def test_the_guard_sees_what_online_mode_would_do(no_network, monkeypatch):
    """Without HF_HUB_OFFLINE the same call goes for the network: the guard records it (so its silence in
    every other test means something), and the error says the endpoint cannot be reached."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(HubError, match="is no local path and not in the hub cache .* cannot be reached") as e:
        resolve_model_source(ModelConfig(model="tiny-org/nope"))
    _one_line(e)
    assert no_network
    no_network.clear()


def test_the_cache_has_huggingface_hubs_layout(hub):
    from huggingface_hub import scan_cache_dir

    info = {r.repo_id: r for r in scan_cache_dir(hub.cache).repos}
    assert set(info) == {
        "tiny-org/llama", "tiny-org/sql-lora", "tiny-org/poem-lora", "tiny-org/pickled-lora",
        "tiny-org/qwen2-vl", "tiny-org/tiny-gguf",
    }  # fmt: skip
    refs = {rev.commit_hash: rev.refs for rev in info["tiny-org/llama"].revisions}
    assert refs == {hub.commits["llama"]: {"main"}, hub.commits["llama-old"]: {"v0.1"}}


def test_ids_are_told_from_paths(hub, tmp_path, monkeypatch):
    assert parse_hub_ref("org/name") == HubRef("org/name", None)
    assert parse_hub_ref("org/name@v1").revision == "v1"
    for not_an_id in ["smollm2", "dummy:tiny-llama", "/abs/path", "a/b/c", "org/x.gguf", "org/name@", "../x"]:
        assert parse_hub_ref(not_an_id) is None, not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_ref("org/name") is None  # an existing folder is a path, never an id
    assert hub_root(str(hub.cache / "models--tiny-org--llama" / "snapshots" / hub.commits["llama"])) == (
        f"tiny-org/llama@{hub.commits['llama']}"
    )


def test_llama_and_adapters_by_id_equal_by_folder_and_hf_peft(hub):
    names = ["sql", None, "tiny-org/poem-lora", "sql", "tiny-org/poem-lora", None]
    by_id = {"sql": "tiny-org/sql-lora", "tiny-org/poem-lora": "tiny-org/poem-lora"}
    by_folder = {"sql": hub.folders["sql"], "tiny-org/poem-lora": hub.folders["poem"]}
    engine, outs = mmlora_greedy("tiny-org/llama", by_id, PROMPTS, names, MAX_NEW, device="cpu")
    _, folder_outs = mmlora_greedy(hub.folders["llama"], by_folder, PROMPTS, names, MAX_NEW, device="cpu")
    assert [o.output_ids for o in outs] == [o.output_ids for o in folder_outs]
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert_same_greedy(outs, hf_peft_greedy(hub.folders["llama"], by_folder, ids, names, MAX_NEW), names)
    assert outs[0].output_ids != outs[1].output_ids  # the adapter matters, so the comparison is not vacuous
    assert engine.model_name == "tiny-org/llama"
    roots = {info["name"]: info["root"] for info in engine.list_loras()}
    assert roots == {
        "sql": f"tiny-org/sql-lora@{hub.commits['sql']}",
        "tiny-org/poem-lora": f"tiny-org/poem-lora@{hub.commits['poem']}",
    }


def test_generate_takes_ids_for_the_model_and_per_prompt_adapters(hub):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hub.folders["llama-old"])
    outs = mmlora.generate(
        None, PROMPTS[:2], ["tiny-org/sql-lora@v1", None], model="tiny-org/llama", revision="v0.1",
        device="cpu", dtype="float32", sampling_params=GREEDY,
    )  # fmt: skip
    expected = hf_peft_greedy(
        hub.folders["llama-old"],
        {"old": hub.folders["sql-old"]},
        [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]],
        ["old", None],
        MAX_NEW,
    )
    assert [o.output_ids for o in outs] == [tokens for tokens, _ in expected]
    assert [o.lora_name for o in outs] == ["tiny-org/sql-lora@v1", None]


def test_a_revision_pin_picks_its_snapshot(hub):
    old = hub.commits["llama-old"]
    for model, revision in [
        ("tiny-org/llama", "v0.1"),
        ("tiny-org/llama", old),
        (f"tiny-org/llama@{old}", None),
    ]:
        source = resolve_model_source(ModelConfig(model=model, revision=revision))
        assert Path(source.path).name == old and source.name == "tiny-org/llama"
    with pytest.raises(HubError, match="names revision 'v0.1' but --revision is 'main'"):
        resolve_model_source(ModelConfig(model="tiny-org/llama@v0.1", revision="main"))
    pinned = mmlora.Engine(model="tiny-org/llama", revision="v0.1", device="cpu", dtype="float32")
    old = mmlora.Engine(model=str(hub.folders["llama-old"]), device="cpu", dtype="float32")
    new = mmlora.Engine(model="tiny-org/llama", device="cpu", dtype="float32")
    run = [e.generate(PROMPTS[:3], sampling_params=GREEDY) for e in (pinned, old, new)]
    assert [o.output_ids for o in run[0]] == [o.output_ids for o in run[1]]
    assert [o.output_ids for o in run[0]] != [o.output_ids for o in run[2]]


def test_qwen2_vl_by_id_reads_its_image_processor_and_equals_by_folder(hub):
    from PIL import Image

    image = Image.fromarray((np.random.default_rng(0).random((448, 448, 3)) * 255).astype("uint8"))
    prompt = "Look: <|vision_start|><|image_pad|><|vision_end|> what is it?"
    outs = []
    for model in ("tiny-org/qwen2-vl", str(hub.folders["qwen2-vl"])):
        engine = mmlora.Engine(model=model, device="cpu", dtype="float32")
        outs.append(engine.generate([prompt], images=[[image]], sampling_params=GREEDY)[0])
        # The fixture's processor caps images at 64 patches of 28x28 (the default allows 1280).
        assert engine.multimodal._processor().size["longest_edge"] == 64 * 28 * 28
    assert outs[0].output_ids == outs[1].output_ids
    assert outs[0].prompt_tokens == outs[1].prompt_tokens


def test_a_gguf_file_in_a_repo(hub):
    source = resolve_model_source(ModelConfig(model="tiny-org/tiny-gguf", gguf_file="tiny.Q8_0.gguf"))
    assert source.kind == "gguf" and source.name == "tiny-org/tiny-gguf"
    assert Path(source.path).read_bytes() == (hub.folders["gguf"] / "tiny.Q8_0.gguf").read_bytes()
    with pytest.raises(HubError, match=r"gguf_file: tiny-org/tiny-gguf .*other\.gguf"):
        resolve_model_source(ModelConfig(model="tiny-org/tiny-gguf", gguf_file="other.gguf"))
    with pytest.raises(ValueError, match="gguf_file: 'x.bin' is not a .gguf file"):
        EngineConfig.from_kwargs(model="tiny-org/tiny-gguf", gguf_file="x.bin")


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_unknown_ids_and_revisions_are_one_line_errors(hub):
    with pytest.raises(HubError) as e:
        mmlora.Engine(model="tiny-org/nope", device="cpu")
    msg = _one_line(e)
    assert (
        "model: tiny-org/nope (revision main) is no local path and not in the hub cache" in msg
        and "HF_HUB_OFFLINE=1" in msg
    )
    with pytest.raises(
        HubError, match=r"model: tiny-org/llama \(revision v9\) is no local path and not in the hub cache"
    ) as e:
        mmlora.Engine(model="tiny-org/llama", revision="v9", device="cpu")
    _one_line(e)
    with pytest.raises(HubError, match=r"lora_paths: tiny-org/nope-lora \(revision main\)") as e:
        mmlora.Engine(model="tiny-org/llama", lora_paths=["x=tiny-org/nope-lora"], device="cpu")
    _one_line(e)


class _FakeHub(BaseHTTPRequestHandler):
    """A Hub endpoint that knows no repo, and answers as the Hub does for a gated one without a token."""

    def do_GET(self) -> None:
        gated = "/gated-" in self.path
        self.send_response(403 if gated else 404)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


def test_missing_and_gated_repos_online_are_one_line_errors(monkeypatch):
    """Online against HF_ENDPOINT (a local fake): what the Hub answers becomes the one-line error."""
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    try:
        with pytest.raises(
            HubError, match=f"model: tiny-org/missing .* is no local path and was not found on {endpoint}"
        ) as e:
            resolve_model_source(ModelConfig(model="tiny-org/missing"))
        assert "HF_TOKEN" in _one_line(e)
        with pytest.raises(HubError, match=r"lora_paths: tiny-org/gated-lora \(revision v2\) is gated") as e:
            mmlora.Engine(model="tiny-org/llama", lora_paths=["tiny-org/gated-lora@v2"], device="cpu")
        assert f"{endpoint}/tiny-org/gated-lora" in _one_line(e) and "HF_TOKEN" in str(e.value)
    finally:
        server.shutdown()


def test_pickled_hub_adapters_stay_refused(hub):
    with pytest.raises(HubError, match="tiny-org/pickled-lora has no adapter_model.safetensors") as e:
        mmlora.Engine(model="tiny-org/llama", lora_paths=["tiny-org/pickled-lora"], device="cpu")
    _one_line(e)
    # Asking for the pickle too (allowed): the repo lists one that the cache lacks, which offline is an error.
    with pytest.raises(
        HubError, match=r"tiny-org/poem-lora \(revision main\) is only partly in the hub cache"
    ):
        resolve_adapter("tiny-org/poem-lora", allow_pickled=True)
    assert resolve_adapter("tiny-org/poem-lora").endswith(hub.commits["poem"])


def test_download_dir_overrides_the_default_cache(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(HubError, match="not in the hub cache"):
        resolve_model_source(ModelConfig(model="tiny-org/llama"))
    source = resolve_model_source(ModelConfig(model="tiny-org/llama", download_dir=str(hub.cache)))
    assert Path(source.path).name == hub.commits["llama"]


def test_engine_load_lora_takes_an_id(hub):
    engine = mmlora.Engine(model="tiny-org/llama", device="cpu", dtype="float32")
    engine.load_lora("old", "tiny-org/sql-lora@v1")
    (info,) = engine.list_loras()
    assert info["root"] == f"tiny-org/sql-lora@{hub.commits['sql-old']}" and info["rank"] == 8


def test_the_environment_alone_is_honoured_in_a_fresh_process(hub, tmp_path):
    """HF_HUB_OFFLINE / HF_HUB_CACHE set only in the environment, read by huggingface_hub itself."""
    script = """
import json, socket, sys
attempts = []
real = socket.socket.connect
def connect(self, address):
    if self.family != socket.AF_UNIX:
        attempts.append(str(address))
        raise OSError("refused")
    return real(self, address)
socket.socket.connect = connect
import mmlora
outs = mmlora.generate(None, sys.argv[1], "tiny-org/sql-lora", model="tiny-org/llama", device="cpu",
                       dtype="float32", sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
print(json.dumps({"tokens": outs[0].output_ids, "attempts": attempts}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub.cache), HF_HOME=str(tmp_path / "home"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(mmlora.__file__).parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", script, PROMPTS[0]], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["attempts"] == []
    engine = mmlora.Engine(
        model=str(hub.folders["llama"]),
        lora_paths=[f"sql={hub.folders['sql']}"],
        device="cpu",
        dtype="float32",
    )
    expected = engine.generate(PROMPTS[0], "sql", sampling_params=GREEDY)[0].output_ids
    assert got["tokens"] == expected


def test_a_tokenizer_by_id(hub):
    mc = ModelConfig(model=str(hub.folders["llama"]), tokenizer="tiny-org/llama@v0.1")
    assert Path(resolve_tokenizer(mc)).name == hub.commits["llama-old"]
    assert resolve_tokenizer(ModelConfig(tokenizer=None)) is None


def test_hub_options_are_cli_flags():
    from mmlora.app.cli import engine_config
    from mmlora.app.cli import parse_args as app_args
    from mmlora.launch_server import parse_args

    app = engine_config(app_args(["--model", "org/m", "--revision", "v2", "--lora-paths", "org/poem"]))
    assert (app.model.model, app.model.revision, app.lora.lora_paths) == ("org/m", "v2", ["org/poem"])

    engine_config, _ = parse_args(
        ["--model-path", "org/m", "--revision", "v2", "--download-dir", "/d", "--gguf-file", "m.Q4.gguf",
         "--lora-paths", "sql=org/sql@v1", "org/poem", "--allow-hub-adapters"]
    )  # fmt: skip
    mc, lc = engine_config.model, engine_config.lora
    assert (mc.model, mc.revision, mc.download_dir, mc.gguf_file) == ("org/m", "v2", "/d", "m.Q4.gguf")
    assert lc.lora_paths == ["sql=org/sql@v1", "org/poem"] and lc.allow_hub_adapters
