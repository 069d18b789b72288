/* bfloat16 y = x W^T (+ b) on Intel AMX tiles (Sapphire Rapids and later), float32 accumulation.
 *
 * An AMX core holds eight tile registers of up to 16 rows x 64 bytes; one TDPBF16PS multiplies a 16 x 32
 * bfloat16 tile of rows (A) by a 32 x 16 tile of weights (B, stored as 16 rows of k-pairs: "VNNI") and adds
 * the 16 x 16 products into a float32 tile (C): 16K multiply-adds per instruction.
 *
 *   packed W: [N / 16][K / 32][16 k-pairs][16 outputs][2]   (one 1 KB B tile per (16 outputs, 32 k);
 *                                                             N padded with zero rows to a multiple of 64)
 *   for each group of 64 outputs (split over the OpenMP threads):
 *       up to 16 rows:   C0..C3 (16 rows x 4 x 16 outputs) += A(16 x 32) B0..B3   for each 32 k in order
 *       more rows:       blocks of 32 rows x 2 x 16 outputs, C0..C3 += A0,A1 x B0,B1
 *   y = round_to_bfloat16(C + b)
 *
 * The result of a row does not depend on the other rows of the call, nor on the block shape that computed
 * it: every output is the same chain -- one TDPBF16PS per 32 k, in order of k, starting from zero -- then
 * the float32 bias and one rounding. So a sequence's logits are the same bits alone, in a full decode batch
 * and beside prefill chunks (tests/engine/test_batch_invariance.py).
 *
 * Rows that do not fill a tile (the last block of a call) are copied into a zero-padded scratch block: a
 * tile load always reads whole rows. K must be a multiple of 32 (amx_gemm.py keeps other weights on oneDNN).
 *
 * Linux lends a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM), and each
 * thread configures its tiles (LDTILECFG) before use and releases them after. Built without AMX (another
 * CPU, an older compiler) the library says so (`cbserve_amx_gemm_available` returns 0) and is not used.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

#define TILE_ROWS 16    /* rows of A and C per tile */
#define TILE_N 16       /* outputs per B and C tile */
#define TILE_K 32       /* k per A and B tile: 32 bfloat16 = 64 bytes */
#define GROUP_N 64      /* outputs per work item: four B tiles */
#define BIG_ROWS 32     /* rows per block of the 2 x 2 kernel */
#define B_TILE (TILE_K * TILE_N) /* bfloat16 per packed B tile */

int cbserve_amx_gemm_group_n(void) { return GROUP_N; }
int cbserve_amx_gemm_tile_k(void) { return TILE_K; }

/* float32 -> bfloat16, rounding to nearest even (as torch's conversion; inputs are finite here) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* out[m, n0 + j] = round(c[m * ldc + j] + bias[n0 + j]) for rows [0, M) and outputs j < n <= GROUP_N: the
 * bias widened once, then one plain loop per row that the compiler turns into vector code */
static void store_rows(uint16_t *out, int64_t ldo, const float *c, int64_t ldc, const uint16_t *bias, int64_t n0,
                       int64_t n, int64_t M) {
    float b[GROUP_N];
    for (int64_t j = 0; j < n; j++) b[j] = bias ? from_bf16(bias[n0 + j]) : 0.0f;
    for (int64_t m = 0; m < M; m++) {
        const float *restrict row = c + m * ldc;
        uint16_t *restrict dst = out + m * ldo + n0;
        for (int64_t j = 0; j < n; j++) dst[j] = to_bf16(row[j] + b[j]);
    }
}

#if HAVE_AMX
/* every tile 16 rows x 64 bytes: C tiles 0-3, A tiles 4-5, B tiles 6-7 (the 1 x 4 kernel: A 4, B 5-7 and 4) */
static void configure_tiles(void) { amx_configure_full_tiles(); }

int cbserve_amx_gemm_available(void) { return amx_permitted(); }

/* C (16 rows x 64 outputs, float32, row stride 64) = A (16 rows, byte stride lda) x 4 B tiles, all k */
static void rows16_times_group(float *c, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t kblocks) {
    const int64_t b_stride = kblocks * B_TILE; /* from one 16-output tile to the next */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *bk = b + kb * B_TILE;
        _tile_loadd(4, a + kb * TILE_K, lda);
        _tile_loadd(5, bk, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, bk + b_stride, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, bk + 2 * b_stride, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, bk + 3 * b_stride, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, GROUP_N * 4);
    _tile_stored(1, c + 16, GROUP_N * 4);
    _tile_stored(2, c + 32, GROUP_N * 4);
    _tile_stored(3, c + 48, GROUP_N * 4);
}

