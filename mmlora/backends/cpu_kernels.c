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
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* NaN stays NaN; a select, not a branch, so that loops over it vectorize */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* 16 floats as one vector (GCC vector extension: one zmm with AVX-512, two ymm with AVX2); unaligned. */
typedef float v16f __attribute__((vector_size(64)));
static inline v16f ld16(const float *p) { v16f v; memcpy(&v, p, sizeof(v)); return v; }
static inline void st16(float *p, v16f v) { memcpy(p, &v, sizeof(v)); }
typedef int32_t v16i __attribute__((vector_size(64)));

/* 16 bf16 values widened to fp32 (ld16_bf), and 16 fp32 values rounded to bf16 exactly as f2bf rounds them
   (st16_bf; round16_bf: rounded and widened back), a vector at a time: element-wise, the rounding's bit
   arithmetic costs several times the work of the kernels around it. With AVX-512 BF16 the rounding is the
   CPU's vcvtneps2bf16 (to nearest even, NaN kept quiet, as f2bf), except for a vector holding an fp32
   denormal, which that instruction flushes to zero: it takes the bit arithmetic. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
static inline v16f ld16_bf(const uint16_t *p) {
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (v16f)_mm512_castsi512_ps(u);
}
static inline __m256i bf16_of(v16f f) {
    const __m512 x = (__m512)f;
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (__builtin_expect(!_mm512_fpclass_ps_mask(x, 0x20), 1))  /* 0x20: denormal lanes */
        return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x40)));
}
static inline void st16_bf(uint16_t *p, v16f f) { _mm256_storeu_si256((__m256i *)p, bf16_of(f)); }
static inline v16f round16_bf(v16f f) {
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_of(f)), 16));
}
#else
static inline v16f ld16_bf(const uint16_t *p) { v16f f; for (int k = 0; k < 16; k++) f[k] = bf2f(p[k]); return f; }
static inline void st16_bf(uint16_t *p, v16f f) { for (int k = 0; k < 16; k++) p[k] = f2bf(f[k]); }
static inline v16f round16_bf(v16f f) { for (int k = 0; k < 16; k++) f[k] = bf2f(f2bf(f[k])); return f; }
#endif
static inline v16f id16(v16f f) { return f; }
static inline float hsum16(v16f v) { float s = 0.0f; for (int k = 0; k < 16; k++) s += v[k]; return s; }
/* Lane masks of the horizontal-sum trees (hsum8 here, hsum16x16 in cpu_row_lora.c): across two vectors,
   the low (LO) and high (HI) halves of each 16-, 8- and 4-lane block. */
