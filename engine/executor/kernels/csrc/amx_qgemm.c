/* bfloat16 y = x W^T (+ b) on Intel AMX tiles for the rows of decode steps, reading a W that the checkpoint
 * stored in 32-weight blocks of integer codes (a GGUF's Q4_0, Q4_1, Q8_0: engine/executor/kernels/block_codes.py)
 * in those blocks: 0.63 (4-bit codes) or 1.06 (8-bit) bytes a weight instead of bfloat16's 2.
 *
 * A decode step reads every weight once for a few rows: it is bound by memory and by the work of turning
 * codes into something the tile unit multiplies, not by the tile unit. Two ways, one per code width:
 *
 * 4-bit codes (any number of rows, 16 at a time): the tile unit multiplies the codes themselves, each B tile
 * (16 outputs x 32 k: one block per output) holding bfloat16 1 + c / 16 -- the code's bits OR-ed into the
 * mantissa of 1.0, exact -- and the block's scale d and offset m (float16) are applied to the tile's float32
 * sums after it, per block:
 *
 *   sum_k x_k (d c_k + m)  =  D S + C X,   S = sum_k x_k (1 + c_k / 16),  X = sum_k x_k,
 *                                          D = 16 d,  C = m - D
 *
 *   y = round_to_bfloat16(bias + sum over blocks in order of k of (acc = fma(D, S, fma(C, X, acc))))
 *
 * S from one TDPBF16PS per block (its products exact), X from one TDPBF16PS of the rows against a tile of
 * ones: the weights are the checkpoint's d c + m, not rounded to bfloat16. A row's result depends only on
 * the row (the sums are per row, in a fixed order), whatever the other rows of the call or the thread split,
 * but it is not the bits of the bfloat16 weights' product (amx_gemm.c): the model's prefill rows take that,
 * its decode rows always this (engine/executor/kernels/row_split.py), so a sequence's results still do not
 * depend on its batch.
 *
 * 8-bit codes (the output head; at most QROWS rows): each B tile is expanded into the bfloat16 weights that
 * the model loaded, in L1, just before TDPBF16PS reads it:
 *
 *   w = round_to_bfloat16(d * code)
 *
 * d float16, widened; the product of a float16 and a code of at most 8 bits is exact in float32, so the one
 * rounding gives block_codes.py's float32 weight bit for bit, and rounding it to nearest even gives the
 * bfloat16 weight the model loaded (fast_paths.py checks the two agree before it packs a weight so). Its
 * values are never float32 denormals, where VCVTNE2PS2BF16 would differ from torch's conversion. The
 * products are amx_gemm.c's: every output one chain of TDPBF16PS over k in order from zero, then the bias
 * and one rounding -- the bits of amx_gemm.c's kernel over the bfloat16 weights, whatever the rows around a
 * row (tests/model/test_amx_qgemm.py).
 *
 *   packed: [N_pad / 16][K / 32][tile]       (N padded with zero codes and scales to a multiple of 64)
 *     4-bit tile:  256 bytes of codes, then 16 float16 d and 16 float16 m (one per output)       320 bytes
 *                  each 64 bytes of codes are 4 tile rows: in 128-bit lane l, bytes 0-7 and 8-15 hold
 *                  words 8l .. 8l + 7 of the group's first two rows (low nibbles) and of its last two
 *                  (high nibbles) -- the order of VPUNPCKLBW / VPUNPCKHBW (expand_q4)
 *     8-bit tile:  16 rows x 32 bytes (code + 128), then 16 float16 d                            544 bytes
 *     a tile row p (k-pair p) as the B tile holds it: 32 codes c(n, 2p), c(n, 2p + 1) for n = 0..15
 *   8-bit, up to 16 rows: items of 64 outputs (or 32: amx_gemm.c's rows16_item_outputs), one A tile, 4 B
 *   tiles; 17-32 rows: items of 32 outputs, two A tiles, 2 B tiles
 *   4-bit: items of 16 outputs per 16 rows
 *
 * The B tiles of a k-block are expanded into one of two buffers, in turn, so the next block's expansion does
 * not write where the tile unit still reads.
 */
