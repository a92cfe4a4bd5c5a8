/* Replay of a recorded chain of this library's kernels (compiled after cpu_kernels.c, cpu_gemm.c and
   cpu_row_lora.c, as one library): a CPU decode step's forward is a few hundred of these calls, and each one
   made from Python costs more than its arithmetic (mmlora/backends/cpu_plan.py records them once, this runs
   them in one call).

   ops: int64 words, each op its kernel's index in PLAN_KERNELS, then that kernel's arguments in order
   (pointers and integers as they are, a float argument as the bits of a double). */

#define PLAN_KERNELS(X)                                                                                     \
    X(lora_expand_f32, 11) X(lora_expand_bf16, 11) X(decode_attention_f32, 17) X(decode_attention_bf16, 17) \
    X(store_kv_rows, 10) X(rms_norm_f32, 10) X(rms_norm_bf16, 10) X(rotary_f32, 12) X(rotary_bf16, 12)       \
    X(silu_and_mul_f32, 6) X(silu_and_mul_bf16, 6) X(gemm_f32, 10) X(gemm_bf16, 10)                         \
    X(lora_row_shrink_f32, 16) X(lora_row_shrink_bf16, 16) X(lora_row_expand_f32, 17)                       \
    X(lora_row_expand_bf16, 17)

#define PLAN_NAME(name, n) #name,
#define PLAN_NARGS(name, n) n,
static const char *const plan_names[] = {PLAN_KERNELS(PLAN_NAME)};
static const int64_t plan_nargs[] = {PLAN_KERNELS(PLAN_NARGS)};
#define PLAN_COUNT ((int64_t)(sizeof(plan_nargs) / sizeof(plan_nargs[0])))

/* The kernels a plan can hold, by index: their names and argument counts (NULL / -1 past the last). */
const char *plan_kernel_name(int64_t i) { return i >= 0 && i < PLAN_COUNT ? plan_names[i] : NULL; }
int64_t plan_kernel_args(int64_t i) { return i >= 0 && i < PLAN_COUNT ? plan_nargs[i] : -1; }

static inline float plan_float(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof(d));
    return (float)d;
}

#include <time.h>

#define P(i) ((void *)(intptr_t)a[i])

/* Run one op; returns 0, 1 when it failed (a GEMM out of memory for its row buffer), -1 when this build does
   not have its kernel (bf16 GEMM without AVX-512 BF16) or does not know it. */
static int64_t plan_op(const int64_t *ops) {
    const int64_t *a = ops + 1;
    switch (ops[0]) {
    case 0: lora_expand_f32(a[0], P(1), a[2], P(3), a[4], P(5), P(6), P(7), a[8], P(9), a[10]); return 0;
    case 1: lora_expand_bf16(a[0], P(1), a[2], P(3), a[4], P(5), P(6), P(7), a[8], P(9), a[10]); return 0;
    case 2:
        decode_attention_f32(a[0], a[1], a[2], a[3], P(4), P(5), P(6), P(7), P(8), a[9], a[10], P(11), a[12],
                             plan_float(a[13]), P(14), a[15], a[16]);
        return 0;
    case 3:
        decode_attention_bf16(a[0], a[1], a[2], a[3], P(4), P(5), P(6), P(7), P(8), a[9], a[10], P(11), a[12],
                              plan_float(a[13]), P(14), a[15], a[16]);
        return 0;
    case 4: store_kv_rows(a[0], a[1], a[2], P(3), a[4], P(5), a[6], P(7), P(8), P(9)); return 0;
    case 5: rms_norm_f32(a[0], a[1], P(2), a[3], P(4), a[5], P(6), P(7), P(8), plan_float(a[9])); return 0;
    case 6: rms_norm_bf16(a[0], a[1], P(2), a[3], P(4), a[5], P(6), P(7), P(8), plan_float(a[9])); return 0;
    case 7: rotary_f32(a[0], a[1], a[2], a[3], P(4), a[5], P(6), a[7], P(8), P(9), P(10), P(11)); return 0;
    case 8: rotary_bf16(a[0], a[1], a[2], a[3], P(4), a[5], P(6), a[7], P(8), P(9), P(10), P(11)); return 0;
    case 9: silu_and_mul_f32(a[0], a[1], P(2), a[3], P(4), a[5]); return 0;
    case 10: silu_and_mul_bf16(a[0], a[1], P(2), a[3], P(4), a[5]); return 0;
    case 11: return gemm_f32(a[0], a[1], a[2], P(3), a[4], P(5), P(6), P(7), a[8], a[9]) ? 1 : 0;
#if defined(__AVX512BF16__)
    case 12: return gemm_bf16(a[0], a[1], a[2], P(3), a[4], P(5), P(6), P(7), a[8], a[9]) ? 1 : 0;
#endif
    case 13:
        lora_row_shrink_f32(a[0], P(1), a[2], P(3), a[4], P(5), a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                            P(13), P(14), a[15]);
        return 0;
    case 14:
        lora_row_shrink_bf16(a[0], P(1), a[2], P(3), a[4], P(5), a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                             P(13), P(14), a[15]);
        return 0;
    case 15:
        lora_row_expand_f32(a[0], P(1), a[2], P(3), a[4], P(5), a[6], a[7], a[8], a[9], a[10], P(11), P(12),
                            a[13], P(14), P(15), a[16]);
        return 0;
    case 16:
        lora_row_expand_bf16(a[0], P(1), a[2], P(3), a[4], P(5), a[6], a[7], a[8], a[9], a[10], P(11), P(12),
                             a[13], P(14), P(15), a[16]);
        return 0;
    default: return -1;
    }
}
#undef P

/* Run the n_ops ops of `ops` in order; with `ns` (else NULL), ns[i] = op i's wall nanoseconds. Returns 0;
   or 1 + the index of an op that failed, after which nothing more runs; or -(1 + index) of an op this
   build does not have or does not know. */
int64_t plan_run(const int64_t *ops, int64_t n_ops, int64_t *ns) {
    struct timespec t0, t1;
    for (int64_t i = 0; i < n_ops; i++) {
        if (ns) clock_gettime(CLOCK_MONOTONIC, &t0);
        const int64_t status = plan_op(ops);
        if (status) return status > 0 ? 1 + i : -(1 + i);
        if (ns) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            ns[i] = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        }
        ops += 1 + plan_nargs[ops[0]];
    }
    return 0;
}
