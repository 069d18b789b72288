/* The prefill attention's work item (paged_prefill.c) in bfloat16, for bfloat16 caches and queries, on Intel
 * AMX tiles or on AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper Lake): the same item -- a
 * sequence's tile of up to BF16_TILE queries times the `group` query heads of one KV head -- with its two
 * products over bfloat16 pairs, float32 accumulation:
 *
 *   S = Q K^T:  the item's query rows in bfloat16 (16 rows at a time) times 16 keys of a K page, re-laid out
 *               in pairs of dimensions ("VNNI": [head_dim / 2][16 keys][2])
 *   P = exp(scale * S - max) per row over its own keys (as paged_prefill.c: soft cap, window, causal
 *       mask), rounded to bfloat16; the row's output divided by the sum of its weights (before rounding,
 *       as flash attention sums them); 16 rows at a time, their maxes and sums reduced together
 *   O = P V:    16 rows of P, 32 keys at a time, times 32 keys of V in pairs of keys, 16 dimensions a vector;
 *               64 dimensions per pass over the keys
 *
 * On AMX each product is a tile product (16 rows x 32 pairs); with AVX512-BF16 each is VDPBF16PS over a
 * register block (16 rows x 16 keys for S, 4 rows x 64 dimensions for O), a row's pairs taken in the same
 * order. The queries come and the outputs go in bfloat16 (the model's q, read in place; no float32 copies); P
 * is rounded to bfloat16, as flash attention does on GPUs, where the vector path keeps it in float32: the
 * results differ from that path's by about one more bfloat16 rounding.
 *
 * A row's result depends only on its own query, position and keys: keys are taken in 32-key chunks aligned
 * to absolute positions, keys a row may not see weigh exactly 0, and V rows outside the keys the item may
 * see (a stale slot may hold NaN; 0 * NaN is NaN) are zeroed when re-laid out. So a prompt's rows are the
 * same bits whether it is prefilled whole or in chunks, and whatever shares their tile.
 *
 * Used where head_dim is a multiple of 32 up to BF16_MAX_HEAD_DIM, q, the output and the cache are bfloat16
 * (cbserve_paged_prefill_attention), and the library was built for AMX (and the process may use the tiles)
 * or for AVX512-BF16. */
#include "../../kernels/csrc/amx_tiles.h"
#include "../../kernels/csrc/bf16_round.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16_DOT_PREFILL 1
#else
#define HAVE_BF16_DOT_PREFILL 0
#endif
#define HAVE_BF16_PREFILL (HAVE_AMX || HAVE_BF16_DOT_PREFILL)

/* the item's kinds (cbserve_paged_prefill_attention's `bf16_kind`) */
#define BF16_ON_DOTS 1
#define BF16_ON_TILES 2

#define BF16_MAX_HEAD_DIM 256
/* queries per work item: each item re-lays out its keys and values, so an item of more queries re-lays out
 * the same pages fewer times (16, the vector path's TILE, re-laid out the K and V pages of a 2,048-token
 * prompt 128 times; here 64 times); a row's result does not depend on its item */
#define BF16_TILE 32

#if HAVE_BF16_PREFILL
/* A thread's scratch for one item: Q rows, scores, P, and the re-laid-out K (one 16-key unit) and V (the
 * item's whole key range) -- sizes for `rows` (a multiple of 16), `ld` keys (a multiple of 32). */
typedef struct {
    uint16_t *q;  /* [rows][head_dim] */
    float *s;     /* [rows][ld] */
    uint16_t *p;  /* [rows][ld] */
    uint16_t *kt; /* [head_dim / 2][16 keys][2] */
    uint16_t *vt; /* [ld / 32][head_dim / 16][16 key pairs][16 dims][2] */
} bf16_scratch;

static int64_t bf16_scratch_bytes(int64_t rows, int64_t ld, int64_t head_dim) {
    return rows * head_dim * 2 + rows * ld * 4 + rows * ld * 2 + head_dim * 16 * 2 + ld * head_dim * 2 + 64 * 5;
}

