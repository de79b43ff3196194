#include "core/device.h"

#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace headroom {

std::string OomReport::str() const {
  std::string s;
  char line[256];
  auto add = [&](const char* label, uint64_t b) {
    std::snprintf(line, sizeof line, "  %-22s %14s\n", label, format_bytes(b).c_str());
    s += line;
  };
  s += "out of memory: " + what + "\n";
  add("requested", requested);
  s += "  category               " + std::string(category_name(category)) + "\n";
  add("memory_limit", limit);
  add("live", live_total);
  add("free under the limit", limit > live_total ? limit - live_total : 0);
  s += "  phase                  " + phase.str() + "\n";
  std::snprintf(line, sizeof line, "  %-22s %14s %14s\n", "by category", "live", "peak");
  s += line;
  for (int i = 0; i < kNumCategories; ++i) {
    std::snprintf(line, sizeof line, "    %-20s %14s %14s\n", category_name(category_at(i)),
                  format_bytes(live[i]).c_str(), format_bytes(peak[i]).c_str());
    s += line;
  }
  return s;
}

OutOfMemory::OutOfMemory(OomReport report)
    : std::runtime_error("out of memory: " + report.what), report_(std::move(report)) {}

void* Device::allocate(uint64_t bytes, Category category, const std::string& what) {
  return allocate_impl(bytes, category, what, true);
}

void* Device::try_allocate(uint64_t bytes, Category category, const std::string& what) {
  return allocate_impl(bytes, category, what, false);
}

void* Device::allocate_impl(uint64_t bytes, Category category, const std::string& what,
                            bool report) {
  const uint64_t live = tracker_.live_total();
  void* ptr = nullptr;
  if (limit_ == 0 || live + bytes <= limit_)
    ptr = allocator_ ? allocator_->allocate(bytes, category) : backend_allocate(bytes);
  if (!ptr) {
    if (!report) return nullptr;
    OomReport r;
    r.requested = bytes;
    r.category = category;
    r.what = what;
    r.limit = limit_;
    r.live_total = live;
    r.live = tracker_.live_by_category();
    r.peak = tracker_.peak_by_category();
    r.phase = tracker_.phase();
    for (AllocationObserver* o : observers_)
      o->on_oom(r);
    throw OutOfMemory(std::move(r));
  }
  blocks_.emplace(ptr, Block{bytes, category});
  tracker_.on_alloc(category, bytes);
  try {
    for (AllocationObserver* o : observers_)
      o->on_alloc(ptr, bytes, category, what);
  } catch (...) {
    free(ptr);  // an observer stopped the run: the caller never sees this buffer
    throw;
  }
  return ptr;
}

void Device::free(void* ptr) {
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) {
    std::fprintf(stderr,
                 "headroom: internal error: freeing %p, which this device never allocated\n", ptr);
    std::abort();
  }
  const Block b = it->second;
  blocks_.erase(it);
  if (allocator_) {
    allocator_->deallocate(ptr, b.bytes);
  } else {
    backend_free(ptr);
  }
  tracker_.on_free(b.category, b.bytes);
  for (AllocationObserver* o : observers_)
    o->on_free(ptr, b.bytes, b.category);
}

void Device::set_allocator(DeviceAllocator* allocator) {
  if (!blocks_.empty()) {
    std::fprintf(stderr, "headroom: internal error: allocator replaced with %zu buffers live\n",
                 blocks_.size());
    std::abort();
  }
  allocator_ = allocator;
}

void Device::remove_observer(AllocationObserver* observer) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
}

namespace {

// The CPU backend: host memory standing in for device memory. The memory limit is the emulated
// wall; host allocation failure is the same out-of-memory path.
class CpuDevice final : public Device {
 public:
  explicit CpuDevice(uint64_t limit) : Device(limit) {
    // Activations are allocated and freed every micro-step. Keep large blocks in the heap instead
    // of mmap/munmap-ing them each time, which would zero fresh pages on every step.
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  std::string kind() const override { return "cpu"; }

  void* backend_allocate(uint64_t bytes) override {
    // 64-byte alignment for vector loads; aligned_alloc wants a multiple of the alignment.
    const uint64_t rounded = std::max<uint64_t>(64, (bytes + 63) / 64 * 64);
    return std::aligned_alloc(64, rounded);
  }
  void backend_free(void* ptr) override { std::free(ptr); }

  // Plain host virtual memory: reserve with PROT_NONE, map by making pages readable and writable.
  uint64_t vm_granularity() const override { return uint64_t(2) << 20; }
  void* vm_reserve(uint64_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  bool vm_map(void* addr, uint64_t bytes) override {
    return mprotect(addr, bytes, PROT_READ | PROT_WRITE) == 0;
  }
  void vm_unmap(void* addr, uint64_t bytes) override {
    // Drop the pages (their contents are gone, as after cuMemUnmap) and fence the range again.
    madvise(addr, bytes, MADV_DONTNEED);
    mprotect(addr, bytes, PROT_NONE);
  }
  void vm_release(void* addr, uint64_t bytes) override { munmap(addr, bytes); }
  BackendStats backend_stats() const override { return BackendStats{}; }
};

}  // namespace

std::unique_ptr<Device> Device::create(const DeviceConfig& config) {
  if (config.kind == "cpu") {
    if (config.index != 0)
      throw ConfigError("device.index = " + std::to_string(config.index) +
                        ": the cpu device has only index 0");
    return std::make_unique<CpuDevice>(config.memory_limit);
  }
  throw ConfigError("device.kind = \"" + config.kind +
                    "\": this build has no such backend; valid: \"cpu\"");
}

}  // namespace headroom
