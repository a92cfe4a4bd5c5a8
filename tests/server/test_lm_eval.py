"""lm-eval-harness's ``local-completions`` model against the server, on a tiny multiple-choice task over a
local JSON file, once on the base model and once with an adapter as ``model``: every loglikelihood it
reports equals HF + PEFT's, computed directly on the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_oracle import hf_prompt_logprobs
from transformers import AutoTokenizer

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog.", " capital of France."]},
    {"question": "Paris is the capital of", "choices": [" France;", " Italy.", " the world"]},
    {"question": "Hello world! How are you", "choices": [" today?", " fine"]},
]


def _task(folder: Path) -> str:
    data = folder / "docs.json"
    data.write_text(json.dumps(DOCS))
    (folder / "tiny_mc.yaml").write_text(
        "\n".join(
            [
                "task: tiny_mc",
                "dataset_path: json",
                "dataset_kwargs:",
                f"  data_files: {{test: {data}}}",
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{question}}"',
                "doc_to_choice: choices",
                "doc_to_target: 0",
                "target_delimiter: ''",
                "metric_list:",
                "  - metric: acc",
            ]
        )
    )
    return "tiny_mc"


def _run(server, tiny, tmp_path: Path, model: str) -> list[tuple[str, str, float]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task = _task(tmp_path)
    args = (
        f"model={model},base_url={server.url}/v1/completions,tokenizer={tiny.folder},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    results = simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    found = []
    for sample in results["samples"][task]:
        for (context, continuation), resp in zip(
            [tuple(a["arguments"]) if isinstance(a, dict) else tuple(a) for a in sample["arguments"]],
            sample["resps"],
        ):
            found.append((context, continuation, resp[0][0]))
    return found


@pytest.mark.parametrize("model", ["tiny", "a2"])
def test_lm_eval_loglikelihoods_equal_hf_peft(server, tiny, tmp_path, model):
    found = _run(server, tiny, tmp_path, model)
    assert len(found) == sum(len(d["choices"]) for d in DOCS)
    tok = AutoTokenizer.from_pretrained(tiny.folder)
    adapter = None if model == "tiny" else tiny.adapters[model]
    for context, continuation, loglikelihood in found:
        context_ids = tok(context, add_special_tokens=False)["input_ids"]
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        expected = sum(hf_prompt_logprobs(tiny.folder, adapter, whole)[len(context_ids) - 1 :])
        assert loglikelihood == pytest.approx(expected, abs=1e-3), (context, continuation)
