// Read bandwidth of one file's pages through a shared read-only map
// against the same bytes copied into anonymous memory, two threads each
// reading half, without and with software prefetches 8 KiB ahead (as the
// panel kernels issue them). The file should be at least 1 GiB:
//   dd if=/dev/urandom of=/tmp/big bs=1M count=1024
//   gcc -O2 -pthread bench/mapped-read.c -o /tmp/mapped-read && /tmp/mapped-read /tmp/big
#include <fcntl.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static int prefetch;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"))) static long sum(const char* p, size_t n) {
    __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 256) {
        if (prefetch) {
            for (int k = 0; k < 256; k += 64) _mm_prefetch(p + i + 8192 + k, _MM_HINT_T1);
        }
        a = _mm512_add_epi64(a, _mm512_load_si512(p + i));
        b = _mm512_add_epi64(b, _mm512_load_si512(p + i + 64));
        c = _mm512_add_epi64(c, _mm512_load_si512(p + i + 128));
        d = _mm512_add_epi64(d, _mm512_load_si512(p + i + 192));
    }
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(c, d)));
}

struct half {
    const char* p;
    size_t n;
    long s;
};

static void* run(void* x) {
    struct half* h = x;
    h->s = sum(h->p, h->n);
    return 0;
}

// GB/s of two threads reading n bytes at p, half each.
static double two(const char* p, size_t n) {
    pthread_t t;
    struct half a = {p, n / 2, 0}, b = {p + n / 2, n / 2, 0};
    double t0 = now();
    pthread_create(&t, 0, run, &a);
    run(&b);
    pthread_join(t, 0);
    return n / (now() - t0) / 1e9;
}

int main(int argc, char** argv) {
    size_t n = (size_t)1 << 30;
    int fd = argc > 1 ? open(argv[1], O_RDONLY) : -1;
    if (fd < 0) {
        fprintf(stderr, "usage: mapped-read FILE (at least 1 GiB)\n");
        return 1;
    }
    char* f = mmap(0, n, PROT_READ, MAP_SHARED, fd, 0);
    char* a = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (f == MAP_FAILED || a == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memcpy(a, f, n);
    for (prefetch = 0; prefetch < 2; prefetch++) {
        for (int r = 0; r < 3; r++) {
            double x = two(f, n), y = two(a, n);
            printf("prefetch %d: file map %.1f GB/s, anonymous %.1f GB/s\n", prefetch, x, y);
        }
    }
    return 0;
}
