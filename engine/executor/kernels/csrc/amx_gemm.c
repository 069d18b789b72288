/* bfloat16 y = x W^T (+ b) on Intel AMX tiles (Sapphire Rapids and later), float32 accumulation.
 *
 * An AMX core holds eight tile registers of up to 16 rows x 64 bytes; one TDPBF16PS multiplies a 16 x 32
 * bfloat16 tile of rows (A) by a 32 x 16 tile of weights (B, stored as 16 rows of k-pairs: "VNNI") and adds
 * the 16 x 16 products into a float32 tile (C): 16K multiply-adds per instruction.
 *
 *   packed W: [N / 16][K / 32][16 k-pairs][16 outputs][2]   (one 1 KB B tile per (16 outputs, 32 k);
 *                                                             N padded with zero rows to a multiple of 64)
 *   up to 16 rows:  per group of 64 outputs (split over the OpenMP threads; halves of 32 where the groups
 *                   would not share out evenly):
 *                       C0..C3 (16 rows x 4 x 16 outputs) += A(16 x 32) B0..B3   for each 32 k in order
 *   more rows:      the threads split the pairs of 32 outputs (or, from 512 rows a thread, the rows,
 *                   MACRO_ROWS at a time to whichever thread is free);
 *                   each takes MACRO_ROWS rows at a time, then per pair of B tiles, per chunk of at most
 *                   K_CHUNK k-blocks, for each block of 32 rows: C0..C3 += A0,A1 x B0,B1
 *   y = round_to_bfloat16(C + b)
 *   SwiGLU (cbserve_amx_gemm_swiglu): the 2 x 2 kernel's two B tiles are the gate's 16 outputs and the up
 *                   half's matching 16, and the block rounds out silu(g) * u (gate_rows)
 *
 * The result of a row does not depend on the other rows of the call, nor on the block shape that computed
 * it: every output is the same chain -- one TDPBF16PS per 32 k, in order of k, starting from zero -- then
 * the float32 bias and one rounding. (Between chunks of k a block's float32 sums wait in memory: a store
 * and a load are exact, so the chain goes on unchanged.) So a sequence's logits are the same bits alone, in
 * a full decode batch and beside prefill chunks (tests/engine/test_batch_invariance.py).
 *
 * Why this blocking for many rows (python -m bench.cpu_matmul --dtype bfloat16, docs/BENCHMARKS.md): a tile
 * register is not renamed, so a tile load that misses L1 stalls the products that wait for it. A pair's B
 * tiles for one chunk of k (at most K_CHUNK x 2 KB) stay in L1 while the MACRO_ROWS rows pass, whose A tiles
 * come from L2 and stay there while every pair of outputs passes over them: they are loaded with the
 * streaming hint (TILELOADDT1), so that they do not push the B tiles out of L1. Meanwhile the blocks ask the
 * next chunk's B tiles into L2 a few lines after each k-block, or its first block would wait for memory at
 * every tile. The rows are read in place where they fill whole blocks and lie on cache lines, else packed
 * (a tile row across two cache lines loads at half the speed); the threads split the outputs while each has
 * few rows, so each reads only its part of W. A finished block's sums are rounded out a few rows at a time
 * between the next block's products; where the call's output is large (STREAM_BYTES) and each block's row
 * is one whole cache line, with non-temporal stores: an ordinary store of a line that is in no cache waits
 * for the line to be read first, and the store buffer, full of them, stalls the tile loads (1.4x the time
 * at 2,048 rows, one thread). (python -m bench.cpu_matmul --dtype bfloat16; docs/BENCHMARKS.md.)
 *
 * Rows that do not fill a block are zero rows of the packed copy (of a scratch tile up to 16 rows): a tile
 * load always reads whole rows. K must be a multiple of 32 (amx_gemm.py keeps other weights on oneDNN).
 *
 * Linux lends a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM), and each
 * thread configures its tiles (LDTILECFG) before use and releases them after. Built without AMX (another
 * CPU, an older compiler) the library says so (`cbserve_amx_gemm_available` returns 0) and is not used.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16_round.h" /* to_bf16_x16: as to_bf16 below where there are no such vectors */
#include "kept_buffer.h"
#include "swiglu_gate.h" /* the fused gate, as cpu_ops.c's silu_and_mul computes it */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_ROUNDING 1
#include <immintrin.h>
#else
#define VECTOR_ROUNDING 0
#endif

