/* The element-wise steps of a decoder layer on the CPU, each one pass over its rows instead of the five to
 * eight torch calls (and temporaries) it takes in PyTorch:
 *
 *   rms_norm      [residual += x;]  out = weight * (h / sqrt(mean(h^2) + eps)),  h = residual or x
 *   silu_and_mul  out = silu(gate) * up          over the [gate | up] halves of the fused projection
 *   gelu_tanh_and_mul  out = gelu_tanh(gate) * up   the same for Gemma's GeGLU (tanh approximation)
 *   rotary        x = x * cos + rotate_half(x) * sin   in place, per token and head ("rotate half" layout)
 *
 * Arithmetic in float32. For bfloat16 tensors every intermediate that PyTorch rounds to bfloat16 is rounded
 * here at the same point (round to nearest even), so the results are those of the PyTorch path in
 * engine/executor/models/layers.py up to the order of the float32 sums (and libm's expf against torch's exp):
 *   rms_norm:     residual = bf16(residual + x); out = bf16(weight * bf16(h * inv_rms))
 *                 with a float32 weight (Gemma's 1 + w): out = bf16(weight * (h * inv_rms)), rounded once
 *   silu_and_mul: out = bf16(bf16(silu(gate)) * up)      (gelu_tanh_and_mul likewise; bf16(act(gate))
 *                 looked up: activation_tables.h)
 *   rotary:       out = bf16(bf16(x * cos) + rolled * sin_signed)     (torch.addcmul rounds once)
 * Rows are split over threads with OpenMP when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* GCC vectorises the generic 16-lane code below in 8-lane halves on these CPUs (and rounds to bfloat16 in ~6
 * integer steps): with AVX-512 the bfloat16 loads widen in one instruction, and with AVX512-BF16 one
 * VCVTNEPS2BF16 rounds 16 floats (to nearest even, a NaN quieted: the bits of bf16_bits16 for every float32
 * but the denormals, which it flushes to zero; no activation is one). 1.7-2.3x faster ops at prefill sizes. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_CVTNE 1
#else
#define HAVE_CVTNE 0
#endif

#define PARALLEL_MIN_ELEMENTS 32768 /* below this a step's op runs on the calling thread alone */
#define LANES 16
#define INLINE static inline __attribute__((always_inline))
/* A function compiled from its own body alone (never inlined, cloned or specialised for a caller): the
 * decode stack (decode_stack.c) includes this file and calls these, and gets the same bits. */
#define NOIPA static __attribute__((noipa))

typedef float v16f __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t v16u __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t v16h __attribute__((vector_size(LANES * sizeof(uint16_t))));

/* Every op has a scalar form (for the tail of a row) and a 16-lane form; `bf16` is a literal at each call
 * site (the entry points dispatch once), so each loop compiles to one branch-free SIMD body per dtype. */

INLINE float load(const void *p, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE v16f load16(const void *p, int64_t i, const int bf16) {
    v16f f;
    if (!bf16) {
        memcpy(&f, (const float *)p + i, sizeof f);
        return f;
    }
#if HAVE_AVX512
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    v16h h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* float32 -> bfloat16 bits, round to nearest even; a NaN stays a quiet NaN (tested on the bits: the build
 * uses -ffast-math, under which `f != f` may be assumed false) */
INLINE uint32_t bf16_bits(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

INLINE v16u bf16_bits16(v16u u) {
    v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u); /* all ones in NaN lanes */
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
}

/* what a tensor of this dtype would hold: f rounded to bfloat16, as float32 (identity for float32) */
INLINE float round_to(float f, const int bf16) {
    if (!bf16) return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = bf16_bits(u) << 16;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE v16f round16(v16f f, const int bf16) {
    if (!bf16) return f;
#if HAVE_CVTNE
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)f)), 16);
#else
    v16u u;
    memcpy(&u, &f, sizeof u);
    u = bf16_bits16(u) << 16;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

INLINE void store(void *p, int64_t i, float f, const int bf16) {
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    ((uint16_t *)p)[i] = (uint16_t)bf16_bits(u);
}

