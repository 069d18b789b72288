/* Paged decode attention on the CPU: each sequence's one new query attends over that sequence's KV pages,
 * read in place through its block table -- no gathered copy of the pages, no padding to a longer sequence.
 *
 * Work item = (row, KV head); the `group` query heads that share the KV head are computed together, so
 * each key and value vector is loaded (and widened from bfloat16) once per step and used by every head of
 * the group (GQA without repeating K/V), and K pages are prefetched ahead (eight into L2, two into L1; each V
 * page into L2 meanwhile; bfloat16 pages of 16 keys a line at a time among the dot products):
 *
 *   s[g, j] = scale * <q[g], K[j]>        for the visible keys j of the sequence
 *   s[g, j] = softcap * tanh(s[g, j] / softcap)   where the model soft-caps its attention logits (Gemma 2)
 *   p[g, j] = softmax_j(s[g, j])
 *   o[g]    = sum_j p[g, j] * V[j]
 *
 * Cache layout (engine/executor/kv_cache.py), per block and KV head, so that both loops run on whole SIMD vectors:
 *   K: [num_blocks, num_kv_heads, head_dim, block_size]  -- transposed: the scores of 16 keys are 16 lanes,
 *                                                           one fused multiply-add per dimension, no
 *                                                           horizontal sums;
 *   V: [num_blocks, num_kv_heads, block_size, head_dim]  -- one value row is head_dim contiguous lanes.
 * Key j of a sequence is row j % block_size of block block_table[j / block_size]. The query sits at
 * position seq_len - 1, so keys 0 .. seq_len - 1 are visible (only the last `sliding_window` of them when
 * the model has a window).
 *
 * Verify runs: a speculative verify chunk of K + 1 tokens enters the step as K + 1 decode rows of one
 * sequence over the same pages at consecutive positions (engine/executor/runner.py's `prepare`). Such rows
 * (found by plan_tiles: consecutive KV lengths, equal block table entries) share work items: work item =
 * (tile, KV head), a tile being a row or up to RUN_ROWS rows of one run, so each K and V vector is loaded
 * once for all of the tile's rows x group query heads. Each row still sees only its own keys (up to its
 * seq_len, its own window and soft cap), and its sums are those of the row attended alone, over the same
 * keys in the same order -- the same bits; a key past a row's end never enters its sums, not even times 0.
 * Runs are cut into more tiles while threads would otherwise have no work item.
 *
 * Caches are float32 or bfloat16 (`kv_is_bf16`); queries and outputs are float32. Parallel over work items
 * with OpenMP: this library asks for libgomp.so.1, which resolves to the copy torch has already loaded, so
 * torch and this kernel share one thread pool (torch.set_num_threads applies to both).
 *
 * Supported: block_size and head_dim multiples of 16, head_dim at most MAX_HEAD_DIM, at most MAX_GROUP query
 * heads per KV head; engine/executor/attention/cpu_kernel.py checks these before choosing this kernel. head_dim 64
 * and 128 with groups of 1, 2, 3, 4 and 8 get their own unrolled copies of the loops, one per tile size.
 *
 * The library also stores each step's new keys and values in their slots (`cbserve_write_kv`), the
 * scatter that PyTorch's index_put_ does several times slower.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16
#define MAX_HEAD_DIM 512

/* The loops work on vectors of VL floats: 16 (one AVX-512 register) where the CPU has 32 vector registers,
 * else 8 (one AVX2 register, 16 of them). With 16 registers the value pass also splits head_dim into
 * slices whose accumulators for the whole group fit in PV_REGS registers (group 3, head_dim 64 would
 * need 24 -- spilled on every key); every lane's sums run in the same order either way.
 *
 * A tile of a verify run (RUN_ROWS rows) keeps the accumulators of all its rows x group query heads in
 * RUN_REGS registers, the rest being left to the K or V vectors and the broadcast probabilities: the score
 * pass's two per head, the value pass's slices of head_dim (value_slice). On AVX-512, 28 spilled the value
 * pass of 4 rows x 3 heads; 24 does not (measured, GCC 12). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define PV_REGS 0 /* no split: head_dim in one pass */
#define RUN_REGS 24
#else
#define VL 8
#define PV_REGS 12
#define RUN_REGS 12
#endif
#define MAX_RUN_ROWS 4
/* K pages asked for ahead of the score pass: into L1 PREFETCH_PAGES ahead (2, 4 and 8 measured alike with
 * the V pages asked for early: a core has few L1 misses in flight), into L2 L2_PAGES ahead (whose queue holds
 * more: attention 3-4% fewer cycles at 8 rows of ~1,100 tokens, in three interleaved pairs; 16 alike) */
#define PREFETCH_PAGES 2
#define L2_PAGES 8
/* the rows of a verify run's tile: as many as RUN_REGS holds two accumulators each of group query heads, at
 * least 1, at most MAX_RUN_ROWS (so a tile of more than one row has at most RUN_REGS / 2 query heads) */
#define FIT_ROWS(group) (RUN_REGS / (2 * (group)))
#define RUN_ROWS(group) (FIT_ROWS(group) > MAX_RUN_ROWS ? MAX_RUN_ROWS : FIT_ROWS(group) < 1 ? 1 : FIT_ROWS(group))

/* compiled from its own body alone (never inlined, cloned or specialised for a caller): the decode stack
 * (engine/executor/kernels/csrc/decode_stack.c) includes this file and gets the same bits */
#define NOIPA static __attribute__((noipa))

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));

int cbserve_lanes(void) { return LANES; }
int cbserve_max_group(void) { return MAX_GROUP; }
int cbserve_max_head_dim(void) { return MAX_HEAD_DIM; }

/* VL consecutive elements of a float32 or bfloat16 cache, as float32 (bfloat16 is the high half). */
static inline vf loadv(const void *cache, int64_t index, int bf16) {
    vf f;
    if (bf16) {
#if VL == 16 /* one widening load: GCC's conversion below goes in 8-lane halves on these CPUs */
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + index));
        f = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
        vh h;
        memcpy(&h, (const uint16_t *)cache + index, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
#endif
    } else {
        memcpy(&f, (const float *)cache + index, sizeof f);
    }
    return f;
}

