/* float32 y = x W^T (+ b) for the few rows of a decode step, over W packed in 16-output panels.
 *
 * At 16 rows a matmul of this model reads each weight once and uses it 16 times: oneDNN's prepacked fp32
 * kernels reach 58-80 GFLOPS there on the benchmark machine (7-10 GB/s of weights), against ~130 GFLOPS of
 * FMA peak and ~30 GB/s of memory bandwidth. Here one 16-output panel is streamed once per block of 16
 * rows, with every row's accumulator in a register:
 *
 *   packed W: [ceil(N / 16)][K][16]   (panel p holds outputs 16p..16p+15, zero-padded past N)
 *   for each panel:  for each block of <= 16 rows:  acc[m] += x[m, k] * W[p][k][:]  for k = 0..K-1
 *
 * Each output is one fused multiply-add chain over k in order, bias added last. Panels are split over
 * the OpenMP threads (libgomp: the pool torch already runs, see engine/native_build.py).
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16 /* outputs per panel: two 8-float vectors */
#define ROWS 6 /* rows per register block: 6 x 2 accumulators + 2 weight vectors fit AVX2's 16 registers */
#define K_BLOCK 1024 /* k is summed in blocks of this many, each from zero, then added in order */
#define PREFETCH_AHEAD 16 /* k steps (64-byte lines of the panel) ahead */
#define INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(8 * sizeof(float))));

INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store_n(float *p, v8f lo, v8f hi, int n) {
    float tmp[PANEL];
    memcpy(tmp, &lo, sizeof lo);
    memcpy(tmp + 8, &hi, sizeof hi);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}

/* rows [0, M) (M a literal at each call site, so the accumulators live in registers) times one panel:
 * out[m, 0:n] = bias + sum over k of x[m, k] * panel[k, 0:n] */
INLINE void block(float *out, int64_t ldo, const float *x, int64_t ldx, const float *panel, const float *bias,
                  int64_t K, int n, const int M) {
    v8f lo[ROWS], hi[ROWS], sum_lo[ROWS], sum_hi[ROWS];
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t k1 = K - k0 < K_BLOCK ? K : k0 + K_BLOCK;
        for (int m = 0; m < M; m++) lo[m] = hi[m] = (v8f){0};
        for (int64_t k = k0; k < k1; k++) {
            __builtin_prefetch(panel + (k + PREFETCH_AHEAD) * PANEL, 0, 3);
            v8f w0 = load8(panel + k * PANEL), w1 = load8(panel + k * PANEL + 8);
            /* in registers: else GCC folds the loads into every row's FMA (3 loads per 2 FMAs) */
            __asm__("" : "+x"(w0), "+x"(w1));
            for (int m = 0; m < M; m++) {
                const v8f xb = (v8f){0} + x[m * ldx + k];
                lo[m] = xb * w0 + lo[m]; /* one FMA: -ffp-contract=fast (GCC's default) */
                hi[m] = xb * w1 + hi[m];
            }
        }
        for (int m = 0; m < M; m++) {
            sum_lo[m] = k0 ? sum_lo[m] + lo[m] : lo[m];
            sum_hi[m] = k0 ? sum_hi[m] + hi[m] : hi[m];
        }
    }
    if (bias) {
        float b[PANEL] = {0};
        memcpy(b, bias, (size_t)n * sizeof(float));
        for (int m = 0; m < M; m++) {
            sum_lo[m] += load8(b);
            sum_hi[m] += load8(b + 8);
        }
    }
    for (int m = 0; m < M; m++) store_n(out + m * ldo, sum_lo[m], sum_hi[m], n);
}

#define CASE(m) \
    case m: block(out, ldo, x, ldx, panel, bias, K, n, m); break;

static void rows_times_panel(float *out, int64_t ldo, const float *x, int64_t ldx, const float *panel,
                             const float *bias, int64_t K, int n, int64_t M) {
    switch (M) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
        default: break;
    }
}

int cbserve_small_gemm_panel(void) { return PANEL; }

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times packed W^T, plus bias [N] if not NULL */
void cbserve_small_gemm(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                        const float *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (panels > 1 && M * N * K >= (1 << 18))
    for (int64_t p = 0; p < panels; p++) {
        const int n = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
        const float *panel = packed + p * K * PANEL;
        const float *b = bias ? bias + p * PANEL : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int64_t rows = M - m0 < ROWS ? M - m0 : ROWS;
            rows_times_panel(out + m0 * ldo + p * PANEL, ldo, x + m0 * ldx, ldx, panel, b, K, n, rows);
        }
    }
}

/* W [N, K] row-major -> packed [ceil(N / 16)][K][16], zero-padded */
void cbserve_small_gemm_pack(float *packed, const float *w, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * K * PANEL;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < PANEL; j++) {
                const int64_t row = p * PANEL + j;
                dst[k * PANEL + j] = row < N ? w[row * K + k] : 0.0f;
            }
    }
}
