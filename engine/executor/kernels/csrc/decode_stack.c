/* A decode step's decoder layers in one call: every layer of a float32 Llama-family (or Gemma 2) model for a
 * batch of sequences that each compute one new token, inside one OpenMP parallel region.
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
 *   rotate q and k (the layer's table); store k and v   cpu_ops.c, paged_decode.c
 *   a = attention(q, pages)                             paged_decode.c, one item per (sequence, KV head),
 *                                                       in the layer's window, scores soft-capped (Gemma 2)
 *   y = a Wo^T (+ b)                                    [Gemma: y = post_attention_norm(y)]
 *   residual += y;  n = post_norm(residual)             (Gemma: its pre-feedforward norm)
 *   g = n Wgate_up^T;  m = silu(gate) * up;  y = m Wdown^T   [Gemma: gelu_tanh; y = post_feedforward_norm(y)]
 *
 * and at the end out = final_norm(residual + y), the rows the output head takes. Each phase splits its
 * work over the threads (rows, output panels or attention items) and ends in a barrier.
 */
#include "small_gemm.c"
#include "cpu_ops.c"
#include "../../attention/csrc/paged_decode.c"

#include <omp.h>

/* One decoder layer's weights, float32: matrices in small_gemm.c's packed panels; where the checkpoint
 * stored a matrix in blocks, its quantized panels too (else NULL), which steps of at most ROWS sequences use. */
typedef struct {
    const float *input_norm;    /* [hidden] */
    const float *qkv;           /* [q_size + 2 * kv_size] x [hidden], packed */
    const float *qkv_bias;      /* [q_size + 2 * kv_size] or NULL */
    const float *o;             /* [hidden] x [q_size], packed */
    const float *o_bias;        /* [hidden] or NULL */
    const float *post_norm;     /* [hidden] */
    const float *gate_up;       /* [2 * intermediate] x [hidden], packed (gate rows first) */
    const float *down;          /* [hidden] x [intermediate], packed */
    float *k_cache;             /* [num_blocks, num_kv_heads, head_dim, block_size] */
    float *v_cache;             /* [num_blocks, num_kv_heads, block_size, head_dim] */
    const uint8_t *qkv_q, *o_q, *gate_up_q, *down_q; /* quantized panels or NULL */
    int64_t qkv_q_offsets, o_q_offsets, gate_up_q_offsets, down_q_offsets; /* 1: d * q + m, 0: d * q */
    int64_t rotate;             /* 1: q and k take the rotary embedding; 0: a NoPE layer (SmolLM3) */
    int64_t sliding_window;     /* this layer's window, <= 0: none */
    const float *post_attn_norm, *post_ff_norm; /* [hidden]: Gemma's norms of each block's output, or NULL */
    int64_t gelu;               /* 1: m = gelu_tanh(gate) * up (Gemma); 0: silu */
    const float *q_norm, *k_norm; /* [head_dim]: per-head norms of q and k before the rotation, or NULL */
    const float *cos, *sin_signed; /* [max_positions, head_dim]: the layer's rotary tables of cpu_ops.c */
} cbserve_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_positions;
    float eps, scale, softcap /* <= 0: none */;
    const float *final_norm;       /* [hidden] */
} cbserve_model;

/* y[:, 0:N] = x W^T (+ b) for M rows: the output panels shared out among the threads of the region; from
 * the quantized panels where there are some and M <= ROWS (small_gemm.py's QUANTIZED_MAX_ROWS) */
static void gemm_shared(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed,
                        const uint8_t *qpacked, int64_t offsets, const float *bias, int64_t M, int64_t N,
                        int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (qpacked != NULL && M <= ROWS) {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++)
            rows_times_qpanel(out, ldo, x, ldx, qpacked, (int)offsets, bias, M, N, K, p, NULL);
    } else {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) rows_times_panel(out, ldo, x, ldx, packed, bias, M, N, K, p);
    }
}

/* Returns 0; -2: a shape the kernels do not take; -3: a slot outside the cache; -4: a position outside the
 * rotary table; -5: a sequence length below 1 or a table entry outside the cache; -1: out of memory.
 * Nothing is written unless it returns 0. */