/* bfloat16 caches on AVX-512: a 64-byte line of 32 elements as two float32 vectors, each element moved into
 * the high half of a float by a shift or kept there by a mask -- two instructions a line where loadv's
 * widening takes four (a shuffle and a shift for each 16): the even elements 0, 2, .., 30 and the odd ones
 * 1, 3, .., 31 of the line. The score and value passes take their lines so where the shapes allow, running
 * every sum in loadv's order on the same values: the same bits. */
#if VL == 16
#define PAIRED_LINES 1
#define PAIRED_MAX_HEAD_DIM 128
static inline void load_pairs(const void *cache, int64_t index, vf *even, vf *odd) {
    const __m512i v = _mm512_loadu_si512((const uint16_t *)cache + index);
    *even = (vf)_mm512_slli_epi32(v, 16);
    *odd = (vf)_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u));
}

/* lanes 0-7 of a and of b interleaved (a0 b0 a1 b1 ..), or with `high` lanes 8-15 */
static inline vf interleave(vf a, vf b, int high) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i idx = high ? _mm512_add_epi32(lo, _mm512_set1_epi32(8)) : lo;
    return (vf)_mm512_permutex2var_ps((__m512)a, idx, (__m512)b);
}
#else
#define PAIRED_LINES 0
static inline vf interleave(vf a, vf b, int high) { return (void)b, (void)high, a; } /* never called */
#endif

/* Whether score_pages takes a page's lines as pairs of dimensions (and its prefetches go by 8 lines) */
static inline int paired_pages(int bf16, int64_t block_size, int64_t head_dim) {
#if PAIRED_LINES
    return bf16 && block_size == VL && head_dim <= PAIRED_MAX_HEAD_DIM;
#else
    return (void)bf16, (void)block_size, (void)head_dim, 0;
#endif
}

/* `count` vectors from `index` (a literal: 1, loadv's; 2 where PAIRED_LINES, a line's even and odd lanes) */
static inline __attribute__((always_inline)) void load_values(vf *row, const void *cache, int64_t index, int bf16,
                                                              int64_t count) {
#if PAIRED_LINES
    if (count == 2) {
        load_pairs(cache, index, &row[0], &row[1]);
        return;
    }
#endif
    (void)count;
    row[0] = loadv(cache, index, bf16);
}

/* Ask for the `elements` from `index` on (one K or V page of one head) ahead of their use: a sequence's pages
 * lie anywhere in the cache, so the hardware prefetcher cannot guess the next one. Into L1, or with `l2`
 * (a literal at each call) into L2 only: a page the item reads later (its V pages, asked for during the K
 * pass, so that the value pass finds them near instead of waiting on each in turn). */
static inline void prefetch_page(const void *cache, int64_t index, int bf16, int64_t elements, const int l2) {
    const char *p = (const char *)cache + index * (bf16 ? 2 : 4);
    const int64_t bytes = elements * (bf16 ? 2 : 4);
    for (int64_t off = 0; off < bytes; off += 64) {
        if (l2)
            __builtin_prefetch(p + off, 0, 2);
        else
            __builtin_prefetch(p + off, 0, 3);
    }
}

/* prefetch_page for the bfloat16 lines of score_pages' pairs (a page a multiple of 512 bytes): eight lines an
 * iteration at constant offsets from one address. Inlined into `attend`, prefetch_page's loop kept its address
 * in a vector register (a spill) and each line waited on that round trip: at an item's start, asking for its
 * first pages cost ~9 cycles a line (perf annotate, 16 rows of 160 tokens). */
static inline void prefetch_page_by_8(const void *cache, int64_t index, int64_t elements, const int l2) {
    const char *p = (const char *)cache + index * 2;
    for (int64_t off = 0; off < elements * 2; off += 512) {
        const char *at = p + off;
#pragma GCC unroll 8
        for (int line = 0; line < 8; line++) {
            if (l2)
                __builtin_prefetch(at + 64 * line, 0, 2);
            else
                __builtin_prefetch(at + 64 * line, 0, 3);
        }
    }
}

/* s[j] = softcap * tanh(s[j] / softcap) for j in [lo, hi): Gemma 2's soft-capped attention logits. */
static inline void soft_cap(float *s, int64_t lo, int64_t hi, float softcap) {
    const float inv = 1.0f / softcap;
    for (int64_t j = lo; j < hi; j++) s[j] = softcap * tanhf(s[j] * inv);
}

/* The vectors of head_dim one pass of the value pass accumulates per query head of a tile of `rows` rows
 * (see VL and RUN_ROWS): head_dim / VL halved while the accumulators exceed the budget (or it does not
 * divide head_dim / VL). Written without a loop, so that the literal copies of `attend` fold it to a
 * constant and unroll the loops over it (their accumulators stay in registers). */
static inline int64_t halve_slice(int64_t slice, int64_t vectors, int64_t heads, int64_t budget) {
    return slice > 1 && (slice * heads > budget || vectors % slice) ? slice / 2 : slice;
}

static inline int64_t value_slice(int64_t rows, int64_t group, int64_t head_dim) {
    /* a tile's pass holds the slice of V[j] too: one more vector per head's (so slice x (rows x group + 1)
     * <= RUN_REGS: at most RUN_REGS / 2 + 1 heads, see RUN_ROWS) */
    const int64_t budget = rows > 1 ? RUN_REGS : PV_REGS, vectors = head_dim / VL;
    const int64_t heads = rows > 1 ? rows * group + 1 : group;
    if (!budget) return vectors;
    int64_t slice = vectors; /* at most MAX_HEAD_DIM / 8 = 64: six halvings reach 1 */
    slice = halve_slice(slice, vectors, heads, budget), slice = halve_slice(slice, vectors, heads, budget);
    slice = halve_slice(slice, vectors, heads, budget), slice = halve_slice(slice, vectors, heads, budget);
    slice = halve_slice(slice, vectors, heads, budget), slice = halve_slice(slice, vectors, heads, budget);
    return slice;
}

/* The softmax of one query head's scores over its visible keys [lo, hi), after the soft cap if any: s[j] =
 * exp(s[j] - max), returns 1 / sum (the max is a visible score, so the sum is >= 1). One compiled body for
 * every copy of `attend`, so a row's sums run in the same order whether it is attended alone or in a tile
 * of a verify run (-ffast-math vectorises the sum; its lanes depend only on lo and hi). */
