#include <stdlib.h>

/* Thin GEMMs of a CPU decode step: y = x W^T (+ bias) for a few rows of x, W prepacked in column panels.
   Compiled after cpu_kernels.c, as one library (its includes and bf16 helpers are in scope here).

   A panel is GEMM_NR consecutive output columns, stored k-major: P[p, k, c] = W[p * NR + c, k], zero past
   the last column. For each panel, a block of up to GEMM_MR rows keeps its GEMM_MR x NR sums in registers
   while the panel streams through once: each weight vector is loaded once and multiplied by every row
   (the x element broadcast). The sums over k run in order, in fp32. Panels are shared out over OpenMP
   threads (static, contiguous ranges: each thread streams its own part of W). The weights come from
   memory on every call (a step reads every layer's weights once), so the panel is prefetched ahead. */
#if defined(__AVX512F__)
#define GEMM_NR 16
#define GEMM_MR 16
#else
#define GEMM_NR 8
#define GEMM_MR 8
#endif
/* The panel is prefetched this far ahead of the k loop, non-temporal (read once a step): none at all costs
   about a third more time on issue 21's EPYC; 1-8 KB and the locality hints are within its noise. */
#define GEMM_PF_BYTES 2048
#define GEMM_PF_LOC 0
typedef float gemm_vec __attribute__((vector_size(GEMM_NR * 4)));
static inline gemm_vec gemm_ld(const float *p) { gemm_vec v; memcpy(&v, p, sizeof(v)); return v; }

/* The packed layout's panel width (columns), which the caller packs for. */
int64_t gemm_panel_width(void) { return GEMM_NR; }

/* Whether gemm_bf16 is built (the CPU multiplies bf16 pairs natively: AVX-512 BF16). */
int64_t gemm_has_bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* A buffer of at least n 4-byte words, one per calling thread and purpose (0: fp32 rows, 1: bf16 pairs),
   grown as needed and reused: no allocation per call. NULL when out of memory. */
static void *gemm_buffer(int which, int64_t n) {
    static __thread void *buf[2] = {NULL, NULL};
    static __thread int64_t cap[2] = {0, 0};
    if (n > cap[which]) {
        free(buf[which]);
        buf[which] = malloc(n * 4);
        cap[which] = buf[which] ? n : 0;
    }
    return buf[which];
}

/* x's rows packed k-major in blocks of GEMM_MR rows, zero past the last row: xp[b, k, r] = x[b * MR + r, k]. */
static float *gemm_pack_rows(int64_t M, int64_t K, const float *x, int64_t ldx) {
    const int64_t blocks = (M + GEMM_MR - 1) / GEMM_MR;
    float *xp = gemm_buffer(0, blocks * K * GEMM_MR);
    if (!xp) return NULL;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t rows = M - b * GEMM_MR < GEMM_MR ? M - b * GEMM_MR : GEMM_MR;
        const float *xr = x + b * GEMM_MR * ldx;
        float *xb = xp + b * K * GEMM_MR;
        /* k outer: each output line written whole, the rows read along */
        for (int64_t k = 0; k < K; k++)
            for (int64_t r = 0; r < GEMM_MR; r++) xb[k * GEMM_MR + r] = r < rows ? xr[r * ldx + k] : 0.0f;
    }
    return xp;
}

/* MR (a constant where inlined) packed rows xb [K, GEMM_MR] against panel Pp [K, NR]: y[r, c] for r < rows,
   c < ncols. */
static inline __attribute__((always_inline)) void gemm_f32_block(
        const int MR, const float *xb, const float *Pp, int64_t K, float *y, int64_t ldy, int64_t rows,
        int64_t ncols, const float *bias) {
    gemm_vec acc[GEMM_MR];
    for (int r = 0; r < MR; r++) acc[r] = (gemm_vec){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch((const char *)(Pp + k * GEMM_NR) + GEMM_PF_BYTES, 0, GEMM_PF_LOC);
        const gemm_vec w = gemm_ld(Pp + k * GEMM_NR);
        for (int r = 0; r < MR; r++) acc[r] += xb[k * GEMM_MR + r] * w;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ncols; c++) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.0f);
}

/* x [M, K] (row stride ldx), P packed from W [N, K] (gemm_panel_width columns a panel), bias [N] or NULL:
   y [M, N] (row stride ldy) = x W^T + bias, fp32. Returns 0, or -1 when out of memory (y untouched). */
