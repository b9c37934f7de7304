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

/* Whether the environment variable FUSEDMLP_CPU_GEMM is `value`. */
static int gemm_choice_is(const char *value) {
  const char *gemm = getenv("FUSEDMLP_CPU_GEMM");
  return gemm != NULL && strcmp(gemm, value) == 0;
}

fmlp_cpu_gemm fmlp_cpu_gemm_in_use(fmlp_dtype dtype) {
  if (gemm_choice_is("aten")) return FMLP_GEMM_HOST;
  fmlp_cpu_isa isa;
  if (!gemm_choice_is("auto") && forced_isa(&isa)) return FMLP_GEMM_KERNELS;
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

/* Up to this many rows an inference op on the host-GEMM path runs our kernels
 * (fmlp_cpu_inference_gemm). Such products are bound by reading the weights,
 * not by the multiplies, so the vector width matters little there: ours read
 * each weight once in place, activation and gate-and-up product in registers,
 * where ATen multiplies layer after layer and gate and up apart. Measured on
 * Zen 4 with torch limited as on an x86 CPU without AVX2 (`--emulate-cpu
 * portable`'s environment; MKL ignores its part on AMD and keeps AVX-512), 2
 * threads, medians of 15-31 alternating rounds in one process, our portable
 * unit / ATen's GEMM with our epilogue, each over eager, float32: 768 -> 3072
 * GELU(tanh) at 1, 2, 4 rows 0.59-0.73 / 0.85-0.90, 0.47 / 0.89, 0.45-0.54 /
 * 0.82; the GeGLU block 768 -> 3072 -> 768 at 1 and 4 rows 0.49-0.55 /
 * 0.99-1.01, 0.48-0.51 / 0.94-0.98; 256^4 ReLU at 1 and 4 rows 0.83-0.85 /
 * 0.87-0.89, 0.71-0.72 / 0.85-0.89; 1024^3 GELU at 1 row 0.62-0.66 / 0.89-0.90;
 * 4096 -> 4096 SiLU at 1 row 0.66-0.67 / 1.03-1.04. bfloat16 at 2-4 rows
 * 0.33-0.71 against 0.87-1.00, at 1 row 0.63-1.05 against 0.84-1.02. At 8 rows
 * ours still won with large weights (0.74-0.80 against 0.83-0.96) but not with
 * the 256^4 chain's, which stay in cache (0.98 against 0.84), and at 16 they
 * lost (1.00-1.10 against 0.72-0.96). Training calls (the forward that saves
 * for backward, and the backward) ran mixed at these rows and keep ATen's. */
#define INFERENCE_KERNEL_MAX_ROWS 4

fmlp_cpu_gemm fmlp_cpu_inference_gemm(fmlp_dtype dtype, int64_t rows, int64_t n_weights,
                                      const fmlp_input *weights) {
  const fmlp_cpu_gemm gemm = fmlp_cpu_gemm_in_use(dtype);
  if (gemm == FMLP_GEMM_KERNELS || gemm_choice_is("aten") || rows < 1 ||
      rows > INFERENCE_KERNEL_MAX_ROWS || n_weights < 0 || (n_weights > 0 && weights == NULL)) {
    return gemm;
  }
  const fmlp_cpu_isa unit = fmlp_cpu_unit_isa(dtype);
  for (int64_t i = 0; i < n_weights; ++i) {
    /* a 1 x 1 corner of the weight, with its strides: packed_weight_bytes is
     * 0 exactly where the unit reads a weight of these strides in place at
     * these rows, whatever its sizes (cpu.h) */
    int64_t bytes;
    if (fmlp_cpu_packed_weight_bytes(dtype, unit, rows, weights[i], 1, 1, &bytes) != FMLP_OK ||
        bytes != 0) {
      return gemm;
    }
  }
  return FMLP_GEMM_KERNELS;
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