NOIPA float softmax_row(float *s, int64_t lo, int64_t hi, float softcap) {
    if (softcap > 0.0f) soft_cap(s, lo, hi, softcap);
    float max = s[lo], sum = 0.0f;
    for (int64_t j = lo + 1; j < hi; j++) max = s[j] > max ? s[j] : max;
    for (int64_t j = lo; j < hi; j++) {
        s[j] = expf(s[j] - max);
        sum += s[j];
    }
    return 1.0f / sum;
}

/* values_row's sums over vectors of `slice` from d_lo on, read `step` vectors at a time (a literal: 1, loadv's
 * vectors; 2, bfloat16 lines of 32 dimensions, accumulator c + 1 the odd lanes of the line whose even lanes
 * are accumulator c) */
static inline __attribute__((always_inline)) void values_row_by(
    float *out, const void *v_cache, int bf16, const int64_t *table, int64_t b_first, int64_t b_end, int64_t lo,
    int64_t hi, const int64_t group, const int64_t head_dim, int64_t block_size, int64_t block_stride,
    int64_t head_offset, const float *scores, int64_t padded, const float *inv_sum, int64_t d_lo, int64_t d_hi,
    int64_t slice, const int64_t step) {
    const int64_t page = head_dim * block_size;
    for (int64_t d0 = d_lo; d0 < d_hi; d0 += slice * VL) {
        vf acc[MAX_GROUP][MAX_HEAD_DIM / VL];
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < slice; c++) acc[g][c] = (vf){0};
        for (int64_t b = b_first; b < b_end; b++) {
            const int64_t v = table[b] * block_stride + head_offset + d0; /* [block_size, head_dim] */
            /* the next page: with bfloat16 lines, a line asked for as each line is read (as score_pages) */
            const int64_t v_next = table[b + 1 < b_end ? b + 1 : b] * block_stride + head_offset + d0;
            if (step == 1 && d0 == d_lo && b + 1 < b_end)
                prefetch_page(v_cache, table[b + 1] * block_stride + head_offset, bf16, page, 0);
            const int64_t j0 = (b - b_first) * block_size;
            const int64_t t0 = lo > j0 ? lo - j0 : 0, t1 = hi - j0 < block_size ? hi - j0 : block_size;
            for (int64_t t = t0; t < t1; t++)
                for (int64_t c = 0; c < slice; c += step) {
                    if (step == 2)
                        __builtin_prefetch((const uint16_t *)v_cache + v_next + t * head_dim + c * VL, 0, 3);
                    vf row[2];
                    load_values(row, v_cache, v + t * head_dim + c * VL, bf16, step);
                    for (int64_t g = 0; g < group; g++)
                        for (int64_t i = 0; i < step; i++) acc[g][c + i] += scores[g * padded + j0 + t] * row[i];
                }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < slice; c += step)
                for (int64_t i = 0; i < step; i++) {
                    vf o = (step == 2 ? interleave(acc[g][c], acc[g][c + 1], (int)i) : acc[g][c]) * inv_sum[g];
                    memcpy(out + g * head_dim + d0 + (c + i) * VL, &o, sizeof o);
                }
    }
}

/* o[g][d_lo:d_hi] = sum_j p[g, j] V[j][d_lo:d_hi] for one row's `group` query heads over its keys [lo, hi)
 * (scores[g * padded + j] = p[g, j] * sum), in slices of `slice` vectors of head_dim (all of the range unless
 * PV_REGS says otherwise; see VL). Each lane sums over the keys in order, whatever the range and the slice.
 * Inlined, as `attend`. */
static inline __attribute__((always_inline)) void values_row(
    float *out, const void *v_cache, int bf16, const int64_t *table, int64_t b_first, int64_t b_end, int64_t lo,
    int64_t hi, const int64_t group, const int64_t head_dim, int64_t block_size, int64_t block_stride,
    int64_t head_offset, const float *scores, int64_t padded, const float *inv_sum, int64_t d_lo, int64_t d_hi) {
    const int64_t whole = value_slice(1, group, head_dim);
    const int64_t slice = whole * VL <= d_hi - d_lo ? whole : (d_hi - d_lo) / VL; /* each lane's sums the same */
    if (PAIRED_LINES && bf16 && slice % 2 == 0 && (d_hi - d_lo) % (slice * VL) == 0)
        values_row_by(out, v_cache, bf16, table, b_first, b_end, lo, hi, group, head_dim, block_size, block_stride,
                      head_offset, scores, padded, inv_sum, d_lo, d_hi, slice, 2);
    else
        values_row_by(out, v_cache, bf16, table, b_first, b_end, lo, hi, group, head_dim, block_size, block_stride,
                      head_offset, scores, padded, inv_sum, d_lo, d_hi, slice, 1);
}

/* values_row for the `rows` rows of a tile of a verify run, row r's keys [lo[r], hi[r]) (ascending in r): each
 * slice of V[j] is loaded once and used by every head of every row that sees key j; the accumulators of
 * all rows x group heads fit in RUN_REGS registers (value_slice); each head's sums are values_row's, over
 * the same keys in the same order. */
