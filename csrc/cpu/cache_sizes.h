/* The data cache sizes the GEMM's blocks are cut to (gemm.h). */
#ifndef FUSEDMLP_CPU_CACHE_SIZES_H
#define FUSEDMLP_CPU_CACHE_SIZES_H

#include <stdint.h>

/* Bytes of one core's level-1 data cache and of its level-2 cache, as the
 * C library reports them (glibc: CPUID on x86), asked once; where it reports
 * nothing, 32 KiB and 1 MiB (the smallest of the x86 and Arm server cores we
 * target), so the blocks err on the small side. */
int64_t fmlp_cpu_l1d_bytes(void);
int64_t fmlp_cpu_l2_bytes(void);

/* The most values of K a packed micro-panel of bytes_per_k bytes per value of K
 * may hold to take at most half the L1 data cache, the other half left to the
 * panel streaming past it and the output tile; at least 64. */
static inline int64_t fmlp_cpu_l1_k_block(int64_t bytes_per_k) {
  const int64_t most = fmlp_cpu_l1d_bytes() / 2 / bytes_per_k;
  return most > 64 ? most : 64;
}

#endif /* FUSEDMLP_CPU_CACHE_SIZES_H */
