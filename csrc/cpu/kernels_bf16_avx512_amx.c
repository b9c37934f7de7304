/* The CPU kernels for bfloat16 storage on AVX-512 with Intel AMX tiles: the
 * packed products (many rows, forward and the backward's dX and dW) and the
 * gated block run AMX micro-kernels over K-pair weight panels
 * (microkernel_amx.h); the few-row paths and the backward's own small
 * products are the AVX-512 float ones with bfloat16 loads. This file alone
 * is compiled with the AVX-512, AVX512-BF16 and AMX flags and only runs after
 * CPUID says the CPU has them and the OS has granted this process the AMX
 * tile state (isa.c). */
#define REAL float /* the accumulator */
#define STORE fmlp_bf16 /* the storage: bfloat16's 16 bits */
#define REAL_SUFFIX bf16_avx512_amx
#include "simd_avx512.h"
#include "storage_bf16.h"
#include "tile_avx512.h"
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_amx.h" /* microkernel_simd.h, then its packed tile and micro-kernels */
#include "drivers.h"
#include "backward.h"
