/* bfloat16 y = x W^T (+ b) on AVX512-BF16's dot products (VDPBF16PS), for CPUs that have them but no AMX
 * tiles (AMD Zen 4 and later; Intel's Cooper Lake).
 *
 * VDPBF16PS adds to each of 16 float32 lanes the products of one pair of bfloat16 values with another: the
 * pair (x[2i], x[2i+1]) of a row, broadcast, against the pairs (W[j][2i], W[j][2i+1]) of 16 outputs j. The
 * weights are packed in 16-output panels of k-pairs, one 64-byte vector a pair:
 *
 *   packed W: [ceil(N / 16)][ceil(K / 2)][16][2]   (zeros past N and, for an odd K, in the last pair)
 *   for each block of <= BROWS rows (packed k-pair-major: a block's pairs at one i lie side by side):
 *       for each two panels:  acc[m][j] += dot(x[m] pair i, W[p + j] pair i)   for every pair i in order
 *   y[m] = bfloat16(acc[m] + b)                                               (rounded to nearest even, once)
 *
 * Each output is one float32 chain over the k-pairs in order, then the bias and one rounding, whatever else
 * the call holds: a row's result never depends on its batch (the chain is the same instruction sequence for
 * a block of one row or of twelve). Per pair, two weight vectors and BROWS broadcasts feed 2 * BROWS dot
 * products: 24 accumulators, 26 of the 32 registers, as small_gemm.c's 16-float path.
 *
 * Calls of at most SHARE_MAX rows (decode steps) share out pairs of panels among the threads (each reads its
 * panels from memory once, asked for ahead; the row blocks after the first read them from L2); larger calls
 * (prefill) split the rows, each thread reading every panel, a group that fits in L2 at a time, once per
 * macro block of its rows. bf16_gemm_share is the shared-out form for callers already inside a parallel
 * region (the decode stack).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16_round.h"
#include "kept_buffer.h"
#include "transpose16.h"

#define BF16_PANEL 16   /* outputs per panel: one vector of float32 accumulators */
#ifndef BROWS
#define BROWS 12        /* rows a register block */
#endif
#ifndef BPANELS
#define BPANELS 2       /* panels a register block */
#endif
#define SHARE_MAX 64    /* calls of at most this many rows share out the panels; more split the rows */
#define BMACRO 240      /* rows a thread packs at a time when the threads split the rows */
#ifndef BLOCALITY
#define BLOCALITY 3
#endif
#ifndef BAHEAD
#define BAHEAD 16       /* k-pairs (64-byte lines of a panel) asked for ahead */
#endif
#define BGROUP_BYTES (1 << 19) /* the panels of a group, read from L2 by every block of a macro block */
#define BF16_INLINE static inline __attribute__((always_inline))

#define QMAX 32 /* rows a call over a checkpoint's blocks takes at most (bf16_gemm.py's QUANTIZED_MAX_ROWS) */
#define QK 32   /* k a block */

