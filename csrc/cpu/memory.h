/* Overflow-checked sizes and aligned scratch allocation for the CPU kernels. */
#ifndef FUSEDMLP_CPU_MEMORY_H
#define FUSEDMLP_CPU_MEMORY_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* *product = a * b; false when it overflows int64_t or an operand is negative. */
static inline bool fmlp_checked_mul(int64_t a, int64_t b, int64_t *product) {
  if (a < 0 || b < 0) return false;
  return !__builtin_mul_overflow(a, b, product);
}

static inline bool fmlp_checked_add(int64_t a, int64_t b, int64_t *sum) {
  if (a < 0 || b < 0) return false;
  return !__builtin_add_overflow(a, b, sum);
}

/* Cache-line aligned scratch of count elements of elem_size bytes; NULL on
 * overflow or when memory runs out. Never NULL for count == 0. */
static inline void *fmlp_alloc_scratch(int64_t count, int64_t elem_size) {
  int64_t bytes;
  if (!fmlp_checked_mul(count, elem_size, &bytes) || !fmlp_checked_add(bytes, 63, &bytes)) {
    return NULL;
  }
  bytes = bytes / 64 * 64;
  if (bytes == 0) bytes = 64;
  if ((uint64_t)bytes > (uint64_t)SIZE_MAX) return NULL;
  return aligned_alloc(64, (size_t)bytes);
}

/* Scratch for `matrices` matrices of rows x cols elements; NULL on overflow. */
static inline void *fmlp_alloc_matrices(int64_t matrices, int64_t rows, int64_t cols,
                                        int64_t elem_size) {
  int64_t count;
  if (!fmlp_checked_mul(matrices, rows, &count) || !fmlp_checked_mul(count, cols, &count)) {
    return NULL;
  }
  return fmlp_alloc_scratch(count, elem_size);
}

#endif /* FUSEDMLP_CPU_MEMORY_H */