#include "amx_gemm.c"

#define QROWS 32                                   /* rows of an 8-bit call at most: two A tiles */
#define Q4_TILE_BYTES (TILE_K / 2 * TILE_N + 4 * TILE_N) /* 256 bytes of codes, 16 d and 16 m (float16) */
#define Q8_TILE_BYTES (TILE_K * TILE_N + 2 * TILE_N)     /* 512 bytes of codes, 16 d */
#define Q4_MAX_K 16384                             /* k of a 4-bit call at most (its rows' block sums) */

int cbserve_amx_qgemm_rows(void) { return QROWS; }
int cbserve_amx_qgemm_max_k(void) { return Q4_MAX_K; }
/* bytes of one quantized tile: 4-bit codes with offsets, or 8-bit */
static inline int64_t qtile_bytes(int offsets) { return offsets ? Q4_TILE_BYTES : Q8_TILE_BYTES; }
int cbserve_amx_qgemm_tile_bytes(int offsets) { return (int)qtile_bytes(offsets); }

#if HAVE_AMX && defined(__AVX512BF16__)
#define HAVE_AMX_Q 1

/* ---- 4-bit codes: the tile unit multiplies the codes, the scales follow per block ---- */

/* a B tile of the codes as bfloat16 1 + c / 16 = 0x3F80 | c << 3, from its 256 code bytes (4 rows per 64
 * bytes: the header's layout): each byte's low nibble (then its high) moved to bits 3-6 and 0x80 set, then
 * interleaved with 0x3F bytes */
static inline void expand_q4(uint16_t *restrict dst, const uint8_t *restrict src) {
    const __m512i bits = _mm512_set1_epi8(0x78), low = _mm512_set1_epi8((char)0x80), high = _mm512_set1_epi8(0x3F);
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(src + 64 * g);
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), bits, low, 0xEA); /* (a & b) | c */
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), bits, low, 0xEA);
        _mm512_store_si512(dst + 32 * (4 * g), _mm512_unpacklo_epi8(lo, high));
        _mm512_store_si512(dst + 32 * (4 * g + 1), _mm512_unpackhi_epi8(lo, high));
        _mm512_store_si512(dst + 32 * (4 * g + 2), _mm512_unpacklo_epi8(hi, high));
        _mm512_store_si512(dst + 32 * (4 * g + 3), _mm512_unpackhi_epi8(hi, high));
    }
}

/* x_sums[kb * 16 + r] = X of row r and k-block kb: the 16 rows of A (byte stride lda) times a tile of ones
 * (tile 6), one TDPBF16PS per block */
static void q4_row_sums(float *x_sums, const uint16_t *a, int64_t lda, int64_t kblocks) {
    uint16_t ones[B_TILE] __attribute__((aligned(64)));
    float c[TILE_ROWS * TILE_N] __attribute__((aligned(64)));
    for (int i = 0; i < B_TILE; i++) ones[i] = 0x3F80;
    _tile_loadd(6, ones, 64);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * TILE_K, lda);
        _tile_zero(2);
        _tile_dpbf16ps(2, 4, 6);
        _tile_stored(2, c, 64);
        for (int r = 0; r < TILE_ROWS; r++) x_sums[kb * TILE_ROWS + r] = c[r * TILE_N];
    }
}

/* acc[r] = fma(D, S[r], fma(C, X[r], acc[r])) for the 16 rows: one block's sums S (the stored tile) scaled */
static inline __attribute__((always_inline)) void q4_apply_block(__m512 *acc, const float *s, const uint8_t *tile,
                                                                 const float *x_sums) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + TILE_K / 2 * TILE_N)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + TILE_K / 2 * TILE_N + 32)));
    const __m512 D = _mm512_mul_ps(d, _mm512_set1_ps(16.0f)), C = _mm512_sub_ps(m, D);
    for (int r = 0; r < TILE_ROWS; r++)
        acc[r] = _mm512_fmadd_ps(D, _mm512_load_ps(s + TILE_N * r), _mm512_fmadd_ps(C, _mm512_set1_ps(x_sums[r]), acc[r]));
}

