// The inference ops' packed-weight cache: one process-wide map from a weight
// (where its values lie, its shape and strides, its dtype, the kernel unit and
// the tensor's version counter) to its copy packed for that unit, bounded in
// bytes with least-recently-used eviction.
//
// Staleness: an in-place update (w.add_, an optimizer step, load_state_dict's
// copy_) bumps the version counter, and a new tensor (`.data =`, a new
// parameter) has other values' address or a fresh counter; either misses. A
// hit also needs the same address, so each entry holds a view of the weight
// (a reference to its storage, as the stable ABI has no weak one): the memory
// cannot be freed and handed to another tensor while the entry lives. What
// the counter does not see (writes through `.data` or through memory shared
// with numpy) is not seen: docs/limits.md.
#include "weight_cache.h"

#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <functional>
#include <list>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace fusedmlp {
namespace {

// Off unless asked for: a write the version counter does not see (through a
// `.data` alias, numpy, DLPack) would leave a stale copy and a silently wrong
// result, so, like Inductor's freezing or ipex.optimize, reading weights as
// constants is the user's choice. 256 MiB holds the packed MLP weights of a
// 12-layer, 768-wide transformer in float32 (12 x 2 x 768 x 3072 x 4 bytes =
// 216 MiB), twice that in bfloat16.
constexpr int64_t kDefaultLimitMiB = 0;

// The bound in bytes: FUSEDMLP_WEIGHT_CACHE_MB MiB (0, the default: no cache),
// read at each call like FUSEDMLP_ISA, so a change applies from the next call.
int64_t limit_bytes() {
  const char *value = std::getenv("FUSEDMLP_WEIGHT_CACHE_MB");
  if (value == nullptr || *value == '\0') return kDefaultLimitMiB << 20;
  char *end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(value, &end, 10);
  FMLP_CHECK(errno == 0 && *end == '\0' && mib >= 0 && mib <= (INT64_MAX >> 20),
             "FUSEDMLP_WEIGHT_CACHE_MB must be a whole number of MiB (0: no weight cache), got '",
             value, "'");
  return static_cast<int64_t>(mib) << 20;
}

// ATen's answer about t (aten::_version, aten::is_inference) through the
// dispatcher: the stable ABI has no direct query.
template <class T>
T tensor_query(const char *op, const Tensor &t) {
  std::array<StableIValue, 1> stack{torch::stable::detail::from(t)};
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, "", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<T>(stack[0]);
}

struct Key {
  const void *data;
  int64_t n, k, row_stride, col_stride, version;
  fmlp_dtype dtype;
  fmlp_cpu_isa unit;

  bool operator==(const Key &other) const {
    return std::tie(data, n, k, row_stride, col_stride, version, dtype, unit) ==
           std::tie(other.data, other.n, other.k, other.row_stride, other.col_stride,
                    other.version, other.dtype, other.unit);
  }
};

struct KeyHash {
  size_t operator()(const Key &key) const {
    size_t seed = std::hash<const void *>()(key.data);
    for (const int64_t part : {key.n, key.k, key.row_stride, key.col_stride, key.version,
                               static_cast<int64_t>(key.dtype), static_cast<int64_t>(key.unit)}) {
      seed ^= std::hash<int64_t>()(part) + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2);
    }
    return seed;
  }
};

struct FreeDeleter {
  void operator()(void *data) const { std::free(data); }
};

struct Entry {
  Key key;
  Tensor source;  // a view of the weight: holds its storage (see the top)
  std::unique_ptr<void, FreeDeleter> packed;
  int64_t bytes;
};
using EntryPtr = std::shared_ptr<const Entry>;

class WeightCache {
 public:
  // The entry of key, now the most recently used, or nullptr (a miss); first
  // evicts down to limit.
  EntryPtr find(const Key &key, int64_t limit) {
    const std::lock_guard<std::mutex> lock(mutex_);
    evict_to(limit);
    const auto found = index_.find(key);
    if (found == index_.end()) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    lru_.splice(lru_.begin(), lru_, found->second);
    return *found->second;
  }

