/* Paged prefill attention on the CPU: each sequence's new queries (a fresh prompt or a later chunk of one)
 * attend causally over that sequence's KV pages, read in place through its block table.
 *
 * Work item = (sequence, KV head, tile of up to TILE consecutive queries, BF16_TILE in bfloat16). The
 * tile's rows are its queries times the `group` query heads that share the KV head, and the two products are
 * small matrix products over the pages:
 *
 *   S[r, j] = scale * <q[r], K[j]>     for the keys j the tile can see   (rows x pages of 16 keys)
 *   S[r, j] = softcap * tanh(S[r, j] / softcap)   where the model soft-caps its attention logits (Gemma 2)
 *   P[r, j] = softmax over the keys row r may see (j <= its position, and inside the sliding window)
 *   O[r]    = sum_j P[r, j] V[j]
 *
 * The cache layout (engine/executor/kv_cache.py) makes both products panel products: a K page of one head is
 * [head_dim, block_size], so the scores of 16 keys are one vector (two of 8 floats without AVX-512) that
 * every row of a register block fills with one fused multiply-add per dimension; a V page is [block_size,
 * head_dim], so a block of rows
 * accumulates slices of head_dim while the page's rows stream past. Each K/V page is read once per tile
 * for all of its rows (PyTorch's SDPA over the same prompts, one call per sequence and layer, ran 10x
 * below the machine's FMA peak).
 *
 * Masked keys inside a tile's key range are real keys of the sequence (a later query's own key, or one
 * before a sliding window): they get probability 0. Nothing past the sequence's length is read.
 *
 * The query of row i of sequence s sits at position seq_lens[s] - q_len + i (q_len = query_starts[s + 1] -
 * query_starts[s]); its keys, already written to the cache, are j in [first, position], first = 0 or
 * position - sliding_window + 1.
 *
 * Caches are float32 or bfloat16 (`kv_is_bf16`); queries and outputs are float32. Supported: the shapes of
 * paged_decode.c (block_size and head_dim multiples of 16, head_dim up to MAX_HEAD_DIM, at most MAX_GROUP
 * query heads per KV head): cpu_attention.c compiles the two kernels into one library, and
 * engine/executor/attention/cpu_kernel.py checks the shape once for both.
 */
#include <omp.h>

#define TILE 16 /* queries per work item */

/* Register blocks, in vectors of VL floats (paged_decode.c: 16 with AVX-512's 32 registers, else 8 with 16):
 * the score product holds QK_ROWS rows x (16 / VL) vectors of a page's 16 keys, the value product PV_ROWS
 * rows x PV_VECS vectors of head_dim, each with its broadcast weights beside. */
#if VL == 16
#define QK_ROWS 12 /* 12 accumulators */
#define PV_ROWS 6  /* ... 6 x 4 = 24 accumulators + 6 weights + 1 value */
#define PV_VECS 4
#else
#define QK_ROWS 6 /* 6 x 2 accumulators */
#define PV_ROWS 3 /* 3 x 4 = 12 accumulators + 3 weights + 1 value (AVX2 has 16 registers) */
#define PV_VECS 4
#endif
#define PAGE_VECS (16 / VL) /* vectors of a page's 16 keys */