static inline __attribute__((always_inline)) void values_run(
    float *const *out, const void *v_cache, int bf16, const int64_t *table, int64_t b_first, int64_t b_end,
    const int64_t *lo, const int64_t *hi, const int64_t rows, const int64_t group, const int64_t head_dim,
    int64_t block_size, int64_t block_stride, int64_t head_offset, const float *scores, int64_t padded,
    const float *inv_sum) {
    const int64_t page = head_dim * block_size, slice = value_slice(rows, group, head_dim), heads = rows * group;
    const int64_t j_lo = lo[0], j_hi = hi[rows - 1];     /* the keys some row sees */
    const int64_t all_lo = lo[rows - 1], all_hi = hi[0]; /* the keys every row sees */
    for (int64_t d0 = 0; d0 < head_dim; d0 += slice * VL) {
        vf acc[RUN_REGS]; /* head h's vector c at h * slice + c */
        for (int64_t i = 0; i < heads * slice; i++) acc[i] = (vf){0};
        for (int64_t b = b_first; b < b_end; b++) {
            const int64_t v = table[b] * block_stride + head_offset + d0; /* [block_size, head_dim] */
            if (d0 == 0 && b + 1 < b_end)
                prefetch_page(v_cache, table[b + 1] * block_stride + head_offset, bf16, page, 0);
            const int64_t j0 = (b - b_first) * block_size;
            const int64_t t0 = j_lo > j0 ? j_lo - j0 : 0, t1 = j_hi - j0 < block_size ? j_hi - j0 : block_size;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t j = j0 + t;
                vf row[RUN_REGS];
                for (int64_t c = 0; c < slice; c++) row[c] = loadv(v_cache, v + t * head_dim + c * VL, bf16);
                if (j >= all_lo && j < all_hi) /* a key every row sees */
                    for (int64_t h = 0; h < heads; h++)
                        for (int64_t c = 0; c < slice; c++) acc[h * slice + c] += scores[h * padded + j] * row[c];
                else /* a key some rows see (selects, not branches: the accumulators stay in registers) */
                    for (int64_t h = 0; h < heads; h++)
                        for (int64_t c = 0; c < slice; c++)
                            acc[h * slice + c] = j >= lo[h / group] && j < hi[h / group]
                                                     ? acc[h * slice + c] + scores[h * padded + j] * row[c]
                                                     : acc[h * slice + c];
            }
        }
        for (int64_t h = 0; h < heads; h++)
            for (int64_t c = 0; c < slice; c++) {
                vf o = acc[h * slice + c] * inv_sum[h];
                memcpy(out[h / group] + (h % group) * head_dim + d0 + c * VL, &o, sizeof o);
            }
    }
}

/* s[r, g, j] = scale * <q[r][g], K[j]> for the keys of pages [b_lo, b_hi) of a tile (rows x group query heads;
 * the tile's scores start at page b_first, `padded` floats per head), a VL-key tile at a time; lanes outside
 * a row's visible keys are computed and never read. Two accumulators per head (even and odd dimensions) hide
 * the FMA latency. Each key's scores are the same whatever range of pages computes them. K pages are asked
 * for L2_PAGES ahead into L2 and PREFETCH_PAGES ahead into L1, each V page into L2 meanwhile. Inlined, as
 * `attend`. */
static inline __attribute__((always_inline)) void score_pages(
    float *scores, const float *const *q, const void *k_cache, const void *v_cache, int bf16, const int64_t *table,
    int64_t b_first, int64_t b_lo, int64_t b_hi, const int64_t rows, const int64_t group, const int64_t head_dim,
    int64_t block_size, int64_t block_stride, int64_t head_offset, float scale, int64_t padded) {
    const int64_t page = head_dim * block_size, b_end = b_hi;
#if VL == 16
    /* bfloat16 pages of 16 keys: rows d and d + 1 of a page are one line (load_pairs), whose even lanes are
     * keys 0, 2, .., 14 of both rows, times q[d] (lanes 0-7) and q[d + 1] (8-15): each key's two chains
     * (even and odd d) in one vector's two halves */
    const int paired = paired_pages(bf16, block_size, head_dim);
    vf q_pairs[paired ? rows * group * head_dim / 2 : 1]; /* [head][d / 2]: q[d] x 8, q[d + 1] x 8 */
    for (int64_t h = 0; paired && h < rows * group; h++)
        for (int64_t d = 0; d < head_dim; d += 2)
            q_pairs[h * head_dim / 2 + d / 2] = (vf)_mm512_shuffle_f32x4(
                _mm512_set1_ps(q[h / group][h % group * head_dim + d]),
                _mm512_set1_ps(q[h / group][h % group * head_dim + d + 1]), 0x44);
#endif
    for (int64_t b = b_lo; b < b_end && b < b_lo + L2_PAGES; b++) {
#if VL == 16
        if (paired) {
            if (b >= b_lo + PREFETCH_PAGES)
                prefetch_page_by_8(k_cache, table[b] * block_stride + head_offset, page, 1);
            else
                prefetch_page_by_8(k_cache, table[b] * block_stride + head_offset, page, 0);
            continue;
        }
#endif
        prefetch_page(k_cache, table[b] * block_stride + head_offset, bf16, page, b >= b_lo + PREFETCH_PAGES);
    }
    for (int64_t b = b_lo; b < b_end; b++) {
        const int64_t k = table[b] * block_stride + head_offset; /* [head_dim, block_size] */
#if VL == 16
        if (paired) {
            /* the pages ahead asked for a line a pair of dimensions, among the dot products (a page is one line
             * a pair): a page's lines asked for at once stall the loop while the core's misses in flight are
             * full, or, inlined here, in the loop's own address round trips through a vector register */
            const int64_t b_far = b + L2_PAGES < b_end ? b + L2_PAGES : b;
            const int64_t b_near = b + PREFETCH_PAGES < b_end ? b + PREFETCH_PAGES : b;
            const uint16_t *far = (const uint16_t *)k_cache + table[b_far] * block_stride + head_offset;
            const uint16_t *near = (const uint16_t *)k_cache + table[b_near] * block_stride + head_offset;
            const uint16_t *values = (const uint16_t *)v_cache + k;
            vf even[MAX_GROUP], odd[MAX_GROUP]; /* keys 0, 2, .., 14 and 1, 3, .., 15: the even d's chains in
                                                   lanes 0-7, the odd d's in 8-15 */
            for (int64_t h = 0; h < rows * group; h++) even[h] = odd[h] = (vf){0};
            for (int64_t d = 0; d < head_dim; d += 2) {
                __builtin_prefetch(far + d * block_size, 0, 2);
                __builtin_prefetch(near + d * block_size, 0, 3);
                __builtin_prefetch(values + d * block_size, 0, 2);
                vf e, o;
                load_pairs(k_cache, k + d * block_size, &e, &o);
                for (int64_t h = 0; h < rows * group; h++) {
                    even[h] += q_pairs[h * head_dim / 2 + d / 2] * e;
                    odd[h] += q_pairs[h * head_dim / 2 + d / 2] * o;
                }
            }
            for (int64_t h = 0; h < rows * group; h++) { /* each key's even chain + its odd chain, in key order */
                const vf e = even[h] + (vf)_mm512_shuffle_f32x4((__m512)even[h], (__m512)even[h], 0x4E);
                const vf o = odd[h] + (vf)_mm512_shuffle_f32x4((__m512)odd[h], (__m512)odd[h], 0x4E);
                vf sc = interleave(e, o, 0) * scale;
                memcpy(scores + h * padded + (b - b_first) * block_size, &sc, sizeof sc);
            }
            continue;
        }
#endif
        if (b + L2_PAGES < b_end)
            prefetch_page(k_cache, table[b + L2_PAGES] * block_stride + head_offset, bf16, page, 1);
        if (b + PREFETCH_PAGES < b_end)
            prefetch_page(k_cache, table[b + PREFETCH_PAGES] * block_stride + head_offset, bf16, page, 0);
        prefetch_page(v_cache, table[b] * block_stride + head_offset, bf16, page, 1);
        for (int64_t t = 0; t < block_size; t += VL) {
            vf even[MAX_GROUP], odd[MAX_GROUP]; /* [rows * group]: row r's head g at r * group + g */
            for (int64_t h = 0; h < rows * group; h++) even[h] = odd[h] = (vf){0};
            for (int64_t d = 0; d < head_dim; d += 2) {
                const vf k0 = loadv(k_cache, k + d * block_size + t, bf16);
                const vf k1 = loadv(k_cache, k + (d + 1) * block_size + t, bf16);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t g = 0; g < group; g++) {
                        even[r * group + g] += q[r][g * head_dim + d] * k0;
                        odd[r * group + g] += q[r][g * head_dim + d + 1] * k1;
                    }
            }
            for (int64_t h = 0; h < rows * group; h++) {
                vf s = (even[h] + odd[h]) * scale;
                memcpy(scores + h * padded + (b - b_first) * block_size + t, &s, sizeof s);
            }
        }
    }
}

