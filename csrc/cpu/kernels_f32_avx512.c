/* The CPU kernels in single precision for AVX-512; this file alone is
 * compiled with -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma and only
 * runs after CPUID says it may. */
#define REAL float /* the accumulator */
#define STORE float /* and the storage */
#define REAL_SUFFIX f32_avx512
#include "simd_avx512.h"
#include "storage_real.h"
#include "tile_avx512.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