static bf16_scratch bf16_scratch_at(char *base, int64_t rows, int64_t ld, int64_t head_dim) {
    bf16_scratch sc;
    char *at = (char *)(((uintptr_t)base + 63) & ~(uintptr_t)63);
#define TAKE(field, type, count)                                             \
    sc.field = (type *)at;                                                  \
    at += (((int64_t)(count) * (int64_t)sizeof(type) + 63) / 64) * 64;
    TAKE(q, uint16_t, rows * head_dim)
    TAKE(s, float, rows * ld)
    TAKE(p, uint16_t, rows * ld)
    TAKE(kt, uint16_t, head_dim * 16)
    TAKE(vt, uint16_t, ld * head_dim)
#undef TAKE
    return sc;
}

/* dst[2t + e] = (e ? r1 : r0)[t] for t < 16: two rows of 16 bfloat16 interleaved (a B tile's row; a vector of 16 pairs) */
static inline void interleave16(uint16_t *dst, const uint16_t *r0, const uint16_t *r1) {
    static const uint16_t order[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r0));
    const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r1));
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, _mm512_loadu_si512(order), b));
}

/* K's 16 keys from `page` (+ key offset `off` in the page, [head_dim][block_size]) as B tiles: pairs of
 * dimensions, kt[d / 2][t][d % 2] */
static inline void relayout_keys(uint16_t *kt, const uint16_t *page, int64_t off, int64_t head_dim,
                                 int64_t block_size) {
    for (int64_t d = 0; d < head_dim; d += 2)
        interleave16(kt + d * 16, page + d * block_size + off, page + (d + 1) * block_size + off);
}

/* V's 32 keys from key `k` on as B tiles (16 dimensions a tile, pairs of keys); keys outside [lo, hi) zero */
static inline void relayout_values(uint16_t *vt, const uint16_t *v_cache, const int64_t *table, int64_t k,
                                   int64_t lo, int64_t hi, int64_t head_dim, int64_t block_size,
                                   int64_t block_stride, int64_t head_page) {
    static const uint16_t zeros[BF16_MAX_HEAD_DIM];
    for (int64_t pair = 0; pair < 16; pair++) {
        const uint16_t *row[2];
        for (int e = 0; e < 2; e++) {
            const int64_t key = k + 2 * pair + e;
            row[e] = key >= lo && key < hi ? v_cache + table[key / block_size] * block_stride + head_page +
                                                 (key % block_size) * head_dim
                                           : zeros;
        }
        for (int64_t n = 0; n < head_dim / 16; n++)
            interleave16(vt + n * 512 + pair * 32, row[0] + n * 16, row[1] + n * 16);
    }
}

#if HAVE_AMX
/* S[:, unit's 16 columns] = Q K^T for the item's rows (`rows`, a multiple of 16) */
static inline void score_unit_tiles(float *s, int64_t ld, const uint16_t *q, int64_t rows, const uint16_t *kt,
                                    int64_t head_dim) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        _tile_zero(0);
        for (int64_t d = 0; d < head_dim; d += 32) {
            _tile_loadd(1, q + r0 * head_dim + d, head_dim * 2);
            _tile_loadd(2, kt + d * 16, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, s + r0 * ld, ld * 4);
    }
}

/* c [16 rows][64] (its first 32 dimensions where not `four`: the last ones where head_dim / 16 is not a
 * multiple of 4) = 16 rows of P x V's dimensions from n * 16, over chunks [c_lo, c_hi): four accumulator
 * tiles (two) per pass over the keys */
