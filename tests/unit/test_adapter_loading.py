"""load_adapter against HF + PEFT: weights, per-module deltas (PEFT's own layer output), refusals.

The oracle: for every LoRA layer PEFT builds, the loaded A/B equal PEFT's tensors, and
``x @ A.T @ B.T * scaling`` equals PEFT's layer output minus its output with the adapter disabled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mmlora.lora.adapter import AdapterError, LoadedAdapter, load_adapter
from mmlora.lora.spec import LoRAModelSpec, LoRATarget

PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ALL_SEVEN = list(PARENTS)


def lora_spec(cfg, refused_prefixes: tuple[tuple[str, str], ...] = ()) -> LoRAModelSpec:
    """What the model classes' ``lora_model_spec(hf_config)`` builds for a Llama-like config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    targets = (
        LoRATarget("qkv_proj", ("q_proj", "k_proj", "v_proj"), h, (q, kv, kv)),
        LoRATarget("o_proj", ("o_proj",), q, (h,)),
        LoRATarget("gate_up_proj", ("gate_proj", "up_proj"), h, (inter, inter)),
        LoRATarget("down_proj", ("down_proj",), inter, (h,)),
    )
    return LoRAModelSpec(cfg.num_hidden_layers, targets, "model.layers", dict(PARENTS), refused_prefixes)


def llama_config() -> LlamaConfig:
    # head_dim * heads != hidden, so q/o shapes differ from hidden
    return LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, vocab_size=64,
    )  # fmt: skip


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip


def make_adapter(path: Path, cfg, seed: int = 0, safe: bool = True, **lora_kwargs):
    """A PEFT model with random (non-zero) A and B, saved to ``path``."""
    torch.manual_seed(seed)
    model_cls = Qwen2ForCausalLM if isinstance(cfg, Qwen2Config) else LlamaForCausalLM
    model = model_cls(cfg).eval()
    lora_kwargs.setdefault("init_lora_weights", False)  # PEFT's default zero B would hide scaling bugs
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs)).eval()
    peft_model.save_pretrained(str(path), safe_serialization=safe)
    return peft_model


def check_against_peft(peft_model, loaded: LoadedAdapter, spec: LoRAModelSpec, atol: float = 2e-5) -> int:
    """Every PEFT LoRA layer matches the loaded weights and delta; nothing else is loaded. Returns #modules."""
    seen: set[tuple[int, str, int]] = set()
    for name, mod in peft_model.named_modules():
        if not isinstance(mod, PeftLoraLinear) or "default" not in mod.lora_A:
            continue
        path = name.removeprefix("base_model.model.")
        parts = path.split(".")  # model.layers.<i>.<parent>.<module>
        layer, module = int(parts[2]), parts[-1]
        target, s = spec.find_slice(module)
        w = loaded.weights[(layer, target.name)]
        a_ref, b_ref = mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach()
        torch.testing.assert_close(w.A[s], a_ref.to(w.A[s].dtype), rtol=0, atol=0)
        torch.testing.assert_close(w.B[s], b_ref.to(w.B[s].dtype), rtol=0, atol=0)
        x = torch.randn(3, target.in_features)
        with torch.no_grad():
            with_lora = mod(x)
            with peft_model.disable_adapter():
                base = mod(x)
        ours = (x.double() @ w.A[s].double().T @ w.B[s].double().T * w.scalings[s]).float()
        torch.testing.assert_close(ours, with_lora - base, rtol=1e-4, atol=atol)
        assert w.scalings[s] == pytest.approx(mod.scaling["default"])
        seen.add((layer, target.name, s))
    for (layer, tname), w in loaded.weights.items():
        for s, a in enumerate(w.A):
            assert (a is None) == ((layer, tname, s) not in seen)
            assert (w.B[s] is None) == (a is None)
            assert (w.scalings[s] == 0.0) == (a is None)
    assert seen, "PEFT built no LoRA layer"
    return len(seen)


@pytest.mark.parametrize("make_config", [llama_config, qwen2_config])
def test_spec_helper_matches_model_class(make_config):
    """The oracle spec used here is the one the engine's model class builds."""
    from mmlora.models.llama import LlamaForCausalLM as OurLlama

    cfg = make_config()
    assert OurLlama(cfg).lora_model_spec() == lora_spec(cfg)


# ---------------------------------------------------------------------------------------------------------
# Faithful loading


