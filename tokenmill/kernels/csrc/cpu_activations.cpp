// Where the kernels' large outputs live: a small cache of buffers that keeps their pages.
//
// glibc serves every allocation of 32 MiB or more with a fresh mmap and unmaps it on free,
// so a kernel writing such an output faults in each 4 KiB page again at every call: a
// Llama-3.2-1B-shaped model's 1,024-token prefill writes 96 MiB of MLP activations a layer
// and spent about a tenth of the step in those faults (docs/benchmarks.md, stop 61). The
// cache hands a freed buffer to the next output that fits it, so a step's layers and the
// steps after it reuse pages already resident; the buffers are 2 MiB aligned and advised
// onto transparent huge pages, so even a first touch faults once per 2 MiB.

#include "cpu_kernels.h"

#include <sys/mman.h>
#include <torch/library.h>

#include <cstdlib>
#include <list>
#include <mutex>
#include <new>
#include <tuple>
#include <vector>

namespace {

constexpr size_t kCachedFrom = size_t{1} << 20;  // smaller outputs: the heap reuses them already
constexpr size_t kHugePage = size_t{2} << 20;
// Free bytes the cache holds on to: a step's largest outputs several times over (a 1B-shaped
// model's 2,048-row MLP writes 192 MiB), not so much that a burst of odd sizes stays resident.
constexpr size_t kKeptAtMost = size_t{512} << 20;

class BufferCache {
 public:
  // A buffer of at least `bytes` (a multiple of kHugePage) and its capacity: the smallest free
  // one of up to twice the size asked, else a new one.
  std::pair<void*, size_t> take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->capacity >= bytes && it->capacity <= 2 * bytes && (best == free_.end() || it->capacity < best->capacity))
          best = it;
      if (best != free_.end()) {
        const Buffer taken = *best;
        free_.erase(best);
        free_bytes_ -= taken.capacity;
        return {taken.data, taken.capacity};
      }
    }
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, bytes) != 0) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);  // advisory: a kernel without THP ignores it
    return {p, bytes};
  }

  // Kept, most recent first; the least recently freed buffers go back to the system past kKeptAtMost.
  void give_back(void* p, size_t capacity) {
    std::vector<void*> released;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      free_.push_front({p, capacity});
      free_bytes_ += capacity;
      while (free_bytes_ > kKeptAtMost) {
        released.push_back(free_.back().data);
        free_bytes_ -= free_.back().capacity;
        free_.pop_back();
      }
    }
    for (void* q : released) std::free(q);
  }

  std::pair<int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(free_.size()), static_cast<int64_t>(free_bytes_)};
  }

 private:
  struct Buffer {
    void* data;
    size_t capacity;
  };
  std::mutex mutex_;
  std::list<Buffer> free_;  // a step frees a handful of large outputs: a short list
  size_t free_bytes_ = 0;
};

// Never destroyed: tensors may be freed after static destructors have run.
BufferCache& buffer_cache() {
  static BufferCache* cache = new BufferCache();
  return *cache;
}

}  // namespace

namespace tokenmill {

at::Tensor activation_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (bytes < kCachedFrom || options.device().type() != c10::DeviceType::CPU) return at::empty(sizes, options);
  const auto [p, capacity] = buffer_cache().take((bytes + kHugePage - 1) / kHugePage * kHugePage);
  return at::from_blob(p, sizes, [capacity = capacity](void* q) { buffer_cache().give_back(q, capacity); }, options);
}

// (free buffers, free bytes) the cache holds: for tests and memory accounting.
std::tuple<int64_t, int64_t> activation_cache_stats() {
  const auto [count, bytes] = buffer_cache().stats();
  return {count, bytes};
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("activation_cache_stats() -> (int, int)", &tokenmill::activation_cache_stats);
}
