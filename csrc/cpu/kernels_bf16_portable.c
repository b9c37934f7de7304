/* The CPU kernels for bfloat16 storage for any CPU (the portable level): the
 * vector-extension float micro-kernels of simd_vector.h (128 bits, no ISA
 * flags), converting while packing and loading, one rounding at each store
 * (storage_bf16.h). */
#define REAL float /* the accumulator */
#define STORE fmlp_bf16 /* the storage: bfloat16's 16 bits */
#define REAL_SUFFIX bf16_portable
#define FMLP_VECTOR_REGISTERS 16 /* what tile_portable.h is tiled for */
#include "simd_vector.h"
#include "storage_bf16.h"
#include "tile_portable.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_simd.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
