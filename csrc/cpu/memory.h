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

#define FMLP_HUGE_PAGE_BYTES ((int64_t)2 << 20)

/* Asks Linux to back the whole 2 MiB pages inside [data, data + bytes), when
 * that is at least 4 MiB, with huge pages (transparent_hugepage in "madvise"
 * mode, a common default, needs this): the first write to a fresh 64 MiB
 * buffer then faults ~32 times instead of 16,384 (filling one measured
 * 17-19 ms before, 4-9 ms after). A hint, and a no-op elsewhere. */
void fmlp_advise_huge_pages(void *data, int64_t bytes);

/* Scratch of count elements of elem_size bytes, cache-line aligned (huge-page
 * aligned and advised from 4 MiB); NULL on overflow or when memory runs out.
 * Never NULL for count == 0. */
static inline void *fmlp_alloc_scratch(int64_t count, int64_t elem_size) {
  int64_t bytes;
  if (!fmlp_checked_mul(count, elem_size, &bytes)) return NULL;
  const int64_t align = bytes >= 2 * FMLP_HUGE_PAGE_BYTES ? FMLP_HUGE_PAGE_BYTES : 64;
  if (!fmlp_checked_add(bytes, align - 1, &bytes)) return NULL;
  bytes = bytes / align * align; /* aligned_alloc wants a multiple of the alignment */
  if (bytes == 0) bytes = 64;
  if ((uint64_t)bytes > (uint64_t)SIZE_MAX) return NULL;
  void *data = aligned_alloc((size_t)align, (size_t)bytes);
  fmlp_advise_huge_pages(data, bytes);
  return data;
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
