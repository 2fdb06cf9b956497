// The AMX unit's own pace on this machine, for comparing the tile kernel
// against: int8 tile products (tdpbssd/tdpbsud) with four accumulators,
// alone, with their four tile loads from L1, and with the A tiles
// streamed from a buffer of growing size (the 2x2 blocking of
// crates/snug-kernels/src/panel/amx.rs). Linux, x86-64 with AMX:
//   gcc -O2 -mamx-tile -mamx-int8 bench/amx-tiles.c -o /tmp/amx-tiles && /tmp/amx-tiles
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int8_t A[8 << 20] __attribute__((aligned(64)));
static int8_t B[2048] __attribute__((aligned(64)));
static int32_t C[256] __attribute__((aligned(64)));

#define PRODUCTS()                \
    _tile_dpbssd(4, 0, 2);        \
    _tile_dpbsud(5, 0, 3);        \
    _tile_dpbssd(6, 1, 2);        \
    _tile_dpbsud(7, 1, 3)

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        fprintf(stderr, "no AMX tile data permission\n");
        return 1;
    }
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
    memset(A, 1, sizeof A);
    memset(B, 1, sizeof B);
    const long n = 2000000;
    _tile_loadd(0, A, 64);
    _tile_loadd(1, A + 1024, 64);
    _tile_loadd(2, B, 64);
    _tile_loadd(3, B + 1024, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    double t = now();
    for (long i = 0; i < n; i++) {
        PRODUCTS();
    }
    double s = now() - t;
    printf("products alone: %.2f ns a product (%.0f GMAC/s)\n", s / n / 4 * 1e9, n * 4 * 16384.0 / s / 1e9);
    t = now();
    for (long i = 0; i < n / 4; i++) {
        _tile_loadd(2, B, 64);
        _tile_loadd(3, B + 1024, 64);
        _tile_loadd(0, A, 64);
        _tile_loadd(1, A + 1024, 64);
        PRODUCTS();
    }
    s = now() - t;
    printf("with four loads from L1: %.2f ns a product\n", s / (n / 4) / 4 * 1e9);
    for (long size = 32768; size <= (long)sizeof A; size *= 4) {
        long steps = size / 2048, done = 0;
        t = now();
        for (long rep = 0; rep < (n / 4) / steps + 1; rep++) {
            for (long j = 0; j < steps; j++) {
                const int8_t* a = A + j * 2048;
                _tile_loadd(2, B, 64);
                _tile_loadd(3, B + 1024, 64);
                _tile_loadd(0, a, 64);
                _tile_loadd(1, a + 1024, 64);
                PRODUCTS();
                done++;
            }
        }
        s = now() - t;
        printf("A tiles streamed from %ld KiB: %.2f ns a product\n", size / 1024, s / done / 4 * 1e9);
    }
    _tile_stored(4, C, 64);
    _tile_release();
    return C[0] == 12345;
}
