/* The fused multiply-add peak of this CPU: independent FMA chains in registers, on every thread, with no
 * memory traffic. bench/cpu_ceiling.py turns the flops it reports and the wall time into GFLOPS.
 *
 * Zen 3 has two 256-bit FMA pipes of 4 cycles' latency: 8 chains in flight keep both busy; 12 leave room.
 * With AVX-512 the vectors are 512 bits (Zen 4 runs them as two halves; Intel's server cores, two pipes). */
#include <omp.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define CHAINS 12

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static volatile float sink[1024];

/* Each of `threads` threads runs `iterations` rounds of CHAINS multiply-adds of LANES floats; returns the
 * floating-point operations done (two per lane per FMA). */
double fma_peak_run(long iterations, int threads) {
    double flops = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
        vec acc[CHAINS], a, b;
        for (int l = 0; l < LANES; l++) {
            a[l] = 0.9999f;
            b[l] = 0.0001f;
        }
        for (int c = 0; c < CHAINS; c++)
            for (int l = 0; l < LANES; l++) acc[c][l] = (float)(c + l);
        for (long i = 0; i < iterations; i++)
            for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * a + b;
        float total = 0.0f;
        for (int c = 0; c < CHAINS; c++)
            for (int l = 0; l < LANES; l++) total += acc[c][l];
        sink[omp_get_thread_num() & 1023] = total; /* keeps the loop from being optimised away */
        flops += 2.0 * LANES * CHAINS * (double)iterations;
    }
    return flops;
}