INLINE void store16(void *p, int64_t i, v16f f, const int bf16) {
    if (!bf16) {
        memcpy((float *)p + i, &f, sizeof f);
        return;
    }
#if HAVE_CVTNE
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), (__m256i)_mm512_cvtneps_pbh((__m512)f));
#else
    v16u u;
    memcpy(&u, &f, sizeof u);
    v16h h = __builtin_convertvector(bf16_bits16(u), v16h);
    memcpy((uint16_t *)p + i, &h, sizeof h);
#endif
}

#include "exp16.h"
#include "activation_tables.h" /* silu and gelu_tanh of a bfloat16 gate, looked up */

/* an activation of 16 bfloat16 gates (bits at gate), from one of activation_tables.h's tables: one gather */
INLINE v16f act16_looked_up(const uint16_t *table, const uint16_t *gate) {
#if HAVE_AVX512
    const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)gate));
    return (v16f)_mm512_slli_epi32(_mm512_i32gather_epi32(index, table, 2), 16);
#else
    v16u u;
    for (int j = 0; j < LANES; j++) u[j] = (uint32_t)table[gate[j]] << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

INLINE float act_looked_up(const uint16_t *table, uint16_t gate) {
    const uint32_t u = (uint32_t)table[gate] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* `f32_weight`: the weight is float32 and scales the float32 norm, rounded once (else the weight has the rows'
 * dtype and scales the norm rounded to it: the same in float32) */
INLINE void rms_norm_row(void *out, void *residual, const void *x, const void *weight, int64_t cols, float eps,
                         const int bf16, const int f32_weight) {
    const int bf16_weight = bf16 && !f32_weight; /* and the norm rounded to bfloat16 before it scales it */
    const int64_t vec_end = cols - cols % LANES;
    const void *h = residual != NULL ? residual : x;
    v16f sum16 = {0};
    float sum = 0.0f;
    if (residual != NULL) {
        for (int64_t c = 0; c < vec_end; c += LANES) {
            v16f v = round16(load16(residual, c, bf16) + load16(x, c, bf16), bf16);
            store16(residual, c, v, bf16);
            sum16 += v * v;
        }
        for (int64_t c = vec_end; c < cols; c++) {
            float v = round_to(load(residual, c, bf16) + load(x, c, bf16), bf16);
            store(residual, c, v, bf16);
            sum += v * v;
        }
    } else {
        for (int64_t c = 0; c < vec_end; c += LANES) {
            v16f v = load16(x, c, bf16);
            sum16 += v * v;
        }
        for (int64_t c = vec_end; c < cols; c++) sum += load(x, c, bf16) * load(x, c, bf16);
    }
    for (int j = 0; j < LANES; j++) sum += sum16[j];
    const float inv_rms = 1.0f / sqrtf(sum / (float)cols + eps);
    for (int64_t c = 0; c < vec_end; c += LANES)
        store16(out, c, load16(weight, c, bf16_weight) * round16(load16(h, c, bf16) * inv_rms, bf16_weight), bf16);
    for (int64_t c = vec_end; c < cols; c++)
        store(out, c, load(weight, c, bf16_weight) * round_to(load(h, c, bf16) * inv_rms, bf16_weight), bf16);
}

INLINE void silu_and_mul_row(void *out, const void *gate, const void *up, int64_t inter, const int bf16) {
    const int64_t vec_end = inter - inter % LANES;
    for (int64_t i = 0; i < vec_end; i += LANES) {
        v16f g = load16(gate, i, bf16);
        v16f silu = bf16 ? act16_looked_up(silu_bf16_table, (const uint16_t *)gate + i) : g / (1.0f + exp16(-g));
        store16(out, i, silu * load16(up, i, bf16), bf16);
    }
    for (int64_t i = vec_end; i < inter; i++) {
        float g = load(gate, i, bf16);
        float silu = bf16 ? act_looked_up(silu_bf16_table, ((const uint16_t *)gate)[i]) : g / (1.0f + expf(-g));
        store(out, i, silu * load(up, i, bf16), bf16);
    }
}

/* gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3): PyTorch's approximate="tanh".
 * Since (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u)), it is g * sigmoid(2u): one exp, vectorised like silu's
 * (exp16), where tanhf would run lane by lane; accurate relative to the result for either sign of g. */
#define GELU_MAX_EXP 88.0f /* exp(-2u) capped below float32's overflow: the gate is g / 3e38 there, ~0 */

INLINE float gelu_tanh(float g) {
    const float e = -1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.0f + expf(e < GELU_MAX_EXP ? e : GELU_MAX_EXP));
}