/* bytes of one (panel, block) of the blocks: 4-bit codes with offsets, or 8-bit (below) */
static int64_t bf16_qblock_bytes(int offsets) { return offsets ? 16 * 16 + 2 * 16 * 4 : 32 * 16 + 16 * 4; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16_DOT 1
#include <immintrin.h>

/* `rows` rows of x (bfloat16, row stride ldx) as 32-bit k-pairs, k-pair-major in blocks of BROWS:
 * xp[(b * KP + i) * BROWS + m] = (x[m, 2i], x[m, 2i + 1]) (zeros past K and past the rows). Sixteen pairs at
 * a time a 16 x 16 transpose of 32-bit lanes, the rest one pair at a time. */
static void pack_pairs(uint32_t *restrict xp, const uint16_t *x, int64_t ldx, int64_t rows, int64_t K) {
    const int64_t KP = (K + 1) / 2, full = K / 2;
    const __mmask16 lanes = (__mmask16)((1u << BROWS) - 1);
    for (int64_t b = 0; b * BROWS < rows; b++) {
        const uint16_t *block = x + b * BROWS * ldx;
        const int64_t here = rows - b * BROWS < BROWS ? rows - b * BROWS : BROWS;
        uint32_t *dst = xp + b * KP * BROWS;
        int64_t i = 0;
        for (; i + 16 <= full; i += 16) {
            __m512 r[16];
            for (int m = 0; m < 16; m++)
                r[m] = m < here ? _mm512_loadu_ps(block + m * ldx + 2 * i) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_mask_storeu_ps(dst + (i + j) * BROWS, lanes, r[j]);
        }
        for (; i < KP; i++)
            for (int m = 0; m < BROWS; m++) {
                uint32_t pair = 0;
                if (m < here) {
                    const uint16_t *row = block + m * ldx;
                    pair = 2 * i + 1 < K ? (uint32_t)row[2 * i] | (uint32_t)row[2 * i + 1] << 16 : row[2 * i];
                }
                dst[i * BROWS + m] = pair;
            }
    }
}

/* out[m, 0:16 np] = bfloat16(sum over pairs of x[m] . (np panels) + bias) for R rows of a packed block (xp);
 * the panels from p0, `stride` 32-bit pairs apart; n: the outputs of the last panel; as float32 (the rounded
 * values) into out32 instead where it is not NULL. R and np are literals at each call site. */
BF16_INLINE void block_times_panels(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp,
                                    const uint32_t *p0, int64_t stride, const uint16_t *bias, int64_t KP, int n,
                                    const int np, const int R) {
    __m512 acc[BROWS * BPANELS];
#pragma GCC unroll 32
    for (int a = 0; a < BROWS * BPANELS; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t i = 0; i < KP; i++) {
        __m512bh w[BPANELS];
#pragma GCC unroll 2
        for (int j = 0; j < np; j++) {
            __builtin_prefetch(p0 + j * stride + (i + BAHEAD) * BF16_PANEL, 0, BLOCALITY);
            w[j] = (__m512bh)_mm512_loadu_si512(p0 + j * stride + i * BF16_PANEL);
            __asm__("" : "+v"(w[j])); /* in a register: one load for every row's dot product */
        }
        const uint32_t *xi = xp + i * BROWS;
#pragma GCC unroll 16
        for (int m = 0; m < R; m++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xi[m]);
#pragma GCC unroll 2
            for (int j = 0; j < np; j++) acc[m * BPANELS + j] = _mm512_dpbf16_ps(acc[m * BPANELS + j], w[j], xb);
        }
    }
    for (int j = 0; j < np; j++) {
        const __mmask16 keep = j == np - 1 ? (__mmask16)((1u << n) - 1) : (__mmask16)0xFFFF;
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + j * BF16_PANEL)), 16))
                              : _mm512_setzero_ps();
        for (int m = 0; m < R; m++) {
            const __m512 o = bias ? _mm512_add_ps(acc[m * BPANELS + j], b) : acc[m * BPANELS + j];
            if (out32 != NULL) {
                const __m512i kept = _mm512_and_si512(bf16_rounded_x16(_mm512_castps_si512(o)),
                                                      _mm512_set1_epi32((int)0xFFFF0000u));
                _mm512_mask_storeu_ps(out32 + m * ldo + j * BF16_PANEL, keep, _mm512_castsi512_ps(kept));
            } else {
                _mm256_mask_storeu_epi16(out + m * ldo + j * BF16_PANEL, keep, to_bf16_x16(o));
            }
        }
    }
}

#define BF16_CASE(r)                                                                 \
    case r:                                                                          \
        if (np == 2 && BPANELS == 2)                                                 \
            block_times_panels(o16, o32, ldo, xp, p0, stride, b, KP, n, BPANELS, r); \
        else                                                                         \
            block_times_panels(o16, o32, ldo, xp, p0, stride, b, KP, n, 1, r); \
        break;

/* R <= BROWS rows of one packed block (xp) times the panels from p (two, or the last one), read from p0
 * (`stride` pairs apart): the block's rows of out, its columns from 16 p */
static void block_times_pair(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp, const uint32_t *p0,
                             int64_t stride, const uint16_t *bias, int64_t N, int64_t KP, int64_t p, int64_t R) {
    const int64_t panels = (N + BF16_PANEL - 1) / BF16_PANEL, np = panels - p < BPANELS ? panels - p : BPANELS;
    const int n = (int)(N - (p + np - 1) * BF16_PANEL < BF16_PANEL ? N - (p + np - 1) * BF16_PANEL : BF16_PANEL);
    const uint16_t *b = bias ? bias + p * BF16_PANEL : NULL;
    uint16_t *o16 = out32 ? NULL : out + p * BF16_PANEL;
    float *o32 = out32 ? out32 + p * BF16_PANEL : NULL;
    switch (R) {
        BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
        BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11) BF16_CASE(12)
#if BROWS > 12
        BF16_CASE(13) BF16_CASE(14)
#endif
#if BROWS > 14
        BF16_CASE(15) BF16_CASE(16)
#endif
        default: break;
    }
}

