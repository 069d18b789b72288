/* float32 -> bfloat16 on 16 lanes (AVX-512 BW/VL), rounding to nearest even in the integer steps of torch's
 * conversion: the matmul's outputs (amx_gemm.c) and the prefill attention's (paged_prefill_bf16.c).
 * NOTE: not VCVTNEPS2BF16 (AVX512-BF16), which flushes float32 denormals to zero where torch's conversion
 * keeps them as bfloat16 denormals. */
#ifndef CBSERVE_BF16_ROUND_H
#define CBSERVE_BF16_ROUND_H

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* float32 bits rounded to nearest even at bit 16, the bfloat16 still in bits 16-31 (the low half garbage) */
static inline __m512i bf16_rounded_x16(__m512i u) {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

static inline __m256i to_bf16_x16(__m512 f) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_x16(_mm512_castps_si512(f)), 16));
}

/* float32 -> bfloat16 on 16 lanes in one VCVTNEPS2BF16 where the CPU has AVX512-BF16 (every one with
 * AMX-BF16 so far), else to_bf16_x16: the same bits but for float32 denormals, which it flushes to zero, as
 * cpu_ops.c's bfloat16 ops round (SwiGLU's gate in amx_gemm.c, the softmax weights in paged_prefill_bf16.c) */
static inline __m256i to_bf16_x16_ftz(__m512 f) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    return to_bf16_x16(f);
#endif
}
#endif

#endif