/* scores[m, c0 .. c0 + 16) = scale * <rows[m], K page> for M <= QK_ROWS rows (M a literal at each call) */
static inline __attribute__((always_inline)) void score_page(float *scores, int64_t ld, const float *const *rows,
                                                             const void *k_cache, int64_t page, int bf16,
                                                             int64_t head_dim, int64_t block_size, int64_t t,
                                                             float scale, const int M) {
    vf acc[QK_ROWS][PAGE_VECS];
    for (int m = 0; m < M; m++)
        for (int v = 0; v < PAGE_VECS; v++) acc[m][v] = (vf){0};
    for (int64_t d = 0; d < head_dim; d++) {
        vf k[PAGE_VECS];
        for (int v = 0; v < PAGE_VECS; v++) k[v] = loadv(k_cache, page + d * block_size + t + v * VL, bf16);
        for (int m = 0; m < M; m++) {
            const vf x = (vf){0} + rows[m][d];
            for (int v = 0; v < PAGE_VECS; v++) acc[m][v] += x * k[v];
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < PAGE_VECS; v++) {
            const vf a = acc[m][v] * scale;
            memcpy(scores + m * ld + v * VL, &a, sizeof a);
        }
}

/* acc[m][0 .. C) += sum over page rows t in [t0, t1) of p[m, j_of_t0 + t - t0] V[t, d0 .. d0 + VL C) for
 * M <= PV_ROWS rows (M and C literals at each call) */
static inline __attribute__((always_inline)) void weigh_values(vf acc[PV_ROWS][PV_VECS], const float *p, int64_t ld,
                                                               const void *v_cache, int64_t page, int bf16,
                                                               int64_t head_dim, int64_t d0, int64_t t0, int64_t t1,
                                                               int64_t j_of_t0, const int M, const int C) {
    for (int64_t t = t0; t < t1; t++) {
        /* the M weights in registers, one value vector at a time */
        vf w[PV_ROWS];
        for (int m = 0; m < M; m++) w[m] = (vf){0} + p[m * ld + j_of_t0 + (t - t0)];
        for (int c = 0; c < C; c++) {
            const vf row = loadv(v_cache, page + t * head_dim + d0 + VL * c, bf16);
            for (int m = 0; m < M; m++) acc[m][c] += w[m] * row;
        }
    }
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* S: scores[r, c] = scale * <q of row r, key k0 + c> for the tile's `rows` rows, page by page over blocks
 * [b_lo, b_hi), row blocks of QK_ROWS (pages past a row's position are computed and not read) */
ALWAYS_INLINE void score_tile(float *scores, int64_t ld, const float *const *row_q, int64_t rows,
                              const void *k_cache, int bf16, const int64_t *table, int64_t b_lo, int64_t b_hi,
                              int64_t head_page, int64_t head_dim, int64_t block_size, int64_t block_stride,
                              float scale) {
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t page = table[b] * block_stride + head_page;
        for (int64_t t = 0; t < block_size; t += 16)
            for (int64_t r0 = 0; r0 < rows; r0 += QK_ROWS) {
                float *s = scores + r0 * ld + (b - b_lo) * block_size + t;
                const float *const *rq = row_q + r0;
                const int64_t M = rows - r0 < QK_ROWS ? rows - r0 : QK_ROWS;
#define SCORE(M_) score_page(s, ld, rq, k_cache, page, bf16, head_dim, block_size, t, scale, M_)
                switch (M) { /* a literal row count for each register block */
                case 1: SCORE(1); break;
                case 2: SCORE(2); break;
                case 3: SCORE(3); break;
                case 4: SCORE(4); break;
                case 5: SCORE(5); break;
#if QK_ROWS > 6
                case 6: SCORE(6); break;
                case 7: SCORE(7); break;
                case 8: SCORE(8); break;
                case 9: SCORE(9); break;
                case 10: SCORE(10); break;
                case 11: SCORE(11); break;
#endif
                default: SCORE(QK_ROWS); break;
                }
#undef SCORE
            }
    }
}

/* P: each row's softmax over its own keys [lo, hi) (relative to k0); 0 elsewhere in the range. Row r is
 * query base + i0 + r / group. */
ALWAYS_INLINE void softmax_rows(float *scores, int64_t ld, int64_t rows, int64_t base, int64_t i0, int64_t group,
                                int64_t k0, int64_t window, float softcap) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = base + i0 + r / group;
        const int64_t lo = (window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0) - k0, hi = pos + 1 - k0;
        float *s = scores + r * ld;
        if (softcap > 0.0f) soft_cap(s, lo, hi, softcap);
        float max = s[lo], sum = 0.0f;
        for (int64_t j = lo + 1; j < hi; j++) max = s[j] > max ? s[j] : max;
        for (int64_t j = lo; j < hi; j++) {
            s[j] = expf(s[j] - max);
            sum += s[j];
        }
        const float inv = 1.0f / sum; /* the max is one of the terms: sum >= 1 */
        for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
        for (int64_t j = lo; j < hi; j++) s[j] *= inv;
        for (int64_t j = hi; j < ld; j++) s[j] = 0.0f;
    }
}