/* rows [m0, m1) (packed in xp, from its first block) times the panel pairs [q0, q1): per group of pairs that
 * fit in L2 together, per block of rows (it stays in L1 while the group's panels pass), per pair */
static void rows_times_panel_pairs(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp, const uint32_t *packed,
                             const uint16_t *bias, int64_t m0, int64_t m1, int64_t N, int64_t KP, int64_t q0,
                             int64_t q1) {
    int64_t group = BGROUP_BYTES / (BPANELS * KP * BF16_PANEL * (int64_t)sizeof(uint32_t));
    if (group < 1) group = 1;
    for (int64_t g0 = q0; g0 < q1; g0 += group) {
        const int64_t g1 = q1 - g0 < group ? q1 : g0 + group;
        for (int64_t i = 0; m0 + i * BROWS < m1; i++) {
            const int64_t r = m1 - m0 - i * BROWS < BROWS ? m1 - m0 - i * BROWS : BROWS;
            const int64_t row = (m0 + i * BROWS) * ldo;
            for (int64_t q = g0; q < g1; q++)
                block_times_pair(out32 ? NULL : out + row, out32 ? out32 + row : NULL, ldo, xp + i * KP * BROWS,
                                 packed + BPANELS * q * KP * BF16_PANEL, KP * BF16_PANEL, bias, N, KP, BPANELS * q, r);
        }
    }
}

static __thread kept_buffer pairs_scratch; /* a thread's packed rows, kept from call to call */

/* The bytes of M rows of K packed by pack_pairs */
static size_t bf16_packed_rows_bytes(int64_t M, int64_t K) {
    return sizeof(uint32_t) * (size_t)((M + BROWS - 1) / BROWS * BROWS * ((K + 1) / 2));
}

/* For the threads of a parallel region: each packs all M rows for itself into xp (its own scratch of
 * bf16_packed_rows_bytes(M, K); NULL: it takes no pairs), then they share out the pairs of panels (a pair's
 * panels come from memory once). Ends with the worksharing loop's barrier. */
static void bf16_gemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                            const uint32_t *packed, const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                            uint32_t *xp) {
    const int64_t KP = (K + 1) / 2, panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    const int64_t pairs = (panels + BPANELS - 1) / BPANELS;
    if (xp != NULL) pack_pairs(xp, x, ldx, M, K);
#pragma omp for schedule(guided) /* a slowed core does not hold the others */
    for (int64_t q = 0; q < pairs; q++)
        if (xp != NULL) rows_times_panel_pairs(out, out32, ldo, xp, packed, bias, 0, M, N, KP, q, q + 1);
}

/* More than SHARE_MAX rows: the threads split the rows (whole blocks each), each packing its own a macro
 * block at a time and reading every panel, with no thread waiting for another. */
static int bf16_gemm_split(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                           const uint32_t *packed, const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t KP = (K + 1) / 2, panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    const int64_t pairs = (panels + BPANELS - 1) / BPANELS, blocks = (M + BROWS - 1) / BROWS;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = blocks * t / threads * BROWS, r1 = blocks * (t + 1) / threads * BROWS;
        const int64_t end = r1 < M ? r1 : M;
        uint32_t *xp = r0 < M ? kept_alloc(&pairs_scratch, sizeof(uint32_t) * (size_t)(BMACRO * KP)) : NULL;
        failed = r0 < M && xp == NULL;
        for (int64_t m0 = r0; m0 < end && xp != NULL; m0 += BMACRO) {
            const int64_t m1 = m0 + BMACRO < end ? m0 + BMACRO : end;
            pack_pairs(xp, x + m0 * ldx, ldx, m1 - m0, K);
            rows_times_panel_pairs(out, out32, ldo, xp, packed, bias, m0, m1, N, KP, 0, pairs);
        }
    }
    return failed ? -1 : 0;
}

