/* bfloat16 y = x W^T (+ b) on Intel AMX tiles, for up to 32 rows, reading a W that the checkpoint stored in
 * 32-weight blocks of integer codes (a GGUF's Q4_0, Q4_1, Q8_0: engine/executor/kernels/block_codes.py) in
 * those blocks: 0.63 (4-bit codes) or 1.06 (8-bit) bytes a weight instead of bfloat16's 2.
 *
 * A decode step reads every weight once for a few rows: it is bound by memory, not by the tile unit. So each
 * B tile (16 outputs x 32 k) is expanded from its codes into bfloat16, in L1, just before TDPBF16PS reads it:
 *
 *   w = round_to_bfloat16(d * code + m)      (8-bit codes: d * code)
 *
 * d and m are float16 (each output's per 32 k), widened; the product of a float16 and a code of at most 8 bits
 * is exact in float32, so the one rounding of the multiply-add gives block_codes.py's float32 weight bit for
 * bit, and rounding it to nearest even gives the bfloat16 weight the model loaded (fast_paths.py checks the
 * two agree before it packs a weight so). Its values are never float32 denormals (a sum of multiples of
 * float16's smallest step is 0 or at least that step), where VCVTNE2PS2BF16 would differ from torch's
 * conversion. The products are amx_gemm.c's: every output one chain of TDPBF16PS over k in order from zero,
 * then the bias and one rounding -- the bits of amx_gemm.c's kernel over the bfloat16 weights, whatever the
 * rows around a row (tests/kernels/test_amx_qgemm.py).
 *
 *   packed: [N_pad / 16][K / 32][tile]       (N padded with zero codes and scales to a multiple of 64)
 *     a tile row p (k-pair p) as the B tile holds it: 32 codes c(n, 2p), c(n, 2p + 1) for n = 0..15
 *     4-bit tile (offsets):  16 rows x 16 bytes (byte j: row code j in the low nibble, code 16 + j in the
 *                            high), then 16 float16 d and 16 float16 m (one per output)      320 bytes
 *     8-bit tile:            16 rows x 32 bytes (code + 128), then 16 float16 d            544 bytes
 *   up to 16 rows:  items of 64 outputs (or 32: amx_gemm.c's rows16_item_outputs), one A tile, 4 B tiles
 *   17-32 rows:     items of 32 outputs, two A tiles, 2 B tiles
 *
 * The B tiles of a k-block are expanded into one of two buffers, in turn, so the next block's expansion does
 * not write where the tile unit still reads.
 */
#include "amx_gemm.c"

#define QROWS 32                                   /* rows a call takes at most: two A tiles */
#define Q4_TILE_BYTES (TILE_K / 2 * TILE_N + 4 * TILE_N) /* 256 bytes of codes, 16 d and 16 m (float16) */
#define Q8_TILE_BYTES (TILE_K * TILE_N + 2 * TILE_N)     /* 512 bytes of codes, 16 d */

int cbserve_amx_qgemm_rows(void) { return QROWS; }
/* bytes of one quantized tile: 4-bit codes with offsets, or 8-bit */
static inline int64_t qtile_bytes(int offsets) { return offsets ? Q4_TILE_BYTES : Q8_TILE_BYTES; }
int cbserve_amx_qgemm_tile_bytes(int offsets) { return (int)qtile_bytes(offsets); }

#if HAVE_AMX && defined(__AVX512BF16__)
#define HAVE_AMX_Q 1

/* The tile rows are expanded without a conversion from integers: a code's byte is put into the mantissa of
 * 1.0f (one byte shuffle, one AND-OR), so f = 1 + code * 2^-s exactly, and the weight is one multiply-add
 *
 *   d * code + m  =  D * f + C,   D = d * 2^s,  C = m - D
 *
 * with the product exact inside the FMA: the same single rounding as block_codes.py's, where C is exact in
 * float32 (amx_qgemm.py packs a weight so only if every block's is; for 8-bit codes, stored as code + 128, C =
 * -(2^15 + 128) d always is). A row's 32 results go to the tile as VCVTNE2PS2BF16 concatenates them: the
 * codes are stored in that order (amx_qgemm.py), so no lane is moved after the rounding. */

