/* Paged decode attention on the CPU: each sequence's one new query attends over that sequence's KV pages,
 * read in place through its block table -- no gathered copy of the pages, no padding to a longer sequence.
 *
 * Work item = (sequence, KV head); the `group` query heads that share the KV head are computed together, so
 * each key and value vector is loaded (and widened from bfloat16) once per step and used by every head of
 * the group (GQA without repeating K/V), and the next page is prefetched while one is computed:
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
 * Caches are float32 or bfloat16 (`kv_is_bf16`); queries and outputs are float32. Parallel over work items
 * with OpenMP: this library asks for libgomp.so.1, which resolves to the copy torch has already loaded, so
 * torch and this kernel share one thread pool (torch.set_num_threads applies to both).
 *
 * Supported: block_size and head_dim multiples of 16, head_dim at most MAX_HEAD_DIM, at most MAX_GROUP query
 * heads per KV head; engine/executor/attention/cpu_kernel.py checks these before choosing this kernel. head_dim 64
 * and 128 with groups of 1, 2, 3, 4 and 8 get their own unrolled copies of the loops.
 *
 * The library also stores each step's new keys and values in their slots (`cbserve_write_kv`), the
 * scatter that PyTorch's index_put_ does several times slower.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16
#define MAX_HEAD_DIM 512

/* The loops work on vectors of VL floats: 16 (one AVX-512 register) where the CPU has 32 vector registers,
 * else 8 (one AVX2 register, 16 of them). With 16 registers the value pass also splits head_dim into
 * slices whose accumulators for the whole group fit in PV_REGS registers (group 3, head_dim 64 would
 * need 24 -- spilled on every key); every lane's sums run in the same order either way. */
#if defined(__AVX512F__)
#define VL 16
#define PV_REGS 0 /* no split: head_dim in one pass */
#else
#define VL 8
#define PV_REGS 12
#endif

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
        vh h;
        memcpy(&h, (const uint16_t *)cache + index, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)cache + index, sizeof f);
    }
    return f;
}

/* Ask for the `bytes` at `p` (one K or V page of one head) ahead of their use: a sequence's pages lie
 * anywhere in the cache, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_page(const void *cache, int64_t index, int bf16, int64_t elements) {
    const char *p = (const char *)cache + index * (bf16 ? 2 : 4);
    const int64_t bytes = elements * (bf16 ? 2 : 4);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* s[j] = softcap * tanh(s[j] / softcap) for j in [lo, hi): Gemma 2's soft-capped attention logits. */
static inline void soft_cap(float *s, int64_t lo, int64_t hi, float softcap) {
    const float inv = 1.0f / softcap;
    for (int64_t j = lo; j < hi; j++) s[j] = softcap * tanhf(s[j] * inv);
}

/* One (sequence, KV head). Inlined into each call site: where `head_dim` and `group` are literals, the
 * loops unroll and the group's accumulators stay in registers. Each K and V vector is loaded (and widened
 * from bfloat16) once and used by all `group` query heads. */
