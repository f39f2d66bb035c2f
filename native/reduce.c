#include "reduce.h"

#include <stdint.h>
#include <string.h>

#include "collective.h"

size_t stc_dtype_size(int dtype) {
    switch (dtype) {
    case STC_FLOAT16: case STC_BFLOAT16: return 2;
    case STC_FLOAT32: case STC_INT32: return 4;
    case STC_FLOAT64: case STC_INT64: return 8;
    case STC_UINT8: return 1;
    default: return 0;
    }
}

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

#define REDUCE_NATIVE(T)                                                  \
    do {                                                                  \
        T *o = (T *)out;                                                  \
        const T *s0 = (const T *)srcs[0];                                 \
        if (nsrc == 1) { if (o != s0) memmove(o, s0, n * sizeof(T)); return; } \
        const T *s1 = (const T *)srcs[1];                                 \
        for (size_t i = 0; i < n; i++) o[i] = s0[i] + s1[i];              \
        for (int k = 2; k < nsrc; k++) {                                  \
            const T *s = (const T *)srcs[k];                              \
            for (size_t i = 0; i < n; i++) o[i] += s[i];                  \
        }                                                                 \
    } while (0)

#define REDUCE_HALF(TO_F, FROM_F)                                         \
    do {                                                                  \
        float acc[BLOCK];                                                 \
        uint16_t *o = (uint16_t *)out;                                    \
        for (size_t b = 0; b < n; b += BLOCK) {                           \
            size_t m = n - b < BLOCK ? n - b : BLOCK;                     \
            const uint16_t *s0 = (const uint16_t *)srcs[0] + b;           \
            for (size_t i = 0; i < m; i++) acc[i] = TO_F(s0[i]);          \
            for (int k = 1; k < nsrc; k++) {                              \
                const uint16_t *s = (const uint16_t *)srcs[k] + b;        \
                for (size_t i = 0; i < m; i++) acc[i] += TO_F(s[i]);      \
            }                                                             \
            for (size_t i = 0; i < m; i++) o[b + i] = FROM_F(acc[i]);     \
        }                                                                 \
    } while (0)

/* Integers wrap on overflow, as two's complement does; computed unsigned so that it is defined. */
void stc_reduce(void *out, const void *const *srcs, int nsrc, size_t n, int dtype) {
    if (n == 0 || nsrc <= 0) return;
    switch (dtype) {
    case STC_FLOAT32: REDUCE_NATIVE(float); break;
    case STC_FLOAT64: REDUCE_NATIVE(double); break;
    case STC_INT32: REDUCE_NATIVE(uint32_t); break;
    case STC_INT64: REDUCE_NATIVE(uint64_t); break;
    case STC_UINT8: REDUCE_NATIVE(uint8_t); break;
    case STC_FLOAT16: REDUCE_HALF(f16_to_float, float_to_f16); break;
    case STC_BFLOAT16: REDUCE_HALF(bf16_to_float, float_to_bf16); break;
    default: break;
    }
}

void stc_accumulate(void *acc, const void *src, size_t n, int dtype) {
    const void *srcs[2] = {acc, src};
    stc_reduce(acc, srcs, 2, n, dtype);
}

void stc_divide(void *buf, size_t n, int dtype, int divisor) {
    size_t i;
    switch (dtype) {
    case STC_FLOAT32: { float *p = buf; for (i = 0; i < n; i++) p[i] /= (float)divisor; break; }
    case STC_FLOAT64: { double *p = buf; for (i = 0; i < n; i++) p[i] /= (double)divisor; break; }
    case STC_INT32: {
        int32_t *p = buf;
        for (i = 0; i < n; i++) p[i] = (p[i] == INT32_MIN && divisor == -1) ? p[i] : p[i] / divisor;
        break;
    }
    case STC_INT64: {
        int64_t *p = buf;
        for (i = 0; i < n; i++) p[i] = (p[i] == INT64_MIN && divisor == -1) ? p[i] : p[i] / divisor;
        break;
    }
    case STC_UINT8: { uint8_t *p = buf; for (i = 0; i < n; i++) p[i] = (uint8_t)(p[i] / divisor); break; }
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
