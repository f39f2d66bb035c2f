#include "reduce.h"

#include <stdint.h>
#include <string.h>

#include "collective.h"

size_t stc_dtype_size(int dtype) {
    switch (dtype) {
    case STC_FLOAT16: case STC_BFLOAT16: case STC_INT16: case STC_UINT16: return 2;
    case STC_FLOAT32: case STC_INT32: return 4;
    case STC_FLOAT64: case STC_INT64: return 8;
    case STC_UINT8: case STC_INT8: case STC_BOOL: return 1;
    default:
        return dtype > STC_OPAQUE && dtype <= STC_OPAQUE + STC_OPAQUE_MAX ? (size_t)(dtype - STC_OPAQUE) : 0;
    }
}

int stc_dtype_reducible(int dtype) { return dtype >= 0 && dtype < STC_OPAQUE && stc_dtype_size(dtype) > 0; }

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static inline uint16_t float_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return bits_to_float(sign);
        /* subnormal: man * 2^-24, exact in float */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t float_to_f16(float f) {
    uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);        /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);       /* rounds to infinity */
    if (a < 0x38800000u) {                                          /* subnormal or zero in half */
        /* half subnormal = round(|f| / 2^-24); adding 0.5 (2^-1) in float rounds for us */
        float v = bits_to_float(a) + 0.5f;
        return (uint16_t)(sign | (float_to_bits(v) - 0x3f000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (a >> 13));
}

#define BLOCK 512

/* Min and max propagate NaN, as numpy's minimum and maximum do; "x != x" is only true for NaN. */
#define MIN2(a, b) (((b) < (a) || (b) != (b)) ? (b) : (a))
#define MAX2(a, b) (((b) > (a) || (b) != (b)) ? (b) : (a))
#define IMIN2(a, b) ((b) < (a) ? (b) : (a))
#define IMAX2(a, b) ((b) > (a) ? (b) : (a))
#define ADD2(a, b) ((a) + (b))
#define MUL2(a, b) ((a) * (b))

/* One loop per op, the op outside it: o = s0 (F) s1, then o = o (F) s for every further source. */
#define FOLD(T, F)                                                        \
    do {                                                                  \
        T *o = (T *)out;                                                  \
        const T *s0 = (const T *)srcs[0], *s1 = (const T *)srcs[1];       \
        for (size_t i = 0; i < n; i++) o[i] = (T)F(s0[i], s1[i]);         \
        for (int k = 2; k < nsrc; k++) {                                  \
            const T *s = (const T *)srcs[k];                              \
            for (size_t i = 0; i < n; i++) o[i] = (T)F(o[i], s[i]);       \
        }                                                                 \
    } while (0)

/* Integers: sums and products computed unsigned (U, widened to W so that no promotion to int can
 * overflow) wrap as two's complement does; min and max compare as the signed type S. */
#define WMUL(a, b) ((W)(a) * (W)(b))
#define REDUCE_INT(S, U)                                               \
    do {                                                                  \
        switch (op) {                                                     \
        case STC_MIN: FOLD(S, IMIN2); break;                              \
        case STC_MAX: FOLD(S, IMAX2); break;                              \
        case STC_PRODUCT: FOLD(U, WMUL); break;                           \
        default: FOLD(U, ADD2); break;                                    \
        }                                                                 \
    } while (0)

#define REDUCE_FLOAT(T)                                                   \
    do {                                                                  \
        switch (op) {                                                     \
        case STC_MIN: FOLD(T, MIN2); break;                               \
        case STC_MAX: FOLD(T, MAX2); break;                               \
        case STC_PRODUCT: FOLD(T, MUL2); break;                           \
        default: FOLD(T, ADD2); break;                                    \
        }                                                                 \
    } while (0)

#define HALF_FOLD(F)                                                      \
    for (int k = 1; k < nsrc; k++) {                                      \
        const uint16_t *s = (const uint16_t *)srcs[k] + b;                \
        for (size_t i = 0; i < m; i++) acc[i] = F(acc[i], TO_F(s[i]));    \
    }

#define REDUCE_HALF(TO_F_, FROM_F)                                        \
    do {                                                                  \
        float acc[BLOCK];                                                 \
        uint16_t *o = (uint16_t *)out;                                    \
        for (size_t b = 0; b < n; b += BLOCK) {                           \
            size_t m = n - b < BLOCK ? n - b : BLOCK;                     \
            const uint16_t *s0 = (const uint16_t *)srcs[0] + b;           \
            for (size_t i = 0; i < m; i++) acc[i] = TO_F_(s0[i]);         \
            switch (op) {                                                 \
            case STC_MIN: HALF_FOLD(MIN2) break;                          \
            case STC_MAX: HALF_FOLD(MAX2) break;                          \
            case STC_PRODUCT: HALF_FOLD(MUL2) break;                      \
            default: HALF_FOLD(ADD2) break;                               \
            }                                                             \
            for (size_t i = 0; i < m; i++) o[b + i] = FROM_F(acc[i]);     \
        }                                                                 \
    } while (0)

#define BOOL_OR(a, b) ((uint8_t)(((a) | (b)) != 0))
#define BOOL_AND(a, b) ((uint8_t)((a) != 0 && (b) != 0))

void stc_reduce(void *out, const void *const *srcs, int nsrc, size_t n, int dtype, int op) {
    if (n == 0 || nsrc <= 0) return;
    if (nsrc == 1) {
        if (out != srcs[0]) memmove(out, srcs[0], n * stc_dtype_size(dtype));
        if (dtype == STC_BOOL) { /* any nonzero byte is true: give back numpy's canonical 1 */
            uint8_t *o = out;
            for (size_t i = 0; i < n; i++) o[i] = o[i] != 0;
        }
        return;
    }
    switch (dtype) {
    case STC_FLOAT32: REDUCE_FLOAT(float); break;
    case STC_FLOAT64: REDUCE_FLOAT(double); break;
#define W uint32_t
    case STC_INT8: REDUCE_INT(int8_t, uint8_t); break;
    case STC_UINT8: REDUCE_INT(uint8_t, uint8_t); break;
    case STC_INT16: REDUCE_INT(int16_t, uint16_t); break;
    case STC_UINT16: REDUCE_INT(uint16_t, uint16_t); break;
    case STC_INT32: REDUCE_INT(int32_t, uint32_t); break;
#undef W
#define W uint64_t
    case STC_INT64: REDUCE_INT(int64_t, uint64_t); break;
#undef W
    case STC_BOOL:
        if (op == STC_MIN || op == STC_PRODUCT) FOLD(uint8_t, BOOL_AND);
        else FOLD(uint8_t, BOOL_OR);
        break;
#define TO_F f16_to_float
    case STC_FLOAT16: REDUCE_HALF(f16_to_float, float_to_f16); break;
#undef TO_F
#define TO_F bf16_to_float
    case STC_BFLOAT16: REDUCE_HALF(bf16_to_float, float_to_bf16); break;
#undef TO_F
    default: break;
    }
}

void stc_accumulate(void *acc, const void *src, size_t n, int dtype, int op) {
    const void *srcs[2] = {acc, src};
    stc_reduce(acc, srcs, 2, n, dtype, op);
}

#define DIVIDE(T)                                                          \
    do {                                                                   \
        T *p = buf;                                                        \
        for (i = 0; i < n; i++) p[i] = (T)(p[i] / (T)divisor);            \
    } while (0)

void stc_divide(void *buf, size_t n, int dtype, int divisor) {
    size_t i;
    if (divisor <= 0) return;
    switch (dtype) {
    case STC_FLOAT32: DIVIDE(float); break;
    case STC_FLOAT64: DIVIDE(double); break;
    /* C's integer division truncates toward zero; a positive divisor cannot overflow. Narrow
     * types are promoted to int first, so the divisor fits. */
    case STC_INT8: { int8_t *p = buf; for (i = 0; i < n; i++) p[i] = (int8_t)(p[i] / divisor); break; }
    case STC_UINT8: { uint8_t *p = buf; for (i = 0; i < n; i++) p[i] = (uint8_t)(p[i] / divisor); break; }
    case STC_INT16: { int16_t *p = buf; for (i = 0; i < n; i++) p[i] = (int16_t)(p[i] / divisor); break; }
    case STC_UINT16: { uint16_t *p = buf; for (i = 0; i < n; i++) p[i] = (uint16_t)(p[i] / divisor); break; }
    case STC_INT32: { int32_t *p = buf; for (i = 0; i < n; i++) p[i] = p[i] / (int32_t)divisor; break; }
    case STC_INT64: { int64_t *p = buf; for (i = 0; i < n; i++) p[i] = p[i] / (int64_t)divisor; break; }
    case STC_FLOAT16: {
        uint16_t *p = buf;
        for (i = 0; i < n; i++) p[i] = float_to_f16(f16_to_float(p[i]) / (float)divisor);
        break;
    }
    case STC_BFLOAT16: {
        uint16_t *p = buf;
        for (i = 0; i < n; i++) p[i] = float_to_bf16(bf16_to_float(p[i]) / (float)divisor);
        break;
    }
    default: break;
    }
}