static inline __attribute__((always_inline)) void attend(
    float *out, const float *q, const void *k_cache, const void *v_cache, int bf16, const int64_t *table,
    int64_t first, int64_t seq_len, const int64_t group, const int64_t head_dim, int64_t block_size,
    int64_t block_stride, int64_t head_offset, float scale, float softcap, float *scores) {
    const int64_t b_first = first / block_size, b_end = (seq_len + block_size - 1) / block_size;
    const int64_t padded = (b_end - b_first) * block_size; /* scores row length per query head */
    const int64_t lo = first - b_first * block_size, hi = seq_len - b_first * block_size; /* valid [lo, hi) */
    const int64_t page = head_dim * block_size; /* elements of one head's K (or V) page */

    /* s[g, j]: a VL-key tile at a time; lanes outside [lo, hi) are computed and never read. Two
     * accumulators per head (even and odd dimensions) hide the FMA latency. */
    prefetch_page(k_cache, table[b_first] * block_stride + head_offset, bf16, page);
    for (int64_t b = b_first; b < b_end; b++) {
        const int64_t k = table[b] * block_stride + head_offset; /* [head_dim, block_size] */
        if (b + 1 < b_end) prefetch_page(k_cache, table[b + 1] * block_stride + head_offset, bf16, page);
        for (int64_t t = 0; t < block_size; t += VL) {
            vf even[MAX_GROUP], odd[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) even[g] = odd[g] = (vf){0};
            for (int64_t d = 0; d < head_dim; d += 2) {
                const vf k0 = loadv(k_cache, k + d * block_size + t, bf16);
                const vf k1 = loadv(k_cache, k + (d + 1) * block_size + t, bf16);
                for (int64_t g = 0; g < group; g++) {
                    even[g] += q[g * head_dim + d] * k0;
                    odd[g] += q[g * head_dim + d + 1] * k1;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                vf s = (even[g] + odd[g]) * scale;
                memcpy(scores + g * padded + (b - b_first) * block_size + t, &s, sizeof s);
            }
        }
    }
    prefetch_page(v_cache, table[b_first] * block_stride + head_offset, bf16, page);

    /* p[g, j] = exp(s[g, j] - max) / sum (after the soft cap, if any); the max is a visible score, so the sum is >= 1 */
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * padded;
        if (softcap > 0.0f) soft_cap(s, lo, hi, softcap);
        float max = s[lo], sum = 0.0f;
        for (int64_t j = lo + 1; j < hi; j++) max = s[j] > max ? s[j] : max;
        for (int64_t j = lo; j < hi; j++) {
            s[j] = expf(s[j] - max);
            sum += s[j];
        }
        inv_sum[g] = 1.0f / sum;
    }

    /* o[g] = sum_j p[g, j] V[j], visible keys only (a stale slot may hold anything, even NaN); in slices
     * of `slice` vectors of head_dim (all of it unless PV_REGS says otherwise; see VL) */
    int64_t slice = head_dim / VL;
    if (PV_REGS)
        while (slice > 1 && (slice * group > PV_REGS || (head_dim / VL) % slice)) slice /= 2;
    for (int64_t d0 = 0; d0 < head_dim; d0 += slice * VL) {
        vf acc[MAX_GROUP][MAX_HEAD_DIM / VL];
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < slice; c++) acc[g][c] = (vf){0};
        for (int64_t b = b_first; b < b_end; b++) {
            const int64_t v = table[b] * block_stride + head_offset + d0; /* [block_size, head_dim] */
            if (d0 == 0 && b + 1 < b_end)
                prefetch_page(v_cache, table[b + 1] * block_stride + head_offset, bf16, page);
            const int64_t j0 = (b - b_first) * block_size;
            const int64_t t0 = lo > j0 ? lo - j0 : 0, t1 = hi - j0 < block_size ? hi - j0 : block_size;
            for (int64_t t = t0; t < t1; t++)
                for (int64_t c = 0; c < slice; c++) {
                    const vf row = loadv(v_cache, v + t * head_dim + c * VL, bf16);
                    for (int64_t g = 0; g < group; g++) acc[g][c] += scores[g * padded + j0 + t] * row;
                }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < slice; c++) {
                vf o = acc[g][c] * inv_sum[g];
                memcpy(out + g * head_dim + d0 + c * VL, &o, sizeof o);
            }
    }
}

/* Whether the kernel takes this shape. */
static int supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    return block_size % LANES == 0 && head_dim % LANES == 0 && head_dim <= MAX_HEAD_DIM && num_kv_heads >= 1 &&
           num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP;
}

/* Floats of scratch one work item over a sequence of `seq_len` keys needs. */
static int64_t scores_size(int64_t group, int64_t seq_len, int64_t block_size) {
    return group * (seq_len + 2 * block_size);
}

/* Work item (s, h): the `group` query heads of sequence s that share KV head h. `scores`: at least
 * scores_size(group, seq_lens[s], block_size) floats. */
NOIPA void attend_item(float *out, const float *q, int64_t q_seq_stride, const void *k_cache, const void *v_cache,
                        int kv_is_bf16, const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t sliding_window, float softcap, int64_t s, int64_t h, float *scores) {
    const int64_t group = num_heads / num_kv_heads, seq_len = seq_lens[s];
    const int64_t block_stride = num_kv_heads * head_dim * block_size, head_stride = head_dim * block_size;
    const int64_t first = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
    const float *qs = q + s * q_seq_stride + h * group * head_dim;
    float *os = out + (s * num_heads + h * group) * head_dim;
    const int64_t *table = block_tables + s * table_stride;
#define ATTEND(GROUP, HEAD_DIM)                                                                       \
    attend(os, qs, k_cache, v_cache, kv_is_bf16, table, first, seq_len, GROUP, HEAD_DIM, block_size,      \
           block_stride, h * head_stride, scale, softcap, scores)
#define ATTEND_GROUPS(HEAD_DIM)                                                                       \
    switch (group) {                                                                                  \
    case 1: ATTEND(1, HEAD_DIM); break;                                                               \
    case 2: ATTEND(2, HEAD_DIM); break;                                                               \
    case 3: ATTEND(3, HEAD_DIM); break;                                                               \
    case 4: ATTEND(4, HEAD_DIM); break;                                                               \
    case 8: ATTEND(8, HEAD_DIM); break;                                                               \
    default: ATTEND(group, HEAD_DIM);                                                                 \
    }
    if (head_dim == 64)
        ATTEND_GROUPS(64)
    else if (head_dim == 128)
        ATTEND_GROUPS(128)
    else
        ATTEND(group, head_dim);
#undef ATTEND_GROUPS
#undef ATTEND
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
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
        float *scores = malloc(sizeof(float) * (size_t)scores_size(group, seq_lens[s], block_size));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend_item(out, q, q_seq_stride, k_cache, v_cache, kv_is_bf16, block_tables, table_stride, seq_lens,
                    num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, softcap, s, h, scores);
        free(scores);
    }
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
