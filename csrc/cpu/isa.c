/* Run-time choice of the instruction set for the float kernels. */
#include <stdlib.h>
#include <string.h>

#include "fusedmlp/cpu.h"

static fmlp_cpu_isa best_supported_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init(); /* idempotent; needed if we run before libgcc's constructor */
  /* libgcc also checks that the OS saves the AVX / AVX-512 register state. */
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma")) {
    return FMLP_ISA_AVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return FMLP_ISA_AVX2;
#endif
  return FMLP_ISA_PORTABLE;
}

static fmlp_cpu_isa isa_named(const char *name, fmlp_cpu_isa fallback) {
  for (int isa = 0; isa < FMLP_ISA_COUNT; ++isa) {
    if (strcmp(name, fmlp_cpu_isa_name((fmlp_cpu_isa)isa)) == 0) return (fmlp_cpu_isa)isa;
  }
  return fallback;
}

fmlp_cpu_isa fmlp_cpu_isa_in_use(void) {
  const fmlp_cpu_isa best = best_supported_isa();
  const char *forced = getenv("FUSEDMLP_ISA");
  if (forced == NULL || forced[0] == '\0') return best;
  const fmlp_cpu_isa wanted = isa_named(forced, best);
  /* Never run instructions the CPU lacks: a wish above the CPU gets the best it has. */
  return wanted < best ? wanted : best;
}

const char *fmlp_cpu_isa_name(fmlp_cpu_isa isa) {
  switch (isa) {
    case FMLP_ISA_PORTABLE: return "portable";
    case FMLP_ISA_AVX2: return "avx2";
    case FMLP_ISA_AVX512: return "avx512";
    case FMLP_ISA_COUNT: break;
  }
  return "unknown";
}