/* One tile (`rows` rows of one verify run, or one decode row) x one KV head. Row r's query heads are at
 * q[r], its output at out[r]; it sees keys first[r] .. seq_len[r] - 1 of the pages in `table`; the rows
 * are in ascending seq_len. Inlined into each call site: where `head_dim`, `group` and `rows` are literals,
 * the loops unroll and the accumulators of the tile's rows x group query heads stay in registers. Each K
 * and V vector is loaded (and widened from bfloat16) once and used by every query head of the tile; each
 * head's sums are those of the row attended alone, over the same keys in the same order. */
static inline __attribute__((always_inline)) void attend(
    float *const *out, const float *const *q, const void *k_cache, const void *v_cache, int bf16,
    const int64_t *table, const int64_t *first, const int64_t *seq_len, const int64_t rows, const int64_t group,
    const int64_t head_dim, int64_t block_size, int64_t block_stride, int64_t head_offset, float scale,
    float softcap, float *scores) {
    const int64_t b_first = first[0] / block_size, b_end = (seq_len[rows - 1] + block_size - 1) / block_size;
    const int64_t padded = (b_end - b_first) * block_size; /* scores row length per query head */
    const int64_t page = head_dim * block_size;            /* elements of one head's K (or V) page */
    int64_t lo[MAX_RUN_ROWS], hi[MAX_RUN_ROWS];                    /* row r's visible keys [lo, hi) in its scores */
    for (int64_t r = 0; r < rows; r++) lo[r] = first[r] - b_first * block_size, hi[r] = seq_len[r] - b_first * block_size;

    score_pages(scores, q, k_cache, v_cache, bf16, table, b_first, b_first, b_end, rows, group, head_dim, block_size,
                block_stride, head_offset, scale, padded);
    if (paired_pages(bf16, block_size, head_dim))
        prefetch_page_by_8(v_cache, table[b_first] * block_stride + head_offset, page, 0);
    else
        prefetch_page(v_cache, table[b_first] * block_stride + head_offset, bf16, page, 0);

    /* p[r, g, j] = exp(s[r, g, j] - max) / sum over row r's visible keys */
    float inv_sum[MAX_GROUP];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < group; g++)
            inv_sum[r * group + g] = softmax_row(scores + (r * group + g) * padded, lo[r], hi[r], softcap);

    /* o[r, g] = sum_j p[r, g, j] V[j] over row r's visible keys only (a stale slot may hold anything, even
     * NaN, so a key past a row's end never enters its sums, not even times 0) */
    if (rows == 1)
        values_row(out[0], v_cache, bf16, table, b_first, b_end, lo[0], hi[0], group, head_dim, block_size,
                   block_stride, head_offset, scores, padded, inv_sum, 0, head_dim);
    else
        values_run(out, v_cache, bf16, table, b_first, b_end, lo, hi, rows, group, head_dim, block_size,
                   block_stride, head_offset, scores, padded, inv_sum);
}

/* Whether the kernel takes this shape. */
static int supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    return block_size % LANES == 0 && head_dim % LANES == 0 && head_dim <= MAX_HEAD_DIM && num_kv_heads >= 1 &&
           num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP;
}

/* Floats of scratch one work item of a tile of `rows` rows of at most `seq_len` keys needs. */
static int64_t scores_size(int64_t rows, int64_t group, int64_t seq_len, int64_t block_size) {
    return rows * group * (seq_len + 2 * block_size);
}

/* CALL(GROUP, HEAD_DIM) with literals where the group and head_dim have their own unrolled copies (groups 1,
 * 2, 3, 4 and 8 at head_dim 64 and 128), else GENERIC */
#define LITERAL_GROUPS(CALL, GENERIC, HEAD_DIM)                                                       \
    switch (group) {                                                                                  \
    case 1: CALL(1, HEAD_DIM); break;                                                                 \
    case 2: CALL(2, HEAD_DIM); break;                                                                 \
    case 3: CALL(3, HEAD_DIM); break;                                                                 \
    case 4: CALL(4, HEAD_DIM); break;                                                                 \
    case 8: CALL(8, HEAD_DIM); break;                                                                 \
    default: GENERIC;                                                                                 \
    }
#define LITERAL_SHAPES(CALL, GENERIC)                                                                 \
    if (head_dim == 64)                                                                               \
        LITERAL_GROUPS(CALL, GENERIC, 64)                                                             \
    else if (head_dim == 128)                                                                         \
        LITERAL_GROUPS(CALL, GENERIC, 128)                                                            \
    else                                                                                              \
        GENERIC

