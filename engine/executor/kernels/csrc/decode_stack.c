/* A decode step's decoder layers in one call: every layer of a Llama-family (or Gemma) model for a batch of
 * sequences that each compute one new token, inside one OpenMP parallel region. float32 (the matmuls on
 * small_gemm.c's panels) or bfloat16 (on amx_gemm.c's AMX tiles, where the CPU has them, else on
 * bf16_gemm.c's panels of k-pairs, where it has AVX512-BF16).
 *
 * Why: run layer by layer from Python, a decode step makes hundreds of calls into C (a matmul, an
 * attention, a norm...); between them the main thread runs Python and PyTorch glue while the other
 * threads spin in OpenMP's barrier (measured: python -m bench.decode_stack_ab, docs/BENCHMARKS.md).
 * Here the threads go from one phase to the next through a barrier, and Python is entered once per step.
 *
 * Per layer (the phases of engine/executor/models/llama.py, with the same kernels, so the same bits):
 *
 *   residual += y;  n = input_norm(residual)           (layer 0: residual = x, the embeddings)
 *   qkv = n Wqkv^T (+ b)                                small_gemm.c's panels
 *   [Qwen3, Gemma 3: q and k normed per head]
 *   rotate q and k (the layer's table); store k and v   cpu_ops.c, paged_decode.c (their cache lines asked
 *                                                       for at the layer's start)
 *   a = attention(q, pages)                             paged_decode.c, one item per (tile, KV head): a
 *                                                       tile is a row or rows of one verify run (its pages
 *                                                       read once for them), in the layer's window, scores
 *                                                       soft-capped (Gemma 2)
 *   y = a Wo^T (+ b)                                    [Gemma: y = post_attention_norm(y)]
 *   residual += y;  n = post_norm(residual)             (Gemma: its pre-feedforward norm)
 *   g = n Wgate_up^T;  m = silu(gate) * up;  y = m Wdown^T   [Gemma: gelu_tanh; y = post_feedforward_norm(y)]
 *
 * and at the end out = final_norm(residual + y), the rows the output head takes. Each phase splits its
 * work over the threads (rows, output panels or attention items) and ends in a barrier.
 *
 * In bfloat16 the activations are bfloat16 where the layer-by-layer path holds bfloat16 tensors (cpu_ops.c
 * rounds at the same points), the queries are widened to float32 for the attention, whose float32 output is
 * rounded to bfloat16 for o, as engine/executor/attention/cpu_kernel.py does. The AMX kernel computes whole
 * tiles of 16 (or blocks of 32) rows: the matmuls' input buffers carry zero rows up to that padded count, so
 * no row is copied, and every row's result is that of a call of any size (amx_gemm.c).
 */
#include "small_gemm.c"
#include "cpu_ops.c"
#include "amx_qgemm.c" /* and amx_gemm.c */
#include "bf16_gemm.c"
#include "../../attention/csrc/paged_decode.c"

#include <omp.h>

/* Where a step's time goes, for bench/decode_phases.py only: built with CBSERVE_PHASE_TIMES (its own copy of
 * this file, bench/csrc/decode_stack_phases.c), the first thread adds the time stamp counter's ticks since
 * the last mark to each phase of every layer (each phase ends in its barrier, so a phase's ticks are the
 * step's time in it). In the engine's build the marks are empty and compile to nothing. */
enum { PHASE_NORM, PHASE_QKV, PHASE_ROTARY_KV, PHASE_ATTENTION, PHASE_O, PHASE_POST_NORM, PHASE_GATE_UP,
       PHASE_ACT, PHASE_DOWN, PHASES };
#if defined(CBSERVE_PHASE_TIMES) && (defined(__x86_64__) || defined(__i386__))
#include <x86intrin.h>
static uint64_t phase_ticks[PHASES], phase_last;
static int64_t phase_steps;
static inline void phase_start(void) {
    if (omp_get_thread_num() == 0) phase_last = __rdtsc();
}
static inline void phase_mark(int phase) {
    if (omp_get_thread_num() != 0) return;
    const uint64_t now = __rdtsc();
    phase_ticks[phase] += now - phase_last;
    phase_last = now;
}
/* ticks[PHASES] = each phase's ticks since the last reset; returns the steps counted */
int64_t cbserve_decode_stack_phases(double *ticks) {
    for (int i = 0; i < PHASES; i++) ticks[i] = (double)phase_ticks[i];
    return phase_steps;
}
void cbserve_decode_stack_phases_reset(void) {
    memset(phase_ticks, 0, sizeof phase_ticks);
    phase_steps = 0;
}
uint64_t cbserve_ticks(void) { return __rdtsc(); }
#define PHASE_STEP() (phase_steps++)
#else
static inline void phase_start(void) {}
static inline void phase_mark(int phase) { (void)phase; }
#define PHASE_STEP() ((void)0)
#endif

