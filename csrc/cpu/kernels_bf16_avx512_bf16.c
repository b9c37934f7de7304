/* The CPU kernels for bfloat16 storage on AVX-512 with its bfloat16
 * dot-product instruction: the packed products (many rows) and the gated
 * block run _mm512_dpbf16_ps micro-kernels over K-pair panels
 * (microkernel_dpbf16.h); the few-row paths and the backward's own small
 * products are the AVX-512 float ones with bfloat16 loads. This file alone
 * is compiled with the AVX-512 flags plus -mavx512bf16 and only runs after
 * CPUID says it may. */
#define REAL float /* the accumulator */
#define STORE fmlp_bf16 /* the storage: bfloat16's 16 bits */
#define REAL_SUFFIX bf16_avx512_bf16
#include "simd_avx512.h"
#include "storage_bf16.h"
#include "tile_avx512.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_dpbf16.h" /* its packed micro-kernels, then microkernel_simd.h */
#include "drivers.h"
#include "backward.h"
