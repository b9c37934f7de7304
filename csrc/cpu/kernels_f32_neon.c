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
/* 6 x 3 accumulators, 3 loads of b and 6 broadcasts of a: 27 of the 32
 * registers. GCC keeps each of a step's broadcasts in a register of its own
 * (a scalar load feeding the by-element fmla), so the 8 x 3 tile (OpenBLAS's
 * 8 x 12, which broadcasts from lanes of 2 loaded vectors) needed 35 and
 * spilled accumulators to the stack in every K loop (aarch64-linux-gnu-gcc 12
 * -O3: 9 stack accesses a 2-step iteration of the packed kernel, 4 in the gated
 * one); this tile and the gated one below have none. Under emulation only:
 * no speed was measured on ARM. */
#define GEMM_MR 6
#define GEMM_NR ((int64_t)(3 * FMLP_SIMD_WIDTH))
/* gated: 3 x 3 of gate and of up, 6 loads, 3 broadcasts: 27 of 32 */
#define GATED_MR 3
#define GATED_NR GEMM_NR
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