/* One decoder layer's weights, in the model's dtype (float32 or bfloat16 bits): matrices packed in
 * small_gemm.c's panels (float32) or amx_gemm.c's tiles (bfloat16); where the checkpoint stored a matrix in
 * blocks, its quantized panels (float32; steps of at most ROWS sequences use them) or quantized tiles
 * (bfloat16, amx_qgemm.c; steps of at most QROWS) too, else NULL. */
typedef struct {
    const void *input_norm;     /* [hidden] */
    const void *qkv;            /* [q_size + 2 * kv_size] x [hidden], packed */
    const void *qkv_bias;       /* [q_size + 2 * kv_size] or NULL */
    const void *o;              /* [hidden] x [q_size], packed */
    const void *o_bias;         /* [hidden] or NULL */
    const void *post_norm;      /* [hidden] */
    const void *gate_up;        /* [2 * intermediate] x [hidden], packed (gate rows first) */
    const void *down;           /* [hidden] x [intermediate], packed */
    void *k_cache;              /* [num_blocks, num_kv_heads, head_dim, block_size] */
    void *v_cache;              /* [num_blocks, num_kv_heads, block_size, head_dim] */
    const uint8_t *qkv_q, *o_q, *gate_up_q, *down_q; /* quantized panels (tiles) or NULL */
    int64_t qkv_q_offsets, o_q_offsets, gate_up_q_offsets, down_q_offsets; /* 1: d * q + m, 0: d * q */
    int64_t rotate;             /* 1: q and k take the rotary embedding; 0: a NoPE layer (SmolLM3) */
    int64_t sliding_window;     /* this layer's window, <= 0: none */
    const void *post_attn_norm, *post_ff_norm; /* [hidden]: Gemma's norms of each block's output, or NULL */
    int64_t gelu;               /* 1: m = gelu_tanh(gate) * up (Gemma); 0: silu */
    const void *q_norm, *k_norm; /* [head_dim]: per-head norms of q and k before the rotation, or NULL */
    const void *cos, *sin_signed; /* [max_positions, head_dim]: the layer's rotary tables of cpu_ops.c */
} cbserve_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_positions;
    float eps, scale, softcap /* <= 0: none */;
    const void *final_norm;        /* [hidden] */
    int64_t bf16;                  /* 1: weights, activations and the KV cache in bfloat16; 0: float32 */
    int64_t f32_norms;             /* 1: every norm's weight float32, scaling before the rounding (Gemma) */
    int64_t bf16_dot;              /* 1: the bfloat16 matmuls on bf16_gemm.c's panels, not AMX tiles */
} cbserve_model;

/* y[:, 0:N] = x W^T (+ b) for M rows: the output panels shared out among the threads of the region; from
 * the quantized panels where there are some and M <= ROWS (small_gemm.py's QUANTIZED_MAX_ROWS); with
 * AVX-512 and at least WIDE_ROWS rows on small_gemm.c's 16-float path */
static void gemm_shared(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                        const uint8_t *qpacked, int64_t offsets, const float *bias, int64_t M, int64_t N,
                        int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (qpacked != NULL && M <= ROWS) {
#pragma omp for schedule(guided)
        for (int64_t p = 0; p < panels; p++)
            rows_times_qpanel(out, ldo, x, ldx, qpacked, (int)offsets, bias, M, N, K, p, NULL);
    } else {
#if defined(__AVX512F__)
        if (M >= WIDE_ROWS) { /* 16-float vectors (small_gemm.c): the same bits */
            wide_shared(out, ldo, x, ldx, packed, bias, M, N, K);
            return;
        }
#endif
#pragma omp for schedule(guided)
        for (int64_t p = 0; p < panels; p++) rows_times_panel(out, ldo, x, ldx, packed, bias, M, N, K, p);
    }
}


/* bfloat16: y[:, 0:N] = x W^T (+ b) for Mp rows (a whole number of AMX blocks: 16, or a multiple of 32),
 * shared out among the threads of the region as amx_gemm.c shares a call's (they have configured their
 * tiles); `scratch`: this thread's, 64-byte aligned, amx_scratch_bytes(Mp, K) */
