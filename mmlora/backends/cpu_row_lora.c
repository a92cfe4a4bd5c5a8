/* Per-row LoRA of a CPU decode step over many adapter slots: each row multiplies by its own slot's A and B,
   read in place from the adapter pool (mmlora/backends/cpu_row_lora.py is the Python side). Compiled after
   cpu_kernels.c, as one library (its includes, bf16 helpers and hsum8 are in scope here).

   A is the pool's [S, n*R, in] (R = U) or paged [S, C, n*U, in]: rank j of slice i of slot s is the row
   A + s*a_slot + (j / U)*a_page + (i*U + j % U)*lda. B is [S, out, R] or paged [S, C, out, U]: column o's
   ranks of page c are U consecutive values at B + s*b_slot + c*b_page + o*U. Only a slot's first
   ranks[s] ranks are read: past them a paged slot's view runs on into other adapters' pages. */

/* Rows of one slot taken together, so that their slot's weights are read once for all of them. */
#define ROW_GROUP 4

/* grp[g]: up to ROW_GROUP rows of one slot (-1 past them), in row order; rows without an adapter (slot
   < 0 or rank 0) in none. Returns the number of groups. An open-addressed table of the slots seen keeps
   it linear in the rows (a decode step has up to a few hundred, each on its own slot). */
static int64_t row_groups(int64_t n, const int32_t *slots, const int32_t *ranks, int64_t (*grp)[ROW_GROUP]) {
    int64_t cap = 1, ngrp = 0;
    while (cap < 2 * n) cap <<= 1;
    int32_t key[cap];
    int64_t open[cap];
    for (int64_t k = 0; k < cap; k++) key[k] = -1;
    for (int64_t t = 0; t < n; t++) {
        const int32_t s = slots[t];
        if (s < 0 || ranks[s] <= 0) continue;
        int64_t k = ((uint32_t)s * 2654435761u) & (cap - 1);
        while (key[k] >= 0 && key[k] != s) k = (k + 1) & (cap - 1);
        if (key[k] < 0 || grp[open[k]][ROW_GROUP - 1] >= 0) {  /* a new slot, or its open group is full */
            key[k] = s;
            open[k] = ngrp;
            for (int m = 0; m < ROW_GROUP; m++) grp[ngrp][m] = -1;
            ngrp++;
        }
        int64_t *g = grp[open[k]];
        int m = 0;
        while (g[m] >= 0) m++;
        g[m] = t;
    }
    return ngrp;
}

/* A vector whose lane k is the sum of t[k]'s 16 lanes: hsum8's tree, one level deeper, so that 16 columns'
   sums come back as one vector for a vector add into y. */
static inline v16f hsum16x16(const v16f t[16]) {
    const v16i even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f a[8], b[4], c[2];
    for (int k = 0; k < 8; k++)  /* lanes 0-7: 8 partial sums of t[2k], 8-15: of t[2k+1] */
        a[k] = hsum_level(t[2 * k], t[2 * k + 1], HSUM_LO8, HSUM_HI8);
    for (int k = 0; k < 4; k++)  /* 4 lanes each of t[4k .. 4k+3] */
        b[k] = hsum_level(a[2 * k], a[2 * k + 1], HSUM_LO4, HSUM_HI4);
    for (int k = 0; k < 2; k++)  /* lanes 2m, 2m+1: t[8k + m] */
        c[k] = hsum_level(b[2 * k], b[2 * k + 1], HSUM_LO2, HSUM_HI2);
    return hsum_level(c[0], c[1], even, odd);
}

/* The first n (<= 16) values at p widened to fp32, zeros in the other lanes; nothing past p + n is read. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline v16f ldn16(const float *p, int64_t n) {
    return (v16f)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline v16f ldn16_bf(const uint16_t *p, int64_t n) {
    const __m256i v = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#else
static inline v16f ldn16(const float *p, int64_t n) {
    v16f f = {0};
    for (int64_t k = 0; k < n; k++) f[k] = p[k];
    return f;
}
static inline v16f ldn16_bf(const uint16_t *p, int64_t n) {
    v16f f = {0};
    for (int64_t k = 0; k < n; k++) f[k] = bf2f(p[k]);
    return f;
}
#endif

/* h[t, i*R + j] = x[t] . A[slots[t], slice i, rank j] for j < r = ranks[slots[t]], summed in fp32 and rounded
   once to T; zeros for j >= r and for rows without an adapter. A work item is a group of rows, a slice and
   up to 8 rank rows (hsum8's width): each A row is loaded once for the group, the 8 dots summed side by
   side. Items are shared out over `threads` OpenMP threads. */