/* C (32 rows x 32 outputs, float32, row stride 64) = A (32 rows, byte stride lda) x 2 B tiles, all k */
static void rows32_times_pair(float *c, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t kblocks) {
    const int64_t b_stride = kblocks * B_TILE;
    const uint16_t *a1 = (const uint16_t *)((const char *)a + 16 * lda);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * TILE_K, lda);
        _tile_loadd(6, b + kb * B_TILE, 64);
        _tile_loadd(7, b + b_stride + kb * B_TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + kb * TILE_K, lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, GROUP_N * 4);
    _tile_stored(1, c + 16, GROUP_N * 4);
    _tile_stored(2, c + 16 * GROUP_N, GROUP_N * 4);
    _tile_stored(3, c + 16 * GROUP_N + 16, GROUP_N * 4);
}

/* rows [m0, m0 + rows) of x as a block of `block` rows: x itself, or (fewer rows) a zero-padded copy */
static const uint16_t *block_rows(const uint16_t *x, int64_t ldx, int64_t m0, int64_t rows, int64_t block, int64_t K,
                                  uint16_t *scratch, int64_t *lda) {
    if (rows == block) {
        *lda = ldx * 2;
        return x + m0 * ldx;
    }
    for (int64_t m = 0; m < block; m++) {
        if (m < rows)
            memcpy(scratch + m * K, x + (m0 + m) * ldx, (size_t)K * 2);
        else
            memset(scratch + m * K, 0, (size_t)K * 2);
    }
    *lda = K * 2;
    return scratch;
}

/* outputs [g * 64, g * 64 + 64) of rows [m0, m1) */
static void rows_times_group(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                             const uint16_t *bias, int64_t m0, int64_t m1, int64_t N, int64_t K, int64_t g,
                             uint16_t *scratch) {
    const int64_t kblocks = K / TILE_K, n0 = g * GROUP_N;
    const uint16_t *b = packed + g * (GROUP_N / TILE_N) * kblocks * B_TILE;
    float c[BIG_ROWS * GROUP_N];
    int64_t lda;
    if (m1 - m0 <= TILE_ROWS) {
        const uint16_t *a = block_rows(x, ldx, m0, m1 - m0, TILE_ROWS, K, scratch, &lda);
        rows16_times_group(c, a, lda, b, kblocks);
        const int64_t n = N - n0 < GROUP_N ? N - n0 : GROUP_N;
        store_rows(out + m0 * ldo, ldo, c, GROUP_N, bias, n0, n, m1 - m0);
        return;
    }
    for (int64_t r0 = m0; r0 < m1; r0 += BIG_ROWS) {
        const int64_t rows = m1 - r0 < BIG_ROWS ? m1 - r0 : BIG_ROWS;
        const uint16_t *a = block_rows(x, ldx, r0, rows, BIG_ROWS, K, scratch, &lda);
        for (int64_t half = 0; half < 2; half++) {
            const int64_t np = n0 + half * 2 * TILE_N;
            if (np >= N) break;
            rows32_times_pair(c, a, lda, b + half * 2 * kblocks * B_TILE, kblocks);
            const int64_t n = N - np < 2 * TILE_N ? N - np : 2 * TILE_N;
            store_rows(out + r0 * ldo, ldo, c, GROUP_N, bias, np, n, rows);
        }
    }
}

/* out [M, N] bfloat16 (row stride ldo) = x [M, K] bfloat16 (row stride ldx) W^T (+ bias [N]); returns 0,
 * or -1 when a scratch block cannot be allocated. Rows go in chunks of about CHUNK_BYTES of x, which stay
 * in L2 while every group of outputs passes over them (streaming all of x once per group instead would
 * bound a prefill by the bandwidth of L3). */
#define CHUNK_BYTES (512 * 1024)
int cbserve_amx_gemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                     const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t groups = (N + GROUP_N - 1) / GROUP_N;
    int64_t chunk = CHUNK_BYTES / (2 * K) / BIG_ROWS * BIG_ROWS;
    if (chunk < BIG_ROWS) chunk = BIG_ROWS;
    if (M <= TILE_ROWS) chunk = M;
    int failed = 0;
#pragma omp parallel if (groups > 1 && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        uint16_t *scratch = malloc((size_t)BIG_ROWS * K * 2);
        configure_tiles();
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m1 = M - m0 < chunk ? M : m0 + chunk;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                if (scratch)
                    rows_times_group(out, ldo, x, ldx, packed, bias, m0, m1, N, K, g, scratch);
                else
                    failed = 1;
            }
        }
        _tile_release();
        free(scratch);
    }
    return failed ? -1 : 0;
}
#else
int cbserve_amx_gemm_available(void) { return 0; }

int cbserve_amx_gemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                     const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    (void)out, (void)ldo, (void)x, (void)ldx, (void)packed, (void)bias, (void)M, (void)N, (void)K;
    (void)store_rows;
    return -1;
}
#endif