/* The shuffles: dword j of a row takes byte j of the 16 broadcast to every 128-bit lane, at bits 8-15 and
 * 16-23 (4-bit: the low nibble at bits 16-19, s = 7; the high at 12-15, s = 11), or at bits 8-15 (8-bit,
 * s = 15). Bytes of 0x80 give zeros. */
static inline __m512i byte_places(int both) {
    int32_t place[16] __attribute__((aligned(64)));
    for (int32_t j = 0; j < 16; j++)
        place[j] = (int32_t)(0x80000080u | (uint32_t)j << 8 | (both ? (uint32_t)j << 16 : 0x800000u));
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

/* a B tile (16 rows of k-pairs x 16 outputs, bfloat16) from its 4-bit tile */
static inline void expand_q4(uint16_t *restrict dst, const uint8_t *restrict src) {
    const __m512 d1 = _mm512_mul_ps(per_lane(src + 256, 0), _mm512_set1_ps(128.0f));
    const __m512 d2 = _mm512_mul_ps(per_lane(src + 256, 1), _mm512_set1_ps(2048.0f));
    const __m512 c1 = _mm512_sub_ps(per_lane(src + 288, 0), d1), c2 = _mm512_sub_ps(per_lane(src + 288, 1), d2);
    const __m512i places = byte_places(1), low = _mm512_set1_epi32(0x000F0000), high = _mm512_set1_epi32(0xF000);
    for (int p = 0; p < TILE_K / 2; p++) {
        const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 16 * p)));
        const __m512i v = _mm512_shuffle_epi8(bytes, places);
        const __m512 w1 = _mm512_fmadd_ps(d1, mantissa_of(v, low), c1);
        const __m512 w2 = _mm512_fmadd_ps(d2, mantissa_of(v, high), c2);
        _mm512_store_si512(dst + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(w2, w1));
    }
}

/* a B tile from its 8-bit tile (codes + 128) */
static inline void expand_q8(uint16_t *restrict dst, const uint8_t *restrict src) {
    const __m512 e1 = per_lane(src + 512, 0), e2 = per_lane(src + 512, 1);
    const __m512 d1 = _mm512_mul_ps(e1, _mm512_set1_ps(32768.0f)), d2 = _mm512_mul_ps(e2, _mm512_set1_ps(32768.0f));
    const __m512 c1 = _mm512_mul_ps(e1, _mm512_set1_ps(-32896.0f)), c2 = _mm512_mul_ps(e2, _mm512_set1_ps(-32896.0f));
    const __m512i places = byte_places(0), byte = _mm512_set1_epi32(0xFF00);
    for (int p = 0; p < TILE_K / 2; p++) {
        const __m512i lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 32 * p)));
        const __m512i hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 32 * p + 16)));
        const __m512 w1 = _mm512_fmadd_ps(d1, mantissa_of(_mm512_shuffle_epi8(lo, places), byte), c1);
        const __m512 w2 = _mm512_fmadd_ps(d2, mantissa_of(_mm512_shuffle_epi8(hi, places), byte), c2);
        _mm512_store_si512(dst + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(w2, w1));
    }
}

static inline void expand(uint16_t *dst, const uint8_t *src, int offsets) {
    offsets ? expand_q4(dst, src) : expand_q8(dst, src);
}

/* C (16 * atiles rows x 16 * ntiles outputs, float32, row stride GROUP_N) = A x the B tiles of `ntiles`
 * consecutive 16-output tiles at q, over every k-block (literals at each call: 1 x 4 or 2 x 2). A: rows
 * 0-15 at a (byte stride lda), rows 16-31 16 rows further. A k-block's tiles are expanded into one of two
 * buffers while the tile unit multiplies the previous block's from the other. */
