"""Small C kernels for the CPU decode step, built on first use with the system C compiler; optional.

A CPU decode step of a thin model (SmolLM2: 30 layers, 16 rows) is a few hundred torch calls whose cost
is the call, not the arithmetic. Where one C loop does what several torch calls do, it is written here:

- :func:`decode_attention`: one decode token per request over the paged KV cache, read in place (and
  :func:`store_kv_unchecked`: the step's K/V rows into their slots, one call for both);
- :func:`rms_norm` (with the residual add), :func:`rotary` and :func:`silu_and_mul`: the arithmetic of the
  torch references in :mod:`mmlora.layers.fused_ops` in one pass each;
- a LoRA module's expand and add, reading only each row's own slot: its Python side is
  :mod:`mmlora.backends.cpu_expand`; over many slots, the shrink and expand reading each row's slot of the
  pool in place (``cpu_row_lora.c``): :mod:`mmlora.backends.cpu_row_lora`;
- the decode step's thin GEMMs over weights prepacked in column panels (``cpu_gemm.c``): its Python side
  is :mod:`mmlora.backends.cpu_gemm`.

The source (``cpu_kernels.c``) is compiled once per machine (``cc -O3 -march=native``, about two seconds) into
``$MMLORA_CACHE_DIR`` (default ``~/.cache/mmlora``) and loaded with ctypes; no torch headers. Only the
attention, the expand and the GEMM run on several threads (OpenMP, as many as torch uses): the library links
``libgomp.so.1``, which in a torch process resolves to the copy torch loaded, so both share one thread
pool; the other kernels are a few microseconds of work and run on the calling thread. Where there is no compiler, the
build fails, the CPU is not x86-64 / aarch64, or ``MMLORA_CPU_KERNELS=0``, :func:`available` is False and
callers keep their torch path. Every kernel is tested against a float64 reference
(``tests/unit/test_cpu_kernels.py``); A/B: ``benchmarks/scripts/cpu_kernels_ab.py``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

#: The kernels' C source: ``cpu_kernels.c``, ``cpu_gemm.c``, ``cpu_row_lora.c`` and ``cpu_plan.c`` (beside
#: this module; package data), one library.
_SOURCE = "\n".join(
    (Path(__file__).parent / name).read_text()
    for name in ("cpu_kernels.c", "cpu_gemm.c", "cpu_row_lora.c", "cpu_plan.c")
)

# fast-math lets the dot products and sums vectorize (reassociated) and expf go through glibc's vector
# math (libmvec); NaN and inf keep their meaning (-fno-finite-math-only). It is given when compiling
# only: linked with -ffast-math, gcc adds crtfastmath.o, which would set flush-to-zero for the whole
# process when the library loads.
_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
_LINK = ["-shared", "-fopenmp", "-lmvec", "-lm"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_EXPAND_ARGS = [_I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64]
_ATTENTION_ARGS = [_I64] * 4 + [_PTR] * 5 + [_I64, _I64, _PTR, _I64, ctypes.c_float, _PTR, _I64, _I64]
_GEMM_ARGS = [_I64] * 3 + [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64]
_ROW_SHRINK_ARGS = [_I64, _PTR, _I64, _PTR, _I64, _PTR] + [_I64] * 7 + [_PTR, _PTR, _I64]
_ROW_EXPAND_ARGS = [_I64, _PTR, _I64, _PTR, _I64, _PTR] + [_I64] * 5 + [_PTR, _PTR, _I64, _PTR, _PTR, _I64]


#: Set False (or ``MMLORA_CPU_KERNELS=0`` before the first use) to keep every caller on its torch path;
#: A/B scripts flip it between calls.
ENABLED = os.environ.get("MMLORA_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    return Path(os.environ.get("MMLORA_CACHE_DIR") or Path.home() / ".cache" / "mmlora") / "cpu_kernels"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model name and flags (Linux), else the platform."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use (None where they cannot be: see the module docstring)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None
    digest = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, *_LINK, _cpu_id()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"mmlora_cpu_{digest}.so"
    try:
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, obj, lib = Path(tmp) / "k.c", Path(tmp) / "k.o", Path(tmp) / "k.so"
                src.write_text(_SOURCE)
                for cmd in (
                    [cc, *_FLAGS, "-c", str(src), "-o", str(obj)],
                    [cc, str(obj), "-o", str(lib), *_LINK],
                ):
                    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                os.replace(lib, path)  # atomic: a concurrent build of the same source lands the same file
        dll = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    for name in ("lora_expand_f32", "lora_expand_bf16"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = _EXPAND_ARGS, None
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = _ATTENTION_ARGS, None
    for kind, args in (("shrink", _ROW_SHRINK_ARGS), ("expand", _ROW_EXPAND_ARGS)):
        for dtype in ("f32", "bf16"):
            fn = getattr(dll, f"lora_row_{kind}_{dtype}")
            fn.argtypes, fn.restype = args, None
    dll.store_kv_rows.argtypes, dll.store_kv_rows.restype = (
        [_I64] * 3 + [_PTR, _I64, _PTR, _I64] + [_PTR] * 3,
        None,
    )
    for name in ("rms_norm_f32", "rms_norm_bf16"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = [_I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, ctypes.c_float], None
    for name in ("rotary_f32", "rotary_bf16"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = [_I64] * 4 + [_PTR, _I64, _PTR, _I64] + [_PTR] * 4, None
    for name in ("silu_and_mul_f32", "silu_and_mul_bf16"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = [_I64, _I64, _PTR, _I64, _PTR, _I64], None
    dll.gemm_panel_width.restype = dll.gemm_has_bf16.restype = _I64
    for name in ("gemm_f32", "gemm_bf16") if dll.gemm_has_bf16() else ("gemm_f32",):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = _GEMM_ARGS, _I64
    dll.plan_kernel_name.argtypes, dll.plan_kernel_name.restype = [_I64], ctypes.c_char_p
    dll.plan_kernel_args.argtypes, dll.plan_kernel_args.restype = [_I64], _I64
    dll.plan_run.argtypes, dll.plan_run.restype = [_PTR, _I64, _PTR], _I64
    from mmlora.backends import cpu_plan  # (it imports this module)

    for index in itertools.count():
        name = dll.plan_kernel_name(index)
        if name is None:
            break
        name = name.decode()
        if name == "gemm_bf16" and not dll.gemm_has_bf16():
            continue  # not built here
        fn = getattr(dll, name)
        if len(fn.argtypes) != dll.plan_kernel_args(index):
            raise RuntimeError(f"cpu_plan.c's PLAN_KERNELS disagrees with the argument types of {name}")
        setattr(dll, name, cpu_plan.Kernel(fn, index))  # recorded while a plan is captured
    return dll


def available() -> bool:
    """Whether the kernels are on (:data:`ENABLED`) and built for this machine."""
    return ENABLED and _library() is not None


#: The dtypes :func:`decode_attention` takes (q, the caches and the output share one).
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One decode token per request over the paged cache, read in place (no gather, no upcast copy):
    ``out[b, qh] = softmax(scale * q[b, qh] . K_b[j]) @ V_b[j]`` over the keys j of request b
    (``seq_lens[b]`` of them, the last ``sliding_window`` where set), query head qh reading KV head
    ``qh // (Hq // Hkv)``; zeros for a request without keys. Scores, softmax and sums in fp32.

    q [B, Hq, D] contiguous; k_cache, v_cache [blocks, block_size, Hkv, D] contiguous, q's dtype (one of
    :data:`ATTENTION_DTYPES`); block_tables [B, max_blocks] int32, seq_lens [B] int32 (CPU), every
    ``seq_lens[b] <= max_seq_len``. Returns [B, Hq, D] in q's dtype. Needs :func:`available`.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if (
        q.dtype not in ATTENTION_DTYPES
        or not q.dtype == k_cache.dtype == v_cache.dtype
        or k_cache.shape != v_cache.shape
        or k_cache.shape[3] != D
        or Hq % Hkv
        or block_tables.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or block_tables.shape[0] < B
        or seq_lens.shape[0] < B
    ):
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)} {q.dtype}, cache {tuple(k_cache.shape)} {k_cache.dtype}, "
            f"tables {block_tables.dtype}, seq_lens {seq_lens.dtype}"
        )
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention: q and the caches must be contiguous")
    if not available():
        raise RuntimeError("decode_attention: the CPU kernels are off or could not be built here")
    tables = block_tables[:B].contiguous()
    scratch = attention_scratch(Hq, max_seq_len)
    return decode_attention_unchecked(
        q, k_cache, v_cache, tables, seq_lens[:B].contiguous(), scale, sliding_window, scratch
    )


def decode_attention_unchecked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """:func:`decode_attention` without its checks; ``tables`` [B, max_blocks] and ``seq_lens`` [B]
    contiguous, ``scratch`` from :func:`attention_scratch` for at least ``max(seq_lens)`` keys. Runs on
    ``scratch``'s thread count (torch's when it was made)."""
    B, Hq, D = q.shape
    out = torch.empty_like(q)
    lib = _library()
    fn = lib.decode_attention_f32 if q.dtype == torch.float32 else lib.decode_attention_bf16
    fn(B, Hq, k_cache.shape[2], D, q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
       tables.data_ptr(), tables.shape[1], k_cache.shape[1], seq_lens.data_ptr(), sliding_window or 0,
       scale, scratch.data_ptr(), scratch.shape[1], scratch.shape[0])  # fmt: skip
    return out


def store_kv_layout_ok(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether :func:`store_kv_unchecked` takes these: k, v [T, Hkv, D] with heads contiguous (any row
    stride), the caches contiguous [blocks, block_size, Hkv, D], one dtype."""
    D = k.shape[-1]
    return (
        k.dim() == 3
        and k.shape == v.shape
        and k.shape[1:] == k_cache.shape[2:]
        and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
        and k.stride(2) == v.stride(2) == 1
        and k.stride(1) == v.stride(1) == D
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def store_kv_unchecked(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """As :func:`mmlora.layers.attention.base.store_kv` (row t of k and v to cache slot ``slots[t]``, int64;
    negative slots skipped) in one call, for tensors :func:`store_kv_layout_ok` takes."""
    T, H, D = k.shape
    _library().store_kv_rows(
        T, H * D, k.element_size(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
    )  # fmt: skip


def attention_scratch(num_heads: int, max_seq_len: int) -> torch.Tensor:
    """fp32 [threads, num_heads * max_seq_len]: :func:`decode_attention_unchecked`'s scores (every query
    head of one request), one row per thread; as many threads as torch uses now (``torch.get_num_threads``)."""
    return torch.empty(torch.get_num_threads(), num_heads * max(max_seq_len, 1), dtype=torch.float32)


#: The dtypes :func:`rms_norm` and :func:`rotary` take.
ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Llama's RMSNorm (offset 0) with the fused residual add, as
    :func:`mmlora.layers.fused_ops.rms_norm_ref`: ``s = x + residual`` (rounded to the dtype), ``y = weight
    * round(s * rsqrt(mean(s^2) + eps))`` with the statistics in fp32. Returns y, or (y, s) with
    ``residual``.

    x [..., N] with unit column stride and rows that flatten to one stride (a column slice of a wider
    tensor is fine), residual [..., N] likewise, weight [N]: CPU, one dtype of :data:`ELEMENTWISE_DTYPES`.
    y and s come back contiguous. Needs :func:`available`."""
    N = x.shape[-1]
    if weight.shape != (N,) or x.dtype != weight.dtype or x.dtype not in ELEMENTWISE_DTYPES:
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} against x {tuple(x.shape)}"
        )
    if not available():
        raise RuntimeError("rms_norm: the CPU kernels are off or could not be built here")
    return rms_norm_unchecked(x, weight, eps, residual)


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as [rows, N] without a copy where its rows share one stride and its columns are unit stride."""
    if t.stride(-1) != 1:
        return None
    flat = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return flat if flat.stride(-1) == 1 and flat.data_ptr() == t.data_ptr() else None


def rms_norm_unchecked(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` without its checks (shapes and dtypes right by construction)."""
    N = x.shape[-1]
    x2 = rows_view(x)
    if x2 is None:
        x2 = x.reshape(-1, N).contiguous()
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype)
    lib = _library()
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    if residual is None:
        fn(rows, N, x2.data_ptr(), x2.stride(0), None, 0, weight.data_ptr(), y.data_ptr(), y.data_ptr(), eps)
        return y
    r2 = rows_view(residual)
    if r2 is None:
        r2 = residual.reshape(-1, N).contiguous()
    s = torch.empty(x.shape, dtype=x.dtype)
    fn(rows, N, x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), weight.data_ptr(), y.data_ptr(),
       s.data_ptr(), eps)  # fmt: skip
    return y, s


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary of q [T, Hq, D] and k [T, Hk, D] by cos, sin [T, D], as
    :func:`mmlora.layers.rotary_ops.apply_rotary_ref`: ``x * cos + rotate_half(x) * sin``, each product
    and the sum rounded to the dtype. q and k: heads contiguous (``stride(1) == D``, unit column stride),
    any row stride (views of a packed qkv output are fine); cos, sin contiguous; CPU, one dtype of
    :data:`ELEMENTWISE_DTYPES`. Returns new contiguous (q, k). Needs :func:`available`."""
    T, Hq, D = q.shape
    if (
        k.dim() != 3
        or k.shape[0] != T
        or k.shape[2] != D
        or D % 2
        or cos.shape != (T, D)
        or sin.shape != (T, D)
        or len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1
        or q.dtype not in ELEMENTWISE_DTYPES
    ):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, {q.dtype}")
    if not rotary_layout_ok(q, k, cos, sin):
        raise ValueError("rotary: heads must be contiguous in q and k, cos and sin contiguous")
    if not available():
        raise RuntimeError("rotary: the CPU kernels are off or could not be built here")
    return rotary_unchecked(q, k, cos, sin)


def rotary_layout_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rotary` takes these tensors as laid out (see there)."""
    D = q.shape[2]
    return (
        q.stride(2) == 1
        and k.stride(2) == 1
        and q.stride(1) == D
        and k.stride(1) == D
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def rotary_unchecked(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary` without its checks."""
    T, Hq, D = q.shape
    qo, ko = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    lib = _library()
    fn = lib.rotary_f32 if q.dtype == torch.float32 else lib.rotary_bf16
    fn(T, Hq, k.shape[1], D, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(),
       sin.data_ptr(), qo.data_ptr(), ko.data_ptr())  # fmt: skip
    return qo, ko


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over gate_up [..., 2I] = [gate | up] (CPU, a dtype of :data:`ELEMENTWISE_DTYPES`),
    as :func:`mmlora.layers.fused_ops.silu_and_mul_ref` rounds it; returns a new [..., I]. Read in place
    where its rows share one stride (:func:`rows_view`), else from a contiguous copy. Needs
    :func:`available`."""
    if gate_up.dtype not in ELEMENTWISE_DTYPES or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} {gate_up.dtype}")
    if not available():
        raise RuntimeError("silu_and_mul: the CPU kernels are off or could not be built here")
    return silu_and_mul_unchecked(gate_up)


def silu_and_mul_unchecked(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` without its checks."""
    x2 = rows_view(gate_up)
    if x2 is None:
        x2 = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    I = gate_up.shape[-1] // 2  # noqa: E741 (the intermediate size, as the docstring names it)
    y = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype)
    lib = _library()
    fn = lib.silu_and_mul_f32 if gate_up.dtype == torch.float32 else lib.silu_and_mul_bf16
    fn(x2.shape[0], I, x2.data_ptr(), x2.stride(0), y.data_ptr(), torch.get_num_threads())
    return y