INLINE v16f gelu_tanh16(v16f g) {
    v16f e = -1.5957691216057308f * (g + 0.044715f * g * g * g);
#if HAVE_AVX512
    e = (v16f)_mm512_min_ps((__m512)e, _mm512_set1_ps(GELU_MAX_EXP));
#else
    for (int j = 0; j < LANES; j++) e[j] = e[j] < GELU_MAX_EXP ? e[j] : GELU_MAX_EXP; /* one vector min */
#endif
    return g / (1.0f + exp16(e));
}

INLINE void gelu_tanh_and_mul_row(void *out, const void *gate, const void *up, int64_t inter, const int bf16) {
    const int64_t vec_end = inter - inter % LANES;
    for (int64_t i = 0; i < vec_end; i += LANES) {
        v16f act = bf16 ? act16_looked_up(gelu_tanh_bf16_table, (const uint16_t *)gate + i)
                        : gelu_tanh16(load16(gate, i, bf16));
        store16(out, i, act * load16(up, i, bf16), bf16);
    }
    for (int64_t i = vec_end; i < inter; i++) {
        float act = bf16 ? act_looked_up(gelu_tanh_bf16_table, ((const uint16_t *)gate)[i])
                         : gelu_tanh(load(gate, i, bf16));
        store(out, i, act * load(up, i, bf16), bf16);
    }
}

/* one head: x[0:half] and x[half:] against cos/sin rows c, s */
INLINE void rotary_head(void *x, const void *c, const void *s, int64_t half, const int bf16) {
    const int64_t vec_end = half - half % LANES;
    for (int64_t i = 0; i < vec_end; i += LANES) {
        v16f a = load16(x, i, bf16), b = load16(x, half + i, bf16);
        v16f ra = round16(a * load16(c, i, bf16), bf16) + b * load16(s, i, bf16);
        v16f rb = round16(b * load16(c, half + i, bf16), bf16) + a * load16(s, half + i, bf16);
        store16(x, i, ra, bf16);
        store16(x, half + i, rb, bf16);
    }
    for (int64_t i = vec_end; i < half; i++) {
        float a = load(x, i, bf16), b = load(x, half + i, bf16);
        float ra = round_to(a * load(c, i, bf16), bf16) + b * load(s, i, bf16);
        float rb = round_to(b * load(c, half + i, bf16), bf16) + a * load(s, half + i, bf16);
        store(x, i, ra, bf16);
        store(x, half + i, rb, bf16);
    }
}

/* float32 rows, for the decode stack and the entry points below alike */
NOIPA void rms_norm_f32(float *out, float *residual, const float *x, const float *weight, int64_t cols, float eps) {
    rms_norm_row(out, residual, x, weight, cols, eps, 0, 0);
}

NOIPA void silu_and_mul_f32(float *out, const float *gate, const float *up, int64_t inter) {
    silu_and_mul_row(out, gate, up, inter, 0);
}

NOIPA void gelu_tanh_and_mul_f32(float *out, const float *gate, const float *up, int64_t inter) {
    gelu_tanh_and_mul_row(out, gate, up, inter, 0);
}

NOIPA void rotary_f32(float *x, const float *c, const float *s, int64_t half) { rotary_head(x, c, s, half, 0); }

/* bfloat16 rows (uint16_t bits), for the decode stack and the entry points below alike */
NOIPA void rms_norm_bf16(uint16_t *out, uint16_t *residual, const uint16_t *x, const uint16_t *weight, int64_t cols,
                         float eps) {
    rms_norm_row(out, residual, x, weight, cols, eps, 1, 0);
}

