/* The CPU kernels for bfloat16 storage, portable C (any CPU; built without
 * -mavx flags): float accumulators, conversion while packing and loading,
 * one rounding at each store (storage_bf16.h). */
#define REAL float /* the accumulator */
#define STORE fmlp_bf16 /* the storage: bfloat16's 16 bits */
#define REAL_SUFFIX bf16_portable
#include "storage_bf16.h"
#define GEMM_MR 4
#define GEMM_NR ((int64_t)16) /* one cache line of float */
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_portable.h" /* the micro-kernel, packing and block loops' shape */
#include "drivers.h"
#include "backward.h"
