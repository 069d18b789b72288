/* Each row's maximum and the first column that holds it, in one pass over float32 rows: what the sampler's
 * greedy pick and its checks for broken rows read (engine/generation/row_argmax.py).
 *
 *   maxima[r] = max_j x[r, j]                    NaN where the row holds a NaN; +-inf as they come
 *   first[r]  = min { j : x[r, j] == maxima[r] }  (-0.0 == +0.0, as torch.argmax compares); -1 with a NaN
 *
 * torch.argmax is an index-tracking reduction that runs a lane at a time (~1 ms for 16 rows of a 49,152-token
 * vocabulary on the benchmark machine); this pass takes ~0.1 ms for them, ~20 us for one row. Each lane of a LANES-wide block keeps its running
 * maximum and the first column that held it, compared as integers (a float's bits mapped to an integer of
 * the same order), so the loop vectorises to integer compares and selects and does not depend on how the
 * compiler treats NaN and infinities under -ffast-math (the kernels' flags); the lanes' winners are then
 * compared in column order. Rows go to OpenMP's threads when there are enough of them.
 */
#include <stdint.h>
#include <string.h>

#define LANES 16
#define PARALLEL_MIN_ELEMENTS (1 << 18) /* 6 rows of a 49,152-token vocabulary */

typedef int32_t v16i __attribute__((vector_size(LANES * sizeof(int32_t))));

/* A float's order as an int32 (NaN excluded): the bits for x >= 0, the magnitude's bits flipped for x < 0;
 * -0.0 maps to +0.0's 0. `magnitude` is bits & 0x7FFFFFFF, `negative` 1 where the sign bit is set. */
static inline v16i order_keys(v16i magnitude, v16i negative) { return magnitude ^ ((magnitude != 0) & -negative); }

static inline int32_t order_key(int32_t magnitude, int32_t negative) {
    return magnitude ^ -(int32_t)(negative && magnitude != 0);
}

/* maxima and first column of one row of `cols` floats: lane l of a LANES-wide block keeps the largest key of
 * columns l, l + LANES, l + 2 LANES, .. and the first of them that held it (a strict compare); the lanes'
 * winners are then compared in column order */
static void row_argmax(const float *x, int64_t cols, float *maximum, int64_t *first) {
    v16i best, where, lane, nan = {0};
    for (int l = 0; l < LANES; l++) best[l] = INT32_MIN, where[l] = -1, lane[l] = l;
    const int64_t whole = cols / LANES * LANES;
    for (int64_t j0 = 0; j0 < whole; j0 += LANES) {
        v16i bits;
        memcpy(&bits, x + j0, sizeof bits);
        const v16i magnitude = bits & 0x7FFFFFFF, negative = (bits < 0) & 1;
        const v16i key = order_keys(magnitude, negative);
        nan |= magnitude > 0x7F800000;
        const v16i better = key > best;
        best = (key & better) | (best & ~better);
        where = (((int32_t)j0 + lane) & better) | (where & ~better);
    }
    int32_t any_nan = 0, at = -1, top = INT32_MIN;
    for (int l = 0; l < LANES; l++) any_nan |= nan[l];
    for (int64_t j = whole; j < cols; j++) { /* the tail, in column order after every lane's own */
        int32_t bits;
        memcpy(&bits, x + j, sizeof bits);
        const int32_t magnitude = bits & 0x7FFFFFFF, key = order_key(magnitude, bits < 0);
        any_nan |= magnitude > 0x7F800000;
        const int l = (int)(j % LANES);
        if (key > best[l]) best[l] = key, where[l] = (int32_t)j;
    }
    if (any_nan || !cols) { /* a NaN in the row (or no columns, which the sampler never passes) */
        const uint32_t quiet_nan = 0x7FC00000u;
        memcpy(maximum, &quiet_nan, sizeof quiet_nan);
        *first = -1;
        return;
    }
    for (int l = 0; l < LANES; l++) /* the largest key; of equal keys, the earliest column */
        if (where[l] >= 0 && (best[l] > top || (best[l] == top && where[l] < at))) top = best[l], at = where[l];
    *first = at;
    *maximum = x[at];
}

/* x: [rows, cols] float32, row stride `stride`; writes maxima[rows] and first[rows] */
void cbserve_row_argmax(const float *x, int64_t stride, int64_t rows, int64_t cols, float *maxima, int64_t *first) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) row_argmax(x + r * stride, cols, maxima + r, first + r);
}
