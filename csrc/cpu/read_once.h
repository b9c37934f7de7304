/* CPU facts that never change while the process runs but cost a trap to
 * learn (CPUID, which a VM's hypervisor intercepts; a system call), asked on
 * the ops' hot path: each is learnt once and kept in an atomic slot. */
#ifndef FUSEDMLP_CPU_READ_ONCE_H
#define FUSEDMLP_CPU_READ_ONCE_H

#include <stdatomic.h>
#include <stdint.h>

/* *slot, which holds 0 until the first call stores ask(what) there; ask
 * never answers 0. Two threads asking at once both ask and agree, so no lock
 * is needed. */
static inline int64_t fmlp_read_once(atomic_llong *slot, int64_t (*ask)(int what), int what) {
  int64_t fact = (int64_t)atomic_load_explicit(slot, memory_order_relaxed);
  if (fact == 0) {
    fact = ask(what);
    atomic_store_explicit(slot, fact, memory_order_relaxed);
  }
  return fact;
}

#endif /* FUSEDMLP_CPU_READ_ONCE_H */