#define TILE_ROWS 16             /* rows of A and C per tile */
#define TILE_N 16                /* outputs per B and C tile */
#define TILE_K 32                /* k per A and B tile: 32 bfloat16 = 64 bytes */
#define GROUP_N 64               /* outputs per work item of up to 16 rows: four B tiles */
#define B_TILE (TILE_K * TILE_N) /* bfloat16 per packed B (or A) tile */
#define BIG_ROWS 32              /* rows per block of the 2 x 2 kernel */
#define PAIR_N 32                /* outputs per block of the 2 x 2 kernel: two B tiles */
#define MACRO_ROWS 256           /* rows a pair's B tiles pass over (their A tiles: 288 KB at K = 576) */
#define K_CHUNK 18               /* k-blocks per chunk at most: a pair's B tiles of a chunk (36 KB) stay in L1 */
#define SPLIT_ROWS 16            /* blocks of 32 rows a thread from which the threads split the rows */
#define STREAM_BYTES (1 << 20)   /* outputs of at least this many bytes a call go to memory past the caches */

int cbserve_amx_gemm_group_n(void) { return GROUP_N; }
int cbserve_amx_gemm_tile_k(void) { return TILE_K; }

#if VECTOR_ROUNDING
/* out[m, n0 + j] = round(c[m * ldc + j] + bias[n0 + j]) for rows [0, M) and outputs j < n <= GROUP_N */
static void store_rows(uint16_t *out, int64_t ldo, const float *c, int64_t ldc, const uint16_t *bias, int64_t n0,
                       int64_t n, int64_t M) {
    __m512 b[GROUP_N / 16];
    __mmask16 keep[GROUP_N / 16];
    const int64_t vectors = (n + 15) / 16;
    for (int64_t v = 0; v < vectors; v++) {
        keep[v] = n - 16 * v >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - 16 * v)) - 1);
        b[v] = _mm512_setzero_ps();
        if (bias) {
            const __m256i bits = _mm256_maskz_loadu_epi16(keep[v], bias + n0 + 16 * v);
            b[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t v = 0; v < vectors; v++) {
            const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(keep[v], c + m * ldc + 16 * v), b[v]);
            _mm256_mask_storeu_epi16(out + m * ldo + n0 + 16 * v, keep[v], to_bf16_x16(sum));
        }
}

/* store_rows for n = PAIR_N outputs whose rows each fill one cache line (out + n0 and ldo * 2 on 64 bytes):
 * each row one non-temporal store of the whole line, which no read for ownership waits for */