/* O: out[query, head] = sum_j P[r, j] V[j] for the tile's rows, in row blocks of PV_ROWS, head_dim in slices
 * of PV_VECS vectors, over each block's keys only */
ALWAYS_INLINE void weigh_tile(float *out, const float *scores, int64_t ld, int64_t rows, const void *v_cache,
                              int bf16, const int64_t *table, int64_t base, int64_t i0, int64_t h,
                              int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size,
                              int64_t block_stride, int64_t head_page, int64_t k0, int64_t window) {
    for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) {
        const int64_t M = rows - r0 < PV_ROWS ? rows - r0 : PV_ROWS;
        const int64_t last = base + i0 + (r0 + M - 1) / group; /* the block's latest position */
        const int64_t first = base + i0 + r0 / group;
        const int64_t lo = window > 0 && first - window + 1 > k0 ? first - window + 1 : k0, hi = last + 1;
        const float *p = scores + r0 * ld;
        const int C = head_dim % (VL * PV_VECS) ? 16 / VL : PV_VECS; /* head_dim is a multiple of 16 */
        for (int64_t d0 = 0; d0 < head_dim; d0 += VL * C) {
            vf acc[PV_ROWS][PV_VECS];
            for (int m = 0; m < PV_ROWS; m++)
                for (int c = 0; c < PV_VECS; c++) acc[m][c] = (vf){0};
            for (int64_t b = lo / block_size; b * block_size < hi; b++) {
                const int64_t page = table[b] * block_stride + head_page;
                const int64_t t0 = lo > b * block_size ? lo - b * block_size : 0;
                const int64_t t1 = hi < (b + 1) * block_size ? hi - b * block_size : block_size;
                const int64_t j = b * block_size + t0 - k0;
#define WEIGH(M_, C_) weigh_values(acc, p, ld, v_cache, page, bf16, head_dim, d0, t0, t1, j, M_, C_)
#define WEIGH_ROWS(C_)                                                                                     \
    switch (M) { /* a literal row count for each register block */                                       \
    case 1: WEIGH(1, C_); break;                                                                          \
    case 2: WEIGH(2, C_); break;                                                                          \
    case 3: WEIGH(3, C_); break;                                                                          \
    case 4: WEIGH(4 < PV_ROWS ? 4 : PV_ROWS, C_); break;                                                   \
    case 5: WEIGH(5 < PV_ROWS ? 5 : PV_ROWS, C_); break;                                                   \
    default: WEIGH(PV_ROWS, C_); break;                                                                   \
    }
                if (C == PV_VECS) {
                    WEIGH_ROWS(PV_VECS)
                } else {
                    WEIGH_ROWS(16 / VL)
                }
#undef WEIGH_ROWS
#undef WEIGH
            }
            for (int64_t m = 0; m < M; m++) {
                const int64_t r = r0 + m;
                float *o = out + (i0 + r / group) * num_heads * head_dim + (h * group + r % group) * head_dim;
                for (int c = 0; c < C; c++) memcpy(o + d0 + VL * c, &acc[m][c], sizeof(vf));
            }
        }
    }
}

/* One work item: queries [i0, i1) of a sequence (positions base + i), KV head h. `scores`: at least
 * TILE * MAX_GROUP * (padded key range) floats. Inlined into one copy per cache dtype (`bf16` a literal),
 * so the inner loops carry no dtype test and their accumulators stay in registers. */
