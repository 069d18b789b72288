/* float32 y = x W^T (+ b) over W packed in 16-output panels.
 *
 * At 16 rows a matmul of this model reads each weight once and uses it 16 times: oneDNN's prepacked fp32
 * kernels reach well under both the FMA peak and the memory bandwidth there (python -m bench.cpu_matmul).
 * Here each row's accumulators live in registers while a panel streams past:
 *
 *   packed W: [ceil(N / 16)][K][16]   (panel p holds outputs 16p..16p+15, zero-padded past N)
 *   for each panel:  for each group of <= 64 rows:  for each chunk of k:  for each block of <= 6 rows:
 *       acc[m] += x[m, k] * W[p][k][:]        for k in the chunk
 *
 * The chunk of k: with few rows (a decode step) the panel comes from memory and the row blocks are few, so
 * the chunks are short (64 k = 4 KB of panel) and every row block reads the chunk from L1 while the next one
 * is prefetched: memory is read at an even rate instead of in bursts during the first block (faster on
 * the AVX2 machine: docs/benchmarks-log.md). With many rows the whole k range is one chunk
 * per block (faster there: no accumulator traffic).
 *
 * Each output is one fused multiply-add chain over k in order (the accumulators carry over between chunks),
 * restarted every K_BLOCK k and the partial sums added in order, then the bias: the chunk length does not
 * change a bit of the result. Panels are split over the OpenMP threads (libgomp: the pool torch already
 * runs, see engine/cpu/native_build.py).
 *
 * Block-quantized weights (a GGUF's Q4_0, Q4_1 and Q8_0 tensors) can stay in their blocks: 32 k of one
 * output share a scale d (and in Q4_1 an offset m), each weight an integer code q, and the weight is d * q
 * (+ m). The product of a float16 scale and a code of at most 8 bits is exact in float32, so d * q + m has
 * one rounding however it is computed: the float32 weight the loader makes, bit for bit. A quantized panel
 * holds, per 32-k block, the 32 x 16 codes (int8, k-major like a float panel), the 16 scales and, with
 * offsets, the 16 offsets (float32):
 *
 *   qpacked W: [ceil(N / 16)][K / 32][32 * 16 int8 | 16 float d | 16 float m]
 *
 * A call expands the weights to float32 just before they are used -- with at most ROWS rows in registers,
 * right before their multiply-adds; with at most GROUP rows QCHUNK k at a time into an L1 buffer that every
 * row block reads; with more, a whole panel into a per-thread scratch panel -- and runs the float32 chains
 * over them: the same bits as the float32 panels, from 1.125 (d * q) or 1.25 (d * q + m) bytes a weight
 * instead of 4. Expanding costs a few instructions per 8 weights, so it pays only where reading the weights
 * is the limit: few rows (small_gemm.py's QUANTIZED_MAX_ROWS).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kept_buffer.h"
#include "transpose16.h" /* pack_wide's 16 x 16 blocks */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

/* the chains of one K_BLOCK (acc) added to the sums of the earlier ones, in order */
INLINE void add_block_sums(v8f sum[][2 * ROWS], v8f acc[][2 * ROWS], int64_t blocks, int first) {
    for (int64_t b = 0; b < blocks; b++)
        for (int j = 0; j < 2 * ROWS; j++) sum[b][j] = first ? acc[b][j] : sum[b][j] + acc[b][j];
}

/* out[m, 0:n] = the sums of row m plus the bias, for M rows */
static void store_group(float *out, int64_t ldo, v8f sum[][2 * ROWS], const float *bias, int n, int64_t M) {
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
        add_block_sums(sum, acc, blocks, kb == 0);
    }
    store_group(out, ldo, sum, bias, n, M);
}

int cbserve_small_gemm_panel(void) { return PANEL; }
int cbserve_small_gemm_rows(void) { return ROWS; }