static inline void weigh_values_tiles(float *c, const uint16_t *p, int64_t ld, const uint16_t *vt, int64_t n,
                                      int64_t head_dim, int64_t c_lo, int64_t c_hi, const int four) {
    const int64_t chunk = (head_dim / 16) * 512; /* bfloat16 of one chunk's V tiles */
    _tile_zero(0);
    _tile_zero(1);
    if (four) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t ch = c_lo; ch < c_hi; ch++) {
        const uint16_t *b = vt + ch * chunk + n * 512;
        _tile_loadd(4, p + ch * 32, ld * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        if (four) {
            _tile_loadd(7, b + 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, 64 * 4);
    _tile_stored(1, c + 16, 64 * 4);
    if (four) {
        _tile_stored(2, c + 32, 64 * 4);
        _tile_stored(3, c + 48, 64 * 4);
    }
}
#endif

#if HAVE_BF16_DOT_PREFILL
/* score_unit_tiles on AVX512-BF16: per 16 rows, one chain of 16 keys a row over the dimensions' pairs in
 * order, each pair of K (16 keys) loaded once for the 16 rows */
static inline void score_unit_dots(float *s, int64_t ld, const uint16_t *q, int64_t rows, const uint16_t *kt,
                                   int64_t head_dim) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const uint32_t *qp = (const uint32_t *)(q + r0 * head_dim); /* row m's pair i at qp[m * head_dim / 2 + i] */
        __m512 acc[16];
#pragma GCC unroll 16
        for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t i = 0; i < head_dim / 2; i++) {
            __m512bh k = (__m512bh)_mm512_loadu_si512(kt + i * 32);
            __asm__("" : "+v"(k)); /* one load for the 16 rows */
#pragma GCC unroll 16
            for (int m = 0; m < 16; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], k, (__m512bh)_mm512_set1_epi32((int)qp[m * head_dim / 2 + i]));
        }
#pragma GCC unroll 16
        for (int m = 0; m < 16; m++) _mm512_storeu_ps(s + (r0 + m) * ld, acc[m]);
    }
}

/* weigh_values_tiles on AVX512-BF16: per 4 rows, one chain of 16 dimensions a row and vector over the key
 * pairs in order (chunk by chunk), each pair of V loaded once for the 4 rows */
static inline void weigh_values_dots(float *c, const uint16_t *p, int64_t ld, const uint16_t *vt, int64_t n,
                                     int64_t head_dim, int64_t c_lo, int64_t c_hi, const int four) {
    const int64_t chunk = (head_dim / 16) * 512;
    const int vecs = four ? 4 : 2;
    for (int r0 = 0; r0 < 16; r0 += 4) {
        const uint32_t *pp = (const uint32_t *)(p + r0 * ld); /* row m's key pair j at pp[m * ld / 2 + j] */
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
#pragma GCC unroll 4
            for (int v = 0; v < vecs; v++) acc[m][v] = _mm512_setzero_ps();
        for (int64_t ch = c_lo; ch < c_hi; ch++) {
            const uint16_t *b = vt + ch * chunk + n * 512;
            for (int64_t j = 0; j < 16; j++) {
                __m512bh w[4];
#pragma GCC unroll 4
                for (int v = 0; v < vecs; v++) {
                    w[v] = (__m512bh)_mm512_loadu_si512(b + v * 512 + j * 32);
                    __asm__("" : "+v"(w[v]));
                }
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pp[m * ld / 2 + ch * 16 + j]);
#pragma GCC unroll 4
                    for (int v = 0; v < vecs; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], w[v], x);
                }
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
#pragma GCC unroll 4
            for (int v = 0; v < vecs; v++) _mm512_storeu_ps(c + (r0 + m) * 64 + v * 16, acc[m][v]);
    }
}
#endif

/* 2^t on 16 lanes (the softmax's exponents, base 2, t <= 0): t = n + f with |f| <= 1/2, 2^f by Cephes'
 * polynomial of exp2f (about 1 ulp), 2^n put in by VSCALEFPS (below float32's range: 0). Fewer steps than
 * exp16 (no range reduction in two parts, no exponent-bit arithmetic, no clamps): the softmax is most of an
 * item's vector work. */
static inline __m512 exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.535336188319500e-4f), f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)), n);
}

/* out lane i = the sum (max: `max` 1) of v[i]'s 16 lanes, for 16 vectors at once: each level pairs the halves
 * of 512, 256, 128 and 64 bits of two vectors (15 shuffle pairs in all, where one vector's own reduction
 * takes 4 dependent steps), the same tree for every lane of the result */