/* The first key a row of KV length `len` sees: all of them, or the last `sliding_window` (> 0). */
static inline int64_t first_key(int64_t len, int64_t sliding_window) {
    return sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
}

/* Work item (tile, h): the `group` query heads that share KV head h of each of the tile's `rows` rows,
 * row_ids[0 .. rows) (one verify run's, in ascending seq_len; or one row), over the pages of the last row's
 * block table (plan_tiles made sure that every row's pages are the same entries there). `scores`: at least
 * scores_size(rows, group, longest seq_len, block_size) floats. */
NOIPA void attend_item(float *out, const float *q, int64_t q_seq_stride, const void *k_cache, const void *v_cache,
                        int kv_is_bf16, const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t sliding_window, float softcap, const int64_t *row_ids, int64_t rows, int64_t h,
                        float *scores) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = num_kv_heads * head_dim * block_size, head_stride = head_dim * block_size;
    const float *qs[MAX_RUN_ROWS];
    float *os[MAX_RUN_ROWS];
    int64_t first[MAX_RUN_ROWS], lens[MAX_RUN_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t s = row_ids[r];
        lens[r] = seq_lens[s];
        first[r] = first_key(lens[r], sliding_window);
        qs[r] = q + s * q_seq_stride + h * group * head_dim;
        os[r] = out + (s * num_heads + h * group) * head_dim;
    }
    const int64_t *table = block_tables + row_ids[rows - 1] * table_stride;
#define ATTEND(ROWS, GROUP, HEAD_DIM)                                                                 \
    attend(os, qs, k_cache, v_cache, kv_is_bf16, table, first, lens, ROWS, GROUP, HEAD_DIM, block_size, \
           block_stride, h * head_stride, scale, softcap, scores)
    /* a literal copy for each tile size this group can have (RUN_ROWS) */
#define ATTEND_ROWS(GROUP, HEAD_DIM)                                                                  \
    switch (rows) {                                                                                   \
    case 1: ATTEND(1, GROUP, HEAD_DIM); break;                                                        \
    case 2: if (RUN_ROWS(GROUP) >= 2) ATTEND(2, GROUP, HEAD_DIM); break;                             \
    case 3: if (RUN_ROWS(GROUP) >= 3) ATTEND(3, GROUP, HEAD_DIM); break;                             \
    default: if (RUN_ROWS(GROUP) >= 4) ATTEND(4, GROUP, HEAD_DIM); break;                            \
    }
    LITERAL_SHAPES(ATTEND_ROWS, ATTEND(rows, group, head_dim));
#undef ATTEND_ROWS
#undef ATTEND
}

/* ---- a lone row's items split over the threads ----
 *
 * A step of one row has a work item per KV head (3 for SmolLM2), so on 2 threads one thread attends two
 * while the other waits (a 2,048-token context: the step ~2.8 ms longer than a balanced split). Where a step
 * has fewer items than two per thread and every tile is one row, the decode stack (decode_stack.c's
 * paged_attention_split) splits each item in three passes, each ending in a barrier:
 *   score_item_part   the scores of one part of the item's pages (parts of near-equal size)
 *   softmax_item_head softmax_row of one query head; 1 / sum stored after the item's scores
 *   values_item_part  the output lanes [d_lo, d_hi) of the item's heads
 * Each key's scores, each head's softmax and each lane's sums are attend_item's computations in the same
 * order, so a row's output is the same bits split or not (tests/model/test_decode_stack.py). An item's
 * scratch is split_scores_size floats. */

/* Floats of one split item's scratch: its heads' scores, then their 1 / sum. */
static int64_t split_scores_size(int64_t group, int64_t seq_len, int64_t block_size) {
    return scores_size(1, group, seq_len, block_size) + group;
}

/* Row s's keys as attend sees them: pages [b_first, b_end), visible keys [lo, hi) of its scores, `padded`
 * scores per query head. */
typedef struct {
    int64_t b_first, b_end, lo, hi, padded;
} row_keys;

static row_keys keys_of(const int64_t *seq_lens, int64_t s, int64_t sliding_window, int64_t block_size) {
    const int64_t len = seq_lens[s], first = first_key(len, sliding_window);
    row_keys k = {first / block_size, (len + block_size - 1) / block_size, 0, 0, 0};
    k.lo = first - k.b_first * block_size, k.hi = len - k.b_first * block_size;
    k.padded = (k.b_end - k.b_first) * block_size;
    return k;
}

/* The scores of part `part` of `parts` of the pages of item (row s, KV head h). */
NOIPA void score_item_part(float *scores, const float *q, int64_t q_seq_stride, const void *k_cache,
                            const void *v_cache, int bf16, const int64_t *block_tables, int64_t table_stride,
                            const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t sliding_window, int64_t s, int64_t h,
                            int64_t part, int64_t parts) {
    const int64_t group = num_heads / num_kv_heads, head_stride = head_dim * block_size;
    const int64_t block_stride = num_kv_heads * head_stride;
    const row_keys k = keys_of(seq_lens, s, sliding_window, block_size);
    const int64_t pages = k.b_end - k.b_first;
    const int64_t b_lo = k.b_first + pages * part / parts, b_hi = k.b_first + pages * (part + 1) / parts;
    const float *qs[1] = {q + s * q_seq_stride + h * group * head_dim};
    const int64_t *table = block_tables + s * table_stride;
#define SCORE(GROUP, HEAD_DIM)                                                                         \
    score_pages(scores, qs, k_cache, v_cache, bf16, table, k.b_first, b_lo, b_hi, 1, GROUP, HEAD_DIM, block_size, \
                block_stride, h * head_stride, scale, k.padded)
    LITERAL_SHAPES(SCORE, SCORE(group, head_dim));
#undef SCORE
}

/* Query head g's softmax over its scores (after score_item_part of every part); its 1 / sum after the
 * item's scores. */
NOIPA void softmax_item_head(float *scores, const int64_t *seq_lens, int64_t group, int64_t block_size,
                              int64_t sliding_window, float softcap, int64_t s, int64_t g) {
    const row_keys k = keys_of(seq_lens, s, sliding_window, block_size);
    scores[group * k.padded + g] = softmax_row(scores + g * k.padded, k.lo, k.hi, softcap);
}