static void stream_rows(uint16_t *out, int64_t ldo, const float *c, int64_t ldc, const uint16_t *bias, int64_t n0,
                        int64_t M) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n0))), 16));
        b1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n0 + 16))), 16));
    }
    for (int64_t m = 0; m < M; m++) {
        const __m256i lo = to_bf16_x16(_mm512_add_ps(_mm512_loadu_ps(c + m * ldc), b0));
        const __m256i hi = to_bf16_x16(_mm512_add_ps(_mm512_loadu_ps(c + m * ldc + 16), b1));
        _mm512_stream_si512((__m512i *)(out + m * ldo + n0), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
}

static inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* SwiGLU's gate of a block whose 16 + 16 outputs are gate and up columns (cbserve_amx_gemm_swiglu):
 * out[m, n0 .. n0 + 16) = silu(g) * u (swiglu_gate.h: the bits of the matmul then cpu_ops.c's silu_and_mul) */
static void gate_rows(uint16_t *out, int64_t ldo, const float *c, int64_t ldc, int64_t n0, int64_t M) {
    for (int64_t m = 0; m < M; m++)
        _mm256_storeu_si256((__m256i *)(out + m * ldo + n0),
                            swiglu_gate_x16(_mm512_loadu_ps(c + m * ldc), _mm512_loadu_ps(c + m * ldc + 16)));
}
#else
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

/* out[m, n0 + j] = round(c[m * ldc + j] + bias[n0 + j]) for rows [0, M) and outputs j < n <= GROUP_N */
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
#endif

/* bytes of the scratch that rows_times_pairs needs for `rows` rows: their packed A tiles (at most MACRO_ROWS
 * rows) and one float32 block of sums per 32 of them */
static size_t pairs_scratch_bytes(int64_t rows, int64_t K) {
    const int64_t block = rows < MACRO_ROWS ? (rows + BIG_ROWS - 1) / BIG_ROWS * BIG_ROWS : MACRO_ROWS;
    return (size_t)block * K * 2 + (size_t)block * PAIR_N * 4;
}

/* The bytes of scratch a thread of amx_gemm_share needs for M rows of K: a zero-padded tile of up to 16 rows,
 * or the blocks of more rows (64-byte aligned, as every tile this file loads: a tile row across two cache
 * lines loads at half the speed) */
static size_t amx_scratch_bytes(int64_t M, int64_t K) {
    return M <= TILE_ROWS ? (size_t)TILE_ROWS * K * 2 : pairs_scratch_bytes(M, K);
}

#if HAVE_AMX
/* every tile 16 rows x 64 bytes: C tiles 0-3, A tiles 4-5, B tiles 6-7 (the 1 x 4 kernel: A 4, B 5-7 and 4) */
static void configure_tiles(void) { amx_configure_full_tiles(); }

int cbserve_amx_gemm_available(void) { return amx_permitted(); }

/* ---- up to 16 rows: one A tile, four B tiles ---- */

/* C (16 rows x 64 outputs, float32, row stride 64) = A (16 rows, byte stride lda) x 4 B tiles, all k (`four`
 * 0: the first 32 outputs, two B tiles; a literal at each call) */
static inline __attribute__((always_inline)) void rows16_times_tiles(float *c, const uint16_t *a, int64_t lda,
                                                                    const uint16_t *b, int64_t kblocks,
                                                                    const int four) {
    const int64_t b_stride = kblocks * B_TILE; /* from one 16-output tile to the next */
    _tile_zero(0);
    _tile_zero(1);
    if (four) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *bk = b + kb * B_TILE;
        _tile_loadd(4, a + kb * TILE_K, lda);
        _tile_loadd(5, bk, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, bk + b_stride, 64);
        _tile_dpbf16ps(1, 4, 6);
        if (four) {
            _tile_loadd(7, bk + 2 * b_stride, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, bk + 3 * b_stride, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, GROUP_N * 4);
    _tile_stored(1, c + 16, GROUP_N * 4);
    if (four) {
        _tile_stored(2, c + 32, GROUP_N * 4);
        _tile_stored(3, c + 48, GROUP_N * 4);
    }
}

/* The outputs a work item of a call of up to 16 rows takes on `threads` threads: a group of 64, or half of one
 * where the groups would not share out evenly (N = 576: 9 groups, one thread waiting for another's fifth; 18
 * halves). Either way every output is the same chain. */
static int64_t rows16_item_outputs(int64_t N, int64_t threads) {
    return (N + GROUP_N - 1) / GROUP_N % threads ? PAIR_N : GROUP_N;
}

/* The A tiles of M <= `rows` rows of x (row stride ldx; `rows` 16, or 32 in amx_qgemm.c): x itself when they
 * fill the tiles, else a zero-padded copy in `scratch` (rows x K, 64-byte aligned), made once per thread and
 * call (once per item, a 49,152-output head copied 14 MB a call). Returns the rows' address; *lda their byte
 * stride. */
static const uint16_t *rows_tiles(const uint16_t *x, int64_t ldx, int64_t M, int64_t rows, int64_t K,
                                  uint16_t *scratch, int64_t *lda) {
    *lda = ldx * 2;
    if (M == rows) return x;
    for (int64_t m = 0; m < rows; m++) {
        if (m < M)
            memcpy(scratch + m * K, x + m * ldx, (size_t)K * 2);
        else
            memset(scratch + m * K, 0, (size_t)K * 2);
    }
    *lda = K * 2;
    return scratch;
}

/* outputs [i * width, i * width + width) (width: rows16_item_outputs) of the M <= 16 rows of the A tile `a`
 * (rows_tiles, byte stride lda) */
static void rows16_times_item(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda, const uint16_t *packed,
                              const uint16_t *bias, int64_t M, int64_t N, int64_t K, int64_t i, int64_t width) {
    const int64_t kblocks = K / TILE_K, n0 = i * width;
    if (n0 >= N) return; /* the zero outputs past N of the last group */
    float c[TILE_ROWS * GROUP_N];
    const uint16_t *b = packed + n0 / TILE_N * kblocks * B_TILE;
    if (width == GROUP_N)
        rows16_times_tiles(c, a, lda, b, kblocks, 1);
    else
        rows16_times_tiles(c, a, lda, b, kblocks, 0);
    store_rows(out, ldo, c, GROUP_N, bias, n0, N - n0 < width ? N - n0 : width, M);
}

/* ---- more rows: blocks of 32 rows x 32 outputs over packed rows ---- */

/* x's `rows` rows (row stride ldx) packed into A tiles, zero rows up to `padded`: the tile of rows
 * [16 t, 16 t + 16) and k-block kb at ap + (t * kblocks + kb) * 512 */
static void pack_rows(uint16_t *restrict ap, const uint16_t *x, int64_t ldx, int64_t rows, int64_t padded,
                      int64_t kblocks) {
    for (int64_t r = 0; r < padded; r++) {
        uint16_t *dst = ap + (r / TILE_ROWS) * kblocks * B_TILE + (r % TILE_ROWS) * TILE_K;
        for (int64_t kb = 0; kb < kblocks; kb++) {
            if (r < rows)
                memcpy(dst + kb * B_TILE, x + r * ldx + kb * TILE_K, TILE_K * 2);
            else
                memset(dst + kb * B_TILE, 0, TILE_K * 2);
        }
    }
}

/* Where a block's A tiles are: rows 0-15 of k-block kb at a0 + kb * step (bfloat16), rows 16-31 at a1 + kb *
 * step, rows `stride` bytes apart (x itself, or its packed copy) */
typedef struct {
    const uint16_t *a0, *a1;
    int64_t step, stride;
} a_tiles;

/* A block of 32 rows x 32 outputs whose float32 sums wait in `c` to be rounded into `out` (rows 0: none);
 * `stream`: its rows are whole cache lines that go to memory past the caches (stream_rows) */
typedef struct {
    uint16_t *out;
    const float *c;
    int64_t n0, n, rows;
    int stream, gated; /* gated: SwiGLU's gate of 16 gate and 16 up sums into 16 outputs (gate_rows) */
} finished_block;

/* out[0:rows, n0:n0 + n] = round(c + bias) of a finished block, rows [r0, r1) of it */
static void round_out(const finished_block *f, int64_t r0, int64_t r1, int64_t ldo, const uint16_t *bias) {
#if VECTOR_ROUNDING
    if (f->gated) {
        gate_rows(f->out + r0 * ldo, ldo, f->c + r0 * PAIR_N, PAIR_N, f->n0, r1 - r0);
        return;
    }
    if (f->stream) {
        stream_rows(f->out + r0 * ldo, ldo, f->c + r0 * PAIR_N, PAIR_N, bias, f->n0, r1 - r0);
        return;
    }
#endif
    store_rows(f->out + r0 * ldo, ldo, f->c + r0 * PAIR_N, PAIR_N, bias, f->n0, f->n, r1 - r0);
}

/* The B tiles that a block asks into L2 for the chunk after its own (whose first block would otherwise wait
 * for memory at every tile; the blocks of a chunk share the asking): lines [first, last) of those at b0 and
 * at b1, `per_kb` after each k-block's products. */
typedef struct {
    const char *b0, *b1;
    int64_t first, last, per_kb;
} next_chunk;

static inline void ask_next(const next_chunk *nx, int64_t step) {
    for (int64_t l = nx->first + step * nx->per_kb, end = l + nx->per_kb; l < end && l < nx->last; l++) {
        _mm_prefetch(nx->b0 + 64 * l, _MM_HINT_T1);
        _mm_prefetch(nx->b1 + 64 * l, _MM_HINT_T1);
    }
}

/* C (32 rows x 32 outputs, float32, row stride 32) over k-blocks [kb0, kb1) of the A tiles `a` and the B
 * tiles b0, b1: from zero when kb0 is 0, else on from the partial sums in c. Meanwhile the block `done`
 * (another c) is rounded out, a few rows after each k-block's products: its vector work runs while the tile
 * unit multiplies (NOTE: after this block's tile stores, it would wait for every product of the block). */
static void block_2x2(float *c, const a_tiles *a, const uint16_t *b0, const uint16_t *b1, int64_t kb0, int64_t kb1,
                      const finished_block *done, const next_chunk *nx, int64_t ldo, const uint16_t *bias) {
    const int64_t rows_per_kb = (done->rows + (kb1 - kb0) - 1) / (kb1 - kb0);
    int64_t rounded = 0;
    if (kb0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c, PAIR_N * 4);
        _tile_loadd(1, c + 16, PAIR_N * 4);
        _tile_loadd(2, c + 16 * PAIR_N, PAIR_N * 4);
        _tile_loadd(3, c + 16 * PAIR_N + 16, PAIR_N * 4);
    }
    for (int64_t kb = kb0; kb < kb1; kb++) {
        _tile_stream_loadd(4, a->a0 + kb * a->step, a->stride);
        _tile_loadd(6, b0 + kb * B_TILE, 64);
        _tile_loadd(7, b1 + kb * B_TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stream_loadd(5, a->a1 + kb * a->step, a->stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        ask_next(nx, kb - kb0);
        if (rounded < done->rows) {
            const int64_t next = done->rows - rounded < rows_per_kb ? done->rows : rounded + rows_per_kb;
            round_out(done, rounded, next, ldo, bias);
            rounded = next;
        }
    }
    _tile_stored(0, c, PAIR_N * 4);
    _tile_stored(1, c + 16, PAIR_N * 4);
    _tile_stored(2, c + 16 * PAIR_N, PAIR_N * 4);
    _tile_stored(3, c + 16 * PAIR_N + 16, PAIR_N * 4);
}

/* out[m0:m1, 32 p0 : 32 p1] for rows [m0, m1) and pairs of outputs [p0, p1), in `scratch` (64-byte aligned,
 * pairs_scratch_bytes(m1 - m0, K)): MACRO_ROWS rows at a time (whole blocks read in place where the rows lie
 * on cache lines, else packed; a last block of fewer rows packed with zero rows), then per pair, per chunk of
 * k, every block of 32 rows; a block's sums are rounded out while the next block computes */
/* The B tiles of the chunk after k-blocks [kc, kc + chunk) of pair p of [p0, p1): the next chunk of p, else
 * the first of p + 1, else (`again`: more rows follow) of p0; as block rb of `blocks` asks for them */
static next_chunk chunk_after(const uint16_t *packed, int64_t up, int64_t p, int64_t p0, int64_t p1, int again,
                              int64_t kc, int64_t chunk, int64_t kblocks, int64_t rb, int64_t blocks) {
    next_chunk nx = {NULL, NULL, 0, 0, 1};
    int64_t q = p, ka = kc + chunk;
    if (ka >= kblocks) q = p + 1, ka = 0;
    if (q >= p1 && again) q = p0;
    if (q >= p1) return nx;
    const int64_t kz = kblocks - ka < chunk ? kblocks : ka + chunk, lines = (kz - ka) * B_TILE * 2 / 64;
    const int64_t share = (lines + blocks - 1) / blocks, ours = kc + chunk < kblocks ? chunk : kblocks - kc;
    const uint16_t *b0 = packed + ((up ? q : 2 * q) * kblocks + ka) * B_TILE;
    nx.b0 = (const char *)b0;
    nx.b1 = (const char *)(b0 + (up ? up : 1) * kblocks * B_TILE);
    nx.first = rb * share;
    nx.last = nx.first + share < lines ? nx.first + share : lines;
    nx.per_kb = (share + ours - 1) / ours;
    return nx;
}

static void rows_times_pairs(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                             const uint16_t *bias, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int64_t N,
                             int64_t K, void *scratch, int stream, int64_t up) {
    const int64_t kblocks = K / TILE_K, c_block = BIG_ROWS * PAIR_N;
    const int64_t chunks = (kblocks + K_CHUNK - 1) / K_CHUNK, chunk = (kblocks + chunks - 1) / chunks;
    const int64_t most = m1 - m0 < MACRO_ROWS ? (m1 - m0 + BIG_ROWS - 1) / BIG_ROWS * BIG_ROWS : MACRO_ROWS;
    const int in_place = (ldx * 2) % 64 == 0 && (uintptr_t)x % 64 == 0;
    uint16_t *ap = scratch;
    float *c = (float *)(ap + most * K);
    finished_block done = {out, c, 0, 0, 0, 0, 0};
    for (int64_t mb = m0; mb < m1; mb += MACRO_ROWS) {
        const int64_t rows = m1 - mb < MACRO_ROWS ? m1 - mb : MACRO_ROWS, blocks = (rows + BIG_ROWS - 1) / BIG_ROWS;
        const int64_t whole = rows / BIG_ROWS; /* blocks read in place (in_place), before a packed last one */
        if (!in_place)
            pack_rows(ap, x + mb * ldx, ldx, rows, blocks * BIG_ROWS, kblocks);
        else if (whole < blocks)
            pack_rows(ap + whole * 2 * kblocks * B_TILE, x + (mb + whole * BIG_ROWS) * ldx, ldx,
                      rows - whole * BIG_ROWS, BIG_ROWS, kblocks);
        for (int64_t p = p0; p < p1; p++) {
            /* the pair's two B tiles: 32 outputs from 32 p, or (`up`: gated) the gate's 16 from 16 p and the
             * up half's 16 from 16 (p + up) */
            const uint16_t *b0 = packed + (up ? p : 2 * p) * kblocks * B_TILE, *b1 = b0 + (up ? up : 1) * kblocks * B_TILE;
            const int64_t n = up ? 16 : N - p * PAIR_N < PAIR_N ? N - p * PAIR_N : PAIR_N;
            for (int64_t kc = 0; kc < kblocks; kc += chunk) {
                const int64_t ke = kblocks - kc < chunk ? kblocks : kc + chunk;
                for (int64_t rb = 0; rb < blocks; rb++) {
                    const uint16_t *rows_x = x + (mb + rb * BIG_ROWS) * ldx, *rows_p = ap + rb * 2 * kblocks * B_TILE;
                    const int packed_block = !in_place || rb == whole;
                    const a_tiles a = packed_block ? (a_tiles){rows_p, rows_p + kblocks * B_TILE, B_TILE, 64}
                                                   : (a_tiles){rows_x, rows_x + TILE_ROWS * ldx, TILE_K, ldx * 2};
                    float *cb = c + rb * c_block;
                    if (done.c == cb) { /* one block of rows: this one's sums go where the last one's wait */
                        round_out(&done, 0, done.rows, ldo, bias);
                        done.rows = 0;
                    }
                    const next_chunk nx =
                        chunk_after(packed, up, p, p0, p1, mb + MACRO_ROWS < m1, kc, chunk, kblocks, rb, blocks);
                    block_2x2(cb, &a, b0, b1, kc, ke, &done, &nx, ldo, bias);
                    done.rows = 0;
                    if (ke == kblocks) {
                        const int64_t r0 = rb * BIG_ROWS, left = rows - r0 < BIG_ROWS ? rows - r0 : BIG_ROWS;
                        done = (finished_block){out + (mb + r0) * ldo, cb,   up ? 16 * p : p * PAIR_N, n, left,
                                                stream && !up && n == PAIR_N, up != 0};
                    }
                }
            }
        }
        round_out(&done, 0, done.rows, ldo, bias); /* before the next macro block's rows overwrite c */
        done.rows = 0;
    }
#if VECTOR_ROUNDING
    if (stream) _mm_sfence(); /* the streamed rows in memory before anyone reads them */
#endif
}

/* This thread's share of more than 16 rows (amx_gemm_share), or (`up` > 0) of SwiGLU's gate over the pairs of
 * 16 gate and 16 up outputs, the up half `up` tile columns after the gate's */
static int pairs_share(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                       const uint16_t *bias, int64_t M, int64_t N, int64_t K, void *scratch, int64_t up) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t pairs = up ? up : (N + PAIR_N - 1) / PAIR_N, blocks = (M + BIG_ROWS - 1) / BIG_ROWS;
    /* a large output goes to memory past the caches, where whole cache lines (no read for ownership) */
    const int stream = M * N * 2 >= STREAM_BYTES && (ldo * 2) % 64 == 0 && (uintptr_t)out % 64 == 0;
    if (blocks >= SPLIT_ROWS * threads) {
        /* the rows, MACRO_ROWS at a time to whichever thread is free (as amx_qgemm.c's items: a core slowed by
         * another tenant does not hold the others at the barrier); each reads all of W per MACRO_ROWS rows
         * either way */
        const int64_t units = (M + MACRO_ROWS - 1) / MACRO_ROWS;
        int failed = 0;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t u = 0; u < units; u++) {
            const int64_t m0 = u * MACRO_ROWS, m1 = m0 + MACRO_ROWS < M ? m0 + MACRO_ROWS : M;
            if (scratch)
                rows_times_pairs(out, ldo, x, ldx, packed, bias, m0, m1, 0, pairs, N, K, scratch, stream, up);
            else
                failed = 1;
        }
        return failed ? -1 : 0;
    }
    const int64_t p0 = pairs * t / threads, p1 = pairs * (t + 1) / threads;
    if (p0 >= p1) return 0;
    if (scratch == NULL) return -1;
    rows_times_pairs(out, ldo, x, ldx, packed, bias, 0, M, p0, p1, N, K, scratch, stream, up);
    return 0;
}

/* This thread's share of out [M, N] = x [M, K] W^T (+ bias), called by every thread of an OpenMP region that
 * has configured its tiles (cbserve_amx_gemm's, the decode stack's), no barrier after it: up to 16 rows, items
 * of 64 outputs (or halves: rows16_item_outputs); more, the rows (from SPLIT_ROWS blocks a thread: each reads
 * all of W once per MACRO_ROWS rows) or pairs of outputs (each reads its part of W, and every row).
 * `scratch`: amx_scratch_bytes(M, K), this thread's. Returns 0, -1 where it was needed and is NULL. */
static int amx_gemm_share(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                          const uint16_t *bias, int64_t M, int64_t N, int64_t K, void *scratch) {
    const int64_t threads = omp_get_num_threads();
    int failed = 0;
    if (M <= TILE_ROWS) {
        const int64_t width = rows16_item_outputs(N, threads);
        const int64_t items = (N + GROUP_N - 1) / GROUP_N * GROUP_N / width;
        int64_t lda = 0;
        const uint16_t *a = scratch || M == TILE_ROWS ? rows_tiles(x, ldx, M, TILE_ROWS, K, scratch, &lda) : NULL;
        /* guided, as amx_qgemm.c's items */
#pragma omp for schedule(guided) nowait
        for (int64_t i = 0; i < items; i++) {
            if (a)
                rows16_times_item(out, ldo, a, lda, packed, bias, M, N, K, i, width);
            else
                failed = 1;
        }
        return failed ? -1 : 0;
    }
    return pairs_share(out, ldo, x, ldx, packed, bias, M, N, K, scratch, 0);
}

/* this thread's scratch, kept from call to call (kept_buffer.h) */
static __thread kept_buffer thread_scratch;

/* out [M, N] bfloat16 (row stride ldo) = x [M, K] bfloat16 (row stride ldx) W^T (+ bias [N]); returns 0,
 * or -1 when a scratch block cannot be allocated. */
int cbserve_amx_gemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                     const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    const int one_group = M <= TILE_ROWS && N <= GROUP_N;
    int failed = 0;
#pragma omp parallel if (!one_group && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        void *scratch = kept_alloc(&thread_scratch, amx_scratch_bytes(M, K));
        configure_tiles();
        failed = amx_gemm_share(out, ldo, x, ldx, packed, bias, M, N, K, scratch) != 0;
        _tile_release();
    }
    return failed ? -1 : 0;
}