static inline __attribute__((always_inline)) void qtiles_times(float *c, const uint16_t *a, int64_t lda,
                                                              const uint8_t *q, int64_t kblocks, int offsets,
                                                              uint16_t *bufs, const int atiles, const int ntiles) {
    const int64_t qbytes = qtile_bytes(offsets), q_stride = kblocks * qbytes;
    const uint16_t *a1 = a + TILE_ROWS * (lda / 2);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int j = 0; j < ntiles; j++) expand(bufs + j * B_TILE, q + j * q_stride, offsets);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b = bufs + (kb & 1) * 4 * B_TILE;
        uint16_t *next = bufs + (~kb & 1) * 4 * B_TILE;
        const uint8_t *qn = q + (kb + 1) * qbytes;
        const int more = kb + 1 < kblocks;
        _tile_loadd(4, a + kb * TILE_K, lda);
        if (atiles == 1) {
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (more) expand(next, qn, offsets);
            _tile_loadd(6, b + B_TILE, 64);
            _tile_dpbf16ps(1, 4, 6);
            if (more) expand(next + B_TILE, qn + q_stride, offsets);
            if (ntiles == 4) {
                _tile_loadd(7, b + 2 * B_TILE, 64);
                _tile_dpbf16ps(2, 4, 7);
                if (more) expand(next + 2 * B_TILE, qn + 2 * q_stride, offsets);
                _tile_loadd(5, b + 3 * B_TILE, 64);
                _tile_dpbf16ps(3, 4, 5);
                if (more) expand(next + 3 * B_TILE, qn + 3 * q_stride, offsets);
            }
        } else {
            _tile_loadd(5, a1 + kb * TILE_K, lda);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (more) expand(next, qn, offsets);
            _tile_loadd(7, b + B_TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
            if (more) expand(next + B_TILE, qn + q_stride, offsets);
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
                             int offsets, const uint16_t *bias, int64_t M, int64_t N, int64_t K, int64_t i,
                             int64_t width) {
    const int64_t kblocks = K / TILE_K, n0 = i * width;
    if (n0 >= N) return; /* the zero outputs past N of the last group */
    float c[QROWS * GROUP_N] __attribute__((aligned(64)));
    uint16_t bufs[2 * 4 * B_TILE] __attribute__((aligned(64)));
    const uint8_t *qn = q + n0 / TILE_N * kblocks * qtile_bytes(offsets);
    if (M > TILE_ROWS)
        qtiles_times(c, a, lda, qn, kblocks, offsets, bufs, 2, 2);
    else if (width == GROUP_N)
        qtiles_times(c, a, lda, qn, kblocks, offsets, bufs, 1, 4);
    else
        qtiles_times(c, a, lda, qn, kblocks, offsets, bufs, 1, 2);
    store_rows(out, ldo, c, GROUP_N, bias, n0, N - n0 < width ? N - n0 : width, M);
}

/* This thread's share of out [M, N] = x [M, K] W^T (+ bias) for M <= QROWS, W in quantized tiles, called by
 * every thread of an OpenMP region that has configured its tiles, no barrier after it. `scratch`:
 * amx_scratch_bytes(M, K), this thread's (unused where the rows fill their tiles). Returns 0, -1 where it was
 * needed and is NULL. */
static int amx_qgemm_share(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q,
                           int offsets, const uint16_t *bias, int64_t M, int64_t N, int64_t K, void *scratch) {
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
            qrows_times_item(out, ldo, a, lda, q, offsets, bias, M, N, K, i, width);
        else
            failed = 1;
    }
    return failed ? -1 : 0;
}

int cbserve_amx_qgemm_available(void) { return amx_permitted(); }

/* out [M, N] bfloat16 (row stride ldo) = x [M, K] bfloat16 (row stride ldx) W^T (+ bias [N]), W in quantized
 * tiles (`offsets` 1: 4-bit tiles, 0: 8-bit); M <= QROWS. Returns 0, -1 when a scratch block cannot be
 * allocated, -2 for more than QROWS rows. */
int cbserve_amx_qgemm(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint8_t *q, int offsets,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    if (M > QROWS) return -2;
    const int one_group = M <= TILE_ROWS && N <= GROUP_N;
    int failed = 0;
#pragma omp parallel if (!one_group && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        void *scratch = kept_alloc(&thread_scratch, amx_scratch_bytes(M, K));
        configure_tiles();
        failed = amx_qgemm_share(out, ldo, x, ldx, q, offsets, bias, M, N, K, scratch) != 0;
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