/* out[:, 0:n] = x times one panel ([K][16] floats) plus its bias (16, or NULL), in groups of GROUP rows */
NOIPA void rows_times_panel_data(float *out, int64_t ldo, const float *x, int64_t ldx, const float *panel,
                                 const float *bias, int64_t M, int n, int64_t K) {
    const int64_t chunk = M <= CHUNKED_ROWS ? SHORT_CHUNK : K_BLOCK;
    const int64_t prefetch = M <= CHUNKED_ROWS ? SHORT_CHUNK : PREFETCH_AHEAD;
    for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
        const int64_t rows = M - m0 < GROUP ? M - m0 : GROUP;
        group_times_panel(out + m0 * ldo, ldo, x + m0 * ldx, ldx, panel, bias, K, n, rows, chunk, prefetch);
    }
}

/* panel p of the output: out[:, 16p : 16p + n] for all M rows */
static void rows_times_panel(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                             const float *bias, int64_t M, int64_t N, int64_t K, int64_t p) {
    const int n = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
    rows_times_panel_data(out + p * PANEL, ldo, x, ldx, packed + p * K * PANEL, bias ? bias + p * PANEL : NULL, M,
                          n, K);
}

#if defined(__AVX512F__)
/* ---- many rows on AVX-512: 16 outputs a vector, two panels x WIDE_ROWS rows of chains in registers ----
 *
 * the threads split the rows; each, for each macro block of WIDE_MACRO of its rows:
 *     x's whole blocks of WIDE_ROWS rows packed k-major ([block][k][WIDE_ROWS])
 *     for each group of panels that fits in L2:  for each block:  for each pair of panels p, p + 1:
 *         acc[m][j] += xp[k][m] * W[p + j][k][:]     for k in order (K_BLOCK at a time), m < WIDE_ROWS, j < 2
 *
 * The same chains as above, one vector of 16 outputs instead of two of 8: the same bits. Per k, two panel
 * loads and WIDE_ROWS broadcasts feed 2 * WIDE_ROWS FMAs (BLIS's blocking for AVX-512). Packed k-major, a
 * block's values of x at one k lie at fixed offsets from one pointer (unpacked, the rows' pointers would
 * not fit the general registers). A block's packed rows stay in L1 while its group's panels pass, from L2;
 * a group's panels are read from memory once per macro block. A last panel alone takes one vector a row, a
 * last block of fewer rows as many accumulators as it has rows. Twice the outputs per instruction of those: at
 * prefill sizes within 5-10% of oneDNN's float32 kernels on Sapphire Rapids (python -m bench.cpu_matmul;
 * they were about half), the threads never waiting for each other. */
#define WIDE_ROWS 12   /* rows a block: WIDE_ROWS x WIDE_PANELS accumulators, 26 of the 32 registers with */
#define WIDE_PANELS 2  /* the panels' vectors (8 x 3, 6 x 4 and 14 x 2 measured alike) */
#define WIDE_MACRO 240 /* rows of a macro block: 20 blocks, 553 KB of packed x at K = 576 */
#define WIDE_FROM 64   /* calls of more rows take this path (small_gemm.py's MAX_ROWS) */
#define WIDE_AHEAD 32  /* k steps (a panel's lines) asked for ahead: a decode step's panels come from memory */
#define WIDE_PANEL_BYTES (1 << 20) /* the panels of a group, held in L2 */

typedef float v16f __attribute__((vector_size(16 * sizeof(float))));

