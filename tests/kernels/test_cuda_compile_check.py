"""scripts/cuda_compile_check.py: launches recorded under the interpreter, compiled for sm_90 without a GPU.

The oracle is Triton's own CUDA compiler: a kernel the interpreter runs but the compiler rejects (a
``return`` inside a loop, which a Python run allows) must be reported, and a correct one compiled to a
cubin, with the specialization the GPU would give it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x, out, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=ok) * factor, mask=ok)


@triton.jit
def first_positive_kernel(x, out, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        v = tl.load(x + start + tl.arange(0, BLOCK))
        if tl.max(v, 0) > 0:
            tl.store(out, start)
            return  # a Python run allows it; the CUDA compiler does not (no return inside a loop)
"""


def test_arguments_round_trip_as_triton_specializes_them():
    import triton.language as tl

    base = torch.zeros(8, dtype=torch.bfloat16)
    values = [base, base[1:], 7, 1, 16, 2**40, 0.5, True, None, "tf32", tl.float16, (3, base)]
    encoded = [triton_specs.encode(v) for v in values]
    assert encoded[0] == {"tensor": "bfloat16", "aligned": True}
    assert encoded[1] == {"tensor": "bfloat16", "aligned": False}
    assert [triton_specs.encode(triton_specs.decode(e)) for e in json.loads(json.dumps(encoded))] == encoded
    with pytest.raises(TypeError, match="object"):
        triton_specs.encode(object())


RECORD = """
import json, sys, torch, triton_specs
import compile_check_kernels as k

uninstall = triton_specs.install(sys.argv[1])
x = torch.arange(-40, 24, dtype=torch.float32)
out = torch.zeros(64)
for factor in (2.0, 2.0, 3.0):  # two launches recorded, one compile
    k.scale_kernel[(4,)](x, out, 64, factor, BLOCK=16)
k.scale_kernel[(4,)](x[1:], out, 63, 2.0, BLOCK=16)  # unaligned: another compile
first = torch.zeros(1, dtype=torch.int32)
k.first_positive_kernel[(1,)](x, first, 64, BLOCK=16)
uninstall()
print(json.dumps({"scaled": torch.equal(out[:63], x[1:] * 2.0), "first": first.item()}))
"""


def test_the_interpreter_runs_both_kernels_and_the_compiler_rejects_one(tmp_path):
    (tmp_path / "compile_check_kernels.py").write_text(textwrap.dedent(KERNELS))
    specs = tmp_path / "out" / "tests.jsonl.1"
    specs.parent.mkdir()
    # Both steps in their own processes: the interpreter is chosen when triton is first imported, and a
    # test run that is itself being recorded (cuda_compile_check.py) must not record these kernels.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", triton_specs.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.path.join(ROOT, "tests"), ROOT])
    cmd = [sys.executable, "-c", RECORD, str(specs)]
    ran = subprocess.run(
        cmd, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1]) == {
        "scaled": True,
        "first": 32,
    }  # the interpreter ran them
    assert len(triton_specs.read([str(specs)])) == 4

    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = os.path.join(ROOT, "scripts", "cuda_compile_check.py")
    cmd = [sys.executable, script, "--compile-only", "--out", str(specs.parent), "--jobs", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((specs.parent / "compile.json").read_text())
    assert summary["arch"] == 90 and summary["launches"] == 4 and summary["compiles"] == 3
    assert summary["variants"] == {
        "compile_check_kernels:first_positive_kernel": 1,
        "compile_check_kernels:scale_kernel": 2,
    }
    [failure] = summary["failures"]
    assert failure["kernel"] == "compile_check_kernels:first_positive_kernel"
    assert "return" in failure["error"].lower(), failure["error"]
    cubins = [f for _, _, files in os.walk(tmp_path / "cache") for f in files if f.endswith(".cubin")]
    assert sorted(cubins) == ["scale_kernel.cubin"] * 2


SHAPES = """
import sys, preset_shapes
preset_shapes.record_preset_shapes(sys.argv[1], cases=(("mistral-7b-v0.3", 1),), backends=("triton-auto",))
"""


def test_the_default_serving_kernels_compile_for_the_h200(tmp_path):
    """What a Mistral-7B engine on triton-auto launches (warm-up, eager steps, decode and mixed-step graph
    buffers, the fused ops; bf16, the H200's device facts) compiles for sm_90 with this machine's Triton,
    so a kernel change that only the CUDA compiler rejects fails here, not in a device call. The whole
    check (every preset and backend, the device's Triton): ``scripts/cuda_compile_check.py --shapes``."""
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", triton_specs.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests"), ROOT])
    cmd = [sys.executable, "-c", SHAPES, str(out / "shapes.jsonl")]
    ran = subprocess.run(
        cmd, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = os.path.join(ROOT, "scripts", "cuda_compile_check.py")
    cmd = [sys.executable, script, "--compile-only", "--out", str(out), "--jobs", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "compile.json").read_text())
    assert done.returncode == 0 and not summary["failures"], done.stdout[-5000:]
    kernels = {name.split(":")[1] for name in summary["variants"]}
    assert {
        "_sgmv_shrink_kernel",
        "_sgmv_expand_kernel",
        "_sgmv_act_expand_kernel",
        "_bgmv_shrink_kernel",
        "_bgmv_expand_kernel",
        "_prefill_kernel",
        "_decode_split_kernel",
        "_decode_reduce_kernel",
        "_store_kv_kernel",
        "_rms_norm_kernel",
        "_act_and_mul_kernel",
        "_rope_kernel",
    } <= kernels, kernels


def test_tuning_overrides_name_a_real_knob():
    """--tuning (and with_tuning.py) take BACKEND:KNOB=JSON for a knob the backend's TUNING has; anything
    else is refused before minutes of recording are spent."""
    from mmlora.backends import triton_sgmv
    from mmlora.backends.tuning import parse_override

    table, knob, value = parse_override("triton-sgmv:run_expand_group=4")
    assert table is triton_sgmv.TUNING and knob == "run_expand_group" and value == 4
    for bad in ("triton-sgmv:no_such_knob=1", "no-such-backend:waves=2", "triton-sgmv:waves"):
        with pytest.raises(SystemExit, match="BACKEND:KNOB=JSON"):
            parse_override(bad)