/* ---- a checkpoint's blocks (Q4_0, Q4_1, Q8_0: block_codes.py), expanded to the panels' pairs as used ----
 *
 *   qpacked W: [ceil(N / 16)][K / 32][block]
 *     4-bit block (codes 0..15 and offsets):  16 pairs x 16 outputs bytes (the even k's code in the low
 *                                             nibble, the odd k's in the high), 16 float32 d, 16 float32 m
 *     8-bit block (codes -128..127):          16 pairs x (16 outputs' even k, 16 odd k) int8, 16 float32 d
 *
 * A weight is round_to_bfloat16(d * code + m) (8-bit: d * code): the product of a float16 d and a code of at
 * most 8 bits is exact in float32, so one rounding of the multiply-add gives block_codes.py's float32 weight
 * and rounding it to nearest even the bfloat16 weight the model loaded (fast_paths.py checks that they agree
 * before it keeps the blocks; the values are never float32 denormals, where VCVTNE2PS2BF16 would flush).
 * A call of at most QMAX rows expands a pair of panels at a time into this thread's scratch (K x 64 bytes,
 * in L2) and runs the same chains over it as over the bfloat16 panels: the same bits, from 0.75 (4-bit) or
 * 1.125 (8-bit) bytes a weight instead of 2. */

/* the blocks of one panel (src: its first, kblocks of them) as its k-pairs: dst[(b * 16 + i) * 16 + j] */
static void expand_qpanel_pairs(uint32_t *restrict dst, const uint8_t *restrict src, int64_t kblocks, int offsets) {
    uint16_t order[32] __attribute__((aligned(64))); /* lane 2j: the even k of output j, 2j + 1: its odd k */
    for (int j = 0; j < 16; j++) order[2 * j] = (uint16_t)j, order[2 * j + 1] = (uint16_t)(16 + j);
    const __m512i interleave = _mm512_load_si512(order), low = _mm512_set1_epi32(0x0F);
    const int64_t bytes = bf16_qblock_bytes(offsets);
    for (int64_t b = 0; b < kblocks; b++, dst += QK / 2 * BF16_PANEL) {
        const uint8_t *block = src + b * bytes;
        if (offsets) {
            const __m512 d = _mm512_loadu_ps(block + 256), m = _mm512_loadu_ps(block + 320);
            for (int i = 0; i < QK / 2; i++) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 16 * i)));
                const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, low)), d, m);
                const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), d, m);
                _mm512_storeu_si512(dst + i * BF16_PANEL,
                                    _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even)));
            }
        } else {
            const __m512 d = _mm512_loadu_ps(block + 512);
            for (int i = 0; i < QK / 2; i++) {
                const __m128i *codes = (const __m128i *)(block + 32 * i);
                const __m512 even = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes))), d);
                const __m512 odd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 1))), d);
                _mm512_storeu_si512(dst + i * BF16_PANEL,
                                    _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even)));
            }
        }
    }
}

/* The bytes of a thread's scratch for bf16_qgemm_share: M rows of K packed, then a pair of panels expanded */
static size_t bf16_qscratch_bytes(int64_t M, int64_t K) {
    return (bf16_packed_rows_bytes(M, K) + 63) / 64 * 64 + sizeof(uint32_t) * (size_t)(BPANELS * K / 2 * BF16_PANEL);
}

/* bf16_gemm_share over the blocks (M <= QMAX, K a multiple of 32): per pair of panels, both expanded into
 * the thread's scratch (bf16_qscratch_bytes(M, K); NULL: it takes no pairs), then every block of rows. */
static void bf16_qgemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                             const uint8_t *qpacked, int offsets, const uint16_t *bias, int64_t M, int64_t N,
                             int64_t K, uint8_t *scratch) {
    const int64_t KP = K / 2, kblocks = K / QK, panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    const int64_t pairs = (panels + BPANELS - 1) / BPANELS, panel_bytes = kblocks * bf16_qblock_bytes(offsets);
    uint32_t *xp = (uint32_t *)scratch;
    uint32_t *w = scratch ? (uint32_t *)(scratch + (bf16_packed_rows_bytes(M, K) + 63) / 64 * 64) : NULL;
    if (xp != NULL) pack_pairs(xp, x, ldx, M, K);
#pragma omp for schedule(guided)
    for (int64_t q = 0; q < pairs; q++) {
        if (xp == NULL) continue;
        const int64_t p = BPANELS * q, np = panels - p < BPANELS ? panels - p : BPANELS;
        for (int64_t j = 0; j < np; j++)
            expand_qpanel_pairs(w + j * KP * BF16_PANEL, qpacked + (p + j) * panel_bytes, kblocks, offsets);
        for (int64_t i = 0; i * BROWS < M; i++) {
            const int64_t r = M - i * BROWS < BROWS ? M - i * BROWS : BROWS, row = i * BROWS * ldo;
            block_times_pair(out32 ? NULL : out + row, out32 ? out32 + row : NULL, ldo, xp + i * KP * BROWS, w,
                             KP * BF16_PANEL, bias, N, KP, p, r);
        }
    }
}

