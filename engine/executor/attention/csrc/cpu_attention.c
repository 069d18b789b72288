/* The CPU attention kernels in one library (engine/executor/attention/cpu_kernel.py): decode (one query per
 * sequence) and prefill (a chunk of queries per sequence), over the same paged KV cache. */
#include "paged_decode.c"
#include "paged_prefill.c"
