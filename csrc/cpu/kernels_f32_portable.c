/* The CPU kernels in single precision, portable C (any CPU; built without
 * -mavx flags). */
#define REAL float /* the accumulator */
#define STORE float /* and the storage */
#define REAL_SUFFIX f32_portable
#include "storage_real.h"
#define GEMM_MR 4
#define GEMM_NR ((int64_t)16) /* one cache line */
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_portable.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