/* One k-block of q4_column: the block's A and B tiles (4 and 5, or 6 and 7 on odd blocks: a tile register is
 * not renamed, so the next block's loads need not wait for this product to read them) times into C tile CT,
 * the next block's B tile expanded meanwhile; and the sums of the block Q4_DRAIN behind it (in tile DT =
 * (CT + 1) % 4, three products ago: a product's sums take that long to be ready) stored and scaled. Tile
 * numbers are literals. */
#define Q4_BLOCK(CT, DT, AT, BT, ODD)                                                                               \
    if (kb < kblocks) {                                                                                    \
        _tile_loadd(AT, a + kb * TILE_K, lda);                                                             \
        _tile_loadd(BT, bufs + (kb & 3) * B_TILE, 64);                                                     \
        _tile_zero(CT);                                                                                    \
        _tile_dpbf16ps(CT, AT, BT);                                                                        \
        if (kb + Q4_AHEAD < kblocks)                                                                       \
            expand_q4(bufs + ((kb + Q4_AHEAD) & 3) * B_TILE, q + (kb + Q4_AHEAD) * Q4_TILE_BYTES);             \
        prefetch_q4(q + (kb + Q4_PREFETCH) * Q4_TILE_BYTES);                                                 \
    }                                                                                                      \
    if (kb >= Q4_DRAIN && kb - Q4_DRAIN < kblocks) {                                                       \
        _tile_stored(DT, s, 64);                                                                           \
        q4_apply_block(acc, s, q + (kb - Q4_DRAIN) * Q4_TILE_BYTES, x_sums + (kb - Q4_DRAIN) * TILE_ROWS);  \
    }                                                                                                      \
    kb++;
#define Q4_DRAIN 3 /* blocks between a product and the scaling of its sums */
#define Q4_PREFETCH 4 /* blocks a tile's codes are asked for ahead of their product (the 30 layers' gate and up
                       * projections at 16 rows, interleaved: 10% faster than the hardware's prefetch alone) */

/* ask for a tile's 320 bytes into L1 (past the end of a column: the next column's, or harmless) */
static inline void prefetch_q4(const uint8_t *tile) {
    for (int l = 0; l < Q4_TILE_BYTES; l += 64) __builtin_prefetch(tile + l, 0, 3);
}
#define Q4_AHEAD 2 /* blocks a B tile is expanded ahead of its product: a tile load of lines that the stores have
                      * only just written waits for them (measured: 1 ahead 81 cycles a tile, 2 ahead 63) */

/* c (16 rows x 16 outputs, float32) = the 16 rows of A (tile-ready, byte stride lda) times the 16 outputs whose
 * k-blocks' tiles start at q: per block the codes' product into C tiles 0-3 in turn, each stored and scaled
 * into the rows' sums three blocks later, in order of k */
static void q4_column(float *c, const uint16_t *a, int64_t lda, const uint8_t *q, const float *x_sums,
                      int64_t kblocks, uint16_t *bufs) {
    float s[TILE_ROWS * TILE_N] __attribute__((aligned(64)));
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < Q4_AHEAD && kb < kblocks; kb++) expand_q4(bufs + kb * B_TILE, q + kb * Q4_TILE_BYTES);
    for (int64_t kb = 0; kb < kblocks + Q4_DRAIN;) {
        Q4_BLOCK(0, 1, 4, 5, 0)
        Q4_BLOCK(1, 2, 6, 7, 1)
        Q4_BLOCK(2, 3, 4, 5, 0)
        Q4_BLOCK(3, 0, 6, 7, 1)
    }
    for (int r = 0; r < TILE_ROWS; r++) _mm512_store_ps(c + TILE_N * r, acc[r]);
}

