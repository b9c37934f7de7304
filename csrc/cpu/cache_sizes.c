/* The data cache sizes (see cache_sizes.h). */
#define _DEFAULT_SOURCE /* sysconf's _SC_LEVEL1_DCACHE_SIZE under -std=c11 (glibc) */
#include "cache_sizes.h"

#include <unistd.h>

#include "read_once.h"

#define DEFAULT_L1D_BYTES ((int64_t)32 << 10)
#define DEFAULT_L2_BYTES ((int64_t)1 << 20)

#ifdef _SC_LEVEL1_DCACHE_SIZE
#define L1D_NAME _SC_LEVEL1_DCACHE_SIZE
#define L2_NAME _SC_LEVEL2_CACHE_SIZE
#else
#define L1D_NAME (-1)
#define L2_NAME (-1)
#endif

/* Bytes of the level-1 data (level 1) or level-2 cache as sysconf says.
 * sysconf may run CPUID, which traps to the hypervisor in a VM: asked once.
 * Where the C library does not know a size (glibc says 0 or -1 on some Arm
 * cores and under some hypervisors), the fallback. */
static int64_t cache_bytes(int level) {
  const int name = level == 1 ? L1D_NAME : L2_NAME;
  const long bytes = name >= 0 ? sysconf(name) : -1;
  return bytes > 0 ? (int64_t)bytes : level == 1 ? DEFAULT_L1D_BYTES : DEFAULT_L2_BYTES;
}

static atomic_llong l1d_bytes, l2_bytes;

int64_t fmlp_cpu_l1d_bytes(void) { return fmlp_read_once(&l1d_bytes, cache_bytes, 1); }
int64_t fmlp_cpu_l2_bytes(void) { return fmlp_read_once(&l2_bytes, cache_bytes, 2); }