/* SwiGLU's matmul and gate in one: out [M, inter] bfloat16 (row stride ldo) = silu(g) * u, where [g | u] =
 * x [M, K] W^T for the packed W [2 inter, K] of a gated MLP's fused gate and up projections (no bias): the
 * bits of cbserve_amx_gemm then cpu_ops.c's silu_and_mul, without writing [g | u] out and reading it back.
 * Returns 0; -1 when a scratch block cannot be allocated, -2 where inter is not a multiple of 16. */
int cbserve_amx_gemm_swiglu(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                            int64_t M, int64_t inter, int64_t K) {
    if (inter % 16 || !VECTOR_ROUNDING) return -2;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        void *scratch = kept_alloc(&thread_scratch, pairs_scratch_bytes(M, K));
        configure_tiles();
        failed = pairs_share(out, ldo, x, ldx, packed, NULL, M, 2 * inter, K, scratch, inter / 16) != 0;
        _tile_release();
    }
    return failed ? -1 : 0;
}
#else
int cbserve_amx_gemm_available(void) { return 0; }

int cbserve_amx_gemm_swiglu(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                            int64_t M, int64_t inter, int64_t K) {
    (void)out, (void)ldo, (void)x, (void)ldx, (void)packed, (void)M, (void)inter, (void)K;
    return -1;
}

int cbserve_amx_gemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                     const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    (void)out, (void)ldo, (void)x, (void)ldx, (void)packed, (void)bias, (void)M, (void)N, (void)K;
    (void)store_rows, (void)amx_scratch_bytes;
    return -1;
}
#endif
