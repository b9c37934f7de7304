/* The CPU kernels in single precision for aarch64 (NEON, which every AArch64
 * CPU has): the vector-extension kernels of simd_vector.h with a tile for
 * NEON's 32 registers. Built without ISA flags (NEON is aarch64's baseline);
 * on other targets it compiles to their vectors but never runs (the
 * registry's asimd feature is aarch64's). */
#define REAL float /* the accumulator */
#define STORE float /* and the storage */
#define REAL_SUFFIX f32_neon
#define FMLP_VECTOR_REGISTERS 32
#include "simd_vector.h"
#include "storage_real.h"
/* 8 x 3 accumulators, 3 loads of b and one broadcast of a: 28 of the 32
 * registers (OpenBLAS's NEON sgemm tile is 8 x 12 too). */
#define GEMM_MR 8
#define GEMM_NR ((int64_t)(3 * FMLP_SIMD_WIDTH))
/* gated: 4 x 3 of gate and of up, 6 loads, one broadcast: 31 of 32 */
#define GATED_MR 4
#define GATED_NR GEMM_NR
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