/* bfloat16 rows with a float32 weight, scaled before the one rounding (Gemma's norms) */
NOIPA void rms_norm_bf16_f32_weight(uint16_t *out, uint16_t *residual, const uint16_t *x, const float *weight,
                                    int64_t cols, float eps) {
    rms_norm_row(out, residual, x, weight, cols, eps, 1, 1);
}

NOIPA void silu_and_mul_bf16(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t inter) {
    silu_and_mul_row(out, gate, up, inter, 1);
}

NOIPA void gelu_tanh_and_mul_bf16(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t inter) {
    gelu_tanh_and_mul_row(out, gate, up, inter, 1);
}

NOIPA void rotary_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t half) {
    rotary_head(x, c, s, half, 1);
}

/* byte offset of element i of a tensor of this dtype */
#define AT(p, i) ((void *)((char *)(p) + (i) * (bf16 ? 2 : 4)))
#define CAT(p, i) ((const void *)((const char *)(p) + (i) * (bf16 ? 2 : 4)))

/* out, x: [rows, cols] with row strides; residual (NULL: none): [rows, cols] contiguous, updated in place;
 * weight: [cols], in the rows' dtype, or float32 where f32_weight (bfloat16 rows: scaled before rounding) */
void cbserve_rms_norm(void *out, int64_t out_stride, void *residual, const void *x, int64_t x_stride,
                      const void *weight, int64_t rows, int64_t cols, float eps, int bf16, int f32_weight) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        void *res = residual != NULL ? AT(residual, r * cols) : NULL;
        if (bf16 && f32_weight)
            rms_norm_bf16_f32_weight(AT(out, r * out_stride), res, CAT(x, r * x_stride), weight, cols, eps);
        else if (bf16)
            rms_norm_bf16(AT(out, r * out_stride), res, CAT(x, r * x_stride), weight, cols, eps);
        else
            rms_norm_f32((float *)out + r * out_stride, res, (const float *)x + r * x_stride, weight, cols, eps);
    }
}

/* gate_up: [rows, 2 * inter] (row stride gu_stride), gate first; out: [rows, inter] contiguous */
void cbserve_silu_and_mul(void *out, const void *gate_up, int64_t gu_stride, int64_t rows, int64_t inter,
                          int bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const void *g = CAT(gate_up, r * gu_stride), *u = CAT(gate_up, r * gu_stride + inter);
        if (bf16)
            silu_and_mul_bf16(AT(out, r * inter), g, u, inter);
        else
            silu_and_mul_f32((float *)out + r * inter, g, u, inter);
    }
}

/* as cbserve_silu_and_mul, with gelu_tanh (Gemma's MLP) */
void cbserve_gelu_tanh_and_mul(void *out, const void *gate_up, int64_t gu_stride, int64_t rows, int64_t inter,
                               int bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const void *g = CAT(gate_up, r * gu_stride), *u = CAT(gate_up, r * gu_stride + inter);
        if (bf16)
            gelu_tanh_and_mul_bf16(AT(out, r * inter), g, u, inter);
        else
            gelu_tanh_and_mul_f32((float *)out + r * inter, g, u, inter);
    }
}

/* x: [tokens, heads, head_dim] with token stride x_stride (heads contiguous), rotated in place;
 * cos, sin_signed: [max_positions, head_dim] tables (sin_signed carries rotate_half's sign: -sin on the
 * first half, +sin on the second); positions: [tokens], each < max_positions */
void cbserve_rotary(void *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                    const int64_t *positions, const void *cos, const void *sin_signed, int bf16) {
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const void *c = CAT(cos, positions[t] * head_dim), *s = CAT(sin_signed, positions[t] * head_dim);
        for (int64_t h = 0; h < heads; h++) {
            void *xh = AT(x, t * x_stride + h * head_dim);
            if (bf16)
                rotary_bf16(xh, c, s, head_dim / 2);
            else
                rotary_f32(xh, c, s, head_dim / 2);
        }
    }
}