static void amx_shared(uint16_t *out, const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, int64_t Mp,
                       int64_t N, int64_t K, uint16_t *scratch) {
#if HAVE_AMX
    (void)amx_gemm_share(out, N, x, K, tiles, bias, Mp, N, K, scratch); /* the scratch is there: allocate() */
#pragma omp barrier
#else
    (void)out, (void)x, (void)tiles, (void)bias, (void)Mp, (void)N, (void)K, (void)scratch;
#endif
}

/* A step's batch, as cbserve_decode_stack takes it: sequence s computes the token at positions[s], whose K
 * and V go to slots[s]; its KV length with that token is seq_lens[s], its pages block_tables[s * table_stride
 * + b]. */
typedef struct {
    const int64_t *positions, *slots, *block_tables, *seq_lens;
    int64_t table_stride;
} batch;

/* The step's buffers, one allocation (`base`, kept for the next step): the activations in the model's dtype,
 * `padded_rows` each (the matmuls' inputs with zero rows past the sequences); then float32: the queries and
 * the attention's output (bfloat16 only), each thread's scores; then each thread's AMX scratch block or
 * (bf16_gemm.c) packed rows (bfloat16 only). The attention's tiles (paged_decode.c's plan_tiles: one plan for every layer) are planned
 * before, in their own allocation. */
typedef struct {
    char *base;
    char *residual;    /* [hidden]: h, the residual stream, before the last block's output y is added */
    char *normed;      /* [hidden]: a norm of h, a block's input */
    char *y;           /* [hidden]: the last block's output (attention or MLP) */
    char *qkv;         /* [q_size + 2 * kv_size] */
    char *attn;        /* [q_size]: the attention's output, o's input */
    char *gate_up;     /* [2 * intermediate] */
    char *act;         /* [intermediate]: act(gate) * up, down's input */
    float *queries, *attn_out; /* [q_size] each, float32 (bfloat16 only) */
    float *scores;     /* scores_per_thread per thread */
    const int64_t *row_ids, *tile_starts; /* the attention's tiles (paged_decode.c's plan_tiles) */
    int64_t tiles;
    int64_t split_item;  /* > 0: the attention runs split (paged_attention_split), an item's scratch floats */
    char *amx_scratches; /* amx_scratch bytes per thread */
    int64_t scores_per_thread;
    size_t amx_scratch;
} buffers;

/* One thread's view of a step: the model's dtype, for the element-wise ops (cpu_ops.c) and the matmuls on
 * rows of `es` bytes; the batch; the buffers; this thread's scratch. */
typedef struct {
    const cbserve_model *m;
    const batch *in;
    const buffers *b;
    int bf16;
    int dot;           /* bfloat16 on bf16_gemm.c's panels (AVX512-BF16), not AMX tiles */
    int64_t es;        /* bytes per element: 2 or 4 */
    int64_t rows;      /* the sequences */
    int64_t padded;    /* rows the bfloat16 matmuls compute (zero rows past `rows`); `rows` in float32 */
    float *scores;     /* this thread's attention scores */
    uint16_t *scratch; /* this thread's AMX scratch block, or its packed rows for bf16_gemm.c (bfloat16) */
} step;

#define ROW(p, r, width) ((char *)(p) + ((r) * (width)) * st->es)

static inline void norm(const step *st, void *out, void *residual, const void *x, const void *w, int64_t n,
                        float eps) {
    if (st->bf16 && st->m->f32_norms)
        rms_norm_bf16_f32_weight(out, residual, x, w, n, eps);
    else if (st->bf16)
        rms_norm_bf16(out, residual, x, w, n, eps);
    else
        rms_norm_f32(out, residual, x, w, n, eps);
}

static inline void gate_mul(const step *st, void *out, const void *gate, const void *up, int64_t n, int gelu) {
    if (st->bf16)
        gelu ? gelu_tanh_and_mul_bf16(out, gate, up, n) : silu_and_mul_bf16(out, gate, up, n);
    else
        gelu ? gelu_tanh_and_mul_f32(out, gate, up, n) : silu_and_mul_f32(out, gate, up, n);
}

static inline void rotate(const step *st, void *x, const void *c, const void *s, int64_t half) {
    if (st->bf16)
        rotary_bf16(x, c, s, half);
    else
        rotary_f32(x, c, s, half);
}

/* bfloat16: amx_shared's product from the checkpoint's blocks in quantized tiles (amx_qgemm.c; 4-bit codes
 * with offsets, else 8-bit), for at most QROWS rows */
static void amx_q_shared(uint16_t *out, const uint16_t *x, const uint8_t *q, int offsets, const uint16_t *bias,
                         int64_t Mp, int64_t N, int64_t K, uint16_t *scratch) {
#if HAVE_AMX_Q
    (void)amx_qgemm_share(out, N, x, K, q, offsets, bias, Mp, N, K, scratch, 0); /* the scratch is there: allocate() */
#pragma omp barrier
#else
    (void)out, (void)x, (void)q, (void)offsets, (void)bias, (void)Mp, (void)N, (void)K, (void)scratch;
#endif
}

