/* The bfloat16 multiply-add peak of this CPU, for bench/cpu_ceiling.py --dtype bfloat16: independent chains of
 * its widest bfloat16 instruction on every thread, with no memory traffic in the loop.
 *
 *   AMX-BF16 (Sapphire Rapids and later): TDPBF16PS into six float32 tiles from two tiles already loaded,
 *       16 x 16 x 32 multiply-adds each;
 *   AVX512-BF16 (Zen 4, Cooper Lake): VDPBF16PS chains, 16 lanes x 2 multiply-adds each;
 *   neither: bf16_peak_kind() is 0 and the caller uses the float32 FMA peak (bfloat16 computed in float32).
 *
 * Returns the floating-point operations done (two per multiply-add). */
#include <omp.h>
#include <stdint.h>

/* the tile permission and configuration the AMX kernels use */
#include "../../engine/executor/kernels/csrc/amx_tiles.h"

#if HAVE_AMX
#define KIND 2
#elif defined(__AVX512BF16__)
#include <immintrin.h>
#define KIND 1
#else
#define KIND 0
#endif

int bf16_peak_kind(void) {
#if KIND == 2
    if (!amx_permitted()) return 0;
#endif
    return KIND;
}

static volatile float sink[1024];

double bf16_peak_run(long iterations, int threads) {
    double flops = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
#if KIND == 2
        amx_configure_full_tiles();
        static const uint16_t zeros[16 * 32] = {0};
        _tile_loadd(6, zeros, 64);
        _tile_loadd(7, zeros, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (long i = 0; i < iterations; i++) { /* six accumulators in flight: the latency hidden */
            _tile_dpbf16ps(0, 6, 7);
            _tile_dpbf16ps(1, 6, 7);
            _tile_dpbf16ps(2, 6, 7);
            _tile_dpbf16ps(3, 6, 7);
            _tile_dpbf16ps(4, 6, 7);
            _tile_dpbf16ps(5, 6, 7);
        }
        float out[16 * 16];
        _tile_stored(0, out, 64);
        sink[omp_get_thread_num() & 1023] = out[0];
        _tile_release();
        flops += 6.0 * 2.0 * 16 * 16 * 32 * (double)iterations;
#elif KIND == 1
        __m512 acc[12];
        __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3800);
        for (int c = 0; c < 12; c++) acc[c] = _mm512_set1_ps((float)c);
        for (long i = 0; i < iterations; i++)
            for (int c = 0; c < 12; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
        float total = 0.0f;
        for (int c = 0; c < 12; c++) total += _mm512_reduce_add_ps(acc[c]);
        sink[omp_get_thread_num() & 1023] = total;
        flops += 12.0 * 16 * 2 * 2 * (double)iterations;
#else
        (void)iterations;
#endif
    }
    return flops;
}
