/* How many rows the host-GEMM path runs through a chain's layers at a time. */
#include "cache_sizes.h"
#include "fusedmlp/cpu.h"
#include "memory.h"

/* Fewer rows a chunk and each GEMM call's fixed cost (ATen's dispatch, its
 * threads' wake-up, packing the weight again) weighs on its work. */
#define MIN_CHUNK_ROWS ((int64_t)256)

static int64_t element_bytes(fmlp_dtype dtype) {
  switch (dtype) {
    case FMLP_F64: return 8;
    case FMLP_BF16: return 2;
    default: return 4;
  }
}

int64_t fmlp_cpu_host_chunk_rows(fmlp_dtype dtype, int64_t rows, int64_t n_layers,
                                 const int64_t *widths, int64_t n_threads) {
  const int64_t elem = element_bytes(dtype), l2 = fmlp_cpu_l2_bytes();
  int64_t widest = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    int64_t weight_bytes;
    if (!fmlp_checked_mul(widths[l], widths[l + 1], &weight_bytes) ||
        !fmlp_checked_mul(weight_bytes, elem, &weight_bytes) || weight_bytes > l2) {
      return rows; /* a large weight: read again for every chunk, it would cost more */
    }
    widest = widths[l] > widest ? widths[l] : widest;
  }
  widest = widths[n_layers] > widest ? widths[n_layers] : widest;
  int64_t row_bytes, caches;
  if (widest <= 0 || !fmlp_checked_mul(widest, elem, &row_bytes) ||
      !fmlp_checked_mul(l2, n_threads > 1 ? n_threads : 1, &caches)) {
    return rows;
  }
  const int64_t chunk = caches / row_bytes > MIN_CHUNK_ROWS ? caches / row_bytes : MIN_CHUNK_ROWS;
  return chunk < rows ? chunk : rows;
}
