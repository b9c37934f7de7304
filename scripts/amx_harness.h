/* What the AMX timing harnesses (amx_bisect.c, amx_gated.c) share beyond
 * harness.h: the tile state asked of Linux, and a hash of bfloat16 outputs
 * by which two builds' results are compared. */
#ifndef FUSEDMLP_SCRIPTS_AMX_HARNESS_H
#define FUSEDMLP_SCRIPTS_AMX_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "harness.h"

/* Asks Linux for the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM of
 * XTILEDATA); exits saying so where the OS does not grant it. */
static void request_amx_tiles(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    fprintf(stderr, "the OS does not grant the AMX tile state\n");
    exit(1);
  }
}

/* FNV-1a's start value, and its hash of n bfloat16 values continued from
 * `hash`. */
#define FNV_START 1469598103934665603u
static uint64_t hash_bf16(uint64_t hash, const fmlp_bf16 *v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) hash = (hash ^ v[i]) * 1099511628211u;
  return hash;
}

#endif
