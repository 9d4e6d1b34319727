/* Which instruction set this build of the kernels uses: one of STRATA_ISA_AVX512, STRATA_ISA_AVX2 or
   STRATA_ISA_GENERIC, as engine/model/kernels/build.py passes it (AVX2 when none is given on x86-64; generic on
   any other architecture).

   - avx2: the kernels as written, 256-bit AVX2 / FMA / F16C intrinsics.
   - avx512: the same source with AVX-512 F/BW/VL/DQ allowed as well: the compiler encodes the same 256-bit
     operations with EVEX and has 32 vector registers instead of 16 (fewer spills in the 4 x 2 tiles). The
     operations and their order are the source's, so the results are avx2's bit for bit.
   - generic: nothing beyond the architecture's baseline (SSE2 on x86-64, NEON on ARM64): scalar.h implements
     every intrinsic the kernels use in portable C, lane by lane with the instruction's own IEEE operation (a fused
     multiply-add stays fused), so a generic build's results are also avx2's bit for bit.

   KERNEL marks the functions that use the instruction set. It is a per-function target attribute rather than a
   command-line -m flag, so that blocks_cpu_ok, which a loader calls before anything else, is baseline code that
   runs on any CPU of the architecture. */
#ifndef STRATA_SIMD_H
#define STRATA_SIMD_H

#if defined(STRATA_ISA_GENERIC) || !(defined(__x86_64__) || defined(_M_X64))
#define STRATA_GENERIC 1
#define STRATA_ISA "generic"
#define KERNEL
#include "scalar.h"
#elif defined(STRATA_ISA_AVX512)
#define STRATA_AVX512 1
#define STRATA_ISA "avx512"
#define KERNEL __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#include <immintrin.h>
#else
#define STRATA_ISA "avx2"
#define KERNEL __attribute__((target("avx2,fma,f16c")))
#include <immintrin.h>
#endif

#endif
