/* bfloat16 y = x W^T (+ b) on Intel AMX tiles, for up to 32 rows, reading a W that the checkpoint stored in
 * 32-weight blocks of integer codes (a GGUF's Q4_0, Q4_1, Q8_0: engine/executor/kernels/block_codes.py) in
 * those blocks: 0.63 (4-bit codes) or 1.06 (8-bit) bytes a weight instead of bfloat16's 2.
 *
 * A decode step reads every weight once for a few rows: it is bound by memory, not by the tile unit. So each
 * tile of weights (16 outputs x 32 k) is expanded from its codes into bfloat16, in L1, just before TDPBF16PS
 * reads it:
 *
 *   w = round_to_bfloat16(d * code + m)      (8-bit codes: d * code)
 *
 * d and m are float16 (each output's per 32 k), widened; the product of a float16 and a code of at most 8 bits
 * is exact in float32, so the one rounding of the multiply-add gives block_codes.py's float32 weight bit for
 * bit, and rounding it to nearest even gives the bfloat16 weight the model loaded (fast_paths.py checks the
 * two agree before it packs a weight so). Its values are never float32 denormals (a sum of multiples of
 * float16's smallest step is 0 or at least that step), where VCVTNE2PS2BF16 would differ from torch's
 * conversion.
 *
 * The weights are the A tiles (an output a tile row of 32 k) and the rows the B tiles (rows_as_b_tiles), so
 * a C tile holds 16 outputs x 16 rows. Why: an output's row of 32 weights has one d and one m, so its 16
 * possible 4-bit weights are one FMA and the codes pick from them (expand_q4) -- half the multiply-adds of
 * computing every weight, and beside a TDPBF16PS multiply-adds run at half speed where permutes, shuffles and
 * stores overlap it (python -m bench.amx_overlap; docs/BENCHMARKS.md, session 29). The products
 * are amx_gemm.c's all the same: every output one chain of TDPBF16PS over k in order from zero (each step
 * the same two products of a weight and a row's value, whichever tile holds which), then the bias and one
 * rounding -- the bits of amx_gemm.c's kernel over the bfloat16 weights, whatever the rows around a row
 * (tests/model/test_amx_qgemm.py).
 *
 *   packed: [N_pad / 16][K / 32][tile]       (N padded with zero codes and scales to a multiple of 64)
 *     4-bit tile (offsets):  8 pairs of outputs x 32 bytes (byte j: output 2i's code j in the low nibble,
 *                            2i + 1's in the high), then 16 float16 d and 16 float16 m    320 bytes
 *     8-bit tile:            16 outputs x 32 bytes (code + 128, in order of k), then 16 float16 d   544 bytes
 *   up to 16 rows:  items of 64 outputs (or 32: amx_gemm.c's rows16_item_outputs), 4 A tiles, one B tile
 *   17-32 rows:     items of 32 outputs, two A tiles, 2 B tiles
 *
 * The A tiles of a k-block are expanded into one of two buffers, in turn, so the next block's expansion does
 * not write where the tile unit still reads.
 */
#include "amx_gemm.c"
#include "transpose16.h"

#define QROWS 32                                   /* rows a call takes at most: two A tiles */
#define Q4_TILE_BYTES (TILE_K / 2 * TILE_N + 4 * TILE_N) /* 256 bytes of codes, 16 d and 16 m (float16) */
#define Q8_TILE_BYTES (TILE_K * TILE_N + 2 * TILE_N)     /* 512 bytes of codes, 16 d */

int cbserve_amx_qgemm_rows(void) { return QROWS; }
/* bytes of one quantized tile: 4-bit codes with offsets, or 8-bit */
static inline int64_t qtile_bytes(int offsets) { return offsets ? Q4_TILE_BYTES : Q8_TILE_BYTES; }
int cbserve_amx_qgemm_tile_bytes(int offsets) { return (int)qtile_bytes(offsets); }

#if HAVE_AMX && defined(__AVX512BF16__)
#define HAVE_AMX_Q 1

/* The rows as B tiles ("VNNI": a tile row p holds k-pair p of each of 16 rows), one per 16 rows and k-block:
 * tiles[g][kb] row p lane r = the 32 bits of x[16 g + r, 32 kb + 2p .. + 1]; rows from M on are zeros.
 * `groups` 1 (up to 16 rows) or 2. */
