/* The CPU kernels in double precision: portable C on every CPU (the SIMD
 * kernels are float only). */
#define REAL double /* the accumulator */
#define STORE double /* and the storage */
#define REAL_SUFFIX f64_portable
#include "storage_real.h"
#define GEMM_MR 4
#define GEMM_NR ((int64_t)8) /* one cache line */
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_portable.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
