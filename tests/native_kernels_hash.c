/* The native kernels' products on fixed pseudo-random inputs, as one FNV-1a hash of every output bit: a program
   of its own, so that a library for another architecture can be run under QEMU and compared with this machine's
   (tests/test_native_packages.py). Usage: native_kernels_hash LIBRARY */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef int (*Product)(const float *, int64_t, int64_t, const uint8_t *, int64_t, float *, int);
static uint64_t state = 88172645463325252ull;
static uint32_t next(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return (uint32_t)state; }
static uint16_t half(void) { /* a finite float16 about 0.001-0.03 */ return (uint16_t)(0x1400 + next() % 0x0C00) | (next() & 1 ? 0x8000 : 0); }
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW); if (!h) { printf("%s\n", dlerror()); return 1; }
    const char *names[4] = {"q4_matmul", "q8_matmul", "q4k_matmul", "q6k_matmul"};
    const int64_t block[4] = {20, 34, 144, 210}, values[4] = {32, 32, 256, 256};
    uint64_t hash = 1469598103934665603ull;
    for (int kind = 0; kind < 4; kind++) {
        Product p = (Product)dlsym(h, names[kind]);
        for (int shape = 0; shape < 3; shape++) {
            const int64_t M = (int64_t[]){1, 5, 9}[shape], N = (int64_t[]){64, 33, 80}[shape], K = (int64_t[]){512, 768, 1024}[shape];
            const int64_t bytes = N * K / values[kind] * block[kind];
            uint8_t *w = malloc(bytes); float *x = malloc(sizeof(float) * M * K), *out = malloc(sizeof(float) * M * N);
            for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)next();
            for (int64_t b = 0; b < bytes / block[kind]; b++) {
                uint8_t *blk = w + b * block[kind]; uint16_t d = half(), e = half();
                if (kind == 1) memcpy(blk, &d, 2);
                if (kind == 2) { memcpy(blk, &d, 2); memcpy(blk + 2, &e, 2); }
                if (kind == 3) memcpy(blk + 208, &d, 2);
            }
            if (kind == 0) for (int64_t r = 0; r < N; r++) for (int64_t b0 = 0; b0 < K / 32; b0 += 8) {
                int64_t c = K / 32 - b0 < 8 ? K / 32 - b0 : 8; uint8_t *run = w + r * (K / 32) * 20 + b0 * 20;
                for (int64_t j = 0; j < 2 * c; j++) { uint16_t v = half(); memcpy(run + 2 * j, &v, 2); }
            }
            for (int64_t i = 0; i < M * K; i++) x[i] = ((int32_t)(next() % 20001) - 10000) * 1e-3f * (float)(1 + i % 7);
            for (int threads = 1; threads <= 3; threads += 2) {
                if (p(x, M, K, w, N, out, threads)) return 2;
                const uint8_t *o = (const uint8_t *)out;
                for (int64_t i = 0; i < (int64_t)sizeof(float) * M * N; i++) hash = (hash ^ o[i]) * 1099511628211ull;
            }
            free(w); free(x); free(out);
        }
    }
    printf("%016llx\n", (unsigned long long)hash);
    return 0;
}