/* y[:, 0:N] = x[:, 0:K] W^T (+ b), every row of the step: from the weights' blocks where the checkpoint
 * stored them so (float32: up to ROWS rows; bfloat16: up to QROWS on AMX, QMAX on bf16_gemm.c) */
static inline void project(const step *st, void *out, const void *x, const void *w, const uint8_t *q, int64_t offsets,
                           const void *bias, int64_t N, int64_t K) {
    if (st->dot && q != NULL && st->rows <= QMAX) /* the scratch: allocate()'s */
        bf16_qgemm_share(out, NULL, N, x, K, q, (int)offsets, bias, st->rows, N, K, (uint32_t *)st->scratch, 0);
    else if (st->dot)
        bf16_gemm_share(out, NULL, N, x, K, w, bias, st->rows, N, K, (uint32_t *)st->scratch);
    else if (st->bf16 && q != NULL && st->padded <= QROWS)
        amx_q_shared(out, x, q, (int)offsets, bias, st->padded, N, K, st->scratch);
    else if (st->bf16)
        amx_shared(out, x, w, bias, st->padded, N, K, st->scratch);
    else
        gemm_shared(out, N, x, K, w, q, offsets, bias, st->rows, N, K);
}

/* The rows of `m` that a bfloat16 step computes for S sequences on AMX tiles: one tile of 16, or blocks of
 * 32 (`amx` 0: S). */
static int64_t padded_rows(int64_t S, int amx) {
    if (!amx) return S;
    return S <= 16 ? 16 : (S + 31) / 32 * 32;
}

/* cbserve_decode_stack's codes for a step of S sequences (0: the kernels take it). */
static int check_inputs(const cbserve_model *m, const cbserve_layer *layers, const batch *in, int64_t S) {
    const int64_t H = m->hidden, I = m->intermediate, bs = m->block_size, q_size = m->num_heads * m->head_dim;
    if (!supported(m->num_heads, m->num_kv_heads, m->head_dim, bs) ||
        (m->bf16 && !m->bf16_dot && (!HAVE_AMX || H % TILE_K || q_size % TILE_K || I % TILE_K)) ||
        (m->bf16_dot && (!m->bf16 || !HAVE_BF16_DOT)))
        return -2;
    for (int64_t s = 0; s < S; s++) {
        const int64_t len = in->seq_lens[s], *table = in->block_tables + s * in->table_stride;
        if (in->slots[s] < 0 || in->slots[s] >= m->num_blocks * bs) return -3;
        if (in->positions[s] < 0 || in->positions[s] >= m->max_positions) return -4;
        if (len < 1 || (len + bs - 1) / bs > in->table_stride) return -5;
        for (int64_t b = 0; b < (len + bs - 1) / bs; b++)
            if (table[b] < 0 || table[b] >= m->num_blocks) return -5;
    }
    for (int64_t l = 0; l < m->num_layers; l++) {
        const cbserve_layer *w = &layers[l];
        if (((w->qkv_q || w->gate_up_q) && H % QBLOCK) || (w->o_q && q_size % QBLOCK) || (w->down_q && I % QBLOCK))
            return -2;
    }
    return 0;
}

/* the calling thread's buffers, kept from step to step (kept_buffer.h) */
static __thread kept_buffer step_buffers;

/* The buffers of a step of S sequences on `threads` threads, `scores` floats of attention scores each; 0: out
 * of memory. */
