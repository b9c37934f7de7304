/* The data cache sizes (see cache_sizes.h). */
#define _DEFAULT_SOURCE /* sysconf's _SC_LEVEL1_DCACHE_SIZE under -std=c11 (glibc) */
#include "cache_sizes.h"

#include <stdatomic.h>
#include <unistd.h>

#define DEFAULT_L1D_BYTES ((int64_t)32 << 10)
#define DEFAULT_L2_BYTES ((int64_t)1 << 20)

/* name's size in bytes, or fallback where the C library does not know it
 * (glibc says 0 or -1 on some Arm cores and under some hypervisors). */
static int64_t cache_bytes(int name, int64_t fallback) {
  const long bytes = name >= 0 ? sysconf(name) : -1;
  return bytes > 0 ? (int64_t)bytes : fallback;
}

/* 0 until first asked: sysconf may run CPUID, which traps to the hypervisor
 * in a VM, so each is asked once (two threads asking at once agree). */
static atomic_llong l1d_bytes, l2_bytes;

static int64_t cached(atomic_llong *slot, int name, int64_t fallback) {
  int64_t bytes = (int64_t)atomic_load_explicit(slot, memory_order_relaxed);
  if (bytes == 0) {
    bytes = cache_bytes(name, fallback);
    atomic_store_explicit(slot, bytes, memory_order_relaxed);
  }
  return bytes;
}

#ifdef _SC_LEVEL1_DCACHE_SIZE
#define L1D_NAME _SC_LEVEL1_DCACHE_SIZE
#define L2_NAME _SC_LEVEL2_CACHE_SIZE
#else
#define L1D_NAME (-1)
#define L2_NAME (-1)
#endif

int64_t fmlp_cpu_l1d_bytes(void) { return cached(&l1d_bytes, L1D_NAME, DEFAULT_L1D_BYTES); }
int64_t fmlp_cpu_l2_bytes(void) { return cached(&l2_bytes, L2_NAME, DEFAULT_L2_BYTES); }