static void rows_as_b_tiles(uint16_t *tiles, const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int groups) {
    const int64_t kblocks = K / TILE_K;
    for (int g = 0; g < groups; g++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            __m512 v[16]; /* a row's 16 k-pairs, as 32-bit lanes */
            for (int r = 0; r < 16; r++) {
                const int64_t m = 16 * g + r;
                v[r] = m < M ? _mm512_loadu_ps(x + m * ldx + kb * TILE_K) : _mm512_setzero_ps();
            }
            transpose16(v);
            uint16_t *t = tiles + (g * kblocks + kb) * B_TILE;
            for (int p = 0; p < 16; p++) _mm512_store_ps(t + 32 * p, v[p]);
        }
}

/* An A tile of weights (16 outputs x 32 k, an output a row of 32 bfloat16 in order of k) from its 4-bit tile.
 * Each output's 16 possible weights of the block, round_to_bfloat16(d * code + m) for code 0..15, are one
 * FMA (exact product, one rounding: block_codes.py's float32 weights) and a rounding; the outputs' codes
 * index them (VPERMW). Outputs 2i and 2i + 1 share their 32 code bytes (2i's code in the low nibble, 2i + 1's
 * in the high) and one vector of both tables (2i + 1's in lanes 0-15, 2i's in 16-31). */
static inline void expand_q4(uint16_t *restrict dst, const uint8_t *restrict src) {
    float dm[32] __attribute__((aligned(64)));
    _mm512_store_ps(dm, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 256))));
    _mm512_store_ps(dm + 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 288))));
    __asm__ volatile("" ::"r"(dm) : "memory"); /* each output's d and m one broadcast load, not a lane permute */
    const __m512 codes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i low = _mm512_set1_epi16(0x0F), second_half = _mm512_set1_epi16(0x10);
    for (int i = 0; i < TILE_N / 2; i++) {
        const int n = 2 * i;
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + 32 * i)));
        const __m512 even = _mm512_fmadd_ps(codes, _mm512_set1_ps(dm[n]), _mm512_set1_ps(dm[16 + n]));
        const __m512 odd = _mm512_fmadd_ps(codes, _mm512_set1_ps(dm[n + 1]), _mm512_set1_ps(dm[17 + n]));
        const __m512i tables = (__m512i)_mm512_cvtne2ps_pbh(even, odd);
        const __m512i even_index = _mm512_ternarylogic_epi32(bytes, low, second_half, 0xEA); /* & low | 16 */
        _mm512_store_si512(dst + 64 * i, _mm512_permutexvar_epi16(even_index, tables));
        _mm512_store_si512(dst + 64 * i + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), tables));
    }
}

/* An A tile of weights from its 8-bit tile (codes + 128): a code's byte is put into the mantissa of 1.0f (its
 * output's 16 codes broadcast to every 128-bit lane, one byte shuffle, one AND-OR), f = 1 + code * 2^-15
 * exactly, and d * (code - 128) = D f + C with D = 2^15 d, C = -(2^15 + 128) d: an exact product and one
 * rounding inside the FMA. */
static inline void expand_q8(uint16_t *restrict dst, const uint8_t *restrict src) {
    float dc[32] __attribute__((aligned(64)));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 512)));
    _mm512_store_ps(dc, _mm512_mul_ps(d, _mm512_set1_ps(32768.0f)));
    _mm512_store_ps(dc + 16, _mm512_mul_ps(d, _mm512_set1_ps(-32896.0f)));
    __asm__ volatile("" ::"r"(dc) : "memory"); /* each output's D and C one broadcast load, not a lane permute */
    int32_t place[16] __attribute__((aligned(64))); /* dword j: byte j of its 128-bit lane at bits 8-15 */
    for (int32_t j = 0; j < 16; j++) place[j] = (int32_t)(0x80800080u | (uint32_t)j << 8);
    const __m512i places = _mm512_load_si512(place), byte = _mm512_set1_epi32(0xFF00);
    const __m512i one = _mm512_set1_epi32(0x3F800000);
    for (int n = 0; n < TILE_N; n++) {
        const __m512 D = _mm512_set1_ps(dc[n]), C = _mm512_set1_ps(dc[16 + n]);
        const __m512i lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 32 * n)));
        const __m512i hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 32 * n + 16)));
        const __m512i v1 = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(lo, places), byte, one, 0xEA); /* & | */
        const __m512i v2 = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(hi, places), byte, one, 0xEA);
        const __m512 w1 = _mm512_fmadd_ps(D, _mm512_castsi512_ps(v1), C), w2 = _mm512_fmadd_ps(D, _mm512_castsi512_ps(v2), C);
        _mm512_store_si512(dst + 32 * n, (__m512i)_mm512_cvtne2ps_pbh(w2, w1));
    }
}

static inline void expand(uint16_t *dst, const uint8_t *src, int offsets) {
    offsets ? expand_q4(dst, src) : expand_q8(dst, src);
}