static inline __m512 lanes_reduce16(__m512 v[16], const int max) {
#define OP(x, y) (max ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y))
    for (int i = 0; i < 8; i++) /* quarters 0-1 of v[i]: v[2i]'s halves summed; 2-3: v[2i + 1]'s */
        v[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* quarter q of v[i]: v[4i + q]'s quarters summed */
        v[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* in quarter q of v[i]: v[8i + q]'s pairs, then v[8i + 4 + q]'s */
        v[i] = OP(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                  _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 r = OP(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1))); /* lane 4q + k: v[4k + q] */
#undef OP
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* The lanes of keys j .. j + 15 of a row's [lo, hi), for j from a = lo / 16 * 16 to b = ceil(hi / 16) * 16:
 * only the first and the last vector hold keys outside */
#define SEEN(j, a, b, head, tail) (__mmask16)(((j) == (a) ? (head) : 0xFFFF) & ((j) + 16 == (b) ? (tail) : 0xFFFF))

/* A row's scores over its keys [lo, hi) (columns from the item's first key), soft-capped in place first where
 * the model caps them (and then already scaled): 16 lanes whose max is the row's max (two chains of 16 lanes;
 * one waits on max's latency) */
static inline __m512 row_max(float *s, int64_t lo, int64_t hi, float scale, float softcap) {
    if (softcap > 0.0f) {
        for (int64_t j = lo; j < hi; j++) s[j] *= scale;
        soft_cap(s, lo, hi, softcap);
    }
    const int64_t a = lo / 16 * 16, b = (hi + 15) / 16 * 16;
    const __mmask16 head = (__mmask16)(0xFFFFu << (lo - a)), tail = (__mmask16)(0xFFFFu >> (b - hi));
    __m512 m0 = _mm512_set1_ps(s[lo]), m1 = m0;
    int64_t j = a;
    for (; j + 16 < b; j += 32) {
        m0 = _mm512_mask_max_ps(m0, SEEN(j, a, b, head, tail), m0, _mm512_loadu_ps(s + j));
        m1 = _mm512_mask_max_ps(m1, SEEN(j + 16, a, b, head, tail), m1, _mm512_loadu_ps(s + j + 16));
    }
    if (j < b) m0 = _mm512_mask_max_ps(m0, SEEN(j, a, b, head, tail), m0, _mm512_loadu_ps(s + j));
    return _mm512_max_ps(m0, m1);
}

/* P row = 2^(S row scale log2(e) - max scale log2(e)) over the row's keys [lo, hi), rounded to bfloat16
 * (nearest even), 0 elsewhere in its `ld` columns: 16 lanes whose sum is the sum of those weights (before
 * rounding, as flash attention sums them). Each key's lane is fixed by its absolute position (columns start at
 * a multiple of 32), so the row's sums do not depend on its tile. */
static inline __m512 row_weights(uint16_t *p, const float *s, int64_t ld, int64_t lo, int64_t hi, float max,
                                 float scale) {
    const int64_t a = lo / 16 * 16, b = (hi + 15) / 16 * 16; /* b <= ld: ld is a multiple of 32 */
    const __mmask16 head = (__mmask16)(0xFFFFu << (lo - a)), tail = (__mmask16)(0xFFFFu >> (b - hi));
    memset(p, 0, (size_t)a * 2);
    memset(p + b, 0, (size_t)(ld - b) * 2);
    const float to_base2 = scale * 1.4426950408889634f;
    const __m512 c = _mm512_set1_ps(to_base2), shift = _mm512_set1_ps(-max * to_base2);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = a; j < b; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(SEEN(j, a, b, head, tail),
                                             exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), c, shift)));
        _mm256_storeu_si256((__m256i *)(p + j), to_bf16_x16_ftz(e));
        sum = _mm512_add_ps(sum, e);
    }
    return sum;
}
#undef SEEN

