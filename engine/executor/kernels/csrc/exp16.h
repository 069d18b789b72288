/* exp on 16 float32 lanes, inline: cpu_ops.c's gates and the AMX prefill attention's softmax
 * (engine/executor/attention/csrc/paged_prefill_bf16.c).
 *
 * Why inline: a call to libmvec's vectorised expf made the loops around it spill their vector registers
 * (silu_and_mul ran at ~3.6 cycles an element on Sapphire Rapids). Cephes' expf: x = n ln2 + r with
 * |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), exp(r) by its degree-5 polynomial (about 1 ulp), and 2^n
 * put in the exponent bits. x is clamped to [-87.3, 88]: below, the result is float32's smallest normal
 * number instead of a subnormal or 0 (1e-38 against 1 in every use here: sigmoid, softmax weights). */
#ifndef CBSERVE_EXP16_H
#define CBSERVE_EXP16_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float exp16_f __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t exp16_i __attribute__((vector_size(16 * sizeof(int32_t))));

static inline __attribute__((always_inline)) exp16_f exp16(exp16_f x) {
    exp16_f n;
#if defined(__AVX512F__) /* the clamp and rint on whole registers (GCC splits the loop below in halves) */
    x = (exp16_f)_mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.0f));
    n = (exp16_f)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    for (int j = 0; j < 16; j++) {
        x[j] = __builtin_fminf(__builtin_fmaxf(x[j], -87.33654f), 88.0f);
        n[j] = __builtin_rintf(x[j] * 1.44269504088896341f);
    }
#endif
    const exp16_f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    exp16_f p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const exp16_i scale = (__builtin_convertvector(n, exp16_i) + 127) << 23;
    return p * (exp16_f)scale;
}

#endif
