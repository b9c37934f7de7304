/* Run-time choice of the instruction set, from the registry
 * fusedmlp/cpu_isas.def. */
#define _DEFAULT_SOURCE /* syscall under -std=c11 */
#include <stdlib.h>
#include <string.h>

#include "fusedmlp/cpu.h"

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>

/* An aarch64 feature, named as /proc/cpuinfo names it, from the kernel's
 * HWCAP bits (what a real CPU and qemu-user both report). */
static int aarch64_has(const char *feature) {
  static const struct {
    const char *name;
    unsigned long bit;
  } hwcaps[] = {{"asimd", HWCAP_ASIMD}};
  for (size_t i = 0; i < sizeof hwcaps / sizeof hwcaps[0]; ++i) {
    if (strcmp(feature, hwcaps[i].name) == 0) return (getauxval(AT_HWCAP) & hwcaps[i].bit) != 0;
  }
  return 0;
}
#elif defined(__aarch64__)
/* Without HWCAP to ask: AArch64 makes Advanced SIMD (asimd) part of the base ISA. */
static int aarch64_has(const char *feature) { return strcmp(feature, "asimd") == 0; }
#endif

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include "read_once.h"

/* Linux hands the AMX tile data state (8 KiB a thread) out per process, on
 * request (Documentation/arch/x86/xstate.rst): a CPU's AMX is usable only
 * once the kernel grants it. The grant lasts as long as the process, and
 * every op call checks the ISAs (fmlp_cpu_isa_best): the request, a system
 * call, is made once (1: granted, -1: refused). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int64_t request_tile_data(int unused) {
  (void)unused;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
}

static atomic_llong tile_data_grant;

static int os_grants(const char *feature) {
  return strcmp(feature, "amx-tile") != 0 ||
         fmlp_read_once(&tile_data_grant, request_tile_data, 0) > 0;
}
#elif defined(__x86_64__) || defined(__i386__)
/* Elsewhere: no AMX (no request to make), every other feature as CPUID says. */
static int os_grants(const char *feature) { return strncmp(feature, "amx-", 4) != 0; }
#endif

int fmlp_cpu_isa_supported(fmlp_cpu_isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init(); /* idempotent; needed if we run before libgcc's constructor */
  /* libgcc also checks that the OS saves the AVX / AVX-512 register state;
   * AMX's tile state the OS grants on request (os_grants). */
#define FMLP_FEATURE(feature) &&__builtin_cpu_supports(#feature) && os_grants(#feature)
#define FMLP_ARM_FEATURE(feature) &&0
#elif defined(__aarch64__)
#define FMLP_FEATURE(feature) &&0
#define FMLP_ARM_FEATURE(feature) &&aarch64_has(#feature)
#else
#define FMLP_FEATURE(feature) &&0
#define FMLP_ARM_FEATURE(feature) &&0
#endif
  switch (isa) {
#define FMLP_ISA(id, name, flags, features) \
  case FMLP_ISA_##id: return 1 features;
#include "fusedmlp/cpu_isas.def"
    case FMLP_ISA_COUNT: break;
  }
  return 0;
}

int fmlp_cpu_isa_forced_only(fmlp_cpu_isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#define FMLP_FORCED_ONLY(id, vendor) \
  if (isa == FMLP_ISA_##id && __builtin_cpu_is(#vendor)) return 1;
#include "fusedmlp/cpu_isas.def"
#else
  (void)isa; /* the vendors named are x86 ones */
#endif
  return 0;
}

int fmlp_cpu_isa_bf16_native(fmlp_cpu_isa isa) {
#define FMLP_BF16_NATIVE(id) \
  if (isa == FMLP_ISA_##id) return 1;
#include "fusedmlp/cpu_isas.def"
  return 0;
}

fmlp_cpu_isa fmlp_cpu_isa_best(void) {
  /* the registry lists ISAs in increasing order: the last supported one wins */
  fmlp_cpu_isa best = FMLP_ISA_PORTABLE;
  for (int isa = 0; isa < FMLP_ISA_COUNT; ++isa) {
    if (fmlp_cpu_isa_supported((fmlp_cpu_isa)isa) && !fmlp_cpu_isa_forced_only((fmlp_cpu_isa)isa)) {
      best = (fmlp_cpu_isa)isa;
    }
  }
  return best;
}

/* Whether FUSEDMLP_ISA names an ISA this CPU supports, and which. */
static int forced_isa(fmlp_cpu_isa *forced_to) {
  const char *forced = getenv("FUSEDMLP_ISA");
  if (forced == NULL || forced[0] == '\0') return 0;
  for (int isa = 0; isa < FMLP_ISA_COUNT; ++isa) {
    if (strcmp(forced, fmlp_cpu_isa_name((fmlp_cpu_isa)isa)) == 0 &&
        fmlp_cpu_isa_supported((fmlp_cpu_isa)isa)) {
      *forced_to = (fmlp_cpu_isa)isa;
      return 1;
    }
  }
  return 0;
}

fmlp_cpu_isa fmlp_cpu_isa_in_use(void) {
  /* Never run instructions the CPU lacks: a wish it cannot grant gets the best it has. */
  fmlp_cpu_isa isa;
  return forced_isa(&isa) ? isa : fmlp_cpu_isa_best();
}

fmlp_cpu_gemm fmlp_cpu_gemm_in_use(fmlp_dtype dtype) {
  const char *gemm = getenv("FUSEDMLP_CPU_GEMM");
  if (gemm != NULL && strcmp(gemm, "aten") == 0) return FMLP_GEMM_HOST;
  fmlp_cpu_isa isa;
  if (forced_isa(&isa)) return FMLP_GEMM_KERNELS;
  /* The unit this dtype runs, not the CPU's best level: a measured level
   * speaks only for the units built for it (float64 on an AVX2 CPU still
   * runs its portable unit), and an unmeasured level above a measured one
   * runs the measured unit for dtypes it has no unit of. */
  const fmlp_cpu_isa unit = fmlp_cpu_unit_isa(dtype);
#define FMLP_BEATS_EAGER(id) \
  if (unit == FMLP_ISA_##id) return FMLP_GEMM_KERNELS;
#include "fusedmlp/cpu_isas.def"
  return FMLP_GEMM_HOST;
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
