/* SiLU and GELU-tanh of every bfloat16 value, rounded to bfloat16, in one table each: a bfloat16 gate has
 * 65,536 possible bit patterns, so act(g) is computed once for each of them when the library loads and looked
 * up afterwards (cpu_ops.c's bfloat16 silu_and_mul and gelu_tanh_and_mul, the decode stack's through them,
 * amx_gemm.c's fused SwiGLU gate). A lookup is one gather where the vector formula was ~25 instructions on
 * the two ports that 512-bit arithmetic has (its exp, its division, its rounding): python -m bench.kernel_ab,
 * docs/BENCHMARKS.md.
 *
 * Each entry is the activation computed in double precision (libm's exp), rounded to float32 and
 * then to bfloat16 (to nearest even, as torch rounds float32 to bfloat16): torch's float32 activation rounded
 * to bfloat16 but for the rare value where their last float32 bits differ across a rounding boundary;
 * SiLU(-inf) is NaN, as torch's is. Computed in scalar code, so every library that includes this header fills
 * the same bits, and every path that looks up an activation of a bfloat16 gate agrees with the others bit for
 * bit.
 *
 *   silu(g)      = g / (1 + exp(-g))
 *   gelu_tanh(g) = g / 2 * (1 + tanh(u)) = g / (1 + exp(-2u)),  u = sqrt(2 / pi) * (g + 0.044715 g^3)
 *                                                                    (PyTorch's approximate="tanh")
 *
 * Two tables per library (128 KB each), filled by a constructor before any call can read them. */
#ifndef CBSERVE_ACTIVATION_TABLES_H
#define CBSERVE_ACTIVATION_TABLES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* entry h: the activation of the bfloat16 value whose bits are h, as bfloat16 bits; two entries of padding,
 * so that a 32-bit gather of the last entry reads inside the table */
static uint16_t silu_bf16_table[65536 + 2] __attribute__((aligned(64)));
static uint16_t gelu_tanh_bf16_table[65536 + 2] __attribute__((aligned(64)));

/* float32 bits -> bfloat16 bits, to nearest even; a NaN a quiet NaN */
static inline uint16_t activation_table_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* NOTE: not vectorised: GCC would call libmvec's vector exp (a few ulp off), where each entry is meant to be
 * libm's scalar exp */
static void fill_activation_tables(void) __attribute__((constructor, optimize("no-tree-vectorize")));
static void fill_activation_tables(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        const uint32_t bits = h << 16;
        float g;
        memcpy(&g, &bits, sizeof g);
        if ((h & 0x7f80u) == 0x7f80u) { /* inf or NaN (tested on the bits: -ffast-math assumes neither) */
            /* NaN stays NaN (quieted), -inf gives NaN, +inf stays +inf: both activations alike */
            const uint16_t special = (h & 0x7fu) ? (uint16_t)(h | 0x40u) : h == 0xff80u ? 0x7fc0u : (uint16_t)h;
            silu_bf16_table[h] = gelu_tanh_bf16_table[h] = special;
            continue;
        }
        const double x = g;
        /* past -700 exp(-x) leaves double's range: silu is -|x| e^x, -0 in float32 */
        silu_bf16_table[h] = x < -700.0 ? 0x8000u : activation_table_round((float)(x / (1.0 + exp(-x))));
        /* (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u)): no cancellation where tanh(u) is near -1 */
        const double e = -1.5957691216057308 * (x + 0.044715 * x * x * x);
        /* past 700 (x far below zero) exp(e) leaves double's range: gelu_tanh is -0 in float32 */
        gelu_tanh_bf16_table[h] = e > 700.0 ? 0x8000u : activation_table_round((float)(x / (1.0 + exp(e))));
    }
}

#endif