static __thread kept_buffer qpairs_scratch; /* a thread's scratch for calls over the blocks */

int cbserve_bf16_qgemm(void *out, int64_t ldo, int out_f32, const uint16_t *x, int64_t ldx, const uint8_t *qpacked,
                       int offsets, const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    if (M > QMAX || K % QK) return -2;
    const int64_t panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    int failed = 0;
#pragma omp parallel if (panels > BPANELS && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        uint8_t *scratch = kept_alloc(&qpairs_scratch, bf16_qscratch_bytes(M, K));
        failed = scratch == NULL;
        bf16_qgemm_share(out_f32 ? NULL : out, out_f32 ? out : NULL, ldo, x, ldx, qpacked, offsets, bias, M, N, K,
                         scratch);
    }
    return failed ? -1 : 0;
}

int cbserve_bf16_gemm_available(void) { return __builtin_cpu_supports("avx512bf16"); }

/* out [M, N] (row stride ldo; bfloat16, or float32 holding the rounded values where out_f32) = x [M, K]
 * (bfloat16, row stride ldx) times packed W^T, plus bias [N] (bfloat16) if not NULL. Returns 0, or -1 when a
 * thread's scratch could not be allocated (the caller raises). */
int cbserve_bf16_gemm(void *out, int64_t ldo, int out_f32, const uint16_t *x, int64_t ldx, const uint32_t *packed,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    uint16_t *o16 = out_f32 ? NULL : out;
    float *o32 = out_f32 ? out : NULL;
    if (M > SHARE_MAX) return bf16_gemm_split(o16, o32, ldo, x, ldx, packed, bias, M, N, K);
    int failed = 0;
    const int64_t panels = (N + BF16_PANEL - 1) / BF16_PANEL;
#pragma omp parallel if (panels > BPANELS && M * N * K >= (1 << 18)) reduction(| : failed)
    {
        uint32_t *xp = kept_alloc(&pairs_scratch, bf16_packed_rows_bytes(M, K));
        failed = xp == NULL;
        bf16_gemm_share(o16, o32, ldo, x, ldx, packed, bias, M, N, K, xp);
    }
    return failed ? -1 : 0;
}
#else
#define HAVE_BF16_DOT 0
/* for the decode stack's build, which never calls them here (its check_inputs refuses bf16_dot) */
static __attribute__((unused)) size_t bf16_packed_rows_bytes(int64_t M, int64_t K) { return (void)M, (void)K, 0; }
static __attribute__((unused)) void bf16_gemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x,
                                                    int64_t ldx, const uint32_t *packed, const uint16_t *bias,
                                                    int64_t M, int64_t N, int64_t K, uint32_t *xp) {
    (void)out, (void)out32, (void)ldo, (void)x, (void)ldx, (void)packed, (void)bias, (void)M, (void)N, (void)K, (void)xp;
}
static __attribute__((unused)) size_t bf16_qscratch_bytes(int64_t M, int64_t K) { return (void)M, (void)K, 0; }
static __attribute__((unused)) void bf16_qgemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x,
                                                     int64_t ldx, const uint8_t *qpacked, int offsets,
                                                     const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                                                     uint8_t *scratch) {
    (void)out, (void)out32, (void)ldo, (void)x, (void)ldx, (void)qpacked, (void)offsets, (void)bias, (void)M, (void)N,
        (void)K, (void)scratch;
}
int cbserve_bf16_gemm_available(void) { return 0; }
int cbserve_bf16_gemm(void *out, int64_t ldo, int out_f32, const uint16_t *x, int64_t ldx, const uint32_t *packed,
                      const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    (void)out, (void)ldo, (void)out_f32, (void)x, (void)ldx, (void)packed, (void)bias, (void)M, (void)N, (void)K;
    return -2;
}
int cbserve_bf16_qgemm(void *out, int64_t ldo, int out_f32, const uint16_t *x, int64_t ldx, const uint8_t *qpacked,
                       int offsets, const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    (void)out, (void)ldo, (void)out_f32, (void)x, (void)ldx, (void)qpacked, (void)offsets, (void)bias, (void)M,
        (void)N, (void)K;
    return -2;
}
#endif

int cbserve_bf16_gemm_panel(void) { return BF16_PANEL; }
int cbserve_bf16_gemm_qmax(void) { return QMAX; }
int cbserve_bf16_gemm_qblock_bytes(int offsets) { return (int)bf16_qblock_bytes(offsets); }
