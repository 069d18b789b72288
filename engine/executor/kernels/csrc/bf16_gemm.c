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
 * panels from memory once, asked for ahead; the row blocks after the first read them from L2; calls of 13-16
 * rows take one block of 16 rows x one panel instead, which reads every panel once, and 29-32 rows two); larger
 * calls (prefill) split the rows, each thread reading every panel, a group that fits in L2 at a time, once per
 * macro block of its rows. bf16_gemm_share is the shared-out form for callers already inside a parallel
 * region (the decode stack).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16_round.h"
#include "kept_buffer.h"
#include "swiglu_gate.h"
#include "transpose16.h"

#define BF16_PANEL 16   /* outputs per panel: one vector of float32 accumulators */
#define BROWS 12        /* rows a register block (14 x 2 panels measured alike: docs/BENCHMARKS.md) */
#define BPANELS 2       /* panels a register block */
#define SHARE_MAX 64    /* calls of at most this many rows share out the panels; more split the rows */
#define BMACRO 240      /* rows a thread packs at a time when the threads split the rows */
#define BAHEAD 16       /* k-pairs (64-byte lines of a panel) asked for ahead (16 to 256, into L1 or L2: alike) */
#define BGROUP_BYTES (1 << 19) /* the panels of a group, read from L2 by every block of a macro block */
#define BF16_INLINE static inline __attribute__((always_inline))

#define QMAX 12 /* rows a call over a checkpoint's blocks takes at most: one register block of BROWS (bf16_gemm.py's
                 * QUANTIZED_MAX_ROWS) */
#define QK 32   /* k a block */

