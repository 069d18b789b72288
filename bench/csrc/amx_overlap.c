/* What runs beside a TDPBF16PS on this core (bench/amx_overlap.py): the time stamp counter ticks of a loop
 * whose every iteration issues `tdps` tile products (one C tile, 16 x 16 x 32 bfloat16) and `count`
 * independent vector instructions of one kind, in 16 register chains (so a kind's latency does not bound
 * it). An instruction kind that overlaps the tile unit costs max(tile, vector) an iteration; one that waits
 * for it costs their sum.
 *
 *   kinds: 0 VFMADD231PS   1 VCVTNE2PS2BF16   2 VPERMW   3 VPSHUFB   4 VPTERNLOGD   5 VMOVDQA64 store
 *
 * Built without AMX and AVX512-BF16 (another CPU, an older compiler) cbserve_overlap_available returns 0. */
#include <stdint.h>
#include <string.h>
#include <x86intrin.h>

#include "../../engine/executor/kernels/csrc/amx_tiles.h"

#define KINDS 6

#if HAVE_AMX && defined(__AVX512BF16__)
int cbserve_overlap_available(void) { return amx_permitted(); }

/* one instruction of a kind on chain x (the next chain y: VPTERNLOGD's third operand) */
#define STEP0(x, y) x = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(x), g, g));
#define STEP1(x, y) x = (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(x), g);
#define STEP2(x, y) x = _mm512_permutexvar_epi16(idx, x);
#define STEP3(x, y) x = _mm512_shuffle_epi8(x, idx);
#define STEP4(x, y) x = _mm512_ternarylogic_epi32(x, idx, y, 0xEA);
#define STEP5(x, y) _mm512_store_si512(sink + 16 * r + SLOT_##x, x); /* r: the round of 16 */
enum { SLOT_v0, SLOT_v1, SLOT_v2, SLOT_v3, SLOT_v4, SLOT_v5, SLOT_v6, SLOT_v7, SLOT_v8, SLOT_v9, SLOT_v10, SLOT_v11,
       SLOT_v12, SLOT_v13, SLOT_v14, SLOT_v15 };
#define SIXTEEN(S)                                                                                             \
    S(v0, v1) S(v1, v2) S(v2, v3) S(v3, v4) S(v4, v5) S(v5, v6) S(v6, v7) S(v7, v8) S(v8, v9) S(v9, v10)     \
    S(v10, v11) S(v11, v12) S(v12, v13) S(v13, v14) S(v14, v15) S(v15, v0)

static __m512i sink[64] __attribute__((aligned(64)));

/* the ticks of `iters` iterations of `tdps` (a literal, 0 or 1) tile products and 16 x `sixteens` (a literal)
 * instructions of the kind whose STEP is S, in 16 register chains */
#define LOOP(S, tdps, sixteens)                                                                                \
    do {                                                                                                       \
        __m512i v0 = _mm512_set1_epi32(0x3F800000), v1 = v0, v2 = v0, v3 = v0, v4 = v0, v5 = v0, v6 = v0,   \
                v7 = v0, v8 = v0, v9 = v0, v10 = v0, v11 = v0, v12 = v0, v13 = v0, v14 = v0, v15 = v0;          \
        const uint64_t start = __rdtsc();                                                                      \
        for (long it = 0; it < iters; it++) {                                                                  \
            if (tdps) _tile_dpbf16ps(0, 4, 5);                                                                 \
            for (int r = 0; r < (sixteens); r++) { SIXTEEN(S) }                                                \
            __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3), "+v"(v4), "+v"(v5), "+v"(v6),      \
                             "+v"(v7));                                                                        \
            __asm__ volatile("" : "+v"(v8), "+v"(v9), "+v"(v10), "+v"(v11), "+v"(v12), "+v"(v13), "+v"(v14), \
                             "+v"(v15));                                                                       \
            __asm__ volatile("" ::"r"(sink) : "memory"); /* the stores happen, every iteration */            \
        }                                                                                                      \
        ticks = __rdtsc() - start;                                                                             \
    } while (0)

#define COUNT(S, sixteens)        \
    if (tdps)                     \
        LOOP(S, 1, sixteens);     \
    else                          \
        LOOP(S, 0, sixteens);
#define COUNTS(S)                                  \
    if (count == 0) { COUNT(S, 0) }                \
    if (count == 16) { COUNT(S, 1) }               \
    if (count == 32) { COUNT(S, 2) }               \
    if (count == 64) { COUNT(S, 4) }

/* ticks an iteration of `iters`: `tdps` (0 or 1) tile products and `count` (0, 16, 32 or 64) instructions of
 * `kind`; -1 for another count or kind */
double cbserve_overlap(int kind, int count, int tdps, long iters) {
    static uint16_t tiles[2][512] __attribute__((aligned(64)));
    if ((count != 0 && count != 16 && count != 32 && count != 64) || kind < 0 || kind >= KINDS || iters < 1)
        return -1.0;
    for (int i = 0; i < 512; i++) tiles[0][i] = tiles[1][i] = (uint16_t)(0x3F80 + i % 7); /* 1.0 .. 1.05 */
    amx_configure_full_tiles();
    _tile_loadd(4, tiles[0], 64);
    _tile_loadd(5, tiles[1], 64);
    _tile_zero(0);
    const __m512 g = _mm512_set1_ps(0.999f);
    const __m512i idx = _mm512_set1_epi16(3);
    uint64_t ticks = 0;
    switch (kind) {
    case 0: COUNTS(STEP0) break;
    case 1: COUNTS(STEP1) break;
    case 2: COUNTS(STEP2) break;
    case 3: COUNTS(STEP3) break;
    case 4: COUNTS(STEP4) break;
    default: COUNTS(STEP5) break;
    }
    _tile_release();
    return (double)ticks / (double)iters;
}
#else
int cbserve_overlap_available(void) { return 0; }

double cbserve_overlap(int kind, int count, int tdps, long iters) {
    (void)kind, (void)count, (void)tdps, (void)iters;
    return -1.0;
}
#endif

int cbserve_overlap_kinds(void) { return KINDS; }
