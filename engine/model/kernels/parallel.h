/* How the kernels spread a loop over threads (parallel.c). */
#ifndef STRATA_PARALLEL_H
#define STRATA_PARALLEL_H
#include <stdint.h>

/* One part of a loop: its iterations [begin, end). `part` < the loop's `threads`: an index for per-part room. */
typedef void (*Part)(void *job, int64_t begin, int64_t end, int part);

/* Runs the n iterations of a loop as min(threads, n) parts of consecutive iterations, part p taking
   [p n / parts, (p + 1) n / parts), and returns when every part is done. Which thread runs which part never
   changes a result: each iteration is computed within one part, with the same operations whatever the parts. */
void parallel_for(int64_t n, int threads, Part fn, void *job);

/* How parts run in this build: "openmp" (the OpenMP runtime's threads), "pool" (parallel.c's own threads) or
   "serial" (one after the other on the calling thread). */
const char *parallel_kind(void);

#endif