static int allocate(buffers *b, const cbserve_model *m, int64_t S, int64_t scores, int threads) {
    const int bf16 = m->bf16 != 0, amx = bf16 && !m->bf16_dot;
    const int64_t H = m->hidden, I = m->intermediate, q_size = m->num_heads * m->head_dim;
    const int64_t qkv_size = q_size + 2 * m->num_kv_heads * m->head_dim;
    const int64_t Sp = padded_rows(S, amx), es = bf16 ? 2 : 4;
    const int64_t widest = H > I ? (H > q_size ? H : q_size) : (I > q_size ? I : q_size);
    b->scores_per_thread = scores;
    b->amx_scratch = bf16 ? ((amx ? amx_scratch_bytes(Sp, widest) : bf16_packed_rows_bytes(S, widest)) + 63) / 64 * 64 : 0;
    const size_t activations = (size_t)(Sp * (3 * H + qkv_size + q_size + 3 * I) * es);
    const size_t floats = (size_t)((bf16 ? 2 * S * q_size : 0) + threads * b->scores_per_thread);
    const size_t scratches = (activations + sizeof(float) * floats + 63) / 64 * 64; /* tiles load 64-byte rows */
    b->base = kept_alloc(&step_buffers, (scratches + threads * b->amx_scratch + 63) / 64 * 64);
    if (b->base == NULL) return 0;
    b->residual = b->base, b->normed = b->residual + Sp * H * es, b->y = b->normed + Sp * H * es;
    b->qkv = b->y + Sp * H * es, b->attn = b->qkv + Sp * qkv_size * es, b->gate_up = b->attn + Sp * q_size * es;
    b->act = b->gate_up + Sp * 2 * I * es;
    b->queries = (float *)(b->base + activations), b->attn_out = b->queries + (bf16 ? S * q_size : 0);
    b->scores = b->attn_out + (bf16 ? S * q_size : 0);
    b->amx_scratches = b->base + scratches;
    if (Sp > S) { /* the matmuls' inputs: zero rows past the sequences */
        memset(b->normed + S * H * es, 0, (size_t)((Sp - S) * H * es));
        memset(b->attn + S * q_size * es, 0, (size_t)((Sp - S) * q_size * es));
        memset(b->act + S * I * es, 0, (size_t)((Sp - S) * I * es));
    }
    return 1;
}

/* The layer's steps below are INLINE (always inlined): the stack compiles to one function, as before it was
 * split for reading; as separate calls it served 2-5% fewer tokens a second (bench/ab_commits.sh). */

/* out = norm(h) row by row, h = residual + y, kept in `residual` (with x, the embeddings: h = x) */
INLINE void add_and_norm(const step *st, void *out, const void *x, const void *weight) {
    const int64_t H = st->m->hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < st->rows; r++) {
        if (x != NULL) {
            memcpy(ROW(st->b->residual, r, H), ROW(x, r, H), (size_t)(H * st->es));
            norm(st, ROW(out, r, H), NULL, ROW(x, r, H), weight, H, st->m->eps);
        } else {
            norm(st, ROW(out, r, H), ROW(st->b->residual, r, H), ROW(st->b->y, r, H), weight, H, st->m->eps);
        }
    }
}

/* y = norm(y) row by row, where there is a norm (Gemma's norms of each block's output) */
INLINE void norm_output(const step *st, const void *weight) {
    if (weight == NULL) return;
    const int64_t H = st->m->hidden;
    char *y = st->b->y;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < st->rows; r++) norm(st, ROW(y, r, H), NULL, ROW(y, r, H), weight, H, st->m->eps);
}

/* Whether a step's attention runs split (paged_decode.c's score_item_part...): every tile one row, and fewer
 * work items (tile, KV head) than two per thread -- one row's three items on two threads otherwise leave one
 * thread a second item while the other waits. */
static int split_attention(int64_t tiles, int64_t num_seqs, int64_t num_kv_heads, int threads) {
    return tiles == num_seqs && tiles * num_kv_heads < 2 * threads;
}

/* Row by row: q and k normed per head (Qwen3, Gemma 3), then rotated to the token's position (the layer's
 * table; not in a NoPE layer); k and v stored in the token's slot; in bfloat16 the queries widened to
 * float32, as the layer-by-layer path hands them to the attention. */
INLINE void rotate_and_store_kv(const step *st, const cbserve_layer *w) {
    const cbserve_model *m = st->m;
    const int64_t nh = m->num_heads, nkv = m->num_kv_heads, hd = m->head_dim, es = st->es;
    const int64_t q_size = nh * hd, kv_size = nkv * hd, qkv_size = q_size + 2 * kv_size;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < st->rows; t++) {
        char *row = ROW(st->b->qkv, t, qkv_size);
        if (w->q_norm != NULL)
            for (int64_t h = 0; h < nh; h++)
                norm(st, row + h * hd * es, NULL, row + h * hd * es, w->q_norm, hd, m->eps);
        if (w->k_norm != NULL)
            for (int64_t h = nh; h < nh + nkv; h++)
                norm(st, row + h * hd * es, NULL, row + h * hd * es, w->k_norm, hd, m->eps);
        const int64_t position = st->in->positions[t];
        const char *c = ROW(w->cos, position, hd), *sn = ROW(w->sin_signed, position, hd);
        if (w->rotate)
            for (int64_t h = 0; h < nh + nkv; h++) rotate(st, row + h * hd * es, c, sn, hd / 2);
        write_token_kv(w->k_cache, w->v_cache, row + q_size * es, row + (q_size + kv_size) * es, st->in->slots[t],
                       nkv, hd, m->block_size, es);
        if (st->bf16)
            for (int64_t i = 0; i < q_size; i++) st->b->queries[t * q_size + i] = load(row, i, 1);
    }
}