INLINE v16f wide_load(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* `rows` rows of x packed k-major in blocks of WIDE_ROWS: xp[(b * K + k) * WIDE_ROWS + m] (a last block of
 * fewer rows padded with zeros); 16 k at a time a 16 x 16 transpose, the rest one value at a time */
static void pack_wide(float *restrict xp, const float *x, int64_t ldx, int64_t rows, int64_t K) {
    const __mmask16 lanes = (__mmask16)((1u << WIDE_ROWS) - 1);
    for (int64_t b = 0; b * WIDE_ROWS < rows; b++) {
        const float *rows_x = x + b * WIDE_ROWS * ldx;
        const int64_t here = rows - b * WIDE_ROWS < WIDE_ROWS ? rows - b * WIDE_ROWS : WIDE_ROWS;
        float *dst = xp + b * K * WIDE_ROWS;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m512 r[16];
            for (int m = 0; m < 16; m++) r[m] = m < here ? _mm512_loadu_ps(rows_x + m * ldx + k) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_mask_storeu_ps(dst + (k + j) * WIDE_ROWS, lanes, r[j]);
        }
        for (; k < K; k++)
            for (int m = 0; m < WIDE_ROWS; m++) dst[k * WIDE_ROWS + m] = m < here ? rows_x[m * ldx + k] : 0.0f;
    }
}

/* R <= WIDE_ROWS rows of a packed block (xp: its k = 0) times np <= WIDE_PANELS panels at p0, `stride` floats
 * apart, over k in [k0, k1) (R and np literals): fresh chains into acc[m * WIDE_PANELS + j] */
INLINE void wide_rows_times_chunk(v16f *acc, const float *xp, const float *p0, int64_t stride, int64_t k0,
                                  int64_t k1, const int np, const int R) {
    v16f a[WIDE_ROWS * WIDE_PANELS];
#pragma GCC unroll 32
    for (int i = 0; i < WIDE_ROWS * WIDE_PANELS; i++) a[i] = (v16f){0};
    for (int64_t k = k0; k < k1; k++) {
        v16f w[WIDE_PANELS];
#pragma GCC unroll 4
        for (int j = 0; j < np; j++) {
            __builtin_prefetch(p0 + j * stride + (k + WIDE_AHEAD) * PANEL, 0, 3);
            w[j] = wide_load(p0 + j * stride + k * PANEL);
            __asm__("" : "+v"(w[j])); /* in a register: one load for every row's FMA */
        }
        const float *xk = xp + k * WIDE_ROWS;
#pragma GCC unroll 16
        for (int m = 0; m < R; m++) {
            const v16f xb = (v16f){0} + xk[m];
#pragma GCC unroll 4
            for (int j = 0; j < np; j++) a[m * WIDE_PANELS + j] = xb * w[j] + a[m * WIDE_PANELS + j];
        }
    }
#pragma GCC unroll 32
    for (int i = 0; i < WIDE_ROWS * WIDE_PANELS; i++) acc[i] = a[i];
}

/* out[m, 0:16 np] = bias + sum over k of x[m, k] * (np panels)[k, :] for R rows of one packed block; n: the
 * outputs of the last of the np panels */
INLINE void wide_block_times_panels(float *out, int64_t ldo, const float *xp, const float *p0, int64_t stride,
                                    const float *bias, int64_t K, int n, const int np, const int R) {
    v16f acc[WIDE_ROWS * WIDE_PANELS], sum[WIDE_ROWS * WIDE_PANELS];
    for (int64_t kb = 0; kb < K; kb += K_BLOCK) {
        wide_rows_times_chunk(acc, xp, p0, stride, kb, K - kb < K_BLOCK ? K : kb + K_BLOCK, np, R);
        for (int i = 0; i < WIDE_ROWS * WIDE_PANELS; i++) sum[i] = kb == 0 ? acc[i] : sum[i] + acc[i];
    }
    for (int j = 0; j < np; j++) {
        const __mmask16 keep = j + 1 < np ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
        const v16f b = bias ? (v16f)_mm512_maskz_loadu_ps(keep, bias + j * PANEL) : (v16f){0};
        for (int m = 0; m < R; m++) {
            const v16f o = bias ? sum[m * WIDE_PANELS + j] + b : sum[m * WIDE_PANELS + j];
            _mm512_mask_storeu_ps(out + m * ldo + j * PANEL, keep, (__m512)o);
        }
    }
}