ALWAYS_INLINE void attend_tile(float *out, const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               int bf16, const int64_t *table, int64_t base, int64_t i0, int64_t i1, int64_t h,
                               int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size,
                               int64_t block_stride, float scale, int64_t window, float softcap, float *scores) {
    const int64_t rows = (i1 - i0) * group, head_page = h * head_dim * block_size;
    /* key range of the tile: from the first query's first key to the last query's own key */
    const int64_t first_pos = base + i0, last_pos = base + i1 - 1;
    const int64_t key_lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    const int64_t b_lo = key_lo / block_size, b_hi = last_pos / block_size + 1;
    const int64_t k0 = b_lo * block_size, ld = (b_hi - b_lo) * block_size; /* scores row r: key k0 + c */
    const float *row_q[TILE * MAX_GROUP];
    for (int64_t r = 0; r < rows; r++)
        row_q[r] = q + (i0 + r / group) * q_stride + (h * group + r % group) * head_dim;
    score_tile(scores, ld, row_q, rows, k_cache, bf16, table, b_lo, b_hi, head_page, head_dim, block_size,
               block_stride, scale);
    softmax_rows(scores, ld, rows, base, i0, group, k0, window, softcap);
    weigh_tile(out, scores, ld, rows, v_cache, bf16, table, base, i0, h, num_heads, group, head_dim, block_size,
               block_stride, head_page, k0, window);
}
#undef ALWAYS_INLINE

#define TILE_ARGS                                                                                           \
    float *out, const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *table, \
        int64_t base, int64_t i0, int64_t i1, int64_t h, int64_t num_heads, int64_t group, int64_t head_dim,     \
        int64_t block_size, int64_t block_stride, float scale, int64_t window, float softcap, float *scores
#define TILE_CALL(BF16)                                                                                       \
    attend_tile(out, q, q_stride, k_cache, v_cache, BF16, table, base, i0, i1, h, num_heads, group, head_dim,  \
                block_size, block_stride, scale, window, softcap, scores)
static void attend_tile_f32(TILE_ARGS) { TILE_CALL(0); }
static void attend_tile_bf16(TILE_ARGS) { TILE_CALL(1); }
#undef TILE_CALL
#undef TILE_ARGS

#include "paged_prefill_bf16.c"
#include "../../kernels/csrc/kept_buffer.h"

/* the calling thread's scores, kept from call to call (kept_buffer.h) */
static __thread kept_buffer prefill_scores;

/* 1 where a bfloat16 prefill of this head_dim runs here on `kind`'s products (paged_prefill_bf16.c): a head_dim
 * the item takes and a library built for that kind (for the tiles: a process allowed to use them) */
int cbserve_prefill_bf16_takes(int64_t head_dim, int kind) {
    if (head_dim % 32 || head_dim > BF16_MAX_HEAD_DIM) return 0;
#if HAVE_AMX
    static int permitted = -1;
    if (kind == BF16_ON_TILES) {
        if (permitted < 0) permitted = amx_permitted();
        return permitted;
    }
#endif
    return kind == BF16_ON_DOTS && HAVE_BF16_DOT_PREFILL;
}

/* Returns 0; -2 for an unsupported shape, -5 for a query count or length that does not fit its sequence
 * (nothing written); -1 if a scratch buffer could not be allocated. */
