/* The CPU kernels for bfloat16 storage on AVX-512 without its bfloat16
 * instructions: the float micro-kernels, converting while packing and
 * loading, one rounding at each store (storage_bf16.h). This file alone is
 * compiled with -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma and only
 * runs after CPUID says it may. */
#define REAL float /* the accumulator */
#define STORE fmlp_bf16 /* the storage: bfloat16's 16 bits */
#define REAL_SUFFIX bf16_avx512
#include "simd_avx512.h"
#include "storage_bf16.h"
#include "tile_avx512.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