/* R <= WIDE_ROWS rows of one packed block (xi) times the two panels from panel p (one at the end): out's rows
 * of the block, its columns from 16 p. R and the panels' count become literals: every loop unrolls. */
#define WIDE_CASE(r)                                                           \
    case r:                                                                    \
        if (np == 2)                                                           \
            wide_block_times_panels(o, ldo, xi, p0, K * PANEL, b, K, n, 2, r); \
        else                                                                   \
            wide_block_times_panels(o, ldo, xi, p0, K * PANEL, b, K, n, 1, r); \
        break;

static void wide_block_times_tuple(float *out, int64_t ldo, const float *xi, const float *packed, const float *bias,
                                   int64_t N, int64_t K, int64_t p, int64_t R) {
    const int64_t panels = (N + PANEL - 1) / PANEL, np = panels - p < WIDE_PANELS ? panels - p : WIDE_PANELS;
    const int n = (int)(N - (p + np - 1) * PANEL < PANEL ? N - (p + np - 1) * PANEL : PANEL);
    const float *p0 = packed + p * K * PANEL, *b = bias ? bias + p * PANEL : NULL;
    float *o = out + p * PANEL;
    switch (R) {
        WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4) WIDE_CASE(5) WIDE_CASE(6)
        WIDE_CASE(7) WIDE_CASE(8) WIDE_CASE(9) WIDE_CASE(10) WIDE_CASE(11) WIDE_CASE(12)
        default: break;
    }
}

/* rows [m0, m1) (packed in xp) times the panel pairs [q0, q1): per group of pairs that fit in L2 together
 * (WIDE_PANEL_BYTES), per block of WIDE_ROWS rows (or fewer, the last: it stays in L1 while the group's
 * panels pass), per pair */
static void wide_rows_times_panels(float *out, int64_t ldo, const float *xp, const float *packed, const float *bias,
                                   int64_t m0, int64_t m1, int64_t N, int64_t K, int64_t q0, int64_t q1) {
    int64_t group = WIDE_PANEL_BYTES / (WIDE_PANELS * K * PANEL * (int64_t)sizeof(float));
    if (group < 1) group = 1;
    for (int64_t g0 = q0; g0 < q1; g0 += group) {
        const int64_t g1 = q1 - g0 < group ? q1 : g0 + group;
        for (int64_t i = 0; m0 + i * WIDE_ROWS < m1; i++) {
            const int64_t r = m1 - m0 - i * WIDE_ROWS < WIDE_ROWS ? m1 - m0 - i * WIDE_ROWS : WIDE_ROWS;
            for (int64_t q = g0; q < g1; q++)
                wide_block_times_tuple(out + (m0 + i * WIDE_ROWS) * ldo, ldo, xp + i * K * WIDE_ROWS, packed, bias,
                                       N, K, WIDE_PANELS * q, r);
        }
    }
}

static __thread kept_buffer wide_scratch; /* a thread's packed macro block, kept from call to call */

/* cbserve_small_gemm for more than WIDE_FROM rows; returns -1 where a thread's scratch cannot be allocated
 * (its rows are then not written). The threads split the rows (whole blocks each, but the last): each packs
 * only its own and reads every panel, with no thread waiting for another. */
static int wide_gemm(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed, const float *bias,
                     int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL, tuples = (panels + WIDE_PANELS - 1) / WIDE_PANELS;
    const int64_t blocks = (M + WIDE_ROWS - 1) / WIDE_ROWS;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = blocks * t / threads * WIDE_ROWS, r1 = blocks * (t + 1) / threads * WIDE_ROWS;
        float *xp = r0 < M ? kept_alloc(&wide_scratch, sizeof(float) * (size_t)(WIDE_MACRO * K)) : NULL;
        failed = r0 < M && xp == NULL;
        for (int64_t m0 = r0; m0 < M && m0 < r1 && xp != NULL; m0 += WIDE_MACRO) {
            const int64_t m1 = m0 + WIDE_MACRO < (r1 < M ? r1 : M) ? m0 + WIDE_MACRO : (r1 < M ? r1 : M);
            pack_wide(xp, x + m0 * ldx, ldx, m1 - m0, K);
            wide_rows_times_panels(out, ldo, xp, packed, bias, m0, m1, N, K, 0, tuples);
        }
    }
    return failed ? -1 : 0;
}