int cbserve_paged_prefill_attention(
    void *out,                   /* [num_tokens, num_heads, head_dim] */
    const void *q,               /* token t's heads at q + t * q_stride, [num_heads, head_dim] */
    int64_t q_stride,
    int bf16_kind,               /* q and out bfloat16 on BF16_ON_TILES or BF16_ON_DOTS (cbserve_prefill_bf16_takes); 0: float32 */
    const void *k_cache,         /* [num_blocks, num_kv_heads, head_dim, block_size] */
    const void *v_cache,         /* [num_blocks, num_kv_heads, block_size, head_dim] */
    int kv_is_bf16,
    const int64_t *block_tables, /* [num_seqs, table_stride] */
    int64_t table_stride,
    const int64_t *query_starts, /* [num_seqs + 1]: sequence s's queries are tokens [starts[s], starts[s+1]) */
    const int64_t *seq_lens,     /* [num_seqs]: KV length including the new tokens */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t sliding_window /* <= 0: none */, float softcap /* <= 0: none */) {
    if (!supported(num_heads, num_kv_heads, head_dim, block_size)) return -2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = num_kv_heads * head_dim * block_size;
    const int threads = omp_get_max_threads(), bf16 = bf16_kind != 0;
    if (bf16 && !(kv_is_bf16 && cbserve_prefill_bf16_takes(head_dim, bf16_kind))) return -2;
    const int64_t tile_q = bf16 ? BF16_TILE : TILE; /* queries per work item */
    int64_t items = 0, widest = 0; /* widest: the longest key range of a tile, in padded keys */
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = query_starts[s + 1] - query_starts[s];
        if (q_len < 1 || q_len > seq_lens[s] || (seq_lens[s] + block_size - 1) / block_size > table_stride)
            return -5;
        items += num_kv_heads * ((q_len + tile_q - 1) / tile_q);
        const int64_t span =
            (sliding_window > 0 && sliding_window < seq_lens[s] ? sliding_window + tile_q : seq_lens[s]);
        widest = span + 2 * block_size > widest ? span + 2 * block_size : widest;
    }
#if HAVE_BF16_PREFILL
    const int64_t scratch = bf16 ? bf16_scratch_bytes(tile_q * group, (widest + 64 + 31) / 32 * 32, head_dim) / 4 + 1
                                 : tile_q * group * widest; /* floats */
#else
    const int64_t scratch = tile_q * group * widest;
#endif
    float *scores = kept_alloc(&prefill_scores, sizeof(float) * (size_t)(threads * scratch));
    if (scores == NULL) return -1;

#pragma omp parallel num_threads(threads)
    {
        float *mine = scores + omp_get_thread_num() * scratch;
#if HAVE_AMX
        if (bf16_kind == BF16_ON_TILES) amx_configure_full_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            /* find the item's sequence, tile and head: items are laid out sequence by sequence, the tiles
             * of a sequence latest first (the longest key ranges start first), heads innermost */
            int64_t s = 0, rest = item, tiles = 0;
            for (;; s++) {
                tiles = (query_starts[s + 1] - query_starts[s] + tile_q - 1) / tile_q;
                if (rest < tiles * num_kv_heads) break;
                rest -= tiles * num_kv_heads;
            }
            const int64_t q_len = query_starts[s + 1] - query_starts[s];
            const int64_t tile = tiles - 1 - rest / num_kv_heads, h = rest % num_kv_heads;
            const int64_t i0 = tile * tile_q, i1 = i0 + tile_q < q_len ? i0 + tile_q : q_len;
            const int64_t start = query_starts[s];
#if HAVE_BF16_PREFILL
            if (bf16) {
                attend_tile_in_bf16(bf16_kind, (uint16_t *)out + start * num_heads * head_dim,
                                    (const uint16_t *)q + start * q_stride, q_stride, k_cache, v_cache,
                                    block_tables + s * table_stride, seq_lens[s] - q_len, i0, i1, h, num_heads, group,
                                    head_dim, block_size, block_stride, scale, sliding_window, softcap, (char *)mine);
                continue;
            }
#endif
            (kv_is_bf16 ? attend_tile_bf16 : attend_tile_f32)(
                (float *)out + start * num_heads * head_dim, (const float *)q + start * q_stride, q_stride, k_cache,
                v_cache,
                block_tables + s * table_stride, seq_lens[s] - q_len, i0, i1, h, num_heads, group, head_dim,
                block_size, block_stride, scale, sliding_window, softcap, mine);
        }
#if HAVE_AMX
        if (bf16_kind == BF16_ON_TILES) _tile_release();
#endif
    }
    return 0;
}