static const v16i HSUM_LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const v16i HSUM_HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
static const v16i HSUM_LO4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const v16i HSUM_HI4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const v16i HSUM_LO2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
static const v16i HSUM_HI2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
/* One level of those trees: the lanes of a and b that ``lo`` picks plus those that ``hi`` picks. */
static inline __attribute__((always_inline)) v16f hsum_level(v16f a, v16f b, v16i lo, v16i hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
/* out[k] = the sum of t[k]'s 16 lanes, k < 8: a transpose-and-add tree (7 shuffle pairs), not 8 serial
   horizontal sums. */
static inline void hsum8(const v16f t[8], float out[8]) {
    const v16i swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v16f a[4], b[2];
    for (int k = 0; k < 4; k++)  /* lanes 0-7: 8 partial sums of t[2k], 8-15: of t[2k+1] */
        a[k] = hsum_level(t[2 * k], t[2 * k + 1], HSUM_LO8, HSUM_HI8);
    for (int k = 0; k < 2; k++)  /* 4 lanes each of t[4k .. 4k+3] */
        b[k] = hsum_level(a[2 * k], a[2 * k + 1], HSUM_LO4, HSUM_HI4);
    v16f c = hsum_level(b[0], b[1], HSUM_LO2, HSUM_HI2);  /* 2 lanes each */
    c += __builtin_shuffle(c, swap);
    for (int k = 0; k < 8; k++) out[k] = c[2 * k];
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
   out = softmax(scale * q . k_j) @ v_j; zeros where there is no key. One request per thread. Keys go in
   blocks of ATT_BLOCK: each cache row (every KV head of a position) is read once, contiguously, and the
   output sums stay in registers across a block (one load and store of a head's sums per block, not per
   key); bf16 rows are widened to fp32 once per block. scratch: threads rows of stride >= Hq * max L. */
#define ATT_BLOCK 8  /* hsum8's width */
/* into L2 (locality 1): into L1 as well, the 24 lines of a key's K and V rows crowd out the demand loads
   (cold 30-layer SmolLM2 decode attention, 16 rows at context 96: 7.2 -> 4.7 ms) */
#define ATT_PREFETCH(base, T, W)                                                                           \
    for (int64_t i_ = 0; i_ < (W); i_ += 64 / (int64_t)sizeof(T)) __builtin_prefetch((base) + i_, 0, 1)
/* row[jj]: the fp32 cache row of key j0 + jj of `cache` for jj < nb (fp32: in place; bf16: widened into buf) */
#define ATT_BLOCK_ROWS(cache, LOAD)                                                                        \
    for (int64_t jj = 0; jj < nb; jj++) {                                                                  \
        const __typeof__(*(cache)) *src_ = (cache) + rows[j0 + jj];                                        \
        if (wide) { row[jj] = (const float *)(const void *)src_; continue; }                               \
        for (int64_t i = 0; i < W; i++) buf[jj * W + i] = LOAD(src_[i]);                                   \
        row[jj] = buf + jj * W;                                                                            \
    }
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                              \
static inline __attribute__((always_inline)) void NAME##_body(                                             \
          int64_t B, int64_t Hq, int64_t Hkv, const int64_t D, const T *q, T *out, const T *kc,            \
          const T *vc, const int32_t *tables, int64_t max_blocks, int64_t bs, const int32_t *seq_lens,     \
          int64_t window, float scale, float *scratch, int64_t stride, int threads) {                      \
    const int64_t G = Hq / Hkv, W = Hkv * D;  /* a cache row: every KV head of one position */             \
    const int wide = sizeof(T) == sizeof(float);  /* fp32 rows are read in place */                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                      \
    for (int64_t b = 0; b < B; b++) {                                                                      \
        const int64_t L = seq_lens[b], lo = (window > 0 && L > window) ? L - window : 0, n = L - lo;       \
        const int32_t *table = tables + b * max_blocks;                                                    \
        float qf[Hq * D], acc[Hq * D], inv[Hq], buf[wide ? 1 : ATT_BLOCK * W];                             \
        const float *row[ATT_BLOCK];                                                                       \
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
        for (int64_t j0 = 0; j0 < n; j0 += ATT_BLOCK) {                                                    \
            const int64_t nb = n - j0 < ATT_BLOCK ? n - j0 : ATT_BLOCK;                                    \
            /* the cache is cold (a step streams every weight between two layers' calls): fetch the */     \
            /* next block's K rows and this block's V rows, which the second pass reads */                 \
            for (int64_t jj = j0 + ATT_BLOCK; jj < j0 + 2 * ATT_BLOCK && jj < n; jj++)                     \
                ATT_PREFETCH(kc + rows[jj], T, W);                                                         \
            for (int64_t jj = 0; jj < nb; jj++) ATT_PREFETCH(vc + rows[j0 + jj], T, W);                   \
            ATT_BLOCK_ROWS(kc, LOAD);                                                                      \
            for (int64_t jj = nb; jj < ATT_BLOCK; jj++) row[jj] = row[0];  /* scores computed, not kept */ \
            for (int64_t qh = 0; qh < Hq; qh++) {                                                          \
                const float *qg = qf + qh * D;                                                             \
                const int64_t kh = (qh / G) * D;                                                           \
                float *sc = sc0 + qh * n + j0, dots[ATT_BLOCK];                                            \
                if (D % 16 == 0) {  /* the block's dots side by side, summed across lanes together */      \
                    v16f t[ATT_BLOCK] = {0};                                                               \
                    for (int64_t d = 0; d < D; d += 16) {                                                  \
                        const v16f qv = ld16(qg + d);                                                      \
                        for (int jj = 0; jj < ATT_BLOCK; jj++) t[jj] += qv * ld16(row[jj] + kh + d);       \
                    }                                                                                      \
                    hsum8(t, dots);                                                                        \
                } else                                                                                     \
                    for (int64_t jj = 0; jj < nb; jj++) {                                                  \
                        dots[jj] = 0.0f;                                                                   \
                        for (int64_t d = 0; d < D; d++) dots[jj] += qg[d] * row[jj][kh + d];               \
                    }                                                                                      \
                for (int64_t jj = 0; jj < nb; jj++) sc[jj] = dots[jj] * scale;                             \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t qh = 0; qh < Hq; qh++) {                                                              \
            float *sc = sc0 + qh * n, m = sc[0], sum = 0.0f;                                               \
            for (int64_t j = 1; j < n; j++) m = sc[j] > m ? sc[j] : m;                                     \
            for (int64_t j = 0; j < n; j++) sc[j] = expf(sc[j] - m);                                       \
            for (int64_t j = 0; j < n; j++) sum += sc[j];                                                  \
            inv[qh] = 1.0f / sum;                                                                          \
        }                                                                                                  \
        for (int64_t j0 = 0; j0 < n; j0 += ATT_BLOCK) {                                                    \
            const int64_t nb = n - j0 < ATT_BLOCK ? n - j0 : ATT_BLOCK;                                    \
            ATT_BLOCK_ROWS(vc, LOAD);                                                                      \
            for (int64_t qh = 0; qh < Hq; qh++) {                                                          \
                const float *p = sc0 + qh * n + j0;                                                        \
                const int64_t vh = (qh / G) * D;                                                           \
                float *a = acc + qh * D;                                                                   \
                int64_t d = 0;                                                                             \
                for (; d + 16 <= D; d += 16) {                                                             \
                    v16f s = ld16(a + d);                                                                  \
                    for (int64_t jj = 0; jj < nb; jj++) s += p[jj] * ld16(row[jj] + vh + d);               \
                    st16(a + d, s);                                                                        \
                }                                                                                          \
                for (; d < D; d++)                                                                         \
                    for (int64_t jj = 0; jj < nb; jj++) a[d] += p[jj] * row[jj][vh + d];                   \
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
#define RMS_NORM(NAME, T, LOAD, STORE, VLD, VST, VROUND)                                                   \
void NAME(int64_t rows, int64_t N, const T *x, int64_t ldx, const T *r, int64_t ldr, const T *w, T *y,      \
          T *s, float eps) {                                                                               \
    const int64_t N16 = N / 16 * 16;                                                                       \
    for (int64_t i = 0; i < rows; i++) {                                                                   \
        const T *xi = x + i * ldx;                                                                         \
        T *si = s + i * N, *yi = y + i * N;                                                                \
        v16f acc = {0};                                                                                    \
        float sumsq = 0.0f;                                                                                \
        if (r) {                                                                                           \
            const T *ri = r + i * ldr;                                                                     \
            for (int64_t c = 0; c < N16; c += 16) {                                                        \
                const v16f v = VROUND(VLD(xi + c) + VLD(ri + c));                                          \
                VST(si + c, v);                                                                            \
                acc += v * v;                                                                              \
            }                                                                                              \
            for (int64_t c = N16; c < N; c++) {                                                            \
                const T sv = STORE(LOAD(xi[c]) + LOAD(ri[c]));                                             \
                const float v = LOAD(sv);                                                                  \
                si[c] = sv;                                                                                \
                sumsq += v * v;                                                                            \
            }                                                                                              \
            xi = si;                                                                                       \
        } else {                                                                                           \
            for (int64_t c = 0; c < N16; c += 16) { const v16f v = VLD(xi + c); acc += v * v; }            \
            for (int64_t c = N16; c < N; c++) { const float v = LOAD(xi[c]); sumsq += v * v; }             \
        }                                                                                                  \
        sumsq += hsum16(acc);                                                                              \
        const float inv = 1.0f / sqrtf(sumsq / (float)N + eps);                                            \
        for (int64_t c = 0; c < N16; c += 16) VST(yi + c, VLD(w + c) * VROUND(VLD(xi + c) * inv));         \
        for (int64_t c = N16; c < N; c++) yi[c] = STORE(LOAD(w[c]) * LOAD(STORE(LOAD(xi[c]) * inv)));     \
    }                                                                                                      \
}
RMS_NORM(rms_norm_f32, float, id_f, id_f, ld16, st16, id16)
RMS_NORM(rms_norm_bf16, uint16_t, bf2f, f2bf, ld16_bf, st16_bf, round16_bf)

/* Neox rotary of q [T, Hq, D] (row stride ldq, heads contiguous) and k [T, Hk, D] (ldk) by cos, sin [T, D]
   into qo [T, Hq, D], ko [T, Hk, D] (contiguous): o = round(x * cos) + round(rot(x) * sin), rounded, with
   rot(x) = [-x2 | x1]; the products are not fused into the sum, so fp32 matches torch bit for bit. */
#define ROTARY(NAME, T, LOAD, STORE, VLD, VST, VROUND)                                                     \
__attribute__((optimize("fp-contract=off"))) /* each product rounded, as torch's: bit for bit in fp32 */    \
static void NAME##_rows(int64_t Tn, int64_t H, int64_t D, const T *x, int64_t ldx, const T *cs,      \
                               const T *sn, T *o) {                                                        \
    const int64_t half = D / 2, half16 = half / 16 * 16;                                                   \
    for (int64_t t = 0; t < Tn; t++)                                                                       \
        for (int64_t h = 0; h < H; h++) {                                                                  \
            const T *xh = x + t * ldx + h * D, *c = cs + t * D, *sv = sn + t * D;                          \
            T *oh = o + (t * H + h) * D;                                                                   \
            for (int64_t d = 0; d < half16; d += 16) {                                                     \
                const v16f x1 = VLD(xh + d), x2 = VLD(xh + d + half);                                      \
                VST(oh + d, VROUND(x1 * VLD(c + d)) + VROUND(-x2 * VLD(sv + d)));                          \
                VST(oh + d + half, VROUND(x2 * VLD(c + d + half)) + VROUND(x1 * VLD(sv + d + half)));      \
            }                                                                                              \
            for (int64_t d = half16; d < half; d++) {                                                      \
                const float a = LOAD(STORE(LOAD(xh[d]) * LOAD(c[d])));                                     \
                const float b = LOAD(STORE(-LOAD(xh[d + half]) * LOAD(sv[d])));                            \
                oh[d] = STORE(a + b);                                                                      \
            }                                                                                              \
            for (int64_t d = half + half16; d < D; d++) {                                                  \
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
ROTARY(rotary_f32, float, id_f, id_f, ld16, st16, id16)
ROTARY(rotary_bf16, uint16_t, bf2f, f2bf, ld16_bf, st16_bf, round16_bf)

/* SiLU-and-multiply over gate_up rows x [rows, 2I] = [g | u] (row stride ldx) into y [rows, I]: y = round(round(
   silu(g)) * u), silu(a) = a / (1 + exp(-a)) in fp32, as torch's F.silu(g) * u rounds (bf16: each op's result
   rounded to bf16). Rows shared over `threads` OpenMP threads. */
#define SILU_AND_MUL(NAME, T, LOAD, STORE)                                                                 \
void NAME(int64_t rows, int64_t I, const T *x, int64_t ldx, T *y, int64_t threads) {                       \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 1 && rows * I >= 8192)")     \
    for (int64_t t = 0; t < rows; t++) {                                                                   \
        const T *g = x + t * ldx, *u = g + I;                                                              \
        T *yt = y + t * I;                                                                                 \
        for (int64_t c = 0; c < I; c++) {                                                                  \
            const float a = LOAD(g[c]);                                                                    \
            yt[c] = STORE(LOAD(STORE(a / (1.0f + expf(-a)))) * LOAD(u[c]));                                \
        }                                                                                                  \
    }                                                                                                      \
}
SILU_AND_MUL(silu_and_mul_f32, float, id_f, id_f)
SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf2f, f2bf)
