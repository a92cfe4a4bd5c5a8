"""Qwen2-VL against HF ``Qwen2VLForConditionalGeneration`` + PEFT (fp32, CPU).

Greedy tokens identical and chosen-token logprobs within 1e-3, in one batch that mixes: images of
different sizes (28x28 .. 112x112), a placeholder mid-text, an image with no placeholder (goes first),
two images in one request, text-only requests, three adapters and base-only rows. Then the same batch
through ``mmlora.generate`` with 16-token prefill chunks that cut image placeholder runs, images given
as PIL, path, bytes and data URL. The oracle expands placeholders the way HF's Qwen2VLProcessor does
(``<|image_pad|>`` -> merged-patch count copies) and gets M-RoPE positions from HF itself.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import ALL_SEVEN, make_adapter, make_qwen2_vl_checkpoint

import mmlora
from mmlora.engine import model_runner
from mmlora.multimodal import images as mm_images

MAX_NEW = 8
SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
ADAPTERS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN),
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(
        r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"], rank_pattern={"up_proj": 2}
    ),
}
SMOKE_SIZES = [(448, 448), (224, 336), (56, 56)]
SIZES = {"a": (28, 28), "b": (56, 84), "c": (84, 56), "d": (112, 112)}  # (height, width)
# (text, image keys, adapter)
ROWS = [
    (f"Hello {SLOT} what is this?", ["b"], "all7"),
    ("The quick brown fox", [], None),
    ("Describe the picture.", ["a"], "attn"),
    (f"{SLOT} and {SLOT} differ in", ["d", "c"], "mlp"),
    ("Paris is the capital of", [], "all7"),
    (f"Look: {SLOT}", ["a"], None),
]


def _image(key: str):
    from PIL import Image

    h, w = SIZES[key]
    rng = np.random.default_rng(sum(map(ord, key)))
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def make_vl_adapter(base: Path, out: Path, seed: int, **lora_kwargs) -> Path:
    return make_adapter(base, out, seed, model_class="Qwen2VLForConditionalGeneration", **lora_kwargs)


def hf_oracle(base: Path, adapters: dict[str, Path]) -> list[tuple[list[int], list[int], list[float]]]:
    """(expanded prompt ids, greedy tokens, chosen-token logprobs) per row, from HF + PEFT one row at a time."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(base)
    proc = AutoImageProcessor.from_pretrained(base)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    first, *rest = list(adapters)
    model = PeftModel.from_pretrained(hf, adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    pad_id = hf.config.image_token_id
    results = []
    for text, keys, adapter in ROWS:
        kwargs: dict = {}
        if keys:
            if SLOT not in text:
                text = SLOT * len(keys) + text
            pix = proc(images=[_image(k) for k in keys], return_tensors="pt")
            for grid in pix["image_grid_thw"]:  # Qwen2VLProcessor.replace_image_token, one image at a time
                text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
            kwargs = dict(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
        ids = tok(text, add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        kwargs.update(mm_token_type_ids=(x == pad_id).int(), attention_mask=torch.ones_like(x))
        gen = dict(max_new_tokens=MAX_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
        gen.update(eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=x, **kwargs, **gen)
            else:
                model.set_adapter(adapter)
                out = model.generate(input_ids=x, **kwargs, **gen)
        tokens = out.sequences[0, len(ids) :].tolist()
        logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
        results.append((ids, tokens, logprobs))
    return results


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2vl")
    base = make_qwen2_vl_checkpoint(root / "base")
    adapters = {n: make_vl_adapter(base, root / n, i + 1, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    return root, base, adapters, hf_oracle(base, adapters)


def _check(outs, expected) -> None:
    for i, (out, (_, tokens, logprobs)) in enumerate(zip(outs, expected)):
        assert out.output_ids == tokens, f"row {i} {ROWS[i]}"
        assert out.logprobs == pytest.approx(logprobs, abs=1e-3), f"row {i} {ROWS[i]}"


def _run_batch(base: Path, adapters: dict, **engine_kwargs) -> tuple[mmlora.Engine, list]:
    engine = mmlora.Engine(
        model=str(base), lora_paths={n: str(p) for n, p in adapters.items()}, max_loras_per_batch=2,
        max_lora_rank=8, dtype="float32", **engine_kwargs,
    )  # fmt: skip
    outs = engine.generate(
        [r[0] for r in ROWS], [r[2] for r in ROWS], [[_image(k) for k in r[1]] or None for r in ROWS],
        {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}, return_logprob=True,
    )  # fmt: skip
    return engine, outs


def test_qwen2_vl_mixed_batch_matches_hf_peft(tiny_vl):
    _, base, adapters, expected = tiny_vl
    engine, outs = _run_batch(base, adapters, device="cpu")
    _check(outs, expected)
    prompts, tok = engine.multimodal, engine.tokenizer
    for (text, keys, _), (ids, _, _) in zip(ROWS, expected):  # placeholder expansion equals the processor's
        assert prompts.prepare_prompt(tok, text, None, [_image(k) for k in keys])[0] == ids
    # input_ids with one <|image_pad|> id per image expand the same way as text.
    slot_ids = tok(ROWS[3][0], add_special_tokens=False)["input_ids"]
    assert prompts.prepare_prompt(tok, None, slot_ids, [_image("d"), _image("c")])[0] == expected[3][0]
    # Images really matter: the same text with a different image answers differently.
    other = engine.generate(
        ROWS[5][0], None, [[_image("b")]], {"max_new_tokens": MAX_NEW, "temperature": 0.0}
    )
    assert other[0].output_ids != outs[5].output_ids
    assert engine.kv_cache.allocator.usage == 0.0


def test_qwen2_vl_decode_graph_inputs_match_hf_peft(tiny_vl):
    """Decode steps through the CUDA-graph runner's static buffers (run eagerly here: ``capture=False``),
    1-D positions from ``decode_position`` (prompt positions plus the image rope offset): HF + PEFT's tokens."""
    from mmlora.engine.cuda_graph import CudaGraphRunner

    _, base, adapters, expected = tiny_vl
    engine = mmlora.Engine(
        model=str(base), lora_paths={n: str(p) for n, p in adapters.items()}, max_loras_per_batch=2,
        max_lora_rank=8, dtype="float32", device="cpu",
    )  # fmt: skip
    runner = engine.runner
    runner.decode_graphs = CudaGraphRunner(runner, 8, engine.max_model_len, capture=False)
    outs = engine.generate(
        [r[0] for r in ROWS], [r[2] for r in ROWS], [[_image(k) for k in r[1]] or None for r in ROWS],
        {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}, return_logprob=True,
    )  # fmt: skip
    assert runner.decode_graphs.num_replays > 0
    _check(outs, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora_backend", ["torch-gather", "triton-sgmv", "triton-bgmv"])
def test_qwen2_vl_cuda_triton_matches_hf_peft(tiny_vl, lora_backend):
    """On the GPU: Triton attention with every LoRA backend, fp32, prefill chunks cutting image runs."""
    _, base, adapters, expected = tiny_vl
    _, outs = _run_batch(
        base, adapters, device="cuda", attention_backend="triton", lora_backend=lora_backend,
        max_num_batched_tokens=16, max_kv_tokens=8192,
    )  # fmt: skip
    _check(outs, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora_backend", ["triton-sgmv", "triton-bgmv"])
def test_qwen2_vl_7b_dummy_bf16_cuda_smoke(tmp_path, lora_backend):
    """The real Qwen2-VL-7B shapes in bf16: images of 256, 96 and 4 tokens, 512-token chunks cutting them."""
    from dummy_smoke import smoke_batch
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in SMOKE_SIZES]
    outs = smoke_batch(
        "qwen2-vl-7b", tmp_path, images=images, device="cuda", dtype="bfloat16", lora_backend=lora_backend,
        max_loras_per_batch=4, max_lora_rank=32, max_num_batched_tokens=512, max_kv_tokens=8192,
    )  # fmt: skip
    assert outs[0].prompt_tokens == 37 + 256 + 2  # 448x448 -> 32x32 patches -> 256 merged tokens


def test_qwen2_vl_generate_api_chunked_prefill_and_image_forms(tiny_vl, tmp_path, monkeypatch):
    """16-token chunks cut image runs; images as PIL, path, PNG bytes and data URL give the same answers."""
    _, base, adapters, expected = tiny_vl
    png = {}
    for k in SIZES:
        buf = io.BytesIO()
        _image(k).save(buf, format="PNG")
        png[k] = buf.getvalue()
        (tmp_path / f"{k}.png").write_bytes(png[k])
    forms = [
        lambda k: _image(k),
        lambda k: str(tmp_path / f"{k}.png"),
        lambda k: png[k],
        lambda k: "data:image/png;base64," + base64.b64encode(png[k]).decode(),
    ]
    images = [[forms[(i + j) % 4](k) for j, k in enumerate(r[1])] or None for i, r in enumerate(ROWS)]
    split = []
    real = model_runner.batch_inputs

    def spy(chunks, encode, device):  # record chunks that cut an image's placeholder run
        for mm, start, n in chunks:
            for s, count in mm.spans if mm is not None else []:
                if s < start < s + count or s < start + n < s + count:
                    split.append((s, count, start, n))
        return real(chunks, encode, device)

    monkeypatch.setattr(model_runner, "batch_inputs", spy)
    outs = mmlora.generate(
        images=images, texts=[r[0] for r in ROWS],
        lora_paths=[str(adapters[r[2]]) if r[2] else None for r in ROWS],
        model=str(base), device="cpu", dtype="float32", max_num_batched_tokens=16,
        sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
        return_logprob=True,
    )  # fmt: skip
    assert split, "no prefill chunk cut an image placeholder run"
    _check(outs, expected)


def test_qwen2_vl_refusals(tiny_vl, tmp_path, monkeypatch):
    root, base, _, _ = tiny_vl
    engine = mmlora.Engine(model=str(base), device="cpu", dtype="float32")
    vision = make_vl_adapter(base, root / "vision", 9, r=4, lora_alpha=8, target_modules=["qkv", "q_proj"])
    with pytest.raises(ValueError, match="vision tower"):
        engine.load_lora("vision", str(vision))
    img = _image("a")
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request(f"{SLOT}{SLOT} two slots", images=[img])
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request(f"{SLOT} no image")
    with pytest.raises(ValueError, match="not a recognised image"):
        engine.add_request("corrupt", images=[b"\x89PNG not really an image"])
    with pytest.raises(ValueError, match="invalid base64"):
        engine.add_request("bad b64", images=["data:image/png;base64,@@@@"])
    with pytest.raises(ValueError, match="unsupported type"):
        engine.add_request("bad type", images=[12345])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    with pytest.raises(ValueError, match="corrupt image data"):
        engine.add_request("truncated", images=[buf.getvalue()[:-40]])
    ppm = io.BytesIO()
    img.save(ppm, format="PPM")
    with pytest.raises(ValueError, match="format PPM is not supported"):
        engine.add_request("ppm", images=[ppm.getvalue()])
    with pytest.raises(ValueError, match="neither an existing file"):
        engine.add_request("missing", images=[str(tmp_path / "missing.png")])
    monkeypatch.setattr(mm_images, "MAX_IMAGE_PIXELS", 28 * 27)
    with pytest.raises(ValueError, match="more than the limit"):
        engine.add_request("too big", images=[buf.getvalue()])
    assert not engine.has_unfinished()