def test_attention_list_targets_llama(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2 * 4
    assert loaded.rank == 4 and loaded.path == str(tmp_path)
    assert set(loaded.weights) == {(i, t) for i in range(2) for t in ("qkv_proj", "o_proj")}
    assert loaded.config["peft_type"] == "LORA"
    assert loaded.nbytes == sum(
        t.numel() * t.element_size() for w in loaded.weights.values() for t in (*w.A, *w.B) if t is not None
    )


def test_all_seven_projections_qwen2(tmp_path):
    cfg = qwen2_config()
    peft_model = make_adapter(tmp_path, cfg, r=8, lora_alpha=16, target_modules=ALL_SEVEN)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2 * 7
    assert all(w.scalings == tuple(2.0 for _ in w.A) for w in loaded.weights.values())


def test_all_linear_targets(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(tmp_path, cfg, r=2, lora_alpha=3, target_modules="all-linear")
    spec = lora_spec(cfg)
    assert check_against_peft(peft_model, load_adapter(tmp_path, spec, max_lora_rank=4), spec) == 14


def test_regex_string_targets(tmp_path):
    cfg = llama_config()
    regex = r".*\.layers\.1\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
    peft_model = make_adapter(tmp_path, cfg, r=4, lora_alpha=4, target_modules=regex)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=16)
    assert check_against_peft(peft_model, loaded, spec) == 3
    qkv = loaded.weights[(1, "qkv_proj")]
    assert qkv.A[1] is None and qkv.A[0] is not None and qkv.A[2] is not None
    assert set(loaded.weights) == {(1, "qkv_proj"), (1, "down_proj")}


def test_rank_and_alpha_patterns(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=ALL_SEVEN,
        rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2, "gate_proj": 6},
        alpha_pattern={"v_proj": 3, r"model\.layers\.0\.mlp\.up_proj": 32},
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    check_against_peft(peft_model, loaded, spec)
    assert loaded.rank == 8
    assert loaded.weights[(1, "down_proj")].A[0].shape[0] == 2
    assert loaded.weights[(0, "down_proj")].A[0].shape[0] == 4
    assert loaded.weights[(0, "qkv_proj")].scalings == (1.0, 2.0, 0.75)
    assert loaded.weights[(0, "gate_up_proj")].scalings == (8 / 6, 8.0)
    assert loaded.weights[(1, "gate_up_proj")].scalings == (8 / 6, 2.0)


def test_rslora(tmp_path):
    cfg = qwen2_config()
    peft_model = make_adapter(tmp_path, cfg, r=16, lora_alpha=8, use_rslora=True, target_modules=ALL_SEVEN)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=16)
    check_against_peft(peft_model, loaded, spec)
    assert loaded.weights[(0, "o_proj")].scalings == (2.0,)


def test_rslora_with_patterns(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 9}, alpha_pattern={"q_proj": 5},
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=16)
    check_against_peft(peft_model, loaded, spec)
    assert loaded.weights[(0, "down_proj")].scalings == (8 / 3,)
    assert loaded.weights[(0, "qkv_proj")].scalings == (2.5, 0.0, 0.0)


@pytest.mark.parametrize("layers_pattern", [None, "layers"])
def test_layers_to_transform(tmp_path, layers_pattern):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], layers_to_transform=[1],
        layers_pattern=layers_pattern,
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2
    assert set(loaded.weights) == {(1, "qkv_proj"), (1, "gate_up_proj")}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ALL_SEVEN,
         "rank_pattern": {"k_proj": 2, "up_proj": 6}, "alpha_pattern": {"o_proj": 3}},
        {"r": 3, "lora_alpha": 5, "target_modules": r".*\.(v_proj|gate_proj)"},
        {"r": 3, "lora_alpha": 5, "target_modules": ["v_proj", "gate_proj"], "layers_to_transform": 1},
    ],
)  # fmt: skip
def test_matches_peft_from_pretrained(tmp_path, kwargs):
    """The serving oracle: PEFT re-reading the saved folder (not the in-memory training model)."""
    from peft import PeftModel

    cfg = qwen2_config()
    make_adapter(tmp_path, cfg, **kwargs)
    reloaded = PeftModel.from_pretrained(Qwen2ForCausalLM(cfg), str(tmp_path)).eval()
    spec = lora_spec(cfg)
    check_against_peft(reloaded, load_adapter(tmp_path, spec, max_lora_rank=8), spec)