/* For a region's threads (the decode stack's), a call of M rows: each packs the rows for itself, then the
 * threads share out the pairs of panels, each taking all the rows of its own (a pair's panels come from
 * memory once, asked for ahead, and stay in L2 for the blocks after the first). Ends with the worksharing
 * loop's barrier. The same bits as rows_times_panel. */
static void wide_shared(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed, const float *bias,
                        int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL, tuples = (panels + WIDE_PANELS - 1) / WIDE_PANELS;
    const int64_t blocks = (M + WIDE_ROWS - 1) / WIDE_ROWS;
    float *xp = kept_alloc(&wide_scratch, sizeof(float) * (size_t)(blocks * WIDE_ROWS * K));
    if (xp != NULL) pack_wide(xp, x, ldx, M, K);
#pragma omp for schedule(guided) /* as amx_qgemm.c's items: a slowed core does not hold the others */
    for (int64_t q = 0; q < tuples; q++) {
        for (int64_t j = WIDE_PANELS * q; xp == NULL && j < WIDE_PANELS * (q + 1) && j < panels; j++)
            rows_times_panel(out, ldo, x, ldx, packed, bias, M, N, K, j); /* no scratch on this thread */
        if (xp != NULL) wide_rows_times_panels(out, ldo, xp, packed, bias, 0, M, N, K, q, q + 1);
    }
}
#endif

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times packed W^T, plus bias [N] if not NULL */
void cbserve_small_gemm(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                        const float *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#if defined(__AVX512F__)
    if (M > WIDE_FROM && wide_gemm(out, ldo, x, ldx, packed, bias, M, N, K) == 0) return;
    if (M >= WIDE_ROWS) { /* decode-sized: the threads share out the panels, as in the decode stack */
#pragma omp parallel if (panels > 1 && M * N * K >= (1 << 18))
        wide_shared(out, ldo, x, ldx, packed, bias, M, N, K);
        return;
    }
#endif
#pragma omp parallel for schedule(guided) if (panels > 1 && M * N * K >= (1 << 18))
    for (int64_t p = 0; p < panels; p++) rows_times_panel(out, ldo, x, ldx, packed, bias, M, N, K, p);
}

/* ------------------------------------------------------------------ block-quantized panels */
#define QBLOCK 32 /* k per block: one scale (and offset) per output */

int64_t cbserve_small_gemm_qblock_bytes(int offsets) {
    return QBLOCK * PANEL + (offsets ? 2 : 1) * PANEL * (int64_t)sizeof(float);
}

/* 8 int8 codes as floats: one sign extension and one conversion (GCC's generic vector conversion of an
 * 8-byte vector goes through scalar registers) */
INLINE v8f codes8(const int8_t *p) {
#if defined(__AVX2__)
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    typedef int8_t v8c __attribute__((vector_size(8)));
    typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t))));
    v8c c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
#endif
}

INLINE v8f expand8(const int8_t *codes, v8f d, v8f m, int offsets) {
    const v8f q = codes8(codes);
    return offsets ? d * q + m : d * q;
}

/* k in [k0, k1) (multiples of 32) of one quantized panel (`src`: its first block) as float32 [k1 - k0][16]
 * into dst: d * q, or d * q + m (one rounding either way) */
