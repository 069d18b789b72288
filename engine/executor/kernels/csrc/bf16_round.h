/* float32 -> bfloat16 on 16 lanes (AVX-512 BW/VL), rounding to nearest even in the integer steps of torch's
 * conversion: the matmul's outputs (amx_gemm.c) and the prefill attention's (paged_prefill_amx.c).
 * NOTE: not VCVTNEPS2BF16 (AVX512-BF16), which flushes float32 denormals to zero where torch's conversion
 * keeps them as bfloat16 denormals. */
#ifndef CBSERVE_BF16_ROUND_H
#define CBSERVE_BF16_ROUND_H

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

static inline __m256i to_bf16_x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif

#endif