/* This thread's share of out [M, N] = x [M, K] W^T (+ bias), W in 4-bit tiles, 16 rows at a time (each
 * thread its columns of 16 outputs of each), called by every thread of a region that has configured its
 * tiles, no barrier after it. x's rows are read in place where `padded` (>= M, a multiple of 16) of them are
 * there to read (zero past M), else copied into `scratch` (padded to 16). Returns 0, -1 where the scratch is
 * needed and cannot be allocated. */
static int amx_q4gemm_share(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q,
                            const uint16_t *bias, int64_t M, int64_t padded, int64_t N, int64_t K) {
    const int64_t kblocks = K / TILE_K, columns = (N + TILE_N - 1) / TILE_N;
    float x_sums[Q4_MAX_K / TILE_K * TILE_ROWS] __attribute__((aligned(64)));
    uint16_t bufs[4 * B_TILE] __attribute__((aligned(64)));
    float c[TILE_ROWS * TILE_N] __attribute__((aligned(64)));
    int failed = 0;
    for (int64_t r0 = 0; r0 < M; r0 += TILE_ROWS) {
        const int64_t rows = M - r0 < TILE_ROWS ? M - r0 : TILE_ROWS;
        int64_t lda = ldx * 2;
        const uint16_t *a = x + r0 * ldx;
        if (r0 + TILE_ROWS > padded) { /* a copy of the last rows, zero rows after them */
            void *scratch = kept_alloc(&thread_scratch, (size_t)TILE_ROWS * K * 2);
            if (scratch == NULL) {
                failed = 1;
                break;
            }
            a = rows_tiles(a, ldx, rows, TILE_ROWS, K, scratch, &lda);
        }
        q4_row_sums(x_sums, a, lda, kblocks);
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < columns; j++) {
            const int64_t n0 = j * TILE_N;
            q4_column(c, a, lda, q + j * kblocks * Q4_TILE_BYTES, x_sums, kblocks, bufs);
            store_rows(out + r0 * ldo, ldo, c, TILE_N, bias, n0, N - n0 < TILE_N ? N - n0 : TILE_N, rows);
        }
    }
    return failed ? -1 : 0;
}

/* ---- 8-bit codes: expanded to the loaded bfloat16 weights ---- */

/* The tile rows are expanded without a conversion from integers: a code's byte is put into the mantissa of
 * 1.0f (one byte shuffle, one AND-OR), so f = 1 + code * 2^-15 exactly, and the weight is one multiply-add
 *
 *   d * code  =  D * f + C,   D = d * 2^15,  C = -D - 128 d   (codes stored as code + 128)
 *
 * with the product exact inside the FMA and C exact in float32: the same single rounding as block_codes.py's.
 * A row's 32 results go to the tile as VCVTNE2PS2BF16 concatenates them: the codes are stored in that order
 * (amx_qgemm.py), so no lane is moved after the rounding. */

/* The shuffle: dword j of a row takes byte j of the 16 broadcast to every 128-bit lane, at bits 8-15. Bytes
 * of 0x80 give zeros. */
static inline __m512i byte_places(void) {
    int32_t place[16] __attribute__((aligned(64)));
    for (int32_t j = 0; j < 16; j++) place[j] = (int32_t)(0x80800080u | (uint32_t)j << 8);
    return _mm512_load_si512(place);
}

/* a vector of 1 + (the bits of v selected by mask) as float32 */
static inline __m512 mantissa_of(__m512i v, __m512i mask) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, mask, _mm512_set1_epi32(0x3F800000), 0xEA));
}

/* Each lane's per-output value of a tile's 16 (float16): lanes 2i and 2i + 1 take output i (+ 8 for `high`) */
static inline __m512 per_lane(const uint8_t *halves, int high) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)halves));
    const __m512i lane = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(high ? _mm512_add_epi32(lane, _mm512_set1_epi32(8)) : lane, v);
}