/* Ask for the cache lines that rotate_and_store_kv will write this layer (each of this thread's rows' K column
 * and V row in its slot's page), into L2, at the layer's start: they arrive during the norm and the qkv
 * projection instead of stalling the stores one line at a time (the K column alone is a line per two
 * dimensions, and the step's weights have evicted them since the last step). The rows are those that its
 * `omp for schedule(static)` gives this thread (libgomp's split: contiguous, the first n % threads one longer).
 * 16 rows: the phase 1.1 -> 0.6 M cycles a step. */
INLINE void prefetch_kv_slots(const step *st, const cbserve_layer *w) {
    const cbserve_model *m = st->m;
    const int64_t nkv = m->num_kv_heads, hd = m->head_dim, bs = m->block_size, es = st->es;
    const int64_t block_stride = nkv * hd * bs, head_stride = hd * bs;
    const int64_t dims_per_line = 64 / (bs * es) > 0 ? 64 / (bs * es) : 1;
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t share = st->rows / threads, longer = st->rows % threads;
    const int64_t r0 = me * share + (me < longer ? me : longer), r1 = r0 + share + (me < longer);
    for (int64_t t = r0; t < r1; t++) {
        const int64_t block = st->in->slots[t] / bs, row = st->in->slots[t] % bs;
        for (int64_t h = 0; h < nkv; h++) {
            const int64_t page = block * block_stride + h * head_stride;
            const char *k = (const char *)w->k_cache + (page + row) * es;        /* [head_dim, block_size] */
            const char *v = (const char *)w->v_cache + (page + row * hd) * es;   /* [block_size, head_dim] */
            for (int64_t d = 0; d < hd; d += dims_per_line) __builtin_prefetch(k + d * bs * es, 0, 2);
            for (int64_t off = 0; off < hd * es; off += 64) __builtin_prefetch(v + off, 0, 2);
        }
    }
}

/* bfloat16: the attention's float32 outputs [first, first + count) rounded into o's input */
INLINE void round_for_o(const step *st, int64_t first, int64_t count) {
    for (int64_t i = first; i < first + count; i++) store(st->b->attn, i, st->b->attn_out[i], 1);
}

/* attn = attention(q, the pages) (paged_decode.c): one item per (tile, KV head), a tile one row or rows of
 * one verify run, in the layer's window, the scores soft-capped where the model caps them; in bfloat16 the
 * float32 output is rounded for o. */
INLINE void paged_attention(const step *st, const cbserve_layer *w) {
    const cbserve_model *m = st->m;
    const buffers *b = st->b;
    const int64_t nh = m->num_heads, nkv = m->num_kv_heads, hd = m->head_dim, group = nh / nkv;
    const int64_t q_size = nh * hd, qkv_size = q_size + 2 * nkv * hd;
    const float *q = st->bf16 ? b->queries : (const float *)b->qkv;
    float *a = st->bf16 ? b->attn_out : (float *)b->attn;
    const int64_t chunk = items_per_chunk(b->tiles, omp_get_num_threads(), nkv);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < b->tiles * nkv; item++) {
        const int64_t tile = item / nkv, h = item % nkv;
        const int64_t *rows = b->row_ids + b->tile_starts[tile], n = b->tile_starts[tile + 1] - b->tile_starts[tile];
        attend_item(a, q, st->bf16 ? q_size : qkv_size, w->k_cache, w->v_cache, st->bf16, st->in->block_tables,
                    st->in->table_stride, st->in->seq_lens, nh, nkv, hd, m->block_size, m->scale, w->sliding_window,
                    m->softcap, rows, n, h, st->scores);
        if (st->bf16) /* this item's heads rounded to bfloat16 for o */
            for (int64_t r = 0; r < n; r++) round_for_o(st, rows[r] * q_size + h * group * hd, group * hd);
    }
}

/* paged_attention for a step that split_attention says runs split: the items' scores by parts of their pages,
 * their heads' softmax, their outputs by slices of head_dim (64 bytes of each V row) -- each pass over all
 * the threads, the same bits as paged_attention's (paged_decode.c). The items' scratch is the threads'
 * scores buffers, one after another. */
