/* One step of a thread's wait for another (see spin_wait.h). */
#define _POSIX_C_SOURCE 200112L /* sched_yield under -std=c11 */
#include <sched.h>
#include <stdint.h>

#include "spin_wait.h"

void fmlp_spin_wait_step(int64_t step) {
  if (step % FMLP_SPINS_PER_YIELD == FMLP_SPINS_PER_YIELD - 1) {
    (void)sched_yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