/* out[r, n0 + i] = round(t[i][r] + bias[n0 + i]) for outputs i < n and rows r < rows: a C tile (16 outputs x 16
 * rows, float32, stored at t) rounded out as amx_gemm.c's store_rows rounds; with `out_f32` the rounded values
 * stored widened to float32 (out a float array: a step's logits, which the sampler reads as float32) */
static void store_transposed(void *out, int64_t ldo, const float *t, const uint16_t *bias, int64_t n0, int64_t n,
                             int64_t rows, int out_f32) {
    const __mmask16 keep = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias) b = widen(_mm256_maskz_loadu_epi16(keep, bias + n0)); /* amx_gemm.c's bfloat16 -> float32 */
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_load_ps(t + 16 * i);
    transpose16(v);
    for (int64_t r = 0; r < rows; r++) {
        const __m256i rounded = to_bf16_x16(_mm512_add_ps(v[r], b));
        if (out_f32)
            _mm512_mask_storeu_ps((float *)out + r * ldo + n0, keep, widen(rounded));
        else
            _mm256_mask_storeu_epi16((uint16_t *)out + r * ldo + n0, keep, rounded);
    }
}

/* The C tiles (16 outputs x 16 rows each, float32) of `ntiles` consecutive 16-output tiles of weights at q
 * times the rows' B tiles (`groups` of 16 rows), over every k-block (literals at each call: 4 x 1, 2 x 1 or
 * 2 x 2), stored at t in turn (2 x 2: outputs 0-15 and 16-31 of rows 0-15, then of rows 16-31). A k-block's
 * tiles are expanded into one of two buffers while the tile unit multiplies the previous block's. */
static inline __attribute__((always_inline)) void qtiles_times(float *t, const uint16_t *rows, const uint8_t *q,
                                                              int64_t kblocks, int offsets, uint16_t *bufs,
                                                              const int groups, const int ntiles) {
    const int64_t qbytes = qtile_bytes(offsets), q_stride = kblocks * qbytes;
    const uint16_t *rows1 = rows + kblocks * B_TILE;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int j = 0; j < ntiles; j++) expand(bufs + j * B_TILE, q + j * q_stride, offsets);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *w = bufs + (kb & 1) * 4 * B_TILE;
        uint16_t *next = bufs + (~kb & 1) * 4 * B_TILE;
        const uint8_t *qn = q + (kb + 1) * qbytes;
        const int more = kb + 1 < kblocks;
        _tile_loadd(4, rows + kb * B_TILE, 64);
        if (groups == 1) {
            _tile_loadd(5, w, 64);
            _tile_dpbf16ps(0, 5, 4);
            if (more) expand(next, qn, offsets);
            _tile_loadd(6, w + B_TILE, 64);
            _tile_dpbf16ps(1, 6, 4);
            if (more) expand(next + B_TILE, qn + q_stride, offsets);
            if (ntiles == 4) {
                _tile_loadd(7, w + 2 * B_TILE, 64);
                _tile_dpbf16ps(2, 7, 4);
                if (more) expand(next + 2 * B_TILE, qn + 2 * q_stride, offsets);
                _tile_loadd(5, w + 3 * B_TILE, 64);
                _tile_dpbf16ps(3, 5, 4);
                if (more) expand(next + 3 * B_TILE, qn + 3 * q_stride, offsets);
            }
        } else {
            _tile_loadd(6, w, 64);
            _tile_loadd(7, w + B_TILE, 64);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 7, 4);
            if (more) expand(next, qn, offsets);
            _tile_loadd(5, rows1 + kb * B_TILE, 64);
            _tile_dpbf16ps(2, 6, 5);
            _tile_dpbf16ps(3, 7, 5);
            if (more) expand(next + B_TILE, qn + q_stride, offsets);
        }
    }
    _tile_stored(0, t, 64);
    _tile_stored(1, t + 256, 64);
    if (groups == 2 || ntiles == 4) {
        _tile_stored(2, t + 512, 64);
        _tile_stored(3, t + 768, 64);
    }
}

