/* A scratch buffer kept from one call of a kernel to the next, per thread (amx_gemm.c's padded tiles and
 * blocks, the decode stack's activations, the prefill attention's scores).
 *
 * Why: a buffer of more than ~128 KB is one the C library maps afresh at each malloc and unmaps at each free,
 * so every call paid a page fault and the zeroing of every page it touched: ~10-20% of a prefill-sized matmul
 * call (its per-thread scratch), a few percent of a decode step. Kept, it is faulted in once per thread. */
#ifndef CBSERVE_KEPT_BUFFER_H
#define CBSERVE_KEPT_BUFFER_H

#include <stdlib.h>

typedef struct {
    void *data;
    size_t size;
} kept_buffer;

/* At least `bytes`, 64-byte aligned (tile rows), from `kept` (a __thread variable of the caller's), grown when
 * short; NULL when out of memory. Valid until the next call with the same `kept`. */
static inline void *kept_alloc(kept_buffer *kept, size_t bytes) {
    if (bytes > kept->size) {
        free(kept->data);
        kept->size = (bytes + 65535) / 65536 * 65536;
        kept->data = aligned_alloc(64, kept->size);
        if (kept->data == NULL) kept->size = 0;
    }
    return kept->data;
}

#endif