/* P for the item's rows r0 .. r0 + 15 (those from `rows` on: zero), and each row's 1 / the sum of its
 * weights in inv[r0 ..], by which its output is scaled (the max's own weight is ~1, so the sum is >= ~1). A row sees keys up to its position, from the window's start. */
static inline void softmax_rows16(uint16_t *p, float *s, int64_t ld, float *inv, int64_t r0, int64_t rows,
                                  int64_t group, int64_t first_pos, int64_t k0, int64_t window, float scale,
                                  float softcap) {
    __m512 part[16];
    int64_t lo[16], hi[16];
    for (int m = 0; m < 16; m++) {
        const int64_t r = r0 + m, pos = first_pos + r / group;
        lo[m] = (window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0) - k0;
        hi[m] = pos + 1 - k0;
        part[m] = r < rows ? row_max(s + r * ld, lo[m], hi[m], scale, softcap) : _mm512_setzero_ps();
    }
    float max[16];
    _mm512_storeu_ps(max, lanes_reduce16(part, 1));
    const float weight_scale = softcap > 0.0f ? 1.0f : scale; /* soft-capped scores are already scaled */
    for (int m = 0; m < 16; m++) {
        const int64_t r = r0 + m;
        if (r < rows) {
            part[m] = row_weights(p + r * ld, s + r * ld, ld, lo[m], hi[m], max[m], weight_scale);
        } else {
            memset(p + r * ld, 0, (size_t)ld * 2);
            part[m] = _mm512_set1_ps(1.0f);
        }
    }
    _mm512_storeu_ps(inv + r0, _mm512_div_ps(_mm512_set1_ps(1.0f), lanes_reduce16(part, 0)));
}

/* S for the item's rows, 16 keys of a unit; O's 16 rows x 64 (32) dimensions from n * 16 into c: on the tiles
 * (`tiles` a literal at each call) or on dot products */
#if HAVE_AMX && HAVE_BF16_DOT_PREFILL
#define SCORE_UNIT(tiles, ...) ((tiles) ? score_unit_tiles(__VA_ARGS__) : score_unit_dots(__VA_ARGS__))
#define WEIGH_VALUES(tiles, ...) ((tiles) ? weigh_values_tiles(__VA_ARGS__) : weigh_values_dots(__VA_ARGS__))
#elif HAVE_AMX
#define SCORE_UNIT(tiles, ...) score_unit_tiles(__VA_ARGS__)
#define WEIGH_VALUES(tiles, ...) weigh_values_tiles(__VA_ARGS__)
#else
#define SCORE_UNIT(tiles, ...) score_unit_dots(__VA_ARGS__)
#define WEIGH_VALUES(tiles, ...) weigh_values_dots(__VA_ARGS__)
#endif

/* One work item, as attend_tile in paged_prefill.c (same arguments; the caches bfloat16); inlined into one
 * copy per kind of products (`tiles` a literal) */
