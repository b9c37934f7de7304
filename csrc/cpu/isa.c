/* Run-time choice of the instruction set, from the registry
 * fusedmlp/cpu_isas.def. */
#include <stdlib.h>
#include <string.h>

#include "fusedmlp/cpu.h"

fmlp_cpu_isa fmlp_cpu_isa_best(void) {
  fmlp_cpu_isa best = FMLP_ISA_PORTABLE;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init(); /* idempotent; needed if we run before libgcc's constructor */
  /* libgcc also checks that the OS saves the AVX / AVX-512 register state. */
#define FMLP_FEATURE(feature) &&__builtin_cpu_supports(#feature)
#else
#define FMLP_FEATURE(feature) &&0 /* CPUID features are x86's */
#endif
  /* the registry lists ISAs in increasing order: the last supported one wins */
#define FMLP_ISA(id, name, flags, features) \
  if (1 features) best = FMLP_ISA_##id;
#include "fusedmlp/cpu_isas.def"
  return best;
}

static fmlp_cpu_isa isa_named(const char *name, fmlp_cpu_isa fallback) {
  for (int isa = 0; isa < FMLP_ISA_COUNT; ++isa) {
    if (strcmp(name, fmlp_cpu_isa_name((fmlp_cpu_isa)isa)) == 0) return (fmlp_cpu_isa)isa;
  }
  return fallback;
}

fmlp_cpu_isa fmlp_cpu_isa_in_use(void) {
  const fmlp_cpu_isa best = fmlp_cpu_isa_best();
  const char *forced = getenv("FUSEDMLP_ISA");
  if (forced == NULL || forced[0] == '\0') return best;
  const fmlp_cpu_isa wanted = isa_named(forced, best);
  /* Never run instructions the CPU lacks: a wish above the CPU gets the best it has. */
  return wanted < best ? wanted : best;
}

const char *fmlp_cpu_isa_name(fmlp_cpu_isa isa) {
  switch (isa) {
#define FMLP_ISA(id, name, flags, features) \
  case FMLP_ISA_##id: return #name;
#include "fusedmlp/cpu_isas.def"
    case FMLP_ISA_COUNT: break;
  }
  return "unknown";
}
