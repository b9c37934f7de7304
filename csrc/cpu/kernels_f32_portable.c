/* The CPU kernels in single precision for any CPU (the portable level):
 * written once in GCC / Clang vector extensions (128-bit vectors,
 * simd_vector.h), which compile to SSE2 on x86-64, NEON on aarch64 and
 * plain code where the target has no vectors. Built without ISA flags. */
#define REAL float /* the accumulator */
#define STORE float /* and the storage */
#define REAL_SUFFIX f32_portable
#define FMLP_VECTOR_REGISTERS 16 /* what tile_portable.h is tiled for */
#include "simd_vector.h"
#include "storage_real.h"
#include "tile_portable.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