int64_t gemm_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *P,
                 const float *bias, float *y, int64_t ldy, int64_t threads) {
    const int64_t panels = (N + GEMM_NR - 1) / GEMM_NR;
    const float *xp = gemm_pack_rows(M, K, x, ldx);
    if (!xp) return -1;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(panels > 1)")
    for (int64_t p = 0; p < panels; p++) {
        const float *Pp = P + p * K * GEMM_NR, *bp = bias ? bias + p * GEMM_NR : NULL;
        const int64_t ncols = N - p * GEMM_NR < GEMM_NR ? N - p * GEMM_NR : GEMM_NR;
        for (int64_t m0 = 0; m0 < M; m0 += GEMM_MR) {
            const int64_t rows = M - m0 < GEMM_MR ? M - m0 : GEMM_MR;
            const float *xb = xp + m0 * K;
            float *yb = y + m0 * ldy + p * GEMM_NR;
            /* a short block runs the next power of two's rows (the packed rows past M are zeros) */
            if (rows > GEMM_MR / 2) gemm_f32_block(GEMM_MR, xb, Pp, K, yb, ldy, rows, ncols, bp);
            else if (rows > 4) gemm_f32_block(8, xb, Pp, K, yb, ldy, rows, ncols, bp);
            else if (rows > 2) gemm_f32_block(4, xb, Pp, K, yb, ldy, rows, ncols, bp);
            else if (rows == 2) gemm_f32_block(2, xb, Pp, K, yb, ldy, rows, ncols, bp);
            else gemm_f32_block(1, xb, Pp, K, yb, ldy, rows, ncols, bp);
        }
    }
    return 0;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* bf16: the panel holds pairs along k, P[p, kk, c, e] = W[p * 16 + c, 2 kk + e] (zero past N and K), and each
   step multiplies a pair of x by a pair of every column (vdpbf16ps: exact products, summed in fp32). The
   output is the fp32 sum plus the bias, rounded to bf16 once. */
static inline __attribute__((always_inline)) void gemm_bf16_block(
        const int MR, const uint32_t *xb, const uint16_t *Pp, int64_t K2, uint16_t *y, int64_t ldy,
        int64_t rows, int64_t ncols, const uint16_t *bias) {
    __m512 acc[16];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < K2; kk++) {
        __builtin_prefetch((const char *)(Pp + kk * 32) + GEMM_PF_BYTES, 0, GEMM_PF_LOC);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(Pp + kk * 32);
        for (int r = 0; r < MR; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)xb[kk * 16 + r]), w);
    }
    for (int64_t r = 0; r < rows; r++) {
        float v[16];
        _mm512_storeu_ps(v, acc[r]);
        for (int64_t c = 0; c < ncols; c++) y[r * ldy + c] = f2bf(v[c] + (bias ? bf2f(bias[c]) : 0.0f));
    }
}

/* x [M, K] bf16 (row stride ldx), P packed as above from W [N, K], bias [N] bf16 or NULL: y [M, N] bf16 (row
   stride ldy) = round(x W^T + bias). Returns 0, or -1 when out of memory (y untouched). */
int64_t gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t ldx, const uint16_t *P,
                  const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads) {
    const int64_t panels = (N + 15) / 16, K2 = (K + 1) / 2, blocks = (M + 15) / 16;
    uint32_t *xp = gemm_buffer(1, blocks * K2 * 16);  /* xp[b, kk, r]: the pair (x[m, 2kk], x[m, 2kk+1]) */
    if (!xp) return -1;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t kk = 0; kk < K2; kk++)  /* kk outer: each output line written whole */
            for (int64_t r = 0; r < 16; r++) {
                const int64_t m = b * 16 + r;
                const uint32_t lo = m < M ? x[m * ldx + 2 * kk] : 0;
                const uint32_t hi = m < M && 2 * kk + 1 < K ? x[m * ldx + 2 * kk + 1] : 0;
                xp[(b * K2 + kk) * 16 + r] = lo | hi << 16;
            }
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(panels > 1)")
    for (int64_t p = 0; p < panels; p++) {
        const uint16_t *Pp = P + p * K2 * 32, *bp = bias ? bias + p * 16 : NULL;
        const int64_t ncols = N - p * 16 < 16 ? N - p * 16 : 16;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int64_t rows = M - m0 < 16 ? M - m0 : 16;
            const uint32_t *xb = xp + m0 * K2;
            uint16_t *yb = y + m0 * ldy + p * 16;
            if (rows > 8) gemm_bf16_block(16, xb, Pp, K2, yb, ldy, rows, ncols, bp);
            else if (rows > 4) gemm_bf16_block(8, xb, Pp, K2, yb, ldy, rows, ncols, bp);
            else if (rows > 2) gemm_bf16_block(4, xb, Pp, K2, yb, ldy, rows, ncols, bp);
            else if (rows == 2) gemm_bf16_block(2, xb, Pp, K2, yb, ldy, rows, ncols, bp);
            else gemm_bf16_block(1, xb, Pp, K2, yb, ldy, rows, ncols, bp);
        }
    }
    return 0;
}
#endif