def test_fp16_dtype(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8, dtype=torch.float16)
    assert all(
        t.dtype == torch.float16 for w in loaded.weights.values() for t in (*w.A, *w.B) if t is not None
    )
    check_against_peft(peft_model, loaded, spec, atol=5e-3)
    fp32 = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert loaded.nbytes * 2 == fp32.nbytes


def test_pickled_adapter_when_allowed(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, safe=False, r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"]
    )
    assert (tmp_path / "adapter_model.bin").exists() and not (tmp_path / "adapter_model.safetensors").exists()
    spec = lora_spec(cfg)
    check_against_peft(peft_model, load_adapter(tmp_path, spec, max_lora_rank=8, allow_pickled=True), spec)


def test_old_style_default_adapter_names(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(file))
    spec = lora_spec(cfg)
    check_against_peft(peft_model, load_adapter(tmp_path, spec, max_lora_rank=8), spec)


def test_pattern_first_match_wins_and_exclude_modules(tmp_path):
    cfg = qwen2_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["down_proj"],
        rank_pattern={r"layers\.0\.self_attn\.q_proj": 6, "q_proj": 2}, alpha_pattern={r".*\.1\..*_proj": 1},
    )  # fmt: skip
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 2 * 6
    assert [loaded.weights[(i, "qkv_proj")].A[0].shape[0] for i in range(2)] == [6, 2]
    assert not any(t == "down_proj" for _, t in loaded.weights)
    assert loaded.weights[(1, "o_proj")].scalings == (0.25,)


def test_overlapping_patterns_reordered_by_save_are_refused(tmp_path):
    """PEFT saves the config with sorted keys, so overlapping patterns can match differently on reload
    (PeftModel.from_pretrained then fails with a size mismatch); the loader refuses with a clear message."""
    make_adapter(
        tmp_path, llama_config(), r=4, target_modules=["q_proj"],
        rank_pattern={"q_proj": 2, r"layers\.0\.self_attn\.q_proj": 6},
    )  # fmt: skip
    refused(
        tmp_path, "'model.layers.0.self_attn.q_proj' has rank 2 in its tensors but the config implies r=6"
    )


def test_exclude_modules_regex(tmp_path):
    cfg = llama_config()
    peft_model = make_adapter(
        tmp_path, cfg, r=4, lora_alpha=8, target_modules=ALL_SEVEN, exclude_modules=r".*\.0\.mlp\..*"
    )
    spec = lora_spec(cfg)
    loaded = load_adapter(tmp_path, spec, max_lora_rank=8)
    assert check_against_peft(peft_model, loaded, spec) == 7 + 4


def test_bfloat16_and_rank_bound_inclusive(tmp_path):
    cfg = llama_config()
    make_adapter(tmp_path, cfg, r=8, lora_alpha=8, target_modules=["o_proj"])
    loaded = load_adapter(tmp_path, lora_spec(cfg), max_lora_rank=8, dtype=torch.bfloat16)
    assert loaded.rank == 8 and loaded.weights[(0, "o_proj")].A[0].dtype == torch.bfloat16


def test_selected_module_without_weights_gets_no_delta(tmp_path, caplog):
    """PEFT keeps its init (zero B by default) for a selected module absent from the file: no delta."""
    cfg = llama_config()
    make_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    file = tmp_path / "adapter_model.safetensors"
    tensors = {k: v for k, v in load_file(str(file)).items() if "layers.1.self_attn.v_proj" not in k}
    save_file(tensors, str(file))
    with caplog.at_level("WARNING", logger="mmlora.lora.adapter"):
        loaded = load_adapter(tmp_path, lora_spec(cfg), max_lora_rank=8)
    assert "model.layers.1.self_attn.v_proj" in caplog.text
    assert loaded.weights[(1, "qkv_proj")].A[2] is None and loaded.weights[(1, "qkv_proj")].scalings[2] == 0.0
    assert loaded.weights[(0, "qkv_proj")].A[2] is not None


# ---------------------------------------------------------------------------------------------------------
# Refusals: every one is an AdapterError naming the adapter path and the problem

