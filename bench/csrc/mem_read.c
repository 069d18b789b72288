/* The read bandwidth of this machine's memory: every thread streams its share of a buffer (the size of a
 * model's weights) through vector adds (8 independent accumulators, so the adds never wait on each other and the
 * loads are the limit), as a decode step streams its weights. bench/cpu_ceiling.py turns the bytes it
 * reports and the wall time into GB/s. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define CHAINS 8

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static volatile float sink[1024];

/* Reads the `n` floats at `buffer` (n a multiple of CHAINS * LANES * threads) `passes` times, split over
 * `threads` threads; returns the bytes read. */
double mem_read_run(const float *buffer, int64_t n, long passes, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t share = n / count, first = me * share;
        vec acc[CHAINS];
        memset(acc, 0, sizeof acc);
        for (long p = 0; p < passes; p++)
            for (int64_t i = first; i < first + share; i += CHAINS * LANES)
                for (int c = 0; c < CHAINS; c++) {
                    vec v;
                    memcpy(&v, buffer + i + c * LANES, sizeof v);
                    acc[c] += v;
                }
        float total = 0.0f;
        for (int c = 0; c < CHAINS; c++)
            for (int l = 0; l < LANES; l++) total += acc[c][l];
        sink[me % 1024] = total;
    }
    return (double)n * 4.0 * (double)passes;
}