INLINE void paged_attention_split(const step *st, const cbserve_layer *w) {
    const cbserve_model *m = st->m;
    const buffers *b = st->b;
    const int64_t nh = m->num_heads, nkv = m->num_kv_heads, hd = m->head_dim, group = nh / nkv, bs = m->block_size;
    const int64_t q_size = nh * hd, items = b->tiles * nkv, parts = omp_get_num_threads();
    const int64_t lanes = hd % (64 / st->es) == 0 ? 64 / st->es : LANES, slices = hd / lanes;
    const float *q = st->bf16 ? b->queries : (const float *)b->qkv;
    float *a = st->bf16 ? b->attn_out : (float *)b->attn;
#define ITEM_ROW(item) (b->row_ids[(item) / nkv])
#pragma omp for schedule(static)
    for (int64_t u = 0; u < items * parts; u++)
        score_item_part(b->scores + u / parts * b->split_item, q, st->bf16 ? q_size : q_size + 2 * nkv * hd,
                        w->k_cache, w->v_cache, st->bf16, st->in->block_tables, st->in->table_stride,
                        st->in->seq_lens, nh, nkv, hd, bs, m->scale, w->sliding_window, ITEM_ROW(u / parts),
                        u / parts % nkv, u % parts, parts);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < items * group; u++)
        softmax_item_head(b->scores + u / group * b->split_item, st->in->seq_lens, group, bs, w->sliding_window,
                          m->softcap, ITEM_ROW(u / group), u % group);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < items * slices; u++) {
        const int64_t item = u / slices, s = ITEM_ROW(item), h = item % nkv, d_lo = u % slices * lanes;
        values_item_part(a, w->v_cache, st->bf16, st->in->block_tables, st->in->table_stride, st->in->seq_lens,
                         nh, nkv, hd, bs, w->sliding_window, s, h, d_lo, d_lo + lanes,
                         b->scores + item * b->split_item);
        if (st->bf16) /* this slice of the item's heads rounded to bfloat16 for o */
            for (int64_t g = 0; g < group; g++) round_for_o(st, s * q_size + (h * group + g) * hd + d_lo, lanes);
    }
#undef ITEM_ROW
}

/* y = o(attention(q, k, v)), q, k, v = qkv(normed): llama.py's Attention (Gemma: y normed after o) */
INLINE void self_attention(const step *st, const cbserve_layer *w) {
    const buffers *b = st->b;
    const int64_t H = st->m->hidden, q_size = st->m->num_heads * st->m->head_dim;
    const int64_t qkv_size = q_size + 2 * st->m->num_kv_heads * st->m->head_dim;
    project(st, b->qkv, b->normed, w->qkv, w->qkv_q, w->qkv_q_offsets, w->qkv_bias, qkv_size, H);
    phase_mark(PHASE_QKV);
    rotate_and_store_kv(st, w);
    phase_mark(PHASE_ROTARY_KV);
    b->split_item ? paged_attention_split(st, w) : paged_attention(st, w);
    phase_mark(PHASE_ATTENTION);
    project(st, b->y, b->attn, w->o, w->o_q, w->o_q_offsets, w->o_bias, H, q_size);
    norm_output(st, w->post_attn_norm);
    phase_mark(PHASE_O);
}

/* Whether the step's SwiGLU runs as one call, the gate applied as the projection's sums round out (the same
 * bits as the projection then gate_mul): on AVX512-BF16 dot products, over the panels or the checkpoint's
 * blocks, SiLU, whole panels of gate outputs. */
static inline int gated_in_registers(const step *st, const cbserve_layer *w) {
    return st->dot && !w->gelu && st->m->intermediate % BF16_PANEL == 0;
}

/* y = down(act(gate) * up), gate, up = gate_up(normed): the gated MLP, act SiLU (Gemma: GELU-tanh, and y
 * normed after down) */
INLINE void mlp(const step *st, const cbserve_layer *w) {
    const buffers *b = st->b;
    const int64_t H = st->m->hidden, I = st->m->intermediate;
    if (gated_in_registers(st, w)) { /* bf16_gemm.c's SwiGLU: silu(g) * u written as the sums round out */
        uint16_t *act = (uint16_t *)b->act;
        const uint16_t *normed = (const uint16_t *)b->normed;
        if (w->gate_up_q != NULL && st->rows <= QMAX)
            bf16_qgemm_share(act, NULL, I, normed, H, w->gate_up_q, (int)w->gate_up_q_offsets, NULL, st->rows, 2 * I,
                             H, (uint32_t *)st->scratch, I / BF16_PANEL);
        else
            bf16_gemm_share_pairs(act, NULL, I, normed, H, w->gate_up, NULL, st->rows, 2 * I, H,
                                  (uint32_t *)st->scratch, I / BF16_PANEL);
        phase_mark(PHASE_GATE_UP);
    } else {
        project(st, b->gate_up, b->normed, w->gate_up, w->gate_up_q, w->gate_up_q_offsets, NULL, 2 * I, H);
        phase_mark(PHASE_GATE_UP);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < st->rows; r++)
            gate_mul(st, ROW(b->act, r, I), ROW(b->gate_up, r, 2 * I), ROW(b->gate_up, r, 2 * I) + I * st->es, I,
                     (int)w->gelu);
    }
    phase_mark(PHASE_ACT);
    project(st, b->y, b->act, w->down, w->down_q, w->down_q_offsets, NULL, H, I);
    norm_output(st, w->post_ff_norm);
    phase_mark(PHASE_DOWN);
}

