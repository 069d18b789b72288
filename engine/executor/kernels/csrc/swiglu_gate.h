/* SwiGLU's gate on 16 lanes, from the float32 sums of 16 gate outputs and their 16 up outputs (no bias): silu(g)
 * * u, g and u rounded as the matmuls round their outputs (bf16_rounded_x16, kept in float32 lanes), silu(g)
 * looked up in activation_tables.h's table as cpu_ops.c's silu_and_mul looks it up, the product rounded as it
 * rounds it (to_bf16_x16_ftz): the bits of the matmul then that op, for the fused SwiGLU calls of amx_gemm.c
 * and bf16_gemm.c. */
#ifndef CBSERVE_SWIGLU_GATE_H
#define CBSERVE_SWIGLU_GATE_H

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#include "activation_tables.h"
#include "bf16_round.h"

static inline __m256i swiglu_gate_x16(__m512 g_sum, __m512 u_sum) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i g = bf16_rounded_x16(_mm512_castps_si512(g_sum));
    const __m512i u = _mm512_and_si512(bf16_rounded_x16(_mm512_castps_si512(u_sum)), high);
    const __m512i silu = _mm512_slli_epi32(_mm512_i32gather_epi32(_mm512_srli_epi32(g, 16), silu_bf16_table, 2), 16);
    return to_bf16_x16_ftz(_mm512_mul_ps(_mm512_castsi512_ps(silu), _mm512_castsi512_ps(u)));
}
#endif

#endif
