/* What every AMX kernel needs before its first tile instruction (amx_gemm.c; the prefill attention's
 * paged_prefill_bf16.c): whether it was built for AMX at all, the process's permission to use the tile
 * registers, and one thread's tile configuration.
 *
 * Linux lends a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM); each thread
 * configures its tiles (LDTILECFG) before use and releases them (TILERELEASE) after. */
#ifndef CBSERVE_AMX_TILES_H
#define CBSERVE_AMX_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* 1 where this process may use the tile registers (asked once; asking again is harmless) */
static inline int amx_permitted(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* this thread's eight tiles, each 16 rows x 64 bytes */
static inline void amx_configure_full_tiles(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* NOTE: not _tile_loadconfig: GCC 12's asm operand there is the first 8 bytes of the configuration, so the
     * compiler may drop the stores of the rest as dead (seen: the column widths gone, LDTILECFG faults) */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}
#else
#define HAVE_AMX 0
#endif

#endif
