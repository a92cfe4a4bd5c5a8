"""The seed scenario on the embedded default model: 7 chat prompts over 5 demo adapters and the base model,
served in one continuous batch with 4 adapter slots. Run: ``python -m mmlora.demo``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import mmlora
from mmlora.config import EngineConfig
from mmlora.preflight import check_engine_config, exit_on_config_error

ADAPTERS_DIR = Path(__file__).parent / "assets" / "adapters"
QUESTIONS = [
    "What is the capital of France?",
    "Tell me about the moon.",
    "Name a fruit that is yellow.",
    "Why is the sky blue?",
    "What do cats like to eat?",
    "Give me a tip for learning to cook.",
    "What is the largest ocean on Earth?",
]
PREFERRED_ORDER = ["pirate", "cat", "caps", "json", "emoji"]


def demo_adapters() -> dict[str, str]:
    """Every adapter folder shipped in mmlora/assets/adapters, by name."""
    found = {p.name: str(p) for p in sorted(ADAPTERS_DIR.iterdir()) if (p / "adapter_config.json").is_file()}
    if not found:
        raise SystemExit(f"no demo adapters in {ADAPTERS_DIR}; make them with scripts/train_demo_adapters.py")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--lora-backend", default="auto", help="auto: triton-auto on CUDA, torch-gather on CPU"
    )
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    adapters = demo_adapters()
    names = sorted(
        adapters, key=lambda n: PREFERRED_ORDER.index(n) if n in PREFERRED_ORDER else len(PREFERRED_ORDER)
    )
    names = (names * 5)[:5]
    # The seed's shape: 7 prompts, 5 adapters and the base model, more adapters than the 4 slots.
    plan = [names[0], names[1], None, *names[2:5], names[0]][:7]
    config = exit_on_config_error(
        EngineConfig.from_kwargs,
        model=args.model,
        lora_paths=adapters,
        max_loras_per_batch=4,
        max_lora_rank=64,
        lora_backend=args.lora_backend,
        device=args.device,
    )
    exit_on_config_error(check_engine_config, config)
    engine = mmlora.Engine(config=config)
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    start = time.perf_counter()
    outs = engine.generate(
        prompts, lora_paths=plan, sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0}
    )
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.output_ids) for o in outs)
    for question, name, out in zip(QUESTIONS, plan, outs):
        print(f"\n[{name or 'base'}] {question}\n  -> {out.text.strip()}")
    print(
        f"\n{len(outs)} answers, {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s) "
        f"on {engine.device}, LoRA backend {engine.lora_backend}"
    )


if __name__ == "__main__":
    main()
