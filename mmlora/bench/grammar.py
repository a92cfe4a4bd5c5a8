"""``python -m mmlora.bench grammar``: what structured output adds to a decode step.

B requests (``--batch``, default 32) decode on the engine; the step is timed as serving runs it (a CUDA
graph replay on CUDA). Then, on logits of the same shape on the same device, the grammar work of one step
for ``--constrained`` rows (default 8) is timed exactly as the engine does it (``apply_grammar_masks``:
fill each constrained row's bitmask on the host, copy, apply per row; then ``accept`` the sampled
token), with matchers walking a JSON schema along tokens sampled under their own masks. The printed ratio
is grammar time over step time; the issue's bound is 10 % on the H200 at B=32 with 8 constrained rows.

Dummy models borrow SmolLM2's tokenizer, which does not fit other vocabularies: the grammar then runs
over a synthetic vocabulary of the model's size (the 256 bytes, then random printable pieces of 2 to 8
characters, as BPE vocabularies look). With ``--model`` pointing at a real checkpoint its own tokenizer
is used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from mmlora.bench.serving_parts import abort_all, start_decode_batch
from mmlora.engine.grammar import GrammarCompiler, GrammarMasks, apply_grammar_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "score", "ok"],
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mmlora.bench grammar", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="default: dummy:mistral-7b-v0.3 on CUDA, dummy:tiny-llama on CPU"
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--constrained", type=int, default=8)
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _synthetic_vocab(size: int, rng: np.random.Generator) -> list[bytes]:
    letters = np.frombuffer(
        b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:;"{}[]', "u1"
    )
    vocab = [bytes([b]) for b in range(min(256, size))]
    while len(vocab) < size:
        vocab.append(bytes(rng.choice(letters, int(rng.integers(2, 9)))))
    return vocab


def _compiler(engine: Any, vocab_size: int, rng: np.random.Generator) -> GrammarCompiler:
    if engine.tokenizer is not None and len(engine.tokenizer) <= vocab_size:
        return engine.grammars
    import xgrammar

    info = xgrammar.TokenizerInfo(
        _synthetic_vocab(vocab_size, rng), xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[2]
    )
    return GrammarCompiler.from_tokenizer_info(info, vocab_size)


def _time_step(engine: Any, steps: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _time_grammar(
    compiler: GrammarCompiler, batch: int, constrained: int, steps: int, device: torch.device, vocab: int
) -> list[float]:
    """The engine's per-step grammar work for ``constrained`` of ``batch`` rows (the first ones)."""
    constraint = ("json_schema", json.dumps(SCHEMA))
    rows = [
        SimpleNamespace(grammar=compiler.state_for(constraint) if i < constrained else None)
        for i in range(batch)
    ]
    masks = GrammarMasks(vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(steps + 3):
        logits = torch.randn(batch, vocab, device=device, generator=gen)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        apply_grammar_masks(logits, rows, masks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        masked = time.perf_counter() - start
        tokens = logits[:constrained].argmax(dim=-1).tolist()  # sampling runs anyway: not grammar time
        start = time.perf_counter()
        for row, token in zip(rows, tokens):
            if row.grammar.accept(token):
                row.grammar = compiler.state_for(constraint)  # a finished row is replaced by a new one
        times.append(masked + time.perf_counter() - start)
    return times[3:]  # the first steps warm the allocator and xgrammar's caches


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mmlora import Engine

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model or ("dummy:mistral-7b-v0.3" if device.type == "cuda" else "dummy:tiny-llama")
    context = args.context if device.type == "cuda" else min(args.context, 64)
    engine = Engine(
        model=model,
        device=device.type,
        max_running_requests=max(args.batch, 8),
        max_kv_tokens=args.batch * (context + args.steps + 16),
    )
    rng = np.random.default_rng(args.seed)
    rids = start_decode_batch(engine, [None] * args.batch, context, rng)
    step = _time_step(engine, args.steps, device)
    abort_all(engine, rids)
    vocab = engine.grammars.vocab_size
    grammar = _time_grammar(
        _compiler(engine, vocab, rng), args.batch, args.constrained, args.steps, device, vocab
    )
    step_ms, grammar_ms = statistics.median(step) * 1e3, statistics.median(grammar) * 1e3
    return {
        "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
        "model": model,
        "batch": args.batch,
        "constrained": args.constrained,
        "vocab": vocab,
        "decode_step_ms": step_ms,
        "grammar_ms": grammar_ms,
        "overhead": grammar_ms / step_ms,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    result = run(_parse(argv))
    import sys

    sys.stdout.write(
        f"{result['model']} on {result['device']}, B={result['batch']}, {result['constrained']} constrained, "
        f"vocab {result['vocab']}: decode step {result['decode_step_ms']:.3f} ms (median), grammar mask+fill+accept "
        f"{result['grammar_ms']:.3f} ms -> {100 * result['overhead']:.1f}% of a step\n"
    )
    return result
