/* SiLU of every bfloat16 value, rounded to bfloat16, in one table: a bfloat16 gate has 65,536 possible bit
 * patterns, so silu(g) = g / (1 + exp(-g)) is computed once for each of them when the library loads and
 * looked up afterwards (cpu_ops.c's bfloat16 silu_and_mul, the decode stack's through it, amx_gemm.c's fused
 * gate). A lookup is one gather where the vector formula was ~25 instructions on the two ports that 512-bit
 * arithmetic has (its exp, its division, its rounding): python -m bench.kernel_ab, docs/BENCHMARKS.md.
 *
 * Each entry is silu computed in double precision (libm's exp), rounded to float32 and then to bfloat16 (to
 * nearest even, as torch rounds float32 to bfloat16): torch's float32 silu rounded to bfloat16 but for
 * the rare value where their last float32 bits differ across a rounding boundary; -inf gives NaN, as
 * torch's does. Computed in scalar code, so every library that includes this header fills the same bits,
 * and every path that looks up silu of a bfloat16 gate agrees with the others bit for bit.
 *
 * One table per library (128 KB), filled by a constructor before any call can read it. */
#ifndef CBSERVE_SILU_TABLE_H
#define CBSERVE_SILU_TABLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* entry h: silu of the bfloat16 value whose bits are h, as bfloat16 bits; two entries of padding, so that a
 * 32-bit gather of the last entry reads inside the table */
static uint16_t silu_bf16_table[65536 + 2] __attribute__((aligned(64)));

/* float32 bits -> bfloat16 bits, to nearest even; a NaN a quiet NaN */
static inline uint16_t silu_table_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void fill_silu_table(void) __attribute__((constructor));
static void fill_silu_table(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        const uint32_t bits = h << 16;
        float g;
        memcpy(&g, &bits, sizeof g);
        uint16_t out;
        if ((h & 0x7f80u) == 0x7f80u) /* inf or NaN (tested on the bits: -ffast-math assumes neither) */
            out = (h & 0x7fu) ? (uint16_t)(h | 0x40u) : (h & 0x8000u) ? 0x7fc0u : (uint16_t)h;
        else if (g < -700.0f) /* exp(-g) past double's range: silu is -|g| e^g, -0 in float32 */
            out = 0x8000u;
        else
            out = silu_table_round((float)((double)g / (1.0 + exp(-(double)g))));
        silu_bf16_table[h] = out;
    }
}

#endif