#define LORA_ROW_SHRINK(NAME, T, LOAD, STORE, LOAD16)                                                      \
void NAME(int64_t Tn, const T *x, int64_t ldx, T *h, int64_t ldh, const T *A, int64_t a_slot,              \
          int64_t a_page, int64_t lda, int64_t in_f, int64_t n_slices, int64_t U, int64_t R,               \
          const int32_t *slots, const int32_t *ranks, int64_t threads) {                                   \
    int64_t grp[Tn > 0 ? Tn : 1][ROW_GROUP];                                                               \
    const int64_t ngrp = row_groups(Tn, slots, ranks, grp);                                                \
    for (int64_t t = 0; t < Tn; t++) {                                                                     \
        const int64_t r = slots[t] < 0 ? 0 : ranks[slots[t]];                                              \
        for (int64_t i = 0; i < n_slices; i++) memset(h + t * ldh + i * R + r, 0, (R - r) * sizeof(T));    \
    }                                                                                                      \
    const int64_t blocks = (R + 7) / 8, items = ngrp * n_slices * blocks;                                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(items > 2)")                        \
    for (int64_t it = 0; it < items; it++) {                                                               \
        const int64_t *gp = grp[it / (n_slices * blocks)], i = (it / blocks) % n_slices;                   \
        const int64_t s = slots[gp[0]], r = ranks[s], j0 = (it % blocks) * 8;                              \
        if (j0 >= r) continue;                                                                             \
        const int64_t nb = r - j0 < 8 ? r - j0 : 8;                                                        \
        const T *a[8];                                                                                     \
        for (int64_t k = 0; k < 8; k++) {  /* past nb: a repeat, summed but not stored */                  \
            const int64_t j = j0 + (k < nb ? k : nb - 1);                                                  \
            a[k] = A + s * a_slot + (j / U) * a_page + (i * U + j % U) * lda;                              \
        }                                                                                                  \
        for (int g = 0; g < ROW_GROUP && gp[g] >= 0; g++) {                                                \
            const T *xt = x + gp[g] * ldx;                                                                 \
            v16f acc[8] = {0};                                                                             \
            int64_t c = 0;                                                                                 \
            for (; c + 16 <= in_f; c += 16) {                                                              \
                const v16f xv = LOAD16(xt + c);                                                            \
                for (int k = 0; k < 8; k++) acc[k] += xv * LOAD16(a[k] + c);                               \
            }                                                                                              \
            float dots[8];                                                                                 \
            hsum8(acc, dots);                                                                              \
            for (; c < in_f; c++)                                                                          \
                for (int k = 0; k < 8; k++) dots[k] += LOAD(xt[c]) * LOAD(a[k][c]);                        \
            T *ht = h + gp[g] * ldh + i * R + j0;                                                          \
            for (int64_t k = 0; k < nb; k++) ht[k] = STORE(dots[k]);                                       \
        }                                                                                                  \
    }                                                                                                      \
}
LORA_ROW_SHRINK(lora_row_shrink_f32, float, id_f, id_f, ld16)
LORA_ROW_SHRINK(lora_row_shrink_bf16, uint16_t, bf2f, f2bf, ld16_bf)

/* y[t, offs[i]:offs[i+1]] += round(sum over j < r of scalings[s, i] * h[t, i*R + j] * B[s, those columns,
   rank j]) for every row t with an adapter (s = slots[t], r = ranks[s]), the delta summed in fp32 and (bf16)
   rounded before it is added, as the C expand of the stacked path rounds it; other rows untouched. A work
   item is a group of rows, a slice and half of its columns; 16 columns at a time, each column's ranks (U
   contiguous values a page) multiplied by the row's h as one vector, the 16 summed side by side into one
   vector (hsum16x16) and added to y as one. The item's body is compiled for the common page ranks (U known,
   the 16 columns' loads are fixed offsets: with U a variable their address arithmetic took most of the
   time, 205 against 132 us for SmolLM2's gate_up at 32 rows on 2 slots). */
#define LORA_ROW_EXPAND(NAME, T, LOAD, STORE, LOADN, LOAD16, STORE16, ROUND16)                             \
static inline __attribute__((always_inline)) void NAME##_item(                                             \
        const int64_t *gp, const T *h, int64_t ldh, T *y, int64_t ldy, const T *bs, int64_t b_page,        \
        const int64_t U, int64_t R, int64_t r, int64_t i, int64_t c0, int64_t c1, int64_t lo, float scale) { \
    const int64_t pages = (r + U - 1) / U, RP = R + 16;  /* hv: zeros past r, so any vector read from */   \
    float hv[ROW_GROUP][RP];                               /* a rank below r stays inside */               \
    int ng = 0;                                                                                            \
    for (; ng < ROW_GROUP && gp[ng] >= 0; ng++)                                                            \
        for (int64_t j = 0; j < RP; j++) hv[ng][j] = j < r ? scale * LOAD(h[gp[ng] * ldh + i * R + j]) : 0.0f; \
    int64_t o = c0;                                                                                        \
    for (; o + 16 <= c1; o += 16)                                                                          \
        for (int g = 0; g < ng; g++) {                                                                     \
            v16f acc[16] = {0};                                                                            \
            for (int64_t p = 0; p < pages; p++) {                                                          \
                const int64_t w = r - p * U < U ? r - p * U : U;                                           \
                const T *bp = bs + p * b_page + o * U;                                                     \
                for (int64_t jb = 0; jb < w; jb += 16) {                                                   \
                    const int64_t nl = w - jb < 16 ? w - jb : 16;                                          \
                    const v16f hg = ld16(hv[g] + p * U + jb);                                              \
                    if (nl == 16)  /* a plain load where the ranks fill the vector: faster than masked */  \
                        for (int k = 0; k < 16; k++) acc[k] += hg * LOAD16(bp + k * U + jb);               \
                    else                                                                                   \
                        for (int k = 0; k < 16; k++) acc[k] += hg * LOADN(bp + k * U + jb, nl);            \
                }                                                                                          \
            }                                                                                              \
            T *yt = y + gp[g] * ldy + o;                                                                   \
            STORE16(yt, LOAD16(yt) + ROUND16(hsum16x16(acc)));                                             \
        }                                                                                                  \
    for (; o < c1; o++)                                                                                    \
        for (int g = 0; g < ng; g++) {                                                                     \
            float d = 0.0f;                                                                                \
            for (int64_t j = 0; j < r; j++) d += hv[g][j] * LOAD(bs[(j / U) * b_page + o * U + j % U]);    \
            T *yt = y + gp[g] * ldy + o;                                                                   \
            *yt = STORE(LOAD(*yt) + LOAD(STORE(d)));                                                       \
        }                                                                                                  \
}                                                                                                          \
void NAME(int64_t Tn, const T *h, int64_t ldh, T *y, int64_t ldy, const T *B, int64_t b_slot,              \
          int64_t b_page, int64_t U, int64_t R, int64_t n_slices, const int64_t *offs,                     \
          const float *scalings, int64_t ld_scale, const int32_t *slots, const int32_t *ranks,             \
          int64_t threads) {                                                                               \
    int64_t grp[Tn > 0 ? Tn : 1][ROW_GROUP];                                                               \
    const int64_t ngrp = row_groups(Tn, slots, ranks, grp), items = ngrp * n_slices * 2;                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(items > 2)")                        \
    for (int64_t it = 0; it < items; it++) {                                                               \
        const int64_t *gp = grp[it / (n_slices * 2)], i = (it / 2) % n_slices, half = it % 2;              \
        const int64_t s = slots[gp[0]], r = ranks[s], lo = offs[i];                                        \
        const int64_t mid = lo + (offs[i + 1] - lo) / 2 / 16 * 16;                                         \
        const int64_t c0 = half ? mid : lo, c1 = half ? offs[i + 1] : mid;                                 \
        const float scale = scalings[s * ld_scale + i];                                                    \
        const T *bs = B + s * b_slot;                                                                      \
        if (U == 16) NAME##_item(gp, h, ldh, y, ldy, bs, b_page, 16, R, r, i, c0, c1, lo, scale);          \
        else if (U == 32) NAME##_item(gp, h, ldh, y, ldy, bs, b_page, 32, R, r, i, c0, c1, lo, scale);     \
        else if (U == 64) NAME##_item(gp, h, ldh, y, ldy, bs, b_page, 64, R, r, i, c0, c1, lo, scale);     \
        else NAME##_item(gp, h, ldh, y, ldy, bs, b_page, U, R, r, i, c0, c1, lo, scale);                   \
    }                                                                                                      \
}
LORA_ROW_EXPAND(lora_row_expand_f32, float, id_f, id_f, ldn16, ld16, st16, id16)
LORA_ROW_EXPAND(lora_row_expand_bf16, uint16_t, bf2f, f2bf, ldn16_bf, ld16_bf, st16_bf, round16_bf)
