"""Compile every Triton kernel variant a CPU run launches for the H200 (sm_90), on a machine with no GPU.

The CPU tests run the Triton kernels in Triton's interpreter, which accepts programs the CUDA compiler
rejects; a device call that finds one is lost (session 22's second call: an early ``return`` inside a
jitted helper). This script finds them first:

1. *record*: runs the given tests under the interpreter with ``tests/triton_specs.py``'s recorder on, then
   (``--shapes``) builds one-layer engines at the real presets' shapes (Mistral-7B, Llama-3-8B, Gemma2-9B,
   Qwen2-7B; rank 16 and 64 adapters; every Triton LoRA backend; bf16), runs their kernel warm-up and a
   mixed batch with the kernels recorded but not run (``execute=False``: the interpreter would take
   minutes a kernel at these shapes);
2. *compile*: in a fresh process with the device's Triton (``--triton``, installed with pip into
   ``--triton-dir`` the first time) and no interpreter, turns each distinct launch into the signature,
   constants and options ``JITFunction.run`` would build on the GPU, and compiles it to a cubin for
   ``--arch``. It prints the variants per kernel and every failure, writes ``compile.json`` and exits 1 if
   any variant fails to compile.

``--tuning BACKEND:KNOB=JSON ...`` records the shapes once more per override, each alone over the defaults:
the variants a launch-setting sweep on the GPU would compile (``--presets`` / ``--backends`` narrow it).

Usage: ``python scripts/cuda_compile_check.py [--tests tests/kernels tests/models] [--shapes] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import triton_specs  # noqa: E402  (tests/ on the path first)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tests", nargs="*", default=["tests/kernels", "tests/models"], help="pytest paths to record"
    )
    p.add_argument("--shapes", action="store_true", help="also record engines at the real presets' shapes")
    p.add_argument("--out", default="/tmp/cuda_compile_check", help="folder for the specs and compile.json")
    p.add_argument("--triton", default="3.6.0", help="Triton version of the device (its compiler is used)")
    p.add_argument("--triton-dir", default=None, help="where that Triton is installed (default: under --out)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, as an int (90 = sm_90)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    p.add_argument("--compile-only", action="store_true", help="compile the specs already under --out")
    p.add_argument(
        "--tuning",
        nargs="*",
        default=[],
        metavar="BACKEND:KNOB=JSON",
        help="with --shapes: also record with each of these Triton TUNING overrides alone "
        "(e.g. triton-sgmv:run_waves=4)",
    )
    p.add_argument("--presets", nargs="*", default=None, help="with --shapes: only these presets")
    p.add_argument("--backends", nargs="*", default=None, help="with --shapes: only these LoRA backends")
    p.add_argument("--record-shapes", action="store_true", help=argparse.SUPPRESS)  # the --shapes subprocess
    return p.parse_args(argv)


def record_tests(paths: list[str], out: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", triton_specs.ENV: os.path.join(out, "tests.jsonl")}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "auto",
        "--maxprocesses",
        "2",
    ]
    cmd += ["--dist", "loadfile", *paths]
    print("recording:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def record_shapes(out: str, tuning: list[str], presets: list[str] | None, backends: list[str] | None) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--record-shapes", "--out", out, "--tuning", *tuning]
    cmd += ["--presets", *presets] if presets else []
    cmd += ["--backends", *backends] if backends else []
    print("recording the presets' shapes", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def ensure_triton(version: str, target: str) -> str:
    marker = os.path.join(target, f"triton-{version}.dist-info")
    if not os.path.isdir(marker):
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target]
        subprocess.run([*pip, f"triton=={version}"], check=True)
    return target


# --- compile (runs with the device's Triton, without the interpreter) -------------------------------


@functools.cache
def _binder(name: str, arch: int) -> tuple[Any, Any, Any]:
    """(the @triton.jit function ``module:qualname``, a CUDA backend of ``arch``, the kernel's argument
    binder), made once per kernel: every launch of it is bound with them."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    module, qualname = name.split(":")
    kernel: Any = importlib.import_module(module)
    for part in qualname.split("."):
        kernel = getattr(kernel, part)
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"{name} is not a @triton.jit function in a process without the interpreter")
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return kernel, backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def _bind(spec: dict[str, Any], arch: int) -> tuple[Any, ...]:
    """What ``JITFunction.run`` builds for this launch on a GPU of ``arch``: (kernel, signature,
    constants, attributes, options), with the key Triton caches the compiled kernel under."""
    kernel, backend, binder = _binder(spec["kernel"], arch)
    args = [triton_specs.decode(a) for a in spec["args"]]
    kwargs = {k: triton_specs.decode(v) for k, v in spec["kwargs"].items()}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    key = (spec["kernel"], str(specialization), str(sorted(options.__dict__.items())))
    return kernel, signature, constexprs, attrs, options, key


