#include "core/device/device.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

#include "core/device/arena.h"
#include "core/device/dry_backend.h"

namespace headroom {

void Device::set_dry(bool dry) {
  dry_ = dry ? make_dry_backend(own_backend()) : nullptr;
  if (host_) host_->set_dry(dry);
}

std::string OomReport::str() const {
  std::string s;
  char line[256];
  auto add = [&](const char* label, uint64_t b) {
    std::snprintf(line, sizeof line, "  %-22s %14s\n", label, format_bytes(b).c_str());
    s += line;
  };
  const bool host = place == "host";
  s += (host ? "out of memory on the host: " : "out of memory: ") + what + "\n";
  add("requested", requested);
  s += "  place                  " + place + "\n";
  s += "  category               " + std::string(category_name(category)) + "\n";
  if (limit) {
    add(host ? "host memory_limit" : "memory_limit", limit);
  } else if (!allocator.empty()) {
    // No wall of ours: the allocator role said no (its own policy, or the device refused it).
    s += "  memory_limit           none: " + allocator + " refused " + format_bytes(requested) +
         " (its own policy, or the device it allocates from)\n";
  } else {
    // No wall of ours: the device itself (the host's malloc, the CUDA driver) said no.
    s += std::string(host ? "  host memory_limit      none: the host"
                          : "  memory_limit           none: the device") +
         " refused the allocation of " + format_bytes(requested) + " itself\n";
  }
  if (limit && !allocator.empty()) s += "  refused by             " + allocator + "\n";
  add("live", live_total);
  add("reserved-but-unused", reserved_unused);
  if (limit) add("free under the limit", free_bytes());
  if (limit) add("largest free block", largest_free);
  s += "  phase                  " + phase.str() + "\n";
  std::snprintf(line, sizeof line, "  %-22s %14s %14s\n", "by category", "live", "peak");
  s += line;
  for (int i = 0; i < kNumCategories; ++i) {
    std::snprintf(line, sizeof line, "    %-20s %14s %14s\n", category_name(category_at(i)),
                  format_bytes(live[i]).c_str(), format_bytes(peak[i]).c_str());
    s += line;
    if (category_at(i) != Category::kPlugin) continue;
    for (const auto& [name, bytes] : plugin_live) {
      if (!bytes) continue;
      std::snprintf(line, sizeof line, "      %-18s %14s\n", ("'" + name + "'").c_str(),
                    format_bytes(bytes).c_str());
      s += line;
    }
  }
  if (!note.empty()) s += "  " + note + "\n";
  return s;
}

uint64_t OomReport::free_bytes() const {
  const uint64_t held = live_total + reserved_unused;
  return limit > held ? limit - held : 0;
}

OutOfMemory::OutOfMemory(OomReport report)
    : std::runtime_error("out of memory: " + report.what), report_(std::move(report)) {}

void* Device::allocate(uint64_t bytes, Category category, const std::string& what) {
  return allocate_impl(bytes, category, what, {}, true);
}

void* Device::try_allocate(uint64_t bytes, Category category, const std::string& what,
                           const std::string& owner) {
  return allocate_impl(bytes, category, what, owner, false);
}

void* Device::allocate_impl(uint64_t bytes, Category category, const std::string& what,
                            const std::string& owner, bool report) {
  void* ptr = nullptr;
  if (within_budget(bytes))
    ptr = allocator_ ? allocator_->allocate(bytes, category, backend().native_stream())
                     : backend_allocate(bytes);
  if (!ptr) {
    if (!report) return nullptr;
    OomReport r = oom_report(bytes, category, what);
    for (AllocationObserver* o : observers_)
      o->on_oom(r);
    throw OutOfMemory(std::move(r));
  }
  const std::string& by = category == Category::kPlugin ? owner : std::string();
  blocks_.emplace(ptr, Block{bytes, category, by});
  tracker_.on_alloc(category, bytes, by);
  try {
    for (AllocationObserver* o : observers_)
      o->on_alloc(ptr, bytes, category, what);
  } catch (...) {
    free(ptr);  // an observer stopped the run: the caller never sees this buffer
    throw;
  }
  return ptr;
}

bool Device::contains(const void* ptr) const {
  auto it = blocks_.upper_bound(ptr);  // the first buffer starting past ptr
  if (it == blocks_.begin()) return false;
  --it;
  return static_cast<const char*>(ptr) <
         static_cast<const char*>(it->first) + std::max<uint64_t>(it->second.bytes, 1);
}

bool Device::within_budget(uint64_t bytes) const {
  // Where the backend places memory itself (the CPU arena), the wall is the backend failing: a
  // request can fail with enough bytes free when no hole is large enough, as on a GPU. Elsewhere
  // the limit is a budget of live bytes.
  return limit_ == 0 || backend_enforces_limit() ||
         (bytes <= limit_ && tracker_.live_total() <= limit_ - bytes);  // no wrap-around
}

OomReport Device::oom_report(uint64_t bytes, Category category, const std::string& what) const {
  OomReport r;
  r.place = place_;
  r.requested = bytes;
  r.category = category;
  r.what = what;
  r.limit = limit_;
  r.live_total = tracker_.live_total();
  r.live = tracker_.live_by_category();
  r.peak = tracker_.peak_by_category();
  r.phase = tracker_.phase();
  for (const auto& [name, o] : tracker_.plugin_owners())
    r.plugin_live[name] = o.live;
  // Within the budget, the allocator said no; past it, the budget did (the allocator was not
  // asked).
  if (allocator_ && within_budget(bytes)) r.allocator = allocator_->name();
  // Held = what the backend has handed out (the arena's blocks and pages), or what the allocator
  // says it reserved where the backend keeps no count; whatever of it is not live is cache or
  // padding. The largest free block is the larger of the backend's largest hole and the
  // allocator's largest cached block: the most one request could get.
  const BackendStats b = backend_stats();
  uint64_t held = b.used;
  r.largest_free = b.largest_free;
  AllocatorStats a;
  if (allocator_stats(&a)) {
    held = std::max(held, a.reserved);
    r.largest_free = std::max(r.largest_free, a.largest_free_block);
  }
  r.reserved_unused = held > r.live_total ? held - r.live_total : 0;
  return r;
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
    allocator_->deallocate(ptr, b.bytes, backend().native_stream());
  } else {
    backend_free(ptr);
  }
  tracker_.on_free(b.category, b.bytes, b.owner);
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

// The CPU backend: host memory standing in for device memory. Without a memory limit it is plain
// host memory. With one, it is an Arena of that many bytes with first-fit placement and no
// caching, like a GPU driver's: the limit is then a wall with a shape, where fragmentation can
// stop a run that has enough bytes free (see core/device/arena.h).
class CpuDevice final : public Device {
 public:
  CpuDevice(uint64_t limit, int threads) : Device(limit), backend_(make_cpu_backend(threads)) {
    if (limit > 0) arena_ = std::make_unique<Arena>(limit);
    keep_large_blocks_in_heap();
  }
  // The host place beside `device`: its buffers from the device's Backend::host_alloc
  // (page-locked on CUDA), its wall `limit` a budget of live bytes (no arena: host memory has no
  // shape a GPU's would), its op table the CPU backend's.
  CpuDevice(uint64_t limit, int threads, Backend& device)
      : Device(limit, "host"), backend_(make_cpu_backend(threads)), pinned_from_(&device) {
    keep_large_blocks_in_heap();
  }
  void keep_large_blocks_in_heap() {
    // Activations are allocated and freed every micro-step. Keep large blocks in the heap instead
    // of mmap/munmap-ing them each time, which would zero fresh pages on every step.
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  std::string kind() const override { return "cpu"; }
  Backend& own_backend() override { return *backend_; }
  void set_page_locked(bool page_locked) override {
    if (pinned_from_ && tracker().live_total() > 0)
      throw std::logic_error("the host place's memory is chosen before its first allocation");
    page_locked_ = page_locked;
  }

  void* backend_allocate(uint64_t bytes) override {
    if (arena_) return arena_->allocate(bytes);
    if (dry()) return dry_allocate(bytes);
    if (pinned_from_ && page_locked_) {
      try {
        return pinned_from_->host_alloc(bytes);
      } catch (const std::exception&) {
        return nullptr;  // page-locked memory refused (cudaMallocHost): out of memory on the host
      }
    }
    // 64-byte alignment for vector loads; aligned_alloc wants a multiple of the alignment.
    if (bytes > UINT64_MAX - 63) return nullptr;  // rounding up would wrap: no host has it
    const uint64_t rounded = std::max<uint64_t>(64, (bytes + 63) / 64 * 64);
    return std::aligned_alloc(64, rounded);
  }
  void backend_free(void* ptr) override {
    if (!arena_) {
      if (dry_maps_.empty())  // a run that computes: no lookup a free
        return pinned_from_ && page_locked_ ? pinned_from_->host_free(ptr) : std::free(ptr);
      const auto it = dry_maps_.find(ptr);
      if (it == dry_maps_.end())
        return pinned_from_ && page_locked_ ? pinned_from_->host_free(ptr) : std::free(ptr);
      munmap(ptr, it->second);
      dry_maps_.erase(it);
    } else if (!arena_->free(ptr)) {
      std::fprintf(stderr, "headroom: backend_free of %p, which the arena never handed out\n", ptr);
    }
  }

  // With the arena, vm_map aliases arena pages into the reserved range (cuMemMap's design). Without
  // it, plain host virtual memory: reserve with PROT_NONE, map by making pages readable and
  // writable.
  uint64_t vm_granularity() const override { return Arena::kPageSize; }
  void* vm_reserve(uint64_t bytes) override {
    if (arena_) return arena_->vm_reserve(bytes);
    return reserve_address_range(bytes, Arena::kPageSize);
  }
  bool vm_map(void* addr, uint64_t bytes) override {
    if (arena_) return arena_->vm_map(addr, bytes);
    return mprotect(addr, bytes, PROT_READ | PROT_WRITE) == 0;
  }
  void vm_unmap(void* addr, uint64_t bytes) override {
    if (arena_) return arena_->vm_unmap(addr, bytes);
    // Drop the pages (their contents are gone, as after cuMemUnmap) and fence the range again.
    madvise(addr, bytes, MADV_DONTNEED);
    mprotect(addr, bytes, PROT_NONE);
  }
  void vm_release(void* addr, uint64_t bytes) override {
    if (arena_) return arena_->vm_release(addr, bytes);
    munmap(addr, bytes);
  }
  BackendStats backend_stats() const override {
    BackendStats s;
    if (!arena_) return s;
    const Arena::Stats a = arena_->stats();
    s.capacity = a.capacity;
    s.used = a.used;
    s.largest_free = a.largest_free;
    return s;
  }

 protected:
  bool backend_enforces_limit() const override { return arena_ != nullptr; }

 private:
  // A dry run's buffer (plan --measure): address space reserved without backing, as the arena's
  // mappings are (MAP_NORESERVE). The dry op table writes no values (core/device/dry_backend.h),
  // so its pages are never touched and an 8B model's variants cost no host memory. Page-aligned,
  // which is 64-byte aligned; each mapping's size is kept for its munmap.
  void* dry_allocate(uint64_t bytes) {
    static const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
    if (bytes > UINT64_MAX - page) return nullptr;
    const uint64_t rounded = std::max<uint64_t>(page, (bytes + page - 1) / page * page);
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    dry_maps_.emplace(p, rounded);
    return p;
  }

  std::unique_ptr<Arena> arena_;
  std::unique_ptr<Backend> backend_;
  Backend* pinned_from_ = nullptr;  // the host place: the device whose host_alloc it uses
  bool page_locked_ = true;         // ... unless set_page_locked(false): plain memory
  std::unordered_map<void*, uint64_t> dry_maps_;  // dry_allocate's mappings and their sizes
};

}  // namespace

uint64_t attention_scratch_numel(const std::string& kind, int B, int T, int NH) {
  (void)B;
  // As backend_cpu.cpp's and kernels/cuda/ops.h's attention_scratch_numel (which needs CUDA's
  // headers), checked against the backends in tests/ops_test.cpp and tests/cuda_ops_test.cpp.
  const uint64_t TT = uint64_t(T) * uint64_t(T);
  return kind == "cuda" ? uint64_t(NH) * TT : TT;
}

std::unique_ptr<Device> Device::create(const DeviceConfig& config) {
  std::unique_ptr<Device> d = create_device(config);
  // The host place beside it, a ledger and wall of its own ([host] memory_limit).
  d->host_ =
      std::make_unique<CpuDevice>(config.host_memory_limit, config.threads, d->own_backend());
  return d;
}

std::unique_ptr<Device> Device::create_device(const DeviceConfig& config) {
  if (config.kind == "cpu") {
    if (config.index != 0)
      throw ConfigError("device.index = " + std::to_string(config.index) +
                        ": the cpu device has only index 0");
    return std::make_unique<CpuDevice>(config.memory_limit, config.threads);
  }
  if (config.kind == "cuda") {
    // The message names where kind was set: the config is right, the machine or build is not.
    const std::string at = config.kind_pos.file.empty() ? "" : config.kind_pos.str() + ": ";
#if defined(HEADROOM_HAVE_CUDA)
    try {
      return make_cuda_device(config);
    } catch (const ConfigError& e) {
      throw ConfigError(at + e.what());
    }
#else
    throw ConfigError(at +
                      "device.kind = \"cuda\": this build of headroom has no CUDA backend (it was "
                      "built without nvcc, or with -DHEADROOM_CUDA=OFF); valid here: \"cpu\"");
#endif
  }
  throw ConfigError("device.kind = \"" + config.kind + "\": valid kinds are \"cpu\" and \"cuda\"");
}

}  // namespace headroom