SPEC = lora_spec(llama_config())
QA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
QB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base_adapter(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "adapter"
    make_adapter(path, llama_config(), r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    return path


@pytest.fixture
def adapter(base_adapter, tmp_path):
    """A fresh copy of a valid all-seven-projections rank-4 adapter, to spoil."""
    dst = tmp_path / "adapter"
    shutil.copytree(base_adapter, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def edit_tensors(path: Path, fn) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))


def refused(path: Path, phrase: str, spec: LoRAModelSpec = SPEC, max_lora_rank: int = 8, **kwargs) -> str:
    with pytest.raises(AdapterError) as info:
        load_adapter(path, spec, max_lora_rank=max_lora_rank, **kwargs)
    message = str(info.value)
    assert phrase in message
    assert str(path) in message
    return message


def test_valid_copy_loads(adapter):
    assert load_adapter(adapter, SPEC, max_lora_rank=8).rank == 4


def test_missing_folder(tmp_path):
    refused(tmp_path / "nope", "no such adapter folder")


def test_path_is_a_file(adapter):
    refused(adapter / "adapter_config.json", "is not a folder")


def test_missing_config(adapter):
    (adapter / "adapter_config.json").unlink()
    refused(adapter, "missing adapter_config.json")


def test_missing_weights(adapter):
    (adapter / "adapter_model.safetensors").unlink()
    refused(adapter, "missing weights file")


@pytest.mark.parametrize("text", ['{"r": 4,', "[1, 2]", "\xff\xfe"])
def test_corrupt_config(adapter, text):
    (adapter / "adapter_config.json").write_bytes(text.encode("latin-1"))
    refused(adapter, "corrupt adapter_config.json")


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_corrupt_safetensors(adapter, how):
    file = adapter / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"\x00garbage" * 10 if how == "garbage" else data[: len(data) // 2])
    refused(adapter, "corrupt adapter_model.safetensors")


def test_pickled_refused_by_default(tmp_path):
    make_adapter(tmp_path, llama_config(), safe=False, r=4, target_modules=["q_proj"])
    message = refused(tmp_path, "pickled adapters")
    assert "allow_pickled_adapters=True" in message and "--allow-pickled-adapters" in message
    assert "safetensors" in message


class _Evil:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['EVIL_MARK']).touch()",))


def test_pickled_code_never_runs(adapter, tmp_path, monkeypatch):
    mark = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({QA: _Evil()}, adapter / "adapter_model.bin")
    refused(adapter, "corrupt adapter_model.bin", allow_pickled=True)
    assert not mark.exists()


@pytest.mark.parametrize(
    "changes, phrase",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"peft_type": "IA3"}, "unsupported peft_type 'IA3'"),
        ({"peft_type": None}, "unsupported peft_type"),
        ({"lora_bias": True}, "lora_bias"),
        ({"init_lora_weights": "pissa_niter_4"}, "path_initial_model_for_weight_conversion"),
        ({"layer_replication": [[0, 1], [0, 2]]}, "layer replication"),
        ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
        ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
        ({"r": "eight"}, "r must be a positive integer"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_alpha": "x"}, "lora_alpha must be a number"),
        ({"rank_pattern": {"q_proj": "x"}}, "rank_pattern must map"),
        ({"alpha_pattern": ["q_proj"]}, "alpha_pattern must map"),
        ({"target_modules": "(q_proj"}, "invalid regex"),
        ({"target_modules": 7}, "target_modules must be a list"),
        ({"layers_to_transform": "0"}, "layers_to_transform must be an integer"),
        (
            {"target_modules": ".*q_proj", "layers_to_transform": [0]},
            "cannot be used when target_modules is a regex",
        ),
        ({"layers_pattern": "layers"}, "layers_pattern is set but layers_to_transform is not"),
    ],
)
def test_refused_config(adapter, changes, phrase):
    edit_config(adapter, **changes)
    refused(adapter, phrase)


def test_target_modules_the_model_cannot_take(adapter):
    edit_config(adapter, target_modules=[*ALL_SEVEN, "c_attn", "fc1"])
    message = refused(adapter, "['c_attn', 'fc1'] cannot take LoRA on this model")
    assert "supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in message


def test_rank_disagrees_with_config(adapter):
    edit_config(adapter, r=2)
    refused(adapter, "has rank 4 in its tensors but the config implies r=2")


def test_rank_disagrees_with_rank_pattern(adapter):
    edit_config(adapter, rank_pattern={r"layers\.1\.mlp\.up_proj": 8})
    refused(adapter, "model.layers.1.mlp.up_proj' has rank 4 in its tensors but the config implies r=8")


@pytest.mark.parametrize(
    "changes",
    [
        {"target_modules": ["q_proj", "k_proj"]},
        {"layers_to_transform": [0]},
        {"exclude_modules": ["down_proj"]},
    ],
)
def test_weights_the_config_does_not_select(adapter, changes):
    edit_config(adapter, **changes)
    refused(adapter, "do not select (config and weights disagree)")