/* bytes of one (panel, block) of the blocks: 4-bit codes with offsets, or 8-bit (below) */
static int64_t bf16_qblock_bytes(int offsets) { return offsets ? 16 * 16 + 2 * 16 * 4 : 32 * 16 + 16 * 4; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16_DOT 1
#include <immintrin.h>

/* `rows` rows of x (bfloat16, row stride ldx) as 32-bit k-pairs, k-pair-major in blocks of `height` (BROWS, or
 * WIDE_ROWS): xp[(b * KP + i) * height + m] = (x[m, 2i], x[m, 2i + 1]) (zeros past K and past the rows). Sixteen
 * pairs at a time a 16 x 16 transpose of 32-bit lanes, the rest one pair at a time. */
static void pack_pairs(uint32_t *restrict xp, const uint16_t *x, int64_t ldx, int64_t rows, int64_t K, int64_t height) {
    const int64_t KP = (K + 1) / 2, full = K / 2;
    const __mmask16 lanes = (__mmask16)((1u << height) - 1);
    for (int64_t b = 0; b * height < rows; b++) {
        const uint16_t *block = x + b * height * ldx;
        const int64_t here = rows - b * height < height ? rows - b * height : height;
        uint32_t *dst = xp + b * KP * height;
        int64_t i = 0;
        for (; i + 16 <= full; i += 16) {
            __m512 r[16];
            for (int m = 0; m < 16; m++)
                r[m] = m < here ? _mm512_loadu_ps(block + m * ldx + 2 * i) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_mask_storeu_ps(dst + (i + j) * height, lanes, r[j]);
        }
        for (; i < KP; i++)
            for (int m = 0; m < height; m++) {
                uint32_t pair = 0;
                if (m < here) {
                    const uint16_t *row = block + m * ldx;
                    pair = 2 * i + 1 < K ? (uint32_t)row[2 * i] | (uint32_t)row[2 * i + 1] << 16 : row[2 * i];
                }
                dst[i * height + m] = pair;
            }
    }
}

/* out[m, 16 j : 16 j + 16] = bfloat16(acc[m * stride + j] + bias) for R rows and np panels (the last one's n
 * outputs); as float32 (the rounded values) into out32 instead where it is not NULL */
BF16_INLINE void store_block(uint16_t *out, float *out32, int64_t ldo, const __m512 *acc, const int stride,
                             const uint16_t *bias, int n, const int np, const int R) {
    for (int j = 0; j < np; j++) {
        const __mmask16 keep = j == np - 1 ? (__mmask16)((1u << n) - 1) : (__mmask16)0xFFFF;
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + j * BF16_PANEL)), 16))
                              : _mm512_setzero_ps();
        for (int m = 0; m < R; m++) {
            const __m512 o = bias ? _mm512_add_ps(acc[m * stride + j], b) : acc[m * stride + j];
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

/* out[m, 0:16 np] = bfloat16(sum over pairs of x[m] . (np panels) + bias) for R rows of a packed block (xp);
 * the panels from p0, `stride` 32-bit pairs apart; n: the outputs of the last panel; as float32 (the rounded
 * values) into out32 instead where it is not NULL. R and np are literals at each call site. */
BF16_INLINE void block_times_panels(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp,
                                    const uint32_t *p0, int64_t stride, const uint16_t *bias, int64_t KP, int n,
                                    const int np, const int R, const int glu) {
    __m512 acc[BROWS * BPANELS];
#pragma GCC unroll 32
    for (int a = 0; a < BROWS * BPANELS; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t i = 0; i < KP; i++) {
        __m512bh w[BPANELS];
#pragma GCC unroll 2
        for (int j = 0; j < np; j++) {
            __builtin_prefetch(p0 + j * stride + (i + BAHEAD) * BF16_PANEL, 0, 3);
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
    if (glu) { /* the two panels: 16 gate outputs and their 16 up outputs */
#pragma GCC unroll 12
        for (int m = 0; m < R; m++)
            _mm256_storeu_si256((__m256i *)(out + m * ldo), swiglu_gate_x16(acc[m * BPANELS], acc[m * BPANELS + 1]));
    } else {
        store_block(out, out32, ldo, acc, BPANELS, bias, n, np, R);
    }
}

#define BF16_CASE(r)                                                                 \
    case r:                                                                          \
        if (glu)                                                                     \
            block_times_panels(out, NULL, ldo, xp, p0, stride, NULL, KP, 16, 2, r, 1); \
        else if (np == 2)                                                            \
            block_times_panels(o16, o32, ldo, xp, p0, stride, b, KP, n, 2, r, 0);    \
        else                                                                         \
            block_times_panels(o16, o32, ldo, xp, p0, stride, b, KP, n, 1, r, 0);    \
        break;

/* R <= BROWS rows of one packed block (xp) times pair q of panels: panels 2q and 2q + 1 (or the last one),
 * the block's rows of out, its columns from 32 q; for SwiGLU (glu: the gate's panels, inter / 16) the gate's
 * panel q and the up half's panel glu + q, the block's rows of out (bfloat16, no bias), silu(g) * u in its
 * columns from 16 q */
static void block_times_pair(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp, const uint32_t *packed,
                             const uint16_t *bias, int64_t N, int64_t KP, int64_t q, int64_t R, int64_t glu) {
    const int64_t p = glu ? q : BPANELS * q, stride = (glu ? glu : 1) * KP * BF16_PANEL;
    const uint32_t *p0 = packed + p * KP * BF16_PANEL;
    if (glu) out += q * BF16_PANEL;
    const int64_t panels = (N + BF16_PANEL - 1) / BF16_PANEL, np = panels - p < BPANELS ? panels - p : BPANELS;
    const int n = (int)(N - (p + np - 1) * BF16_PANEL < BF16_PANEL ? N - (p + np - 1) * BF16_PANEL : BF16_PANEL);
    const uint16_t *b = bias ? bias + p * BF16_PANEL : NULL;
    uint16_t *o16 = out32 ? NULL : out + p * BF16_PANEL;
    float *o32 = out32 ? out32 + p * BF16_PANEL : NULL;
    switch (R) {
        BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
        BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11) BF16_CASE(12)
        default: break;
    }
}

/* ---- calls of 13-16 rows (decode steps of 13-16 sequences) and 29-32: blocks of 16 rows ----
 *
 * Past BROWS rows a second register block would read every pair of panels again (from L2, after the first
 * block): ~1.3 ms more whatever its rows, at 16 rows ~2 ms of a 16-row decode step's 12 ms of matmuls. One
 * block of WIDE_ROWS rows x one panel (16 accumulators; a weight vector and 16 broadcasts a pair: the
 * vector units' rate as 12 x 2's, measured in registers) reads each panel once. It consumes a panel's lines
 * at 1.5x a 12 x 2 block's pace per line, so its lines are asked for WAHEAD pairs ahead (BAHEAD's 16 fell
 * behind memory; 32 gained nothing, 48-64 the most: python -m bench.kernel_ab --rows 16, the 30 layers'
 * matmuls 5-7% faster, and 13 rows as fast as 12 + 1). Each output is the same chain over the k-pairs in
 * order: the same bits as the blocks'. */
#define WIDE_ROWS 16
#define WAHEAD 64

/* Whether a call of M rows runs in blocks of WIDE_ROWS rows: 13-16 rows (one pass over the panels instead of
 * two) and 29-32 (two instead of three: the 30 layers' matmuls of 32 rows 19.62 -> 18.77 ms median); past
 * that the calls are bound by the dot products (48 rows: 1%), and between, blocks of 16 would compute up to
 * a third more padding rows */
static inline int wide_blocks(int64_t M) {
    return (M > BROWS && M <= WIDE_ROWS) || (M > 2 * WIDE_ROWS - 4 && M <= 2 * WIDE_ROWS);
}

/* acc[m] = sum over pairs of x[m] . panel for the WIDE_ROWS rows of xp (rows past the call's are zeros); the
 * lines asked for ahead run on into `next`, the panel read after this one */
BF16_INLINE void wide_block_times_panel(__m512 *acc, const uint32_t *xp, const uint32_t *panel, const uint32_t *next,
                                        int64_t KP) {
#pragma GCC unroll 16
    for (int m = 0; m < WIDE_ROWS; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < KP; i++) {
        const int64_t a = i + WAHEAD;
        __builtin_prefetch(a < KP ? panel + a * BF16_PANEL : next + (a - KP) * BF16_PANEL, 0, 3);
        __m512bh w = (__m512bh)_mm512_loadu_si512(panel + i * BF16_PANEL);
        __asm__("" : "+v"(w)); /* in a register: one load for every row's dot product */
        const uint32_t *xi = xp + i * WIDE_ROWS;
#pragma GCC unroll 16
        for (int m = 0; m < WIDE_ROWS; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32((int)xi[m]));
    }
}

/* block_times_pair for the M rows of a call that wide_blocks takes, packed in blocks of WIDE_ROWS: each of the
 * pair's panels (for SwiGLU the gate's panel q, then the up half's panel glu + q) by wide_block_times_panel */
static void wide_rows_times_pair(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp, const uint32_t *packed,
                                 const uint16_t *bias, int64_t N, int64_t KP, int64_t q, int64_t M, int64_t glu) {
    const int64_t p = glu ? q : BPANELS * q, stride = (glu ? glu : 1) * KP * BF16_PANEL;
    const uint32_t *p0 = packed + p * KP * BF16_PANEL;
    const int64_t panels = (N + BF16_PANEL - 1) / BF16_PANEL, np = panels - p < BPANELS ? panels - p : BPANELS;
    __m512 acc[WIDE_ROWS], gate[WIDE_ROWS];
    for (int64_t r0 = 0; r0 < M; r0 += WIDE_ROWS) { /* a block of WIDE_ROWS rows (xp's) at a time */
        const int64_t R = M - r0 < WIDE_ROWS ? M - r0 : WIDE_ROWS;
        const uint32_t *xb = xp + r0 * KP;
        if (glu) {
            wide_block_times_panel(gate, xb, p0, p0 + stride, KP);
            wide_block_times_panel(acc, xb, p0 + stride, p0 + KP * BF16_PANEL, KP);
            uint16_t *o = out + r0 * ldo + q * BF16_PANEL;
            for (int64_t m = 0; m < R; m++)
                _mm256_storeu_si256((__m256i *)(o + m * ldo), swiglu_gate_x16(gate[m], acc[m]));
            continue;
        }
        for (int64_t j = 0; j < np; j++) {
            const int64_t col = (p + j) * BF16_PANEL;
            const int n = (int)(N - col < BF16_PANEL ? N - col : BF16_PANEL);
            wide_block_times_panel(acc, xb, p0 + j * KP * BF16_PANEL, p0 + (j + 1) * KP * BF16_PANEL, KP);
            store_block(out32 ? NULL : out + r0 * ldo + col, out32 ? out32 + r0 * ldo + col : NULL, ldo, acc, 1,
                        bias ? bias + col : NULL, n, 1, (int)R);
        }
    }
}

/* rows [m0, m1) (packed in xp, from its first block) times the panel pairs [q0, q1) (block_times_pair's, glu
 * as there): per group of pairs that fit in L2 together, per block of rows (it stays in L1 while the group's
 * panels pass), per pair */
static void rows_times_panel_pairs(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp, const uint32_t *packed,
                                   const uint16_t *bias, int64_t m0, int64_t m1, int64_t N, int64_t KP, int64_t q0,
                                   int64_t q1, int64_t glu) {
    int64_t group = BGROUP_BYTES / (BPANELS * KP * BF16_PANEL * (int64_t)sizeof(uint32_t));
    if (group < 1) group = 1;
    for (int64_t g0 = q0; g0 < q1; g0 += group) {
        const int64_t g1 = q1 - g0 < group ? q1 : g0 + group;
        for (int64_t i = 0; m0 + i * BROWS < m1; i++) {
            const int64_t r = m1 - m0 - i * BROWS < BROWS ? m1 - m0 - i * BROWS : BROWS;
            const int64_t row = (m0 + i * BROWS) * ldo;
            for (int64_t q = g0; q < g1; q++)
                block_times_pair(out32 ? NULL : out + row, out32 ? out32 + row : NULL, ldo, xp + i * KP * BROWS,
                                 packed, bias, N, KP, q, r, glu);
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
static void bf16_gemm_share_pairs(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                                  const uint32_t *packed, const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                                  uint32_t *xp, int64_t glu) {
    const int64_t KP = (K + 1) / 2, panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    const int64_t pairs = glu ? glu : (panels + BPANELS - 1) / BPANELS;
    const int wide = wide_blocks(M);
    if (xp != NULL) pack_pairs(xp, x, ldx, M, K, wide ? WIDE_ROWS : BROWS);
#pragma omp for schedule(guided) /* a slowed core does not hold the others */
    for (int64_t q = 0; q < pairs; q++)
        if (xp != NULL && wide)
            wide_rows_times_pair(out, out32, ldo, xp, packed, bias, N, KP, q, M, glu);
        else if (xp != NULL)
            rows_times_panel_pairs(out, out32, ldo, xp, packed, bias, 0, M, N, KP, q, q + 1, glu);
}

static void bf16_gemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                            const uint32_t *packed, const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                            uint32_t *xp) {
    bf16_gemm_share_pairs(out, out32, ldo, x, ldx, packed, bias, M, N, K, xp, 0);
}

/* More than SHARE_MAX rows: the threads split the rows (whole blocks each), each packing its own a macro
 * block at a time and reading every panel, with no thread waiting for another. */
static int bf16_gemm_split(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                           const uint32_t *packed, const uint16_t *bias, int64_t M, int64_t N, int64_t K, int64_t glu) {
    const int64_t KP = (K + 1) / 2, panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    const int64_t pairs = glu ? glu : (panels + BPANELS - 1) / BPANELS, blocks = (M + BROWS - 1) / BROWS;
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
            pack_pairs(xp, x + m0 * ldx, ldx, m1 - m0, K, BROWS);
            rows_times_panel_pairs(out, out32, ldo, xp, packed, bias, m0, m1, N, KP, 0, pairs, glu);
        }
    }
    return failed ? -1 : 0;
}

/* ---- a checkpoint's blocks (Q4_0, Q4_1, Q8_0: block_codes.py), expanded in registers as they are used ----
 *
 *   qpacked W: [ceil(N / 16)][K / 32][block]
 *     4-bit block (codes 0..15 and offsets):  16 pairs x 16 bytes, then 16 float32 d and 16 float32 m
 *     8-bit block (codes -128..127):          16 pairs x 32 int8, then 16 float32 d
 *   pair i's codes in lane order: lane t of the first 16 the code of output t / 2 at k = 2i + t % 2, lane t
 *   of the second 16 that of output 8 + t / 2 (4-bit: the first 16 in the low nibbles, the second in the high)
 *
 * A weight is round_to_bfloat16(d * code + m) (8-bit: d * code): the product of a float16 d and a code of at
 * most 8 bits is exact in float32, so one rounding of the multiply-add gives block_codes.py's float32 weight
 * and rounding it to nearest even the bfloat16 weight the model loaded (fast_paths.py checks that they agree
 * before it keeps the blocks; the values are never float32 denormals, where VCVTNE2PS2BF16 would flush). In
 * lane order the two halves' 16 floats each round (VCVTNE2PS2BF16) into one vector of the panel's k-pairs,
 * with no permute. A call of at most QMAX rows (one register block) expands each pair of a panel in
 * registers and runs the rows' chains over it right away: the chains of the bfloat16 panels, so the same
 * bits, from 0.75 (4-bit) or 1.125 (8-bit) bytes a weight instead of 2. */

/* pair i of a 4-bit block (its 16 code bytes; each half's d and m in lane order) as the panel's k-pairs */
BF16_INLINE __m512bh expand_pair_q4(const uint8_t *codes, __m512 d0, __m512 m0, __m512 d1, __m512 m1) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(0x0F))), d0, m0);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), d1, m1);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* pair i of an 8-bit block (its 32 codes) */
BF16_INLINE __m512bh expand_pair_q8(const uint8_t *codes, __m512 d0, __m512 d1) {
    const __m128i *c = (const __m128i *)codes;
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c))), d0);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1))), d1);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* out[m, 0:n] = bfloat16(sum over pairs of x[m] . (one panel's blocks, from src) + bias) for R <= BROWS rows of
 * a packed block (xp); R and offsets literals at each call site */
BF16_INLINE void block_times_qpanel(uint16_t *out, float *out32, int64_t ldo, const uint32_t *xp, const uint8_t *src,
                                    const uint16_t *bias, int64_t kblocks, int n, const int offsets, const int R) {
    uint32_t halves[32] __attribute__((aligned(64))); /* lane t: output t / 2, then 8 + t / 2 */
    for (int t = 0; t < 16; t++) halves[t] = (uint32_t)t / 2, halves[16 + t] = 8 + (uint32_t)t / 2;
    const __m512i first = _mm512_load_si512(halves), second = _mm512_load_si512(halves + 16);
    const int64_t bytes = bf16_qblock_bytes(offsets);
    __m512 acc[BROWS];
#pragma GCC unroll 16
    for (int a = 0; a < BROWS; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kblocks; b++) {
        const uint8_t *block = src + b * bytes, *ahead = block + 4 * bytes;
        for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
        const __m512 d = _mm512_loadu_ps(block + (offsets ? 256 : 512));
        const __m512 m = offsets ? _mm512_loadu_ps(block + 320) : _mm512_setzero_ps();
        const __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
        const __m512 m0 = _mm512_permutexvar_ps(first, m), m1 = _mm512_permutexvar_ps(second, m);
        for (int i = 0; i < QK / 2; i++) {
            __m512bh w = offsets ? expand_pair_q4(block + 16 * i, d0, m0, d1, m1) : expand_pair_q8(block + 32 * i, d0, d1);
            __asm__("" : "+v"(w)); /* the weights as such, once for every row */
            const uint32_t *xi = xp + (b * QK / 2 + i) * BROWS;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32((int)xi[r]));
        }
    }
    store_block(out, out32, ldo, acc, 1, bias, n, 1, R);
}

#define BF16_QCASE(r)                                                                          \
    case r:                                                                               \
        if (offsets)                                                                      \
            block_times_qpanel(o16, o32, ldo, xp, src, b, kblocks, n, 1, r);              \
        else                                                                              \
            block_times_qpanel(o16, o32, ldo, xp, src, b, kblocks, n, 0, r);              \
        break;

/* M <= QMAX rows of a packed block (xp) times one panel's blocks (src): block_times_qpanel for that M */
static void rows_times_qpanel_bf16(uint16_t *o16, float *o32, int64_t ldo, const uint32_t *xp, const uint8_t *src,
                                   const uint16_t *b, int64_t kblocks, int n, int offsets, int64_t M) {
    switch (M) {
        BF16_QCASE(1) BF16_QCASE(2) BF16_QCASE(3) BF16_QCASE(4) BF16_QCASE(5) BF16_QCASE(6)
        BF16_QCASE(7) BF16_QCASE(8) BF16_QCASE(9) BF16_QCASE(10) BF16_QCASE(11) BF16_QCASE(12)
        default: break;
    }
}

/* SwiGLU's gate over the blocks: gate panel p and the up half's panel glu + p, each into float32 sums rounded
 * as the matmul rounds them, then out[m, 16 p : 16 p + 16] = silu(g) * u (swiglu_gate.h, which rounds the
 * sums again: the same values), the bits of the matmul then silu_and_mul */
static void rows_times_qpanel_gate(uint16_t *out, int64_t ldo, const uint32_t *xp, const uint8_t *qpacked,
                                   int offsets, int64_t kblocks, int64_t glu, int64_t p, int64_t M) {
    float g[QMAX * BF16_PANEL] __attribute__((aligned(64))), u[QMAX * BF16_PANEL] __attribute__((aligned(64)));
    const int64_t panel_bytes = kblocks * bf16_qblock_bytes(offsets);
    rows_times_qpanel_bf16(NULL, g, BF16_PANEL, xp, qpacked + p * panel_bytes, NULL, kblocks, BF16_PANEL, offsets, M);
    rows_times_qpanel_bf16(NULL, u, BF16_PANEL, xp, qpacked + (glu + p) * panel_bytes, NULL, kblocks, BF16_PANEL,
                           offsets, M);
    for (int64_t m = 0; m < M; m++)
        _mm256_storeu_si256((__m256i *)(out + m * ldo + p * BF16_PANEL),
                            swiglu_gate_x16(_mm512_load_ps(g + m * BF16_PANEL), _mm512_load_ps(u + m * BF16_PANEL)));
}

/* The threads of a parallel region share out the panels of M <= QMAX rows (each packs them into xp, its own
 * scratch of bf16_packed_rows_bytes(M, K); NULL: it takes no panels); for SwiGLU (glu: the gate's panels,
 * inter / 16; N = 2 inter, no bias) the pairs of a gate panel and its up panel, out [M, inter] silu(g) * u.
 * Ends with the loop's barrier. */
static void bf16_qgemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x, int64_t ldx,
                             const uint8_t *qpacked, int offsets, const uint16_t *bias, int64_t M, int64_t N,
                             int64_t K, uint32_t *xp, int64_t glu) {
    const int64_t kblocks = K / QK, panels = glu ? glu : (N + BF16_PANEL - 1) / BF16_PANEL;
    if (xp != NULL) pack_pairs(xp, x, ldx, M, K, BROWS);
#pragma omp for schedule(guided)
    for (int64_t p = 0; p < panels; p++) {
        if (xp == NULL) continue;
        if (glu) {
            rows_times_qpanel_gate(out, ldo, xp, qpacked, offsets, kblocks, glu, p, M);
            continue;
        }
        const int n = (int)(N - p * BF16_PANEL < BF16_PANEL ? N - p * BF16_PANEL : BF16_PANEL);
        const uint8_t *src = qpacked + p * kblocks * bf16_qblock_bytes(offsets);
        const uint16_t *b = bias ? bias + p * BF16_PANEL : NULL;
        rows_times_qpanel_bf16(out32 ? NULL : out + p * BF16_PANEL, out32 ? out32 + p * BF16_PANEL : NULL, ldo, xp,
                               src, b, kblocks, n, offsets, M);
    }
}

