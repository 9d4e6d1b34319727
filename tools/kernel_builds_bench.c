/* The native kernels' builds side by side: a decode step's worth of 4-bit products (L layers of q/k/v, o,
   gate/up and down projections, then the output matrix), for each library named, best of R rounds. Needs only a C
   compiler, so it runs where PyTorch is not installed; the weights are synthetic (timing does not depend on their
   values).

     gcc -O2 -o /tmp/kernel_builds_bench tools/kernel_builds_bench.c -ldl
     /tmp/kernel_builds_bench HIDDEN INTER VOCAB LAYERS ROWS THREADS ROUNDS LIBRARY...
     e.g. /tmp/kernel_builds_bench 576 1536 49152 30 1 8 15 engine/model/kernels/_strata_kernels-linux-x86_64-*.so

   The engine's environment for libgomp applies to the OpenMP builds: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000
   (engine/cli.py), which the thread pool's builds (parallel.c) read too. docs/BENCHMARKS.md has the figures. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int (*Product)(const float *, int64_t, int64_t, const uint8_t *, int64_t, float *, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static uint8_t *q4(int64_t n, int64_t k) { /* Q4 runs: scales 1.0 (0x3C00), minimums 0, random codes */
    int64_t bytes = n * (k / 32) * 20; uint8_t *w = malloc(bytes);
    for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)(rand() >> 7);
    for (int64_t r = 0; r < n; r++) for (int64_t b0 = 0; b0 < k / 32; b0 += 8) {
        int64_t c = k / 32 - b0 < 8 ? k / 32 - b0 : 8; uint8_t *run = w + r * (k / 32) * 20 + b0 * 20;
        for (int64_t j = 0; j < c; j++) { run[2 * j] = 0; run[2 * j + 1] = 0x3C; run[2 * c + 2 * j] = 0; run[2 * c + 2 * j + 1] = 0; }
    }
    return w;
}
int main(int argc, char **argv) {
    if (argc < 9) {
        fprintf(stderr, "usage: %s HIDDEN INTER VOCAB LAYERS ROWS THREADS ROUNDS LIBRARY...\n", argv[0]);
        return 2;
    }
    int64_t E = atoll(argv[1]), I = atoll(argv[2]), V = atoll(argv[3]), L = atoll(argv[4]), M = atoll(argv[5]);
    int threads = atoi(argv[6]), rounds = atoi(argv[7]);
    int64_t qkv = E + 2 * (E / 3); /* the bundled model's 9 heads over 3 K/V heads, roughly */
    uint8_t **w = malloc(sizeof(uint8_t *) * L * 4);
    for (int64_t l = 0; l < L; l++) { w[4 * l] = q4(qkv, E); w[4 * l + 1] = q4(E, E); w[4 * l + 2] = q4(2 * I, E); w[4 * l + 3] = q4(E, I); }
    uint8_t *head = q4(V, E);
    float *x = malloc(sizeof(float) * M * (I > E ? I : E)), *out = malloc(sizeof(float) * M * (V > 2 * I ? V : 2 * I));
    for (int64_t i = 0; i < M * (I > E ? I : E); i++) x[i] = (float)((i * 7919) % 101) / 50.0f - 1.0f;
    for (int a = 8; a < argc; a++) {
        void *h = dlopen(argv[a], RTLD_NOW); if (!h) { printf("%s: %s\n", argv[a], dlerror()); continue; }
        Product p = (Product)dlsym(h, "q4_matmul");
        double best_step = 1e9, best_head = 1e9, best_gu = 1e9;
        for (int r = 0; r < rounds; r++) {
            double t0 = now();
            for (int64_t l = 0; l < L; l++) {
                p(x, M, E, w[4 * l], qkv, out, threads); p(x, M, E, w[4 * l + 1], E, out, threads);
                p(x, M, E, w[4 * l + 2], 2 * I, out, threads); p(x, M, I, w[4 * l + 3], E, out, threads);
            }
            double t1 = now(); p(x, M, E, head, V, out, threads); double t2 = now();
            p(x, M, E, w[2], 2 * I, out, threads); double t3 = now();
            if (t1 - t0 < best_step) best_step = t1 - t0;
            if (t2 - t1 < best_head) best_head = t2 - t1;
            if (t3 - t2 < best_gu) best_gu = t3 - t2;
        }
        const char *name = strrchr(argv[a], '/'); name = name ? name + 1 : argv[a];
        printf("%-28s M=%-3ld threads=%-2d layers %8.0f us  head %7.0f us  gate_up %6.0f us  -> step %6.1f ms\n", name, (long)M, threads,
               best_step * 1e6, best_head * 1e6, best_gu * 1e6, (best_step + best_head) * 1e3);
        fflush(stdout);
    }
    return 0;
}