/* The output lanes [d_lo, d_hi) of item (row s, KV head h)'s query heads (after softmax_item_head of every
 * head): out as attend_item's. */
NOIPA void values_item_part(float *out, const void *v_cache, int bf16, const int64_t *block_tables,
                             int64_t table_stride, const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t sliding_window, int64_t s, int64_t h,
                             int64_t d_lo, int64_t d_hi, const float *scores) {
    const int64_t group = num_heads / num_kv_heads, head_stride = head_dim * block_size;
    const int64_t block_stride = num_kv_heads * head_stride;
    const row_keys k = keys_of(seq_lens, s, sliding_window, block_size);
    float *o = out + (s * num_heads + h * group) * head_dim;
    const int64_t *table = block_tables + s * table_stride;
#define VALUES(GROUP, HEAD_DIM)                                                                        \
    values_row(o, v_cache, bf16, table, k.b_first, k.b_end, k.lo, k.hi, GROUP, HEAD_DIM, block_size, block_stride, \
               h * head_stride, scores, k.padded, scores + GROUP * k.padded, d_lo, d_hi)
    LITERAL_SHAPES(VALUES, VALUES(group, head_dim));
#undef VALUES
}
#undef LITERAL_SHAPES
#undef LITERAL_GROUPS

/* Whether row s can follow row `last` in the verify run that row `head` began: the next position, and the
 * same pages (the same block table entries for every page s reads; compared from its last page, where
 * two different sequences' tables differ -- a shared prefix is at the front). */
static int continues_run(const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                         int64_t block_size, int64_t head, int64_t last, int64_t s) {
    if (seq_lens[s] != seq_lens[last] + 1) return 0;
    const int64_t *a = block_tables + head * table_stride, *b = block_tables + s * table_stride;
    for (int64_t page = (seq_lens[s] + block_size - 1) / block_size - 1; page >= 0; page--)
        if (a[page] != b[page]) return 0;
    return 1;
}

/* The tiles a call needs so that each of `threads` threads has a work item (tile, KV head). */
static int64_t min_tiles(int64_t threads, int64_t num_kv_heads) { return (threads + num_kv_heads - 1) / num_kv_heads; }

/* How far back plan_tiles looks for the run a row continues: the rows are in ascending KV length
 * (engine/executor/inputs.py), so other sequences' rows of the same lengths can sit between two rows of a
 * run; a run missed is only attended row by row. */
#define RUN_LOOKBACK 64

/* int64s of a plan of num_seqs rows: row_ids, tile_starts, plan_tiles' scratch */
static int64_t plan_size(int64_t num_seqs) { return 6 * num_seqs + 1; }

/* The work items' tiles of a decode call: the rows grouped into verify runs (rows at consecutive KV lengths
 * over the same pages, as engine/executor/runner.py's `prepare` lays out a speculative verify chunk), each
 * run cut into tiles of near-equal size, as few as RUN_ROWS(group) allows -- but while the call has fewer
 * than `min_tiles` tiles (threads without a work item), the run with the largest tiles is cut once more, down
 * to a row per tile: today's split, each page read once per row. Every other row is a tile of its own.
 * Tile i is rows row_ids[tile_starts[i] .. tile_starts[i + 1]) in ascending KV length. `plan` holds
 * plan_size(num_seqs) int64s; returns the number of tiles, the plan at `plan` (row_ids) and `plan +
 * num_seqs` (tile_starts). It does not depend on the window: one plan serves every layer of a step. */
static int64_t plan_tiles(const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                          int64_t num_seqs, int64_t block_size, int64_t group, int64_t min_tiles, int64_t *plan) {
    int64_t *row_ids = plan, *tile_starts = plan + num_seqs, *head = plan + 2 * num_seqs + 1;
    int64_t *next = head + num_seqs, *length = next + num_seqs, *cuts = length + num_seqs;
    /* each row's run's first row, the run's next row; a run's length and tiles (at its first row) */
    for (int64_t s = 0; s < num_seqs; s++) {
        head[s] = s, next[s] = -1, length[s] = 1;
        const int64_t stop = s > RUN_LOOKBACK ? s - RUN_LOOKBACK : 0;
        for (int64_t r = s - 1; r >= stop && seq_lens[r] + 1 >= seq_lens[s]; r--)
            if (next[r] < 0 && continues_run(block_tables, table_stride, seq_lens, block_size, head[r], r, s)) {
                next[r] = s, head[s] = head[r], length[head[s]]++;
                break;
            }
    }
    const int64_t max_rows = RUN_ROWS(group);
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        if (head[s] == s) cuts[s] = (length[s] + max_rows - 1) / max_rows, tiles += cuts[s];
    while (tiles < min_tiles) {
        int64_t widest = -1; /* the run with the largest tiles, length / cuts */
        for (int64_t s = 0; s < num_seqs; s++)
            if (head[s] == s && cuts[s] < length[s] &&
                (widest < 0 || length[s] * cuts[widest] > length[widest] * cuts[s]))
                widest = s;
        if (widest < 0) break;
        cuts[widest]++, tiles++;
    }
    int64_t placed = 0, tile = 0;
    tile_starts[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (head[s] != s) continue;
        const int64_t n = length[s], k = cuts[s];
        for (int64_t r = s, i = 0; r >= 0; r = next[r]) row_ids[placed + i++] = r;
        for (int64_t i = 0; i < k; i++) {
            placed += n / k + (i < n % k);
            tile_starts[++tile] = placed;
        }
    }
    return tiles;
}

/* Floats of scratch the largest work item of a plan of `tiles` tiles needs (scores_size of its tile). */
static int64_t plan_scores_size(const int64_t *plan, int64_t tiles, int64_t num_seqs, const int64_t *seq_lens,
                                int64_t group, int64_t block_size) {
    const int64_t *row_ids = plan, *tile_starts = plan + num_seqs;
    int64_t most = 0;
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t rows = tile_starts[i + 1] - tile_starts[i], last = row_ids[tile_starts[i + 1] - 1];
        const int64_t size = scores_size(rows, group, seq_lens[last], block_size);
        most = size > most ? size : most;
    }
    return most;
}