int cbserve_bf16_qgemm(void *out, int64_t ldo, int out_f32, const uint16_t *x, int64_t ldx, const uint8_t *qpacked,
                       int offsets, const uint16_t *bias, int64_t M, int64_t N, int64_t K) {
    if (M > QMAX || K % QK) return -2;
    const int64_t panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    int failed = 0;
#pragma omp parallel if (panels > 1 && M * N * K >= (1 << 16)) reduction(| : failed)
    {
        uint32_t *xp = kept_alloc(&pairs_scratch, bf16_packed_rows_bytes(M, K));
        failed = xp == NULL;
        bf16_qgemm_share(out_f32 ? NULL : out, out_f32 ? out : NULL, ldo, x, ldx, qpacked, offsets, bias, M, N, K, xp,
                         0);
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
    if (M > SHARE_MAX) return bf16_gemm_split(o16, o32, ldo, x, ldx, packed, bias, M, N, K, 0);
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
/* SwiGLU's matmul and gate in one: out [M, inter] bfloat16 (row stride ldo) = silu(g) * u, where [g | u] =
 * x [M, K] W^T for the packed W [2 inter, K] of a gated MLP's fused gate and up projections (no bias): the
 * bits of cbserve_bf16_gemm then cpu_ops.c's silu_and_mul, without writing [g | u] out and reading it back
 * (each register block's two panels are a gate panel and its up panel). Returns 0; -1 when a thread's scratch
 * could not be allocated, -2 where inter is not a multiple of 16. */
int cbserve_bf16_gemm_swiglu(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint32_t *packed,
                             int64_t M, int64_t inter, int64_t K) {
    if (inter % BF16_PANEL) return -2;
    const int64_t glu = inter / BF16_PANEL;
    if (M > SHARE_MAX) return bf16_gemm_split(out, NULL, ldo, x, ldx, packed, NULL, M, 2 * inter, K, glu);
    int failed = 0;
#pragma omp parallel if (glu > 1 && M * inter * K >= (1 << 17)) reduction(| : failed)
    {
        uint32_t *xp = kept_alloc(&pairs_scratch, bf16_packed_rows_bytes(M, K));
        failed = xp == NULL;
        bf16_gemm_share_pairs(out, NULL, ldo, x, ldx, packed, NULL, M, 2 * inter, K, xp, glu);
    }
    return failed ? -1 : 0;
}
#else
#define HAVE_BF16_DOT 0
/* for the decode stack's build, which never calls them here (its check_inputs refuses bf16_dot) */
static __attribute__((unused)) size_t bf16_packed_rows_bytes(int64_t M, int64_t K) { return (void)M, (void)K, 0; }
static __attribute__((unused)) void bf16_gemm_share_pairs(uint16_t *out, float *out32, int64_t ldo,
                                                          const uint16_t *x, int64_t ldx, const uint32_t *packed,
                                                          const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                                                          uint32_t *xp, int64_t glu) {
    (void)out, (void)out32, (void)ldo, (void)x, (void)ldx, (void)packed, (void)bias, (void)M, (void)N, (void)K, (void)xp,
        (void)glu;
}
static __attribute__((unused)) void bf16_gemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x,
                                                    int64_t ldx, const uint32_t *packed, const uint16_t *bias,
                                                    int64_t M, int64_t N, int64_t K, uint32_t *xp) {
    bf16_gemm_share_pairs(out, out32, ldo, x, ldx, packed, bias, M, N, K, xp, 0);
}
static __attribute__((unused)) void bf16_qgemm_share(uint16_t *out, float *out32, int64_t ldo, const uint16_t *x,
                                                     int64_t ldx, const uint8_t *qpacked, int offsets,
                                                     const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                                                     uint32_t *xp, int64_t glu) {
    (void)out, (void)out32, (void)ldo, (void)x, (void)ldx, (void)qpacked, (void)offsets, (void)bias, (void)M, (void)N,
        (void)K, (void)xp, (void)glu;
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
int cbserve_bf16_gemm_swiglu(uint16_t *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint32_t *packed,
                             int64_t M, int64_t inter, int64_t K) {
    (void)out, (void)ldo, (void)x, (void)ldx, (void)packed, (void)M, (void)inter, (void)K;
    return -2;
}
#endif

int cbserve_bf16_gemm_panel(void) { return BF16_PANEL; }
int cbserve_bf16_gemm_qmax(void) { return QMAX; }
int cbserve_bf16_gemm_qblock_bytes(int offsets) { return (int)bf16_qblock_bytes(offsets); }