int cbserve_decode_stack(const cbserve_model *m, const cbserve_layer *layers,
                         float *out,                  /* [num_seqs, hidden]: the final norm's output */
                         const float *x,              /* [num_seqs, hidden]: the new tokens' embeddings */
                         const int64_t *positions,    /* [num_seqs] */
                         const int64_t *slots,        /* [num_seqs] block * block_size + row */
                         const int64_t *block_tables, /* [num_seqs, table_stride] */
                         int64_t table_stride,
                         const int64_t *seq_lens,     /* [num_seqs] KV length with the new token */
                         int64_t num_seqs) {
    const int64_t S = num_seqs, H = m->hidden, hd = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    const int64_t I = m->intermediate, bs = m->block_size;
    const int64_t q_size = nh * hd, kv_size = nkv * hd, qkv_size = q_size + 2 * kv_size;
    if (!supported(nh, nkv, hd, bs)) return -2;
    const int64_t group = nh / nkv;
    int64_t max_len = 1;
    for (int64_t s = 0; s < S; s++) {
        if (slots[s] < 0 || slots[s] >= m->num_blocks * bs) return -3;
        if (positions[s] < 0 || positions[s] >= m->max_positions) return -4;
        if (seq_lens[s] < 1 || (seq_lens[s] + bs - 1) / bs > table_stride) return -5;
        for (int64_t b = 0; b < (seq_lens[s] + bs - 1) / bs; b++)
            if (block_tables[s * table_stride + b] < 0 || block_tables[s * table_stride + b] >= m->num_blocks)
                return -5;
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    }
    for (int64_t l = 0; l < m->num_layers; l++) {
        const cbserve_layer *w = &layers[l];
        if (((w->qkv_q || w->gate_up_q) && H % QBLOCK) || (w->o_q && q_size % QBLOCK) || (w->down_q && I % QBLOCK))
            return -2;
    }
    const int threads = omp_get_max_threads();
    const int64_t scratch = scores_size(group, max_len, bs);
    float *buffer = malloc(sizeof(float) * (size_t)(S * (3 * H + qkv_size + q_size + 3 * I) + threads * scratch));
    if (buffer == NULL) return -1;
    float *residual = buffer, *normed = residual + S * H, *y = normed + S * H, *qkv = y + S * H;
    float *attn = qkv + S * qkv_size, *gate_up = attn + S * q_size, *act = gate_up + S * 2 * I;
    float *scores = act + S * I;

#pragma omp parallel num_threads(threads)
    {
        float *my_scores = scores + omp_get_thread_num() * scratch;
        for (int64_t l = 0; l < m->num_layers; l++) {
            const cbserve_layer *w = &layers[l];
#pragma omp for schedule(static)
            for (int64_t r = 0; r < S; r++) {
                if (l == 0) {
                    memcpy(residual + r * H, x + r * H, sizeof(float) * (size_t)H);
                    rms_norm_f32(normed + r * H, NULL, x + r * H, w->input_norm, H, m->eps);
                } else {
                    rms_norm_f32(normed + r * H, residual + r * H, y + r * H, w->input_norm, H, m->eps);
                }
            }
            gemm_shared(qkv, qkv_size, normed, H, w->qkv, w->qkv_q, w->qkv_q_offsets, w->qkv_bias, S, qkv_size, H);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < S; t++) {
                float *row = qkv + t * qkv_size;
                if (w->q_norm != NULL)
                    for (int64_t h = 0; h < nh; h++) rms_norm_f32(row + h * hd, NULL, row + h * hd, w->q_norm, hd, m->eps);
                if (w->k_norm != NULL)
                    for (int64_t h = nh; h < nh + nkv; h++)
                        rms_norm_f32(row + h * hd, NULL, row + h * hd, w->k_norm, hd, m->eps);
                const float *c = w->cos + positions[t] * hd, *sn = w->sin_signed + positions[t] * hd;
                if (w->rotate)
                    for (int64_t h = 0; h < nh + nkv; h++) rotary_f32(row + h * hd, c, sn, hd / 2);
                write_token_kv(w->k_cache, w->v_cache, row + q_size, row + q_size + kv_size, slots[t], nkv, hd,
                               bs, sizeof(float));
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < S * nkv; item++)
                attend_item(attn, qkv, qkv_size, w->k_cache, w->v_cache, 0, block_tables, table_stride, seq_lens,
                            nh, nkv, hd, bs, m->scale, w->sliding_window, m->softcap, item / nkv, item % nkv,
                            my_scores);
            gemm_shared(y, H, attn, q_size, w->o, w->o_q, w->o_q_offsets, w->o_bias, S, H, q_size);
            if (w->post_attn_norm != NULL) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < S; r++)
                    rms_norm_f32(y + r * H, NULL, y + r * H, w->post_attn_norm, H, m->eps);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < S; r++)
                rms_norm_f32(normed + r * H, residual + r * H, y + r * H, w->post_norm, H, m->eps);
            gemm_shared(gate_up, 2 * I, normed, H, w->gate_up, w->gate_up_q, w->gate_up_q_offsets, NULL, S, 2 * I, H);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < S; r++) {
                if (w->gelu)
                    gelu_tanh_and_mul_f32(act + r * I, gate_up + r * 2 * I, gate_up + r * 2 * I + I, I);
                else
                    silu_and_mul_f32(act + r * I, gate_up + r * 2 * I, gate_up + r * 2 * I + I, I);
            }
            gemm_shared(y, H, act, I, w->down, w->down_q, w->down_q_offsets, NULL, S, H, I);
            if (w->post_ff_norm != NULL) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < S; r++)
                    rms_norm_f32(y + r * H, NULL, y + r * H, w->post_ff_norm, H, m->eps);
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < S; r++) {
            if (m->num_layers == 0)
                rms_norm_f32(out + r * H, NULL, x + r * H, m->final_norm, H, m->eps);
            else
                rms_norm_f32(out + r * H, residual + r * H, y + r * H, m->final_norm, H, m->eps);
        }
    }
    free(buffer);
    return 0;
}
