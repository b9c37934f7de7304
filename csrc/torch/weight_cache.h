// The inference ops' cache of packed weights (weight_cache.cpp): each weight
// packed once for the CPU kernel unit that reads it (fmlp_cpu_pack_weight), in
// place of packing it again on every call.
#pragma once

#include <cstdint>
#include <memory>

#include "arguments.h"
#include "fusedmlp/cpu.h"

namespace fusedmlp {

// w (n x k, as the ops take it) packed for dtype's kernel unit `unit` and an
// op over `rows` rows, from the process-wide cache, or packed and cached on a
// miss; nullptr when the op takes no packed weight at these rows (it reads w
// in place), when the cache is off or too small for it
// (FUSEDMLP_WEIGHT_CACHE_MB), or when w has no version counter to tell its
// changes by (an inference tensor). The pointer keeps the packed copy alive
// while the op reads it, even if the cache evicts it meanwhile. Only for ops
// nothing will differentiate: a training call's weights change every step.
std::shared_ptr<const void> cached_packed_weight(const Tensor &w, fmlp_dtype dtype,
                                                 fmlp_cpu_isa unit, int64_t rows,
                                                 const fmlp_threading &threading);

// Whether the calls on this thread skip the cache (neither read nor fill it):
// set by Python around calls whose weights are new tensors each time (autocast's
// casts), which would only fill it with copies never used again.
bool &weight_cache_paused();

struct WeightCacheInfo {
  int64_t entries, bytes, limit_bytes, hits, misses;
};

// What the cache holds now, its bound, and its hits and misses since the last clear.
WeightCacheInfo weight_cache_info();

// Drops every entry (copies in use stay alive until their ops finish) and the counts.
void clear_weight_cache();

}  // namespace fusedmlp
