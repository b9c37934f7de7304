/* bfloat16 <-> float, one value at a time, as PyTorch converts them
 * (c10::BFloat16): widening is exact; narrowing rounds to nearest, ties to
 * even, and every NaN becomes the quiet NaN 0x7FC0. A bfloat16 is stored as
 * its 16 bits in a uint16_t. */
#ifndef FUSEDMLP_CPU_BF16_H
#define FUSEDMLP_CPU_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t fmlp_bf16;

static inline float fmlp_bf16_to_float(fmlp_bf16 h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline fmlp_bf16 fmlp_float_to_bf16(float f) {
  if (f != f) return (fmlp_bf16)0x7FC0;
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (fmlp_bf16)(bits >> 16);
}

#endif /* FUSEDMLP_CPU_BF16_H */
