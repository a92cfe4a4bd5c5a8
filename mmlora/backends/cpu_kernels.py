"""Small C kernels for the CPU decode step, built on first use with the system C compiler; optional.

A CPU decode step of a thin model (SmolLM2: 30 layers, 16 rows) is a few hundred torch calls whose cost
is the call, not the arithmetic. Where one C loop does what several torch calls do, it is written here:

- :func:`decode_attention`: one decode token per request over the paged KV cache, read in place (and
  :func:`store_kv_unchecked`: the step's K/V rows into their slots, one call for both);
- :func:`rms_norm` (with the residual add) and :func:`rotary`: the arithmetic of the torch references in
  :mod:`mmlora.layers.fused_ops` in one pass each;
- :func:`lora_expand`: a LoRA module's expand and add, ``y[t, slice i] += h[t, slot(t)'s slice i rows]
  @ E[those rows, slice i]``, reading only each row's own slot (the torch path masks the other slots'
  columns to zero, multiplies every row by every slot's expand rows and adds: three calls).

The source is compiled once per machine (``cc -O3 -march=native``, about two seconds) into
``$MMLORA_CACHE_DIR`` (default ``~/.cache/mmlora``) and loaded with ctypes; no torch headers. Only the
attention and the expand run on several threads (OpenMP, as many as torch uses): the library links
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
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__)
/* glibc's libmvec has vector expf (_ZGV*v_expf); its header announces them only under full fast-math. */
#pragma omp declare simd notinbranch
float expf(float);
#endif

static inline float bf2f(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float id_f(float x) { return x; }
static inline uint16_t f2bf(float f) {  /* round to nearest even, as torch rounds fp32 to bf16 */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* For each row t with rows[2t] >= 0 (its slot's first column in h / row in E) and rank r = rows[2t+1]:
   for each slice i: acc = h[t, s + i*r : s + (i+1)*r] @ E[s + i*r : s + (i+1)*r, offs[i]:offs[i+1]],
   then y[t, offs[i]:offs[i+1]] += round(acc) (bf16: the delta rounded, then the sum, as torch's
   y += h @ E). E is compact: row k holds only its slice's columns, at element eoff[k] (a slot's rows
   are one contiguous run). Up to EXPAND_GROUP rows of one slot go together, so each E row is loaded
   once for all of them; the sum runs over j for EXPAND_CHUNK columns at a time, held in registers. The
   (group, slice, half of the columns) items are shared out over `threads` OpenMP threads. */
#define EXPAND_CHUNK 32
#define EXPAND_GROUP 4
#define LORA_EXPAND(NAME, T, LOAD, STORE)                                                                 \
void NAME(int64_t Tn, const T *h, int64_t ldh, T *y, int64_t ldy, const T *E, const int64_t *eoff,         \
          const int32_t *rows, int64_t n_slices, const int64_t *offs, int64_t threads) {                   \
    char done[Tn > 0 ? Tn : 1];                                                                            \
    int64_t grp[Tn > 0 ? Tn : 1][EXPAND_GROUP], ngrp = 0;                                                  \
    memset(done, 0, sizeof(done));                                                                         \
    for (int64_t t0 = 0; t0 < Tn; t0++) {                                                                  \
        if (done[t0] || rows[2 * t0] < 0 || rows[2 * t0 + 1] <= 0) continue;                               \
        int64_t ng = 0;                                                                                    \
        for (int64_t t = t0; t < Tn && ng < EXPAND_GROUP; t++)                                             \
            if (!done[t] && rows[2 * t] == rows[2 * t0]) { grp[ngrp][ng++] = t; done[t] = 1; }             \
        for (; ng < EXPAND_GROUP; ng++) grp[ngrp][ng] = -1;  /* padding: h taken as 0, not stored */       \
        ngrp++;                                                                                            \
    }                                                                                                      \
    const int64_t items = ngrp * n_slices * 2;                                                             \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(items > 2)")                        \
    for (int64_t it = 0; it < items; it++) {                                                               \
        const int64_t *gp = grp[it / (n_slices * 2)], i = (it / 2) % n_slices, half = it % 2;              \
        const int64_t s = rows[2 * gp[0]], r = rows[2 * gp[0] + 1], col = s + i * r, lo = offs[i];         \
        const int64_t mid = lo + (offs[i + 1] - lo) / 2 / EXPAND_CHUNK * EXPAND_CHUNK;                     \
        const int64_t c0 = half ? mid : lo, hi = half ? offs[i + 1] : mid;                                 \
        float hv[EXPAND_GROUP][r];                                                                         \
        for (int g = 0; g < EXPAND_GROUP; g++)                                                             \
            for (int64_t j = 0; j < r; j++) hv[g][j] = gp[g] < 0 ? 0.0f : LOAD(h[gp[g] * ldh + col + j]);  \
        int64_t c = c0;                                                                                    \
        for (; c + EXPAND_CHUNK <= hi; c += EXPAND_CHUNK) {                                                \
            float a[EXPAND_GROUP][EXPAND_CHUNK] = {{0}};                                                   \
            for (int64_t j = 0; j < r; j++) {                                                              \
                const T *e = E + eoff[col + j] + (c - lo);                                                 \
                for (int g = 0; g < EXPAND_GROUP; g++) {                                                   \
                    const float hg = hv[g][j];                                                             \
                    for (int cc = 0; cc < EXPAND_CHUNK; cc++) a[g][cc] += hg * LOAD(e[cc]);                \
                }                                                                                          \
            }                                                                                              \
            for (int g = 0; g < EXPAND_GROUP && gp[g] >= 0; g++) {                                         \
                T *yt = y + gp[g] * ldy + c;                                                               \
                for (int cc = 0; cc < EXPAND_CHUNK; cc++)                                                  \
                    yt[cc] = STORE(LOAD(yt[cc]) + LOAD(STORE(a[g][cc])));                                  \
            }                                                                                              \
        }                                                                                                  \
        for (; c < hi; c++)                                                                                \
            for (int g = 0; g < EXPAND_GROUP && gp[g] >= 0; g++) {                                         \
                float a = 0.0f;                                                                            \
                for (int64_t j = 0; j < r; j++) a += hv[g][j] * LOAD(E[eoff[col + j] + (c - lo)]);         \
                T *yt = y + gp[g] * ldy + c;                                                               \
                *yt = STORE(LOAD(*yt) + LOAD(STORE(a)));                                                   \
            }                                                                                              \
    }                                                                                                      \
}
LORA_EXPAND(lora_expand_f32, float, id_f, id_f)
LORA_EXPAND(lora_expand_bf16, uint16_t, bf2f, f2bf)

/* Decode attention over the paged cache, one query token per request, fp32 arithmetic.
   q, out [B, Hq, D]; kc, vc [blocks * bs, Hkv, D]; tables [B, max_blocks] int32; seq_lens [B] int32.
   Query head qh reads KV head qh / (Hq / Hkv). Request b attends to keys j in [lo, L), L = seq_lens[b],
   lo = max(0, L - window) (window 0: no window); key j lives in cache row tables[b, j / bs] * bs + j % bs.
   out = softmax(scale * q . k_j) @ v_j; zeros where there is no key. One request per thread; each cache row
   (every KV head of a position) is read once, contiguously. scratch: threads rows of stride >= Hq * max L. */
#define PREFETCH 8
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                              \
static inline __attribute__((always_inline)) void NAME##_body(                                             \
          int64_t B, int64_t Hq, int64_t Hkv, const int64_t D, const T *q, T *out, const T *kc,            \
          const T *vc, const int32_t *tables, int64_t max_blocks, int64_t bs, const int32_t *seq_lens,     \
          int64_t window, float scale, float *scratch, int64_t stride, int threads) {                      \
    const int64_t G = Hq / Hkv, W = Hkv * D;  /* a cache row: every KV head of one position */             \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                      \
    for (int64_t b = 0; b < B; b++) {                                                                      \
        const int64_t L = seq_lens[b], lo = (window > 0 && L > window) ? L - window : 0, n = L - lo;       \
        const int32_t *table = tables + b * max_blocks;                                                    \
        float qf[Hq * D], acc[Hq * D], kf[W], inv[Hq];                                                     \
        float *sc0 = scratch + (int64_t)omp_get_thread_num() * stride;  /* [Hq, n] scores */               \
        const T *qb = q + b * Hq * D;                                                                      \
        T *ob = out + b * Hq * D;                                                                          \
        for (int64_t i = 0; i < Hq * D; i++) { qf[i] = LOAD(qb[i]); acc[i] = 0.0f; }                       \
        if (n <= 0) { for (int64_t i = 0; i < Hq * D; i++) ob[i] = STORE(0.0f); continue; }                \
        int64_t rows[n];  /* element offset of each key's cache row */                                     \
        for (int64_t j = 0, blk = lo / bs, off = lo % bs; j < n; j++) {                                    \
            rows[j] = ((int64_t)table[blk] * bs + off) * W;                                                \
            if (++off == bs) { off = 0; blk++; }                                                           \
        }                                                                                                  \
        for (int64_t j = 0; j < n; j++) {                                                                  \
            /* the cache is cold (a step streams every weight between two layers' calls): fetch the K  */  \
            /* row PREFETCH keys ahead, across pages, and the V row the second pass reads              */  \
            if (j + PREFETCH < n)                                                                          \
                for (int64_t i = 0; i < W; i += 64 / (int64_t)sizeof(T))                                   \
                    __builtin_prefetch(kc + rows[j + PREFETCH] + i);                                       \
            for (int64_t i = 0; i < W; i += 64 / (int64_t)sizeof(T)) __builtin_prefetch(vc + rows[j] + i); \
            const T *kp = kc + rows[j];                                                                    \
            for (int64_t i = 0; i < W; i++) kf[i] = LOAD(kp[i]);                                           \
            for (int64_t qh = 0; qh < Hq; qh++) {                                                          \
                const float *qg = qf + qh * D, *kh = kf + (qh / G) * D;                                    \
                float dot = 0.0f;                                                                          \
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kh[d];                                      \
                sc0[qh * n + j] = dot * scale;                                                             \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t qh = 0; qh < Hq; qh++) {                                                              \
            float *sc = sc0 + qh * n, m = sc[0], sum = 0.0f;                                               \
            for (int64_t j = 1; j < n; j++) m = sc[j] > m ? sc[j] : m;                                     \
            for (int64_t j = 0; j < n; j++) sc[j] = expf(sc[j] - m);                                       \
            for (int64_t j = 0; j < n; j++) sum += sc[j];                                                  \
            inv[qh] = 1.0f / sum;                                                                          \
        }                                                                                                  \
        for (int64_t j = 0; j < n; j++) {                                                                  \
            const T *vp = vc + rows[j];                                                                    \
            for (int64_t i = 0; i < W; i++) kf[i] = LOAD(vp[i]);                                           \
            for (int64_t qh = 0; qh < Hq; qh++) {                                                          \
                const float p = sc0[qh * n + j], *vh = kf + (qh / G) * D;                                  \
                float *ag = acc + qh * D;                                                                  \
                for (int64_t d = 0; d < D; d++) ag[d] += p * vh[d];                                        \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t qh = 0; qh < Hq; qh++)                                                                \
            for (int64_t d = 0; d < D; d++) ob[qh * D + d] = STORE(acc[qh * D + d] * inv[qh]);             \
    }                                                                                                      \
}                                                                                                          \
void NAME(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const T *q, T *out, const T *kc, const T *vc,     \
          const int32_t *tables, int64_t max_blocks, int64_t bs, const int32_t *seq_lens, int64_t window,   \
          float scale, float *scratch, int64_t stride, int64_t threads) {                                  \
    /* head dims 64 and 128 compiled with D known */                                                       \
    if (D == 64)                                                                                           \
        NAME##_body(B, Hq, Hkv, 64, q, out, kc, vc, tables, max_blocks, bs, seq_lens, window, scale,       \
                    scratch, stride, (int)threads);                                                        \
    else if (D == 128)                                                                                     \
        NAME##_body(B, Hq, Hkv, 128, q, out, kc, vc, tables, max_blocks, bs, seq_lens, window, scale,      \
                    scratch, stride, (int)threads);                                                        \
    else                                                                                                   \
        NAME##_body(B, Hq, Hkv, D, q, out, kc, vc, tables, max_blocks, bs, seq_lens, window, scale,        \
                    scratch, stride, (int)threads);                                                        \
}

DECODE_ATTENTION(decode_attention_f32, float, id_f, id_f)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, bf2f, f2bf)

/* K/V rows of this step into their cache slots: kc[slots[t]] = k[t], vc[slots[t]] = v[t] (W = Hkv * D
   elements a row; k and v rows of stride ldk, ldv; slots < 0 skipped). */
void store_kv_rows(int64_t Tn, int64_t W, int64_t esize, const char *k, int64_t ldk, const char *v,
                   int64_t ldv, char *kc, char *vc, const int64_t *slots) {
    for (int64_t t = 0; t < Tn; t++) {
        if (slots[t] < 0) continue;
        memcpy(kc + slots[t] * W * esize, k + t * ldk * esize, W * esize);
        memcpy(vc + slots[t] * W * esize, v + t * ldv * esize, W * esize);
    }
}

/* RMSNorm as Llama computes it, with the residual add of the fused decoder layers. Per row of x [rows, N]
   (row stride ldx): s = x + r (rounded to T; stored to s when r is given, else s is x), then
   y = w * round_T(s * (1 / sqrt(mean(s^2) + eps))), statistics in fp32. */
#define RMS_NORM(NAME, T, LOAD, STORE)                                                                     \
void NAME(int64_t rows, int64_t N, const T *x, int64_t ldx, const T *r, int64_t ldr, const T *w, T *y,      \
          T *s, float eps) {                                                                               \
    for (int64_t i = 0; i < rows; i++) {                                                                   \
        const T *xi = x + i * ldx;                                                                         \
        T *si = s + i * N, *yi = y + i * N;                                                                \
        float sumsq = 0.0f;                                                                                \
        if (r) {                                                                                           \
            const T *ri = r + i * ldr;                                                                     \
            for (int64_t c = 0; c < N; c++) {                                                              \
                const T sv = STORE(LOAD(xi[c]) + LOAD(ri[c]));                                             \
                const float v = LOAD(sv);                                                                  \
                si[c] = sv;                                                                                \
                sumsq += v * v;                                                                            \
            }                                                                                              \
            xi = si;                                                                                       \
        } else {                                                                                           \
            for (int64_t c = 0; c < N; c++) { const float v = LOAD(xi[c]); sumsq += v * v; }               \
        }                                                                                                  \
        const float inv = 1.0f / sqrtf(sumsq / (float)N + eps);                                            \
        for (int64_t c = 0; c < N; c++) yi[c] = STORE(LOAD(w[c]) * LOAD(STORE(LOAD(xi[c]) * inv)));        \
    }                                                                                                      \
}
RMS_NORM(rms_norm_f32, float, id_f, id_f)
RMS_NORM(rms_norm_bf16, uint16_t, bf2f, f2bf)

/* Neox rotary of q [T, Hq, D] (row stride ldq, heads contiguous) and k [T, Hk, D] (ldk) by cos, sin [T, D]
   into qo [T, Hq, D], ko [T, Hk, D] (contiguous): o = round(x * cos) + round(rot(x) * sin), rounded, with
   rot(x) = [-x2 | x1]; the products are not fused into the sum, so fp32 matches torch bit for bit. */
#define ROTARY(NAME, T, LOAD, STORE)                                                                       \
__attribute__((optimize("fp-contract=off"))) /* each product rounded, as torch's: bit for bit in fp32 */    \
static void NAME##_rows(int64_t Tn, int64_t H, int64_t D, const T *x, int64_t ldx, const T *cs,      \
                               const T *sn, T *o) {                                                        \
    const int64_t half = D / 2;                                                                            \
    for (int64_t t = 0; t < Tn; t++)                                                                       \
        for (int64_t h = 0; h < H; h++) {                                                                  \
            const T *xh = x + t * ldx + h * D, *c = cs + t * D, *sv = sn + t * D;                          \
            T *oh = o + (t * H + h) * D;                                                                   \
            for (int64_t d = 0; d < half; d++) {                                                           \
                const float a = LOAD(STORE(LOAD(xh[d]) * LOAD(c[d])));                                     \
                const float b = LOAD(STORE(-LOAD(xh[d + half]) * LOAD(sv[d])));                            \
                oh[d] = STORE(a + b);                                                                      \
            }                                                                                              \
            for (int64_t d = half; d < D; d++) {                                                           \
                const float a = LOAD(STORE(LOAD(xh[d]) * LOAD(c[d])));                                     \
                const float b = LOAD(STORE(LOAD(xh[d - half]) * LOAD(sv[d])));                             \
                oh[d] = STORE(a + b);                                                                      \
            }                                                                                              \
        }                                                                                                  \
}                                                                                                          \
void NAME(int64_t Tn, int64_t Hq, int64_t Hk, int64_t D, const T *q, int64_t ldq, const T *k, int64_t ldk,  \
          const T *cs, const T *sn, T *qo, T *ko) {                                                        \
    NAME##_rows(Tn, Hq, D, q, ldq, cs, sn, qo);                                                            \
    NAME##_rows(Tn, Hk, D, k, ldk, cs, sn, ko);                                                            \
}
ROTARY(rotary_f32, float, id_f, id_f)
ROTARY(rotary_bf16, uint16_t, bf2f, f2bf)
"""

