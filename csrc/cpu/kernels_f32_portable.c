/* The CPU kernels in single precision for any CPU (the portable level):
 * written once in GCC / Clang vector extensions (128-bit vectors,
 * simd_vector.h), which compile to SSE2 on x86-64, NEON on aarch64 and
 * plain code where the target has no vectors. Built without ISA flags. */
#define REAL float /* the accumulator */
#define STORE float /* and the storage */
#define REAL_SUFFIX f32_portable
/* 16 registers: x86-64's xmm file, and the least of the vector CPUs */
#define FMLP_VECTOR_REGISTERS 16
#include "simd_vector.h"
#include "storage_real.h"
/* 6 x 2 accumulators, 2 loads of b and one broadcast of a: 15 of the 16
 * registers. */
#define GEMM_MR 6
#define GEMM_NR ((int64_t)(2 * FMLP_SIMD_WIDTH))
/* gated: 6 x 1 of gate and of up, 2 loads, one broadcast: 15 of 16 (the
 * AVX2 unit's tile, measured there) */
#define GATED_MR 6
#define GATED_NR FMLP_SIMD_WIDTH
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