def _compile(job: tuple[dict[str, Any], int]) -> tuple[str, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec, arch = job
    try:
        kernel, signature, constexprs, attrs, options, _ = _bind(spec, arch)
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs),
            target=GPUTarget("cuda", arch, 32),
            options=options.__dict__,
        )
        if not compiled.asm.get("cubin"):
            raise RuntimeError("no cubin was produced")
        error = None
    except Exception as exc:  # every failure is reported with its launch, none stops the others
        error = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
    return spec["kernel"], error


def _commit() -> str:
    """The checked-out commit, ``+dirty`` where the tree differs from it."""
    git = ["git", "-C", ROOT]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True
        ).stdout
    except OSError:
        return "unknown"
    return head.strip() + ("+dirty" if dirty.strip() else "") if head.strip() else "unknown"


def compile_all(out: str, arch: int, jobs: int) -> int:
    import triton

    paths = [os.path.join(out, f) for f in sorted(os.listdir(out)) if ".jsonl" in f]
    specs = triton_specs.read(paths)
    unique: dict[tuple, dict[str, Any]] = {}
    errors: list[dict[str, Any]] = []
    for spec in specs:
        try:
            unique.setdefault(_bind(spec, arch)[-1], spec)
        except Exception as exc:
            errors.append({"kernel": spec["kernel"], "error": f"{type(exc).__name__}: {exc}", "spec": spec})
    print(
        f"{len(specs)} recorded launches, {len(unique)} distinct compiles (triton {triton.__version__}, sm_{arch})"
    )
    start = time.perf_counter()
    variants: Counter[str] = Counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        todo = list(unique.values())
        for spec, (name, error) in zip(todo, pool.map(_compile, [(s, arch) for s in todo])):
            variants[name] += 1
            if error is not None:
                errors.append({"kernel": name, "error": error, "spec": spec})
    for name, n in sorted(variants.items()):
        bad = sum(e["kernel"] == name for e in errors)
        print(f"  {name}: {n} variants" + (f", {bad} FAILED" if bad else ""))
    for e in errors:
        print(f"\nFAILED {e['kernel']}\n  kwargs {e['spec']['kwargs']}\n  {e['error']}")
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(),
        "triton": triton.__version__,
        "arch": arch,
        "launches": len(specs),
        "compiles": len(unique),
        "seconds": round(time.perf_counter() - start, 1),
        "variants": dict(sorted(variants.items())),
        "failures": errors,
    }
    with open(os.path.join(out, "compile.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"\n{len(unique) - len(errors)} of {len(unique)} compiled in {summary['seconds']} s; {len(errors)} failed"
    )
    return 1 if errors else 0


def _record_shapes_here(out: str, args: argparse.Namespace) -> None:
    """The --shapes recording (under the interpreter): the defaults, then each --tuning override alone."""
    from preset_shapes import BACKENDS, CASES, record_preset_shapes  # this folder's workload

    from mmlora.backends.tuning import parse_override

    cases = tuple(c for c in CASES if not args.presets or c[0] in args.presets)
    backends = tuple(args.backends or BACKENDS)
    if not cases:
        raise SystemExit(f"--presets {args.presets}: none of {[c[0] for c in CASES]}")
    overrides = [parse_override(spec) for spec in args.tuning]
    record_preset_shapes(os.path.join(out, "shapes.jsonl"), cases, backends)
    for i, (table, knob, value) in enumerate(overrides):
        saved = table[knob]
        table[knob] = value
        try:
            print(f"recording with {args.tuning[i]}", flush=True)
            record_preset_shapes(os.path.join(out, f"shapes-tuning{i}.jsonl"), cases, backends)
        finally:
            table[knob] = saved


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    if args.record_shapes:
        _record_shapes_here(out, args)
        return 0
    if args.compile_only:
        return compile_all(out, args.arch, args.jobs)
    if args.tuning:
        from mmlora.backends.tuning import parse_override

        for spec in args.tuning:  # refused now, not after minutes of recording
            parse_override(spec)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        if ".jsonl" in f:
            os.remove(os.path.join(out, f))
    if args.tests:
        record_tests(args.tests, out)
    if args.shapes:
        record_shapes(out, args.tuning, args.presets, args.backends)
    triton_dir = ensure_triton(args.triton, args.triton_dir or os.path.join(out, f"triton-{args.triton}"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Triton's compile cache of this run only, emptied first: every variant is compiled, none found cached
    env["TRITON_CACHE_DIR"] = cache = os.path.join(out, "triton-cache")
    shutil.rmtree(cache, ignore_errors=True)
    env["PYTHONPATH"] = os.pathsep.join([triton_dir, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, os.path.abspath(__file__), "--compile-only", "--out", out]
    cmd += ["--arch", str(args.arch), "--jobs", str(args.jobs)]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
