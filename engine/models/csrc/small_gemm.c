/* float32 y = x W^T (+ b) over W packed in 16-output panels.
 *
 * At 16 rows a matmul of this model reads each weight once and uses it 16 times: oneDNN's prepacked fp32
 * kernels reach 58-80 GFLOPS there on the benchmark machine (7-10 GB/s of weights), against ~159 GFLOPS of
 * FMA peak and ~27 GB/s of memory bandwidth. Here each row's accumulators live in registers while a panel
 * streams past:
 *
 *   packed W: [ceil(N / 16)][K][16]   (panel p holds outputs 16p..16p+15, zero-padded past N)
 *   for each panel:  for each group of <= 64 rows:  for each chunk of k:  for each block of <= 6 rows:
 *       acc[m] += x[m, k] * W[p][k][:]        for k in the chunk
 *
 * The chunk of k: with few rows (a decode step) the panel comes from memory and the row blocks are few, so
 * the chunks are short (64 k = 4 KB of panel) and every row block reads the chunk from L1 while the next one
 * is prefetched: memory is read at an even rate instead of in bursts during the first block (a 16-row
 * step's matmuls 8-10% faster on the 2-core AVX2 machine). With many rows the whole k range is one chunk
 * per block (faster there: no accumulator traffic).
 *
 * Each output is one fused multiply-add chain over k in order (the accumulators carry over between chunks),
 * restarted every K_BLOCK k and the partial sums added in order, then the bias: the chunk length does not
 * change a bit of the result. Panels are split over the OpenMP threads (libgomp: the pool torch already
 * runs, see engine/native_build.py).
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16 /* outputs per panel: two 8-float vectors */
#define ROWS 6 /* rows per register block: 6 x 2 accumulators + 2 weight vectors fit AVX2's 16 registers */
#define K_BLOCK 1024 /* k is summed in blocks of this many, each from zero, then added in order */
#define GROUP 64 /* rows whose accumulators one pass over a panel keeps (in L1 between chunks) */
#define GROUP_BLOCKS ((GROUP + ROWS - 1) / ROWS)
#define CHUNKED_ROWS 24 /* calls of at most this many rows read the panel in chunks of SHORT_CHUNK k */
#define SHORT_CHUNK 64 /* k steps: 4 KB of panel, prefetched one chunk ahead */
#define PREFETCH_AHEAD 16 /* k steps (64-byte lines of the panel) ahead with many rows */
#define INLINE static inline __attribute__((always_inline))
/* compiled from its own body alone (never inlined, cloned or specialised for a caller): the decode stack
 * (decode_stack.c) includes this file and gets the same bits */
#define NOIPA static __attribute__((noipa))

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

/* rows [0, M) (M a literal at each call site, so the accumulators live in registers) times one panel over
 * k in [k0, k1): acc (per row: low and high 8 outputs) continues its chains, or starts them when `fresh` */
INLINE void rows_times_chunk(v8f *acc, const float *x, int64_t ldx, const float *panel, int64_t k0, int64_t k1,
                             int64_t prefetch, int fresh, const int M) {
    v8f lo[ROWS], hi[ROWS];
    for (int m = 0; m < M; m++) {
        lo[m] = fresh ? (v8f){0} : acc[2 * m];
        hi[m] = fresh ? (v8f){0} : acc[2 * m + 1];
    }
    for (int64_t k = k0; k < k1; k++) {
        __builtin_prefetch(panel + (k + prefetch) * PANEL, 0, 3);
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
        acc[2 * m] = lo[m];
        acc[2 * m + 1] = hi[m];
    }
}

#define CASE(m) \
    case m: rows_times_chunk(acc, x, ldx, panel, k0, k1, prefetch, fresh, m); break;

static void block_times_chunk(v8f *acc, const float *x, int64_t ldx, const float *panel, int64_t k0, int64_t k1,
                              int64_t prefetch, int fresh, int64_t M) {
    switch (M) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
        default: break;
    }
}

/* out[m, 0:n] = bias + sum over k of x[m, k] * panel[k, 0:n] for a group of M <= GROUP rows */
static void group_times_panel(float *out, int64_t ldo, const float *x, int64_t ldx, const float *panel,
                              const float *bias, int64_t K, int n, int64_t M, int64_t chunk, int64_t prefetch) {
    v8f acc[GROUP_BLOCKS][2 * ROWS], sum[GROUP_BLOCKS][2 * ROWS];
    const int64_t blocks = (M + ROWS - 1) / ROWS;
    for (int64_t kb = 0; kb < K; kb += K_BLOCK) {
        const int64_t kb1 = K - kb < K_BLOCK ? K : kb + K_BLOCK;
        for (int64_t k0 = kb; k0 < kb1; k0 += chunk) {
            const int64_t k1 = kb1 - k0 < chunk ? kb1 : k0 + chunk;
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t m0 = b * ROWS, rows = M - m0 < ROWS ? M - m0 : ROWS;
                block_times_chunk(acc[b], x + m0 * ldx, ldx, panel, k0, k1, prefetch, k0 == kb, rows);
            }
        }
        for (int64_t b = 0; b < blocks; b++)
            for (int j = 0; j < 2 * ROWS; j++) sum[b][j] = kb ? sum[b][j] + acc[b][j] : acc[b][j];
    }
    float padded_bias[PANEL] = {0};
    if (bias) memcpy(padded_bias, bias, (size_t)n * sizeof(float));
    for (int64_t m = 0; m < M; m++) {
        v8f lo = sum[m / ROWS][2 * (m % ROWS)], hi = sum[m / ROWS][2 * (m % ROWS) + 1];
        if (bias) {
            lo += load8(padded_bias);
            hi += load8(padded_bias + 8);
        }
        store_n(out + m * ldo, lo, hi, n);
    }
}

int cbserve_small_gemm_panel(void) { return PANEL; }

/* panel p of the output: out[:, 16p : 16p + n] for all M rows, in groups of GROUP rows */
NOIPA void rows_times_panel(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                             const float *bias, int64_t M, int64_t N, int64_t K, int64_t p) {
    const int64_t chunk = M <= CHUNKED_ROWS ? SHORT_CHUNK : K_BLOCK;
    const int64_t prefetch = M <= CHUNKED_ROWS ? SHORT_CHUNK : PREFETCH_AHEAD;
    const int n = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
    const float *panel = packed + p * K * PANEL;
    const float *b = bias ? bias + p * PANEL : NULL;
    for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
        const int64_t rows = M - m0 < GROUP ? M - m0 : GROUP;
        group_times_panel(out + m0 * ldo + p * PANEL, ldo, x + m0 * ldx, ldx, panel, b, K, n, rows, chunk,
                          prefetch);
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times packed W^T, plus bias [N] if not NULL */
void cbserve_small_gemm(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                        const float *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (panels > 1 && M * N * K >= (1 << 18))
    for (int64_t p = 0; p < panels; p++) rows_times_panel(out, ldo, x, ldx, packed, bias, M, N, K, p);
}
