/* Waiting for another thread without a lock. */
#ifndef FUSEDMLP_CPU_SPIN_WAIT_H
#define FUSEDMLP_CPU_SPIN_WAIT_H

#include <stdint.h>

/* A waiter yields its core every this many steps (16384 pause instructions
 * take 0.25 ms on the Sapphire Rapids Xeon): on a crowded machine the thread
 * it waits for may need that core to finish. Not sooner: a waiter that has
 * claimed the next stage's task and yields hands its core to another process
 * for a whole time slice (milliseconds), while the thread it waits for
 * finishes in microseconds and then waits for it in turn; libgomp's barriers
 * spin longer still (300000 steps by default) before sleeping. Measured (16 x
 * 256^3 ReLU training step, 2 threads, machine at load 5-6 on 2 cores, fused
 * and eager alternating in one process, 6 processes per setting): yielding
 * every 256 steps (4 us), the fused step's 5th percentile was 1.2-8.2x (median
 * 4x) eager's; every 16384 or 2^20 steps, 0.34-2.4x (median 1.03x). The
 * concurrent-call tests ran as fast. */
#define FMLP_SPINS_PER_YIELD 16384

/* Step `step` (0, 1, 2, ...) of a busy wait: a pause instruction (x86), or a
 * sched_yield every FMLP_SPINS_PER_YIELD steps. */
void fmlp_spin_wait_step(int64_t step);

#endif /* FUSEDMLP_CPU_SPIN_WAIT_H */