# fast-math lets the dot products and sums vectorize (reassociated) and expf go through glibc's vector
# math (libmvec); NaN and inf keep their meaning (-fno-finite-math-only). It is given when compiling
# only: linked with -ffast-math, gcc adds crtfastmath.o, which would set flush-to-zero for the whole
# process when the library loads.
_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
_LINK = ["-shared", "-fopenmp", "-lmvec", "-lm"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_EXPAND_ARGS = [_I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64]
_ATTENTION_ARGS = [_I64] * 4 + [_PTR] * 5 + [_I64, _I64, _PTR, _I64, ctypes.c_float, _PTR, _I64, _I64]

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
    return dll


def available() -> bool:
    """Whether the kernels are on (:data:`ENABLED`) and built for this machine."""
    return ENABLED and _library() is not None


#: The dtypes :func:`lora_expand` takes.
EXPAND_DTYPES = (torch.float32, torch.bfloat16)


def expand_rows(token_slots: list[int], ranks: list[int], n_slices: int) -> torch.Tensor:
    """[T, 2] int32 for :func:`lora_expand`: each token's first column in the live rank layout of
    :func:`mmlora.backends.cpu_dense.live_rows` (slot-major: slot s starts at ``n_slices * sum(ranks[:s])``)
    and its slot's rank; (-1, 0) for base-only tokens."""
    starts = [0] * len(ranks)
    for s in range(1, len(ranks)):
        starts[s] = starts[s - 1] + n_slices * ranks[s - 1]
    return torch.tensor(
        [(starts[s], ranks[s]) if s >= 0 else (-1, 0) for s in token_slots], dtype=torch.int32
    ).reshape(-1, 2)


def compact_expand(
    E: torch.Tensor, row_slices: list[int], offsets: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_compact 1-D, eoff int64 [K]) for :func:`lora_expand`: row k of E [K, out] cut to its slice's
    columns ``offsets[row_slices[k]] : offsets[row_slices[k] + 1]`` (the rest of an expand matrix row is
    zeros), the rows one after another; eoff[k] is where row k starts."""
    parts, eoff, at = [], [], 0
    for k, i in enumerate(row_slices):
        lo, hi = offsets[i], offsets[i + 1]
        parts.append(E[k, lo:hi])
        eoff.append(at)
        at += hi - lo
    flat = torch.cat(parts) if parts else E.new_zeros(0)
    return flat.contiguous(), torch.tensor(eoff, dtype=torch.int64)


def live_row_slices(n_slices: int, ranks: list[int]) -> list[int]:
    """The slice of each row of the live rank layout (:func:`mmlora.backends.cpu_dense.live_rows`'s
    order: slot, then slice, then rank row)."""
    return [i for r in ranks for i in range(n_slices) for _ in range(r)]


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    E: torch.Tensor,
    eoff: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """``y[t, lo_i:hi_i] += h[t, c_t + i r_t : c_t + (i+1) r_t] @ W[same rows, lo_i:hi_i]`` for every
    token t with ``rows[t] = (c_t, r_t)``, c_t >= 0 (:func:`expand_rows`), slice i of ``offsets``
    (int64 [n + 1]); base-only tokens untouched. W [K, out] is the expand matrix, given compact as
    (E, eoff) by :func:`compact_expand`.

    y [T, out], h [T, K]: CPU, one dtype of :data:`EXPAND_DTYPES` (E too), unit column stride (rows may be
    strided: y and h may be views of one [T, out + K] tensor). The delta of a slice is summed in fp32
    and (bf16) rounded to bf16 before it is added, as ``y += h @ W`` rounds. Needs :func:`available`.
    """
    T = y.shape[0]
    if h.shape[0] != T or rows.shape != (T, 2) or eoff.shape != (h.shape[1],) or E.dim() != 1:
        raise ValueError(
            f"lora_expand: shapes y {tuple(y.shape)}, h {tuple(h.shape)}, eoff {tuple(eoff.shape)}"
        )
    if not (y.dtype == h.dtype == E.dtype) or y.dtype not in EXPAND_DTYPES:
        raise ValueError(f"lora_expand: dtypes {y.dtype}, {h.dtype}, {E.dtype}")
    if y.stride(1) != 1 or h.stride(1) != 1 or not E.is_contiguous() or not rows.is_contiguous():
        raise ValueError("lora_expand: needs unit column strides and contiguous E and rows")
    if rows.dtype != torch.int32 or eoff.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("lora_expand: rows int32, eoff and offsets int64")
    if int(offsets[-1]) > y.shape[1]:
        raise ValueError("lora_expand: offsets past y's columns")
    if not available():
        raise RuntimeError("lora_expand: the CPU kernels are off or could not be built here")
    lora_expand_unchecked(y, h, E, eoff, rows, offsets)


def lora_expand_unchecked(
    y: torch.Tensor,
    h: torch.Tensor,
    E: torch.Tensor,
    eoff: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """:func:`lora_expand` without its checks, for callers whose tensors are right by construction (the
    fused LoRA path goes through :class:`ExpandCall`, which also keeps the pointers)."""
    fn = _expand_fn(y.dtype)
    fn(y.shape[0], h.data_ptr(), h.stride(0), y.data_ptr(), y.stride(0), E.data_ptr(), eoff.data_ptr(),
       rows.data_ptr(), offsets.numel() - 1, offsets.data_ptr(), torch.get_num_threads())  # fmt: skip


def _expand_fn(dtype: torch.dtype):  # noqa: ANN202
    """The compiled expand for ``dtype`` (one of :data:`EXPAND_DTYPES`)."""
    lib = _library()
    return lib.lora_expand_f32 if dtype == torch.float32 else lib.lora_expand_bf16


class ExpandCall:
    """:func:`lora_expand_unchecked` for one module's fixed expand matrix, its pointers taken once (a
    SmolLM2 step makes 120 of these calls, where two column views and their pointers cost as much as
    the C work): ``call(yk, rows)`` adds the expand of ``yk[:, out:]`` to ``yk[:, :out]`` in place, for yk
    [T, out + K] with unit column stride (the stacked GEMM's output) and ``rows`` from :func:`expand_rows`.
    Holds E, eoff and offsets (whose pointers it keeps)."""

    __slots__ = ("_fn", "_keep", "_E", "_eoff", "_offs", "_n", "_h_offset")

    def __init__(self, E: torch.Tensor, eoff: torch.Tensor, offsets: torch.Tensor, out_features: int) -> None:
        self._fn = _expand_fn(E.dtype)
        self._keep = (E, eoff, offsets)
        self._E, self._eoff, self._offs = E.data_ptr(), eoff.data_ptr(), offsets.data_ptr()
        self._n = offsets.numel() - 1
        self._h_offset = out_features * E.element_size()

    def __call__(self, yk: torch.Tensor, rows: torch.Tensor) -> None:
        y, ld = yk.data_ptr(), yk.stride(0)
        self._fn(yk.shape[0], y + self._h_offset, ld, y, ld, self._E, self._eoff, rows.data_ptr(), self._n,
                 self._offs, torch.get_num_threads())  # fmt: skip


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


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
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
    x2 = _rows_view(x)
    if x2 is None:
        x2 = x.reshape(-1, N).contiguous()
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype)
    lib = _library()
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    if residual is None:
        fn(rows, N, x2.data_ptr(), x2.stride(0), None, 0, weight.data_ptr(), y.data_ptr(), y.data_ptr(), eps)
        return y
    r2 = _rows_view(residual)
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
    :func:`mmlora.layers.fused_ops.apply_rotary_ref`: ``x * cos + rotate_half(x) * sin``, each product
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