static inline __attribute__((always_inline)) void attend_tile_bf16_item(
    uint16_t *out, const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *table, int64_t base, int64_t i0, int64_t i1, int64_t h, int64_t num_heads, int64_t group,
    int64_t head_dim, int64_t block_size, int64_t block_stride, float scale, int64_t window, float softcap,
    char *scratch, const int tiles) {
    (void)tiles; /* unused where the library has one kind */
    const int64_t rows = (i1 - i0) * group, padded = (rows + 15) / 16 * 16, head_page = h * head_dim * block_size;
    const int64_t first_pos = base + i0, last_pos = base + i1 - 1;
    const int64_t key_lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    const int64_t k0 = key_lo / 32 * 32, key_hi = last_pos + 1;  /* keys [key_lo, key_hi); columns from k0 */
    const int64_t ld = (key_hi - k0 + 31) / 32 * 32;
    const bf16_scratch sc = bf16_scratch_at(scratch, padded, ld, head_dim);

    for (int64_t r = 0; r < padded; r++) { /* the item's query rows, zero rows to a whole tile */
        uint16_t *dst = sc.q + r * head_dim;
        if (r < rows)
            memcpy(dst, q + (i0 + r / group) * q_stride + (h * group + r % group) * head_dim, (size_t)head_dim * 2);
        else
            memset(dst, 0, (size_t)head_dim * 2);
    }
    for (int64_t u = key_lo / 16; u * 16 < key_hi; u++) { /* S, 16 keys at a time */
        const uint16_t *page = k_cache + table[u * 16 / block_size] * block_stride + head_page;
        relayout_keys(sc.kt, page, u * 16 % block_size, head_dim, block_size);
        SCORE_UNIT(tiles, sc.s + (u * 16 - k0), ld, sc.q, padded, sc.kt, head_dim);
    }
    float inv[BF16_TILE * MAX_GROUP]; /* each row's 1 / sum of its weights */
    for (int64_t r0 = 0; r0 < padded; r0 += 16) /* P */
        softmax_rows16(sc.p, sc.s, ld, inv, r0, rows, group, first_pos, k0, window, scale, softcap);
    const int64_t chunks = ld / 32, c_lo = (key_lo - k0) / 32;
    for (int64_t ch = c_lo; ch < chunks; ch++)
        relayout_values(sc.vt + ch * (head_dim / 16) * 512, v_cache, table, k0 + ch * 32, key_lo, key_hi,
                        head_dim, block_size, block_stride, head_page);
    float c[16 * 64];
    for (int64_t r0 = 0; r0 < padded; r0 += 16) { /* O = P V, 16 rows x 64 (or 32) dimensions at a time */
        for (int64_t n = 0; n < head_dim / 16; n += 4) {
            const int64_t width = head_dim / 16 - n >= 4 ? 4 : 2;
            if (width == 4) /* a literal `four` in each call: its tests fold away */
                WEIGH_VALUES(tiles, c, sc.p + r0 * ld, ld, sc.vt, n, head_dim, c_lo, chunks, 1);
            else
                WEIGH_VALUES(tiles, c, sc.p + r0 * ld, ld, sc.vt, n, head_dim, c_lo, chunks, 0);
            for (int64_t m = 0; m < 16 && r0 + m < rows; m++) {
                const int64_t r = r0 + m;
                uint16_t *o = out + (i0 + r / group) * num_heads * head_dim + (h * group + r % group) * head_dim;
                const __m512 scale = _mm512_set1_ps(inv[r]);
                for (int64_t d = 0; d < width * 16; d += 16) /* bfloat16(c * inv[r]), nearest even, 16 at a time */
                    _mm256_storeu_si256((__m256i *)(o + n * 16 + d),
                                        to_bf16_x16(_mm512_mul_ps(_mm512_loadu_ps(c + m * 64 + d), scale)));
            }
        }
    }
}
#undef SCORE_UNIT
#undef WEIGH_VALUES

#define BF16_ITEM_ARGS                                                                                          \
    uint16_t *out, const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,       \
        const int64_t *table, int64_t base, int64_t i0, int64_t i1, int64_t h, int64_t num_heads, int64_t group, \
        int64_t head_dim, int64_t block_size, int64_t block_stride, float scale, int64_t window, float softcap,  \
        char *scratch
#define BF16_ITEM_CALL(TILES)                                                                                    \
    attend_tile_bf16_item(out, q, q_stride, k_cache, v_cache, table, base, i0, i1, h, num_heads, group, head_dim, \
                          block_size, block_stride, scale, window, softcap, scratch, TILES)
/* The item on `kind`'s products (BF16_ON_TILES or BF16_ON_DOTS: one cbserve_prefill_bf16_takes says runs here) */
static void attend_tile_in_bf16(int kind, BF16_ITEM_ARGS) {
#if HAVE_AMX
    if (kind == BF16_ON_TILES) {
        BF16_ITEM_CALL(1);
        return;
    }
#endif
#if HAVE_BF16_DOT_PREFILL
    if (kind == BF16_ON_DOTS) BF16_ITEM_CALL(0);
#endif
    (void)kind;
}
#undef BF16_ITEM_CALL
#undef BF16_ITEM_ARGS
#endif