  // entry cached (evicting the least recently used down to limit), or the
  // entry another thread cached for its key meanwhile.
  EntryPtr insert(EntryPtr entry, int64_t limit) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = index_.find(entry->key);
    if (found != index_.end()) return *found->second;
    evict_to(limit - entry->bytes);
    lru_.push_front(entry);
    index_.emplace(entry->key, lru_.begin());
    bytes_ += entry->bytes;
    return entry;
  }

  WeightCacheInfo info() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(lru_.size()), bytes_, limit_bytes(), hits_, misses_};
  }

  // Evicts the least recently used down to limit.
  void trim(int64_t limit) {
    const std::lock_guard<std::mutex> lock(mutex_);
    evict_to(limit);
  }

  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    evict_to(0);
    hits_ = misses_ = 0;
  }

 private:
  void evict_to(int64_t limit) {
    while (bytes_ > limit && !lru_.empty()) {
      bytes_ -= lru_.back()->bytes;
      index_.erase(lru_.back()->key);
      lru_.pop_back();
    }
  }

  std::mutex mutex_;
  std::list<EntryPtr> lru_;  // most recently used first
  std::unordered_map<Key, std::list<EntryPtr>::iterator, KeyHash> index_;
  int64_t bytes_ = 0, hits_ = 0, misses_ = 0;
};

// Never destroyed: its entries hold tensors, which must not be released after
// torch has begun tearing itself down at exit.
WeightCache &cache() {
  static WeightCache *instance = new WeightCache;
  return *instance;
}

}  // namespace

bool &weight_cache_paused() {
  thread_local bool paused = false;
  return paused;
}

std::shared_ptr<const void> cached_packed_weight(const Tensor &w, fmlp_dtype dtype,
                                                 fmlp_cpu_isa unit, int64_t rows,
                                                 const fmlp_threading &threading) {
  if (weight_cache_paused()) return nullptr;
  const int64_t limit = limit_bytes();
  if (limit == 0) {  // off: what it held goes too
    cache().trim(0);
    return nullptr;
  }
  const fmlp_input in = {w.data_ptr(), w.stride(0), w.stride(1)};
  const int64_t n = w.size(0), k = w.size(1);
  int64_t bytes = 0;
  FMLP_CHECK(fmlp_cpu_packed_weight_bytes(dtype, unit, rows, in, n, k, &bytes) == FMLP_OK,
             "fusedmlp: a ", n, " x ", k, " weight is too large to pack");
  if (bytes == 0 || bytes > limit || tensor_query<bool>("aten::is_inference", w)) {
    return nullptr;
  }
  const Key key = {in.data, n, k, in.row_stride, in.col_stride,
                   tensor_query<int64_t>("aten::_version", w), dtype, unit};
  EntryPtr entry = cache().find(key, limit);
  if (entry == nullptr) {
    // packed outside the lock: other threads' look-ups do not wait for it
    std::unique_ptr<void, FreeDeleter> packed(fmlp_cpu_alloc_packed_weight(bytes));
    FMLP_CHECK(packed != nullptr, "fusedmlp: out of memory packing a ", n, " x ", k,
               " weight for the weight cache");
    const fmlp_status status =
        fmlp_cpu_pack_weight(dtype, unit, in, n, k, packed.get(), &threading);
    FMLP_CHECK(status == FMLP_OK, "fusedmlp: packing a weight failed: ",
               fmlp_status_string(status));
    entry = cache().insert(std::make_shared<const Entry>(Entry{
                               key, torch::stable::transpose(w, 0, 1), std::move(packed), bytes}),
                           limit);
  }
  return {entry, entry->packed.get()};
}

WeightCacheInfo weight_cache_info() { return cache().info(); }

void clear_weight_cache() { cache().clear(); }

}  // namespace fusedmlp
