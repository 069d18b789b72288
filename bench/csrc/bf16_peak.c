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
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KIND 2
#elif defined(__AVX512BF16__)
#include <immintrin.h>
#define KIND 1
#else
#define KIND 0
#endif

int bf16_peak_kind(void) {
#if KIND == 2
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 0;
#endif
    return KIND;
}

static volatile float sink[1024];

double bf16_peak_run(long iterations, int threads) {
    double flops = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
#if KIND == 2
        struct {
            uint8_t palette_id, start_row, reserved[14];
            uint16_t colsb[16];
            uint8_t rows[16];
        } cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        /* NOTE: not _tile_loadconfig, whose asm operand (GCC 12) is the configuration's first 8 bytes: the
         * compiler may drop the other stores as dead (engine/executor/kernels/csrc/amx_tiles.h) */
        __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
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
