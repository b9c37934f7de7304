/* The CPU kernels in single precision for AVX2 + FMA; this file alone is
 * compiled with -mavx2 -mfma and only runs after CPUID says it may. */
#define REAL float /* the accumulator */
#define STORE float /* and the storage */
#define REAL_SUFFIX f32_avx2
#include "simd_avx2.h"
#include "storage_real.h"
#include "tile_avx2.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
