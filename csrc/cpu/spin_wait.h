/* Waiting for another thread without a lock. */
#ifndef FUSEDMLP_CPU_SPIN_WAIT_H
#define FUSEDMLP_CPU_SPIN_WAIT_H

#include <stdint.h>

/* A waiter yields its core every this many steps: on a crowded machine the
 * thread it waits for may need that core to finish. */
#define FMLP_SPINS_PER_YIELD 256

/* Step `step` (0, 1, 2, ...) of a busy wait: a pause instruction (x86), or a
 * sched_yield every FMLP_SPINS_PER_YIELD steps. */
void fmlp_spin_wait_step(int64_t step);

#endif /* FUSEDMLP_CPU_SPIN_WAIT_H */
