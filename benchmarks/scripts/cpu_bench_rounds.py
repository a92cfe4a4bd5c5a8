"""``python -m mmlora.bench cpu``'s four systems in its order and with its warm-ups, for more rounds, each
round's wall and process-CPU seconds printed and kept (the bench keeps only the best of each): to tell a
ratio the bench reports from the noise of its best-of-two (issue 21, session 12).

Same set-up as the bench: SmolLM2 from the embedded GGUF, four random rank-8 PEFT adapters on all seven
projections, 16 prompts x 64 new tokens, rows cycling over the adapters and the base; systems mmlora mixed
(fp32), mmlora base-only (fp32), HF + PEFT mixed, mmlora mixed (bf16).

    PYTHONPATH=. python benchmarks/scripts/cpu_bench_rounds.py [--rounds 3] [--out F]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import mmlora
from mmlora.bench.cpu import PROMPTS, load_hf_model, make_peft_adapters


def main() -> None:  # noqa: PLR0915
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    hf, tok = load_hf_model("smollm2")
    peft_model, paths = make_peft_adapters(hf, Path(tempfile.mkdtemp()), 4, 8, 0)
    names = [*paths, None]
    per_row = [names[i % len(names)] for i in range(len(PROMPTS))]

    def engine(dtype: str) -> mmlora.Engine:
        return mmlora.Engine(
            model="smollm2", lora_paths=paths, max_loras_per_batch=4, max_lora_rank=8,
            max_running_requests=64, device="cpu", dtype=dtype,
        )  # fmt: skip

    e32 = engine("float32")
    texts = [e32.apply_chat_template([{"role": "user", "content": q}]) for q in PROMPTS]
    sp = {"max_new_tokens": 64, "min_new_tokens": 64, "temperature": 0.0}
    warm = {**sp, "max_new_tokens": 4, "min_new_tokens": 4}
    e32.generate(texts, lora_paths=per_row, sampling_params=warm)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    adapter_names = [n or "__base__" for n in per_row]

    def hf_generate(n: int = 64) -> None:
        with torch.inference_mode():
            peft_model.generate(
                **enc, adapter_names=adapter_names, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip

    hf_generate(4)
    e16 = engine("bfloat16")
    e16.generate(texts, lora_paths=per_row, sampling_params=warm)
    systems = {
        "mmlora_mixed": lambda: e32.generate(texts, lora_paths=per_row, sampling_params=sp),
        "mmlora_base": lambda: e32.generate(texts, lora_paths=None, sampling_params=sp),
        "hf_peft_mixed": hf_generate,
        "mmlora_mixed_bf16": lambda: e16.generate(texts, lora_paths=per_row, sampling_params=sp),
    }
    res: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in systems}
    for r in range(args.rounds):
        for name, fn in systems.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            res[name]["wall"].append(time.perf_counter() - w0)
            res[name]["cpu"].append(time.process_time() - c0)
        cpu = {k: v["cpu"][-1] for k, v in res.items()}
        print(
            f"round {r}: " + ", ".join(f"{k} {v:.3f} CPU-s" for k, v in cpu.items())
            + f"; mixed / base {cpu['mmlora_base'] / cpu['mmlora_mixed']:.3f}, "
            f"bf16 / fp32 {cpu['mmlora_mixed'] / cpu['mmlora_mixed_bf16']:.3f}",
            flush=True,
        )  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rounds": args.rounds, "seconds": res}, f, indent=2)


if __name__ == "__main__":
    main()