static void expand_qpanel(float *restrict dst, const uint8_t *restrict src, int64_t k0, int64_t k1, int offsets) {
    const int64_t block_bytes = cbserve_small_gemm_qblock_bytes(offsets);
    for (int64_t b = k0 / QBLOCK; b < k1 / QBLOCK; b++, dst += QBLOCK * PANEL) {
        const uint8_t *block = src + b * block_bytes;
        const int8_t *codes = (const int8_t *)block;
        const float *scales = (const float *)(block + QBLOCK * PANEL);
        const v8f d0 = load8(scales), d1 = load8(scales + 8);
        const v8f m0 = offsets ? load8(scales + PANEL) : (v8f){0}, m1 = offsets ? load8(scales + PANEL + 8) : (v8f){0};
        for (int k = 0; k < QBLOCK; k++) {
            v8f w0 = expand8(codes + k * PANEL, d0, m0, offsets), w1 = expand8(codes + k * PANEL + 8, d1, m1, offsets);
            memcpy(dst + k * PANEL, &w0, sizeof w0);
            memcpy(dst + k * PANEL + 8, &w1, sizeof w1);
        }
    }
}

#define QCHUNK 64 /* k expanded at a time for a group of rows: 4 KB of float32 panel, read from L1 */

/* rows [0, M) (M <= ROWS, a literal at each call site) times the quantized blocks [b0, b1) of one panel,
 * each weight expanded in registers just before its multiply-adds: acc continues its chains, or starts them
 * when `fresh` */
INLINE void rows_times_qblocks(v8f *acc, const float *x, int64_t ldx, const uint8_t *src, int64_t b0, int64_t b1,
                               int offsets, int fresh, const int M) {
    const int64_t block_bytes = cbserve_small_gemm_qblock_bytes(offsets);
    v8f lo[ROWS], hi[ROWS];
    for (int m = 0; m < M; m++) {
        lo[m] = fresh ? (v8f){0} : acc[2 * m];
        hi[m] = fresh ? (v8f){0} : acc[2 * m + 1];
    }
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *block = src + b * block_bytes;
        const int8_t *codes = (const int8_t *)block;
        const v8f d0 = load8((const float *)(block + QBLOCK * PANEL)), d1 = load8((const float *)(block + QBLOCK * PANEL) + 8);
        const v8f m0 = offsets ? load8((const float *)(block + QBLOCK * PANEL) + PANEL) : (v8f){0};
        const v8f m1 = offsets ? load8((const float *)(block + QBLOCK * PANEL) + PANEL + 8) : (v8f){0};
        __builtin_prefetch(block + 2 * block_bytes, 0, 3); /* two blocks ahead: codes, then scales */
        __builtin_prefetch(block + 2 * block_bytes + 64 * 4, 0, 3);
        for (int k = 0; k < QBLOCK; k++) {
            v8f w0 = expand8(codes + k * PANEL, d0, m0, offsets);
            v8f w1 = expand8(codes + k * PANEL + 8, d1, m1, offsets);
            /* the weights as such: else -ffast-math may fold the scale into x (x * d * q), other bits */
            __asm__("" : "+x"(w0), "+x"(w1));
            for (int m = 0; m < M; m++) {
                const v8f xb = (v8f){0} + x[m * ldx + b * QBLOCK + k];
                lo[m] = xb * w0 + lo[m];
                hi[m] = xb * w1 + hi[m];
            }
        }
    }
    for (int m = 0; m < M; m++) {
        acc[2 * m] = lo[m];
        acc[2 * m + 1] = hi[m];
    }
}

#define QCASE(m, off) \
    case m: rows_times_qblocks(acc, x, ldx, src, b0, b1, off, fresh, m); break;