/* a B tile (16 rows of k-pairs x 16 outputs, bfloat16) from its 8-bit tile (codes + 128) */
static inline void expand_q8(uint16_t *restrict dst, const uint8_t *restrict src) {
    const __m512 e1 = per_lane(src + 512, 0), e2 = per_lane(src + 512, 1);
    const __m512 d1 = _mm512_mul_ps(e1, _mm512_set1_ps(32768.0f)), d2 = _mm512_mul_ps(e2, _mm512_set1_ps(32768.0f));
    const __m512 c1 = _mm512_mul_ps(e1, _mm512_set1_ps(-32896.0f)), c2 = _mm512_mul_ps(e2, _mm512_set1_ps(-32896.0f));
    const __m512i places = byte_places(), byte = _mm512_set1_epi32(0xFF00);
    for (int p = 0; p < TILE_K / 2; p++) {
        const __m512i lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 32 * p)));
        const __m512i hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 32 * p + 16)));
        const __m512 w1 = _mm512_fmadd_ps(d1, mantissa_of(_mm512_shuffle_epi8(lo, places), byte), c1);
        const __m512 w2 = _mm512_fmadd_ps(d2, mantissa_of(_mm512_shuffle_epi8(hi, places), byte), c2);
        _mm512_store_si512(dst + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(w2, w1));
    }
}

/* C (16 * atiles rows x 16 * ntiles outputs, float32, row stride GROUP_N) = A x the B tiles of `ntiles`
 * consecutive 16-output tiles at q, over every k-block (literals at each call: 1 x 4 or 2 x 2). A: rows
 * 0-15 at a (byte stride lda), rows 16-31 16 rows further. A k-block's tiles are expanded into one of two
 * buffers while the tile unit multiplies the previous block's from the other. */
static inline __attribute__((always_inline)) void qtiles_times(float *c, const uint16_t *a, int64_t lda,
                                                              const uint8_t *q, int64_t kblocks, uint16_t *bufs,
                                                              const int atiles, const int ntiles) {
    const int64_t q_stride = kblocks * Q8_TILE_BYTES;
    const uint16_t *a1 = a + TILE_ROWS * (lda / 2);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int j = 0; j < ntiles; j++) expand_q8(bufs + j * B_TILE, q + j * q_stride);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b = bufs + (kb & 1) * 4 * B_TILE;
        uint16_t *next = bufs + (~kb & 1) * 4 * B_TILE;
        const uint8_t *qn = q + (kb + 1) * Q8_TILE_BYTES;
        const int more = kb + 1 < kblocks;
        _tile_loadd(4, a + kb * TILE_K, lda);
        if (atiles == 1) {
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (more) expand_q8(next, qn);
            _tile_loadd(6, b + B_TILE, 64);
            _tile_dpbf16ps(1, 4, 6);
            if (more) expand_q8(next + B_TILE, qn + q_stride);
            if (ntiles == 4) {
                _tile_loadd(7, b + 2 * B_TILE, 64);
                _tile_dpbf16ps(2, 4, 7);
                if (more) expand_q8(next + 2 * B_TILE, qn + 2 * q_stride);
                _tile_loadd(5, b + 3 * B_TILE, 64);
                _tile_dpbf16ps(3, 4, 5);
                if (more) expand_q8(next + 3 * B_TILE, qn + 3 * q_stride);
            }
        } else {
            _tile_loadd(5, a1 + kb * TILE_K, lda);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (more) expand_q8(next, qn);
            _tile_loadd(7, b + B_TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
            if (more) expand_q8(next + B_TILE, qn + q_stride);
        }
    }
    if (atiles == 1) {
        _tile_stored(0, c, GROUP_N * 4);
        _tile_stored(1, c + 16, GROUP_N * 4);
        if (ntiles == 4) {
            _tile_stored(2, c + 32, GROUP_N * 4);
            _tile_stored(3, c + 48, GROUP_N * 4);
        }
    } else {
        _tile_stored(0, c, GROUP_N * 4);
        _tile_stored(1, c + 16, GROUP_N * 4);
        _tile_stored(2, c + TILE_ROWS * GROUP_N, GROUP_N * 4);
        _tile_stored(3, c + TILE_ROWS * GROUP_N + 16, GROUP_N * 4);
    }
}