/* One decoder layer, llama.py's DecoderLayer: h = residual + y (layer 0: h = x, the embeddings);
 * y = self_attention(input_norm(h)); h = h + y; y = mlp(post_norm(h)). */
INLINE void decoder_layer(const step *st, const cbserve_layer *w, const void *x) {
    phase_start();
    prefetch_kv_slots(st, w);
    add_and_norm(st, st->b->normed, x, w->input_norm);
    phase_mark(PHASE_NORM);
    self_attention(st, w);
    add_and_norm(st, st->b->normed, NULL, w->post_norm);
    phase_mark(PHASE_POST_NORM);
    mlp(st, w);
}

/* Returns 0; -2: a shape (or dtype) the kernels do not take; -3: a slot outside the cache; -4: a position
 * outside the rotary table; -5: a sequence length below 1 or a table entry outside the cache; -1: out of
 * memory. Nothing is written unless it returns 0. */
int cbserve_decode_stack(const cbserve_model *m, const cbserve_layer *layers,
                         void *out,                   /* [num_seqs, hidden]: the final norm's output */
                         const void *x,               /* [num_seqs, hidden]: the new tokens' embeddings */
                         const int64_t *positions,    /* [num_seqs] */
                         const int64_t *slots,        /* [num_seqs] block * block_size + row */
                         const int64_t *block_tables, /* [num_seqs, table_stride] */
                         int64_t table_stride,
                         const int64_t *seq_lens,     /* [num_seqs] KV length with the new token */
                         int64_t num_seqs) {
    const batch in = {positions, slots, block_tables, seq_lens, table_stride};
    const int rc = check_inputs(m, layers, &in, num_seqs);
    if (rc != 0) return rc;
    const int threads = omp_get_max_threads();
    const int64_t group = m->num_heads / m->num_kv_heads;
    int64_t *plan = malloc(sizeof(int64_t) * (size_t)plan_size(num_seqs));
    if (plan == NULL) return -1;
    const int64_t tiles = plan_tiles(block_tables, table_stride, seq_lens, num_seqs, m->block_size, group,
                                     min_tiles(threads, m->num_kv_heads), plan);
    buffers b;
    int64_t scores = plan_scores_size(plan, tiles, num_seqs, seq_lens, group, m->block_size), split_item = 0;
    if (split_attention(tiles, num_seqs, m->num_kv_heads, threads)) { /* the items' scratch, one after another */
        int64_t longest = 0;
        for (int64_t s = 0; s < num_seqs; s++) longest = seq_lens[s] > longest ? seq_lens[s] : longest;
        split_item = split_scores_size(group, longest, m->block_size);
        const int64_t per_thread = (tiles * m->num_kv_heads * split_item + threads - 1) / threads;
        scores = per_thread > scores ? per_thread : scores;
    }
    if (!allocate(&b, m, num_seqs, scores, threads)) {
        free(plan);
        return -1;
    }
    b.row_ids = plan, b.tile_starts = plan + num_seqs, b.tiles = tiles, b.split_item = split_item;
    const int bf16 = m->bf16 != 0, dot = bf16 && m->bf16_dot, amx = bf16 && !dot;

#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num();
        const step st = {m, &in, &b, bf16, dot, bf16 ? 2 : 4, num_seqs, padded_rows(num_seqs, amx),
                         b.scores + me * b.scores_per_thread, (uint16_t *)(b.amx_scratches + me * b.amx_scratch)};
#if HAVE_AMX
        if (amx) configure_tiles();
#endif
        for (int64_t l = 0; l < m->num_layers; l++) decoder_layer(&st, &layers[l], l == 0 ? x : NULL);
        add_and_norm(&st, out, m->num_layers == 0 ? x : NULL, m->final_norm); /* the rows the head takes */
#if HAVE_AMX
        if (amx) _tile_release();
#endif
    }
    free(plan);
    PHASE_STEP();
    return 0;
}
