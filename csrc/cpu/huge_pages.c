/* Huge-page advice for large buffers the kernels are about to fill. */
#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE under -std=c11 */
#include <stdint.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "memory.h"

void fmlp_advise_huge_pages(void *data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == NULL || bytes < 2 * FMLP_HUGE_PAGE_BYTES) return;
  const uintptr_t mask = (uintptr_t)FMLP_HUGE_PAGE_BYTES - 1;
  const uintptr_t begin = ((uintptr_t)data + mask) & ~mask;
  const uintptr_t end = ((uintptr_t)data + (uintptr_t)bytes) & ~mask;
  /* a hint: where the kernel refuses it, pages stay small */
  if (end > begin) (void)madvise((void *)begin, (size_t)(end - begin), MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}