/* outputs [i * width, i * width + width) of the M <= 32 rows of the A tiles `a` */
static void qrows_times_item(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda, const uint8_t *q,
                             const uint16_t *bias, int64_t M, int64_t N, int64_t K, int64_t i, int64_t width) {
    const int64_t kblocks = K / TILE_K, n0 = i * width;
    if (n0 >= N) return; /* the zero outputs past N of the last group */
    float c[QROWS * GROUP_N] __attribute__((aligned(64)));
    uint16_t bufs[2 * 4 * B_TILE] __attribute__((aligned(64)));
    const uint8_t *qn = q + n0 / TILE_N * kblocks * Q8_TILE_BYTES;
    if (M > TILE_ROWS)
        qtiles_times(c, a, lda, qn, kblocks, bufs, 2, 2);
    else if (width == GROUP_N)
        qtiles_times(c, a, lda, qn, kblocks, bufs, 1, 4);
    else
        qtiles_times(c, a, lda, qn, kblocks, bufs, 1, 2);
    store_rows(out, ldo, c, GROUP_N, bias, n0, N - n0 < width ? N - n0 : width, M);
}

/* This thread's share of out [M, N] = x [M, K] W^T (+ bias) for M <= QROWS, W in 8-bit tiles, called by
 * every thread of an OpenMP region that has configured its tiles, no barrier after it. `scratch`:
 * amx_scratch_bytes(M, K), this thread's (unused where the rows fill their tiles). Returns 0, -1 where it was
 * needed and is NULL. */
static int amx_q8gemm_share(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q,
                            const uint16_t *bias, int64_t M, int64_t N, int64_t K, void *scratch) {
    const int64_t threads = omp_get_num_threads();
    const int64_t width = M <= TILE_ROWS ? rows16_item_outputs(N, threads) : PAIR_N;
    const int64_t items = (N + GROUP_N - 1) / GROUP_N * GROUP_N / width;
    const int64_t rows = M <= TILE_ROWS ? TILE_ROWS : QROWS;
    int64_t lda = 0;
    const uint16_t *a = scratch || M == rows ? rows_tiles(x, ldx, M, rows, K, scratch, &lda) : NULL;
    int failed = 0;
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < items; i++) {
        if (a)
            qrows_times_item(out, ldo, a, lda, q, bias, M, N, K, i, width);
        else
            failed = 1;
    }
    return failed ? -1 : 0;
}

int cbserve_amx_qgemm_available(void) { return amx_permitted(); }

/* out [M, N] bfloat16 (row stride ldo) = x [M, K] bfloat16 (row stride ldx) W^T (+ bias [N]), W in quantized
 * tiles (`offsets` 1: 4-bit tiles, any M, K <= Q4_MAX_K; 0: 8-bit, M <= QROWS). Returns 0, -1 when a scratch
 * block cannot be allocated, -2 for a shape it does not take. */
int cbserve_amx_qgemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q, int offsets,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    if (offsets ? K > Q4_MAX_K : M > QROWS) return -2;
    const int one_group = M <= TILE_ROWS && N <= (offsets ? TILE_N : GROUP_N);
    int failed = 0;
#pragma omp parallel if (!one_group && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        configure_tiles();
        if (offsets) {
            failed = amx_q4gemm_share(out, ldo, x, ldx, q, bias, M, M / TILE_ROWS * TILE_ROWS, N, K) != 0;
        } else {
            void *scratch = kept_alloc(&thread_scratch, amx_scratch_bytes(M, K));
            failed = amx_q8gemm_share(out, ldo, x, ldx, q, bias, M, N, K, scratch) != 0;
        }
        _tile_release();
    }
    return failed ? -1 : 0;
}
#else
#define HAVE_AMX_Q 0
int cbserve_amx_qgemm_available(void) { return 0; }

int cbserve_amx_qgemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q, int offsets,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    (void)out, (void)ldo, (void)x, (void)ldx, (void)q, (void)offsets, (void)bias, (void)M, (void)N, (void)K;
    return -1;
}
#endif