/* The work items' tiles of a decode call of these rows with `group` query heads per KV head on `threads`
 * threads and `num_kv_heads` KV heads (plan_tiles): writes row_ids[num_seqs] and tile_starts[num_seqs + 1],
 * returns the number of tiles; -1: out of memory. For tests and tools: which rows share their pages' reads. */
int64_t cbserve_decode_tiles(const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                             int64_t num_seqs, int64_t block_size, int64_t group, int64_t num_kv_heads,
                             int64_t threads, int64_t *row_ids, int64_t *tile_starts) {
    int64_t *plan = malloc(sizeof(int64_t) * (size_t)plan_size(num_seqs));
    if (plan == NULL) return -1;
    const int64_t tiles = plan_tiles(block_tables, table_stride, seq_lens, num_seqs, block_size, group,
                                     min_tiles(threads, num_kv_heads), plan);
    memcpy(row_ids, plan, sizeof(int64_t) * (size_t)num_seqs);
    memcpy(tile_starts, plan + num_seqs, sizeof(int64_t) * (size_t)(tiles + 1));
    free(plan);
    return tiles;
}

/* Work items handed to a thread at a time: a tile's KV heads together (their pages lie side by side in each
 * block, so one thread reads each block's K, then V, in one stretch) where there are tiles enough for every
 * thread; else one item, so that a single row's heads still spread over the threads. A 16-row step of
 * 128-token prompts: the attention 26 -> 25% of the decode stack's cycles, 54 -> 52% at 1,100 tokens. */
static int64_t items_per_chunk(int64_t tiles, int threads, int64_t num_kv_heads) {
    return tiles >= 2 * threads ? num_kv_heads : 1;
}

/* Returns 0; -2 for an unsupported shape (nothing written); -1 if a scratch buffer could not be allocated. */
int cbserve_paged_decode_attention(
    float *out,                  /* [num_seqs, num_heads, head_dim] */
    const float *q,              /* sequence s's heads at q + s * q_seq_stride, [num_heads, head_dim] */
    int64_t q_seq_stride,
    const void *k_cache,         /* [num_blocks, num_kv_heads, head_dim, block_size] */
    const void *v_cache,         /* [num_blocks, num_kv_heads, block_size, head_dim] */
    int kv_is_bf16,
    const int64_t *block_tables, /* [num_seqs, table_stride] */
    int64_t table_stride,
    const int64_t *seq_lens,     /* [num_seqs], KV length including the new token, >= 1 */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t sliding_window /* <= 0: none */, float softcap /* <= 0: none */) {
    if (!supported(num_heads, num_kv_heads, head_dim, block_size)) return -2;
    const int64_t group = num_heads / num_kv_heads;
    int64_t *plan = malloc(sizeof(int64_t) * (size_t)plan_size(num_seqs));
    if (plan == NULL) return -1;
    const int64_t tiles = plan_tiles(block_tables, table_stride, seq_lens, num_seqs, block_size, group,
                                     min_tiles(omp_get_max_threads(), num_kv_heads), plan);
    const int64_t *row_ids = plan, *tile_starts = plan + num_seqs;
    int failed = 0;
    const int64_t chunk = items_per_chunk(tiles, omp_get_max_threads(), num_kv_heads);

#pragma omp parallel for schedule(dynamic, chunk) reduction(| : failed)
    for (int64_t item = 0; item < tiles * num_kv_heads; item++) {
        const int64_t tile = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t *rows = row_ids + tile_starts[tile], n = tile_starts[tile + 1] - tile_starts[tile];
        float *scores = malloc(sizeof(float) * (size_t)scores_size(n, group, seq_lens[rows[n - 1]], block_size));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend_item(out, q, q_seq_stride, k_cache, v_cache, kv_is_bf16, block_tables, table_stride, seq_lens,
                    num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, softcap, rows, n, h, scores);
        free(scores);
    }
    free(plan);
    return failed ? -1 : 0;
}

/* Token i's keys and values into row slot % block_size of block slot / block_size (K transposed). */
NOIPA void write_token_kv(void *k_cache, void *v_cache, const void *k, const void *v, int64_t slot,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t elem_size) {
    const int64_t block_stride = num_kv_heads * head_dim * block_size, head_stride = head_dim * block_size;
    const int64_t block = slot / block_size, row = slot % block_size;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const int64_t page = block * block_stride + h * head_stride, src = h * head_dim;
        if (elem_size == 2) {
            uint16_t *kc = (uint16_t *)k_cache + page + row;
            const uint16_t *ks = (const uint16_t *)k + src;
            for (int64_t d = 0; d < head_dim; d++) kc[d * block_size] = ks[d];
            memcpy((uint16_t *)v_cache + page + row * head_dim, (const uint16_t *)v + src, 2 * head_dim);
        } else {
            float *kc = (float *)k_cache + page + row;
            const float *ks = (const float *)k + src;
            for (int64_t d = 0; d < head_dim; d++) kc[d * block_size] = ks[d];
            memcpy((float *)v_cache + page + row * head_dim, (const float *)v + src, 4 * head_dim);
        }
    }
}

/* Store the batch's new keys and values in their cache slots (the batch's one write per layer, before it
 * attends): token i goes to row slots[i] % block_size of block slots[i] / block_size; K is stored
 * transposed ([head_dim, block_size] per head), V as rows. `k` and `v` hold token i, head h at
 * i * *_token_stride + h * head_dim (a view into the fused QKV projection); elements are `elem_size` bytes,
 * as in the caches. Returns 0; -2 for an unsupported element size; -3 (nothing written) if a slot is
 * outside the cache. */
int cbserve_write_kv(
    void *k_cache, void *v_cache, const void *k, int64_t k_token_stride, const void *v, int64_t v_token_stride,
    const int64_t *slots, int64_t num_tokens, int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t elem_size) {
    if (elem_size != 2 && elem_size != 4) return -2;
    for (int64_t i = 0; i < num_tokens; i++)
        if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return -3;
#pragma omp parallel for schedule(static) if (num_tokens * num_kv_heads * head_dim >= (1 << 16))
    for (int64_t i = 0; i < num_tokens; i++)
        write_token_kv(k_cache, v_cache, (const char *)k + i * k_token_stride * elem_size,
                       (const char *)v + i * v_token_stride * elem_size, slots[i], num_kv_heads, head_dim,
                       block_size, elem_size);
    return 0;
}