/* outputs [i * width, i * width + width) of the M <= 32 rows, given as B tiles (rows_as_b_tiles) */
static void qrows_times_item(void *out, int64_t ldo, const uint16_t *rows, const uint8_t *q, int offsets,
                             const uint16_t *bias, int64_t M, int64_t N, int64_t K, int64_t i, int64_t width,
                             int out_f32) {
    const int64_t kblocks = K / TILE_K, n0 = i * width;
    if (n0 >= N) return; /* the zero outputs past N of the last group */
    float t[4 * 256] __attribute__((aligned(64)));
    uint16_t bufs[2 * 4 * B_TILE] __attribute__((aligned(64)));
    const uint8_t *qn = q + n0 / TILE_N * kblocks * qtile_bytes(offsets);
    if (M > TILE_ROWS)
        qtiles_times(t, rows, qn, kblocks, offsets, bufs, 2, 2);
    else if (width == GROUP_N)
        qtiles_times(t, rows, qn, kblocks, offsets, bufs, 1, 4);
    else
        qtiles_times(t, rows, qn, kblocks, offsets, bufs, 1, 2);
    /* 1 x 4 or 1 x 2: tile j outputs 16 j of rows 0-15; 2 x 2: tiles 0, 1 outputs 0, 16 of rows 0-15, 2, 3 of 16-31 */
    const int tiles = M > TILE_ROWS ? 4 : (int)(width / TILE_N);
    for (int j = 0; j < tiles; j++) {
        const int64_t group = M > TILE_ROWS && j >= 2, first = n0 + TILE_N * (M > TILE_ROWS ? j & 1 : j);
        const int64_t rows_left = M - TILE_ROWS * group;
        const int64_t offset = group * TILE_ROWS * ldo * (out_f32 ? 4 : 2); /* bytes to the row group */
        if (first < N)
            store_transposed((char *)out + offset, ldo, t + 256 * j, bias, first, N - first,
                             rows_left < TILE_ROWS ? rows_left : TILE_ROWS, out_f32);
    }
}

/* This thread's share of out [M, N] = x [M, K] W^T (+ bias) for M <= QROWS, W in quantized tiles, called by
 * every thread of an OpenMP region that has configured its tiles, no barrier after it. `scratch`:
 * amx_scratch_bytes(M, K), this thread's (room for the rows as B tiles: 1 KB per 32 k of each 16 rows, as for
 * amx_gemm.c's zero-padded A tiles). Returns 0, -1 where it is NULL. */
static int amx_qgemm_share(void *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q,
                           int offsets, const uint16_t *bias, int64_t M, int64_t N, int64_t K, void *scratch,
                           int out_f32) {
    const int64_t threads = omp_get_num_threads();
    const int64_t width = M <= TILE_ROWS ? rows16_item_outputs(N, threads) : PAIR_N;
    const int64_t items = (N + GROUP_N - 1) / GROUP_N * GROUP_N / width;
    if (scratch) rows_as_b_tiles(scratch, x, ldx, M, K, M <= TILE_ROWS ? 1 : 2);
    int failed = 0;
    /* guided: each thread a long run of items first, the rest in ever smaller runs to whichever is free, so a
     * core slowed by another tenant does not hold the others at the barrier (the static split's threads were
     * busy 0.6:1 at times on the 2-core VM: docs/BENCHMARKS.md, session 29); an item is whole outputs, so its
     * bits do not depend on the thread */
#pragma omp for schedule(guided) nowait
    for (int64_t i = 0; i < items; i++) {
        if (scratch)
            qrows_times_item(out, ldo, scratch, q, offsets, bias, M, N, K, i, width, out_f32);
        else
            failed = 1;
    }
    return failed ? -1 : 0;
}

int cbserve_amx_qgemm_available(void) { return amx_permitted(); }

/* out [M, N] bfloat16 (row stride ldo) = x [M, K] bfloat16 (row stride ldx) W^T (+ bias [N]), W in quantized
 * tiles (`offsets` 1: 4-bit tiles, 0: 8-bit); M <= QROWS. With `out_f32`, out is float32: the same bfloat16
 * values widened (an output head's logits, without a second pass to widen them). Returns 0, -1 when a scratch
 * block cannot be allocated, -2 for more than QROWS rows. */
int cbserve_amx_qgemm(void *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q, int offsets,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K, int out_f32) {
    if (M > QROWS) return -2;
    const int one_group = M <= TILE_ROWS && N <= GROUP_N;
    int failed = 0;
#pragma omp parallel if (!one_group && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        void *scratch = kept_alloc(&thread_scratch, amx_scratch_bytes(M, K));
        configure_tiles();
        failed = amx_qgemm_share(out, ldo, x, ldx, q, offsets, bias, M, N, K, scratch, out_f32) != 0;
        _tile_release();
    }
    return failed ? -1 : 0;
}
#else
#define HAVE_AMX_Q 0
int cbserve_amx_qgemm_available(void) { return 0; }

int cbserve_amx_qgemm(void *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q, int offsets,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K, int out_f32) {
    (void)out, (void)ldo, (void)x, (void)ldx, (void)q, (void)offsets, (void)bias, (void)M, (void)N, (void)K;
    (void)out_f32;
    return -1;
}
#endif