def test_rank_above_max_lora_rank(adapter):
    refused(adapter, "has rank 4, above max_lora_rank=2", max_lora_rank=2)


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


def _rename(old: str, new: str):
    def fn(t):
        for k in [k for k in t if old in k]:
            t[k.replace(old, new)] = t.pop(k)

    return fn


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (lambda t: t.pop(QB), "has lora_A but no lora_B (incomplete A/B pair)"),
        (lambda t: t.pop(QA), "has lora_B but no lora_A (incomplete A/B pair)"),
        (
            _set(QA, torch.randn(4, 31)),
            f"tensor {QA!r} does not fit the base model: expected [4, 32], got [4, 31]",
        ),
        (
            _set(QB, torch.randn(47, 4)),
            f"tensor {QB!r} does not fit the base model: expected [48, 4], got [47, 4]",
        ),
        (_set(QB, torch.randn(48, 3)), "rank mismatch"),
        (_set(QA, torch.full((4, 32), float("nan"))), "NaN or Inf"),
        (_set(QB, torch.full((48, 4), float("inf"))), "NaN or Inf"),
        (_set(QA, torch.ones(4, 32, dtype=torch.int32)), "must be floating point"),
        (_set(QA, torch.randn(4, 32, 1)), "must be a 2-D matrix"),
        (_set(QA, torch.randn(0, 32)), "rank mismatch"),
        (_rename("layers.1.", "layers.5."), "is for layer 5 but the base model has 2 layers"),
        (_set("some.other.tensor", torch.zeros(2)), "is not a recognised PEFT LoRA key"),
        (
            _set("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2)),
            "not a recognised PEFT LoRA key",
        ),
        (_rename("self_attn.q_proj", "self_attn.qkv"), "target module 'qkv' is not supported by this model"),
        (_rename("self_attn.q_proj", "mlp.q_proj"), "is not a recognised module path"),
        (_rename("model.layers.0.self_attn.q_proj", "model.norm.q_proj"), "outside the decoder layers"),
        (_rename("model.layers.0.self_attn.q_proj", "lm_head"), "lm_head (lm_head) is not supported yet"),
        (_set("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 64)), "embeddings"),
        (
            _set("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(48)),
            "DoRA",
        ),
        (_set("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", torch.ones(48)), "lora_bias"),
        (
            lambda t: t.__setitem__(QA.replace(".weight", ".default.weight"), t[QA].clone()),
            "has two lora_A tensors",
        ),
        (lambda t: t.clear() or t.__setitem__("__metadata_only__", torch.zeros(0)), "not a recognised"),
    ],
)
def test_refused_tensors(adapter, edit, phrase):
    edit_tensors(adapter, edit)
    refused(adapter, phrase)


def test_empty_weights_file(adapter):
    save_file({}, str(adapter / "adapter_model.safetensors"))
    refused(adapter, "holds no tensors")


def test_overflow_in_requested_dtype(adapter):
    edit_tensors(adapter, _set(QA, torch.full((4, 32), 1e6)))
    load_adapter(adapter, SPEC, max_lora_rank=8)  # finite in fp32
    refused(adapter, "NaN or Inf values (in torch.float16)", dtype=torch.float16)


def test_adapter_for_another_base_model(tmp_path):
    make_adapter(tmp_path, llama_config(), r=4, target_modules=["q_proj"])
    refused(
        tmp_path, "does not fit the base model: expected [4, 48], got [4, 32]", spec=lora_spec(qwen2_config())
    )


def test_vision_tower_refused(adapter):
    spec = lora_spec(llama_config(), refused_prefixes=(("model.visual", "vision tower"),))
    edit_tensors(
        adapter, _set("base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight", torch.zeros(4, 8))
    )
    refused(adapter, "LoRA on 'model.visual' (vision tower) is not supported", spec=spec)


# Real PEFT adapters with features we refuse (not hand-edited files)


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head (lm_head) is not supported yet"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embeddings"),
        ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj"], "bias": "lora_only"}, "bias='lora_only'"),
        ({"target_modules": ["q_proj"], "lora_bias": True}, "lora_bias"),
        ({"target_modules": ["q_proj"], "r": 16}, "has rank 16, above max_lora_rank=8"),
    ],
)
def test_refused_real_peft_adapters(tmp_path, kwargs, phrase):
    make_adapter(tmp_path, llama_config(), **kwargs)
    refused(tmp_path, phrase)