static void block_times_qblocks(v8f *acc, const float *x, int64_t ldx, const uint8_t *src, int64_t b0, int64_t b1,
                                int offsets, int fresh, int64_t M) {
    if (offsets) {
        switch (M) { QCASE(1, 1) QCASE(2, 1) QCASE(3, 1) QCASE(4, 1) QCASE(5, 1) QCASE(6, 1) default: break; }
    } else {
        switch (M) { QCASE(1, 0) QCASE(2, 0) QCASE(3, 0) QCASE(4, 0) QCASE(5, 0) QCASE(6, 0) default: break; }
    }
}

/* group_times_panel over a quantized panel (more than ROWS rows: QCHUNK k at a time expanded into
 * chunk[QCHUNK * 16]): the same chains (restarted every K_BLOCK k) over the same weights, so the same bits */
static void group_times_qpanel(float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *src,
                               int offsets, const float *bias, int64_t K, int n, int64_t M, float *chunk) {
    v8f acc[GROUP_BLOCKS][2 * ROWS], sum[GROUP_BLOCKS][2 * ROWS];
    const int64_t blocks = (M + ROWS - 1) / ROWS;
    for (int64_t kb = 0; kb < K; kb += K_BLOCK) {
        const int64_t kb1 = K - kb < K_BLOCK ? K : kb + K_BLOCK;
        if (M <= ROWS) { /* one register block: no chunk, each weight expanded where it is used */
            block_times_qblocks(acc[0], x, ldx, src, kb / QBLOCK, kb1 / QBLOCK, offsets, 1, M);
        } else {
            for (int64_t k0 = kb; k0 < kb1; k0 += QCHUNK) {
                const int64_t k1 = kb1 - k0 < QCHUNK ? kb1 : k0 + QCHUNK;
                expand_qpanel(chunk, src, k0, k1, offsets);
                for (int64_t b = 0; b < blocks; b++) {
                    const int64_t m0 = b * ROWS, rows = M - m0 < ROWS ? M - m0 : ROWS;
                    block_times_chunk(acc[b], x + m0 * ldx + k0, ldx, chunk, 0, k1 - k0, 0, k0 == kb, rows);
                }
            }
        }
        add_block_sums(sum, acc, blocks, kb == 0);
    }
    store_group(out, ldo, sum, bias, n, M);
}

/* panel p of the output from quantized panels. Up to ROWS rows each weight is expanded in registers where
 * it is used; up to GROUP rows the panel is expanded a chunk at a time (L1); more rows share one expansion
 * of the whole panel into scratch ([K][16] floats, this thread's; unused up to ROWS rows). */
static void rows_times_qpanel(float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *qpacked,
                              int offsets, const float *bias, int64_t M, int64_t N, int64_t K, int64_t p,
                              float *scratch) {
    const int n = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
    const uint8_t *src = qpacked + p * (K / QBLOCK) * cbserve_small_gemm_qblock_bytes(offsets);
    const float *b = bias ? bias + p * PANEL : NULL;
    if (M <= GROUP) {
        group_times_qpanel(out + p * PANEL, ldo, x, ldx, src, offsets, b, K, n, M, scratch);
    } else {
        expand_qpanel(scratch, src, 0, K, offsets);
        rows_times_panel_data(out + p * PANEL, ldo, x, ldx, scratch, b, M, n, K);
    }
}

/* cbserve_small_gemm over quantized panels (K a multiple of 32). Returns 0, or -1 when a thread's scratch
 * panel could not be allocated (its panels of out are then not written: the caller raises). */
int cbserve_small_gemm_q(float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *qpacked, int offsets,
                         const float *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel if (panels > 1 && M * N * K >= (1 << 18))
    {
        /* up to ROWS rows the weights are expanded in registers: no scratch */
        float *scratch = M <= ROWS ? NULL : malloc(sizeof(float) * (size_t)(K * PANEL));
        if (M > ROWS && scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided)
        for (int64_t p = 0; p < panels; p++)
            if (M <= ROWS || scratch != NULL)
                rows_times_qpanel(out, ldo, x, ldx, qpacked, offsets, bias, M, N, K, p, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}
