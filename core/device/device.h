// The device: the one allocation path every device buffer goes through, the memory wall
// ([device] memory_limit) and the out-of-memory report.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/backend.h"
#include "core/device/memory.h"

namespace headroom {

// What was asked for when an allocation failed, and what memory held at that moment.
struct OomReport {
  // Where the memory ran out (docs/design.md "Places"): "device", or "host" for the host ledger
  // ([host] memory_limit).
  std::string place = "device";
  uint64_t requested = 0;
  Category category = Category::kWorkspace;
  std::string what;  // the buffer: "block 3 activations: att (B, NH, T, T)"
  uint64_t limit = 0;
  uint64_t live_total = 0;
  ByCategory live{};  // at the failed request
  ByCategory peak{};  // each category's peak so far
  Phase phase;
  // Device memory held but not live: cached by an allocator, or padding around blocks (the
  // backend's used bytes, or the allocator's reserved bytes, minus the tracker's live bytes).
  uint64_t reserved_unused = 0;
  // The largest contiguous free block: what one allocation could still get. Below `requested`
  // while free_bytes() is not, the memory is fragmented (defrag_allocator is the cure).
  uint64_t largest_free = 0;
  // Who refused the request when an allocator serves every allocation ("'defrag_allocator'
  // (allocator plugin)"); empty when the backend itself allocates.
  std::string allocator;
  // What the run adds (the micro-batch a plugin had lowered it to): one line, or empty.
  std::string note;
  // Category::kPlugin by the plugin that holds it: live bytes at the failed request.
  std::map<std::string, uint64_t> plugin_live;

  // The bytes under the limit that nothing holds: limit - live - reserved_unused (0 without one).
  uint64_t free_bytes() const;
  // The multi-line report the host prints (exit code 3).
  std::string str() const;
};

class OutOfMemory : public std::runtime_error {
 public:
  explicit OutOfMemory(OomReport report);
  const OomReport& report() const { return report_; }

 private:
  OomReport report_;
};

// Told of every allocation, free and failed allocation (the trainer turns these into the ALLOC,
// FREE and OOM events). Called on the thread that allocates.
class AllocationObserver {
 public:
  virtual ~AllocationObserver() = default;
  virtual void on_alloc(const void* ptr, uint64_t bytes, Category category,
                        const std::string& what) = 0;
  virtual void on_free(const void* ptr, uint64_t bytes, Category category) = 0;
  virtual void on_oom(const OomReport& report) = 0;
};

// What an allocator holds (the allocator role's hr_allocator_stats, in the host's terms).
struct AllocatorStats {
  uint64_t allocated = 0;           // bytes in blocks handed out now
  uint64_t reserved = 0;            // bytes taken from the device (segments and mapped pages)
  uint64_t largest_free_block = 0;  // the largest request it could serve now without the device
  uint64_t device_allocs = 0;       // segments and page mappings taken from the device so far
  uint64_t retries = 0;             // requests served after releasing its cache
  uint64_t ooms = 0;                // requests it could not serve
};

// Replaces the backend's own allocation for every device buffer (the allocator role). Called on the
// training thread; returns nullptr when it has no memory for the request. `stream` is the native
// stream the buffer is used on (the backend's compute stream, where all of headroom's device work
// runs; NULL on the CPU): a caching allocator may hand a freed block out again at once only on the
// stream it was used on, whose queued work finishes with it before any later work starts.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(uint64_t bytes, Category category, void* stream) = 0;
  virtual void deallocate(void* ptr, uint64_t bytes, void* stream) = 0;
  // Fills *out and returns true when the allocator keeps statistics.
  virtual bool stats(AllocatorStats* out) const {
    (void)out;
    return false;
  }
  // Who allocates, for the messages: "'defrag_allocator' (allocator plugin)".
  virtual std::string name() const = 0;
};

// Elements of the naive attention backward's scratch that the op table of [device] kind `kind`
// allocates for a (B, T) micro-batch with NH heads (Backend::attention_scratch_numel), for
// estimates made without a device: the CPU's one (T, T) at a time, CUDA's (NH, T, T).
uint64_t attention_scratch_numel(const std::string& kind, int B, int T, int NH);

// A place memory lives in, with its ledger (the tracker by category) and its own wall. The device
// is one; the host is another (docs/design.md "Places"): Device::create makes the device and the
// host place beside it, a CPU device over host memory (page-locked on CUDA: the device's
// Backend::host_alloc) whose wall is [host] memory_limit as a budget of live bytes and whose op
// table is the CPU backend's, so that the same kernels compute on either. On the CPU backend the
// two are distinct ledgers over the same RAM.
class Device {
 public:
  // Throws ConfigError for a kind this build cannot run.
  static std::unique_ptr<Device> create(const DeviceConfig& config);
  virtual ~Device() = default;

  virtual std::string kind() const = 0;
  // "device", or "host" for the host place: what the reports call this memory.
  const std::string& place() const { return place_; }
  // The host place beside this device (Device::create made it); nullptr for the host place
  // itself and for a device made otherwise.
  Device* host_place() const { return host_.get(); }
  // The host place only: whether its buffers come from the device's Backend::host_alloc
  // (page-locked on CUDA; true, the default) or are plain pageable memory (false:
  // headroom.offload/1 set_host_page_locked). Before its first allocation; nothing elsewhere.
  virtual void set_page_locked(bool page_locked) { (void)page_locked; }
  uint64_t memory_limit() const { return limit_; }
  // The op table that computes on this device's memory: the device's own, or the dry one that
  // wraps it after set_dry(true) (core/device/dry_backend.h: same memory, no arithmetic).
  Backend& backend() { return dry_ ? *dry_ : own_backend(); }
  // Runs every later op dry (plan --measure). Set before the first op.
  void set_dry(bool dry);
  bool dry() const { return dry_ != nullptr; }

  // Every device buffer comes from here. Past the memory limit (or when the backend has no memory
  // left) it notifies the observers and throws OutOfMemory; nothing is allocated then.
  void* allocate(uint64_t bytes, Category category, const std::string& what);
  // The same, returning nullptr instead of firing OOM and throwing: for a caller that handles
  // its own failure (a plugin's services->alloc). `owner`: with Category::kPlugin, the plugin
  // whose buffer it is (the tracker keeps the category by plugin).
  void* try_allocate(uint64_t bytes, Category category, const std::string& what,
                     const std::string& owner = {});
  void free(void* ptr);
  // Whether `ptr` is a buffer this place handed out (and has not taken back).
  bool holds(const void* ptr) const { return blocks_.count(ptr) != 0; }
  // Whether `ptr` points into a buffer this place handed out (its start or inside it).
  bool contains(const void* ptr) const;
  // The op table that reads and writes `ptr`: the host place's for memory of it, else this
  // device's (a snapshot's optimizer state, an offloaded gradient shard, live in either place).
  Backend& backend_for(const void* ptr) {
    return host_ && host_->contains(ptr) ? host_->backend() : backend();
  }

  // The allocator every buffer comes from from now on; nullptr restores the backend's own. Set it
  // before the first allocation: a buffer is returned to the allocator that made it.
  void set_allocator(DeviceAllocator* allocator);
  DeviceAllocator* allocator() const { return allocator_; }
  // The installed allocator's statistics; false when there is none or it keeps none.
  bool allocator_stats(AllocatorStats* out) const { return allocator_ && allocator_->stats(out); }
  // The backend's own memory, outside the tracker: what an allocator plugin builds its pools from.
  virtual void* backend_allocate(uint64_t bytes) = 0;  // nullptr when the backend has none
  virtual void backend_free(void* ptr) = 0;

  // Virtual memory, for allocators that grow a segment page by page instead of needing one
  // contiguous hole (CUDA: cuMemAddressReserve / cuMemCreate + cuMemMap / cuMemUnmap /
  // cuMemAddressFree; the CPU backend models the same over its arena). Sizes and addresses are
  // multiples of vm_granularity(). vm_map returns false when there is no memory to back the range.
  virtual uint64_t vm_granularity() const = 0;
  virtual void* vm_reserve(uint64_t bytes) = 0;  // nullptr on failure
  virtual bool vm_map(void* addr, uint64_t bytes) = 0;
  virtual void vm_unmap(void* addr, uint64_t bytes) = 0;
  virtual void vm_release(void* addr, uint64_t bytes) = 0;

  // What the backend's memory looks like now: bytes in use by backend allocations and mapped
  // pages, and the largest contiguous free block (what the next backend_allocate can get). All
  // zero for a backend with no placement model (the CPU without a memory_limit).
  struct BackendStats {
    uint64_t capacity = 0;  // the memory limit, 0 when none
    uint64_t used = 0;
    uint64_t largest_free = 0;
  };
  virtual BackendStats backend_stats() const = 0;

  MemoryTracker& tracker() { return tracker_; }
  const MemoryTracker& tracker() const { return tracker_; }
  void add_observer(AllocationObserver* observer) { observers_.push_back(observer); }
  void remove_observer(AllocationObserver* observer);

 protected:
  explicit Device(uint64_t limit, std::string place = "device")
      : place_(std::move(place)), limit_(limit) {}
  virtual Backend& own_backend() = 0;
  // True when the backend's own memory is the wall (the CPU arena): an allocation fails when the
  // backend has no place for it. Otherwise the limit is checked against the tracker's live bytes.
  virtual bool backend_enforces_limit() const { return false; }

 private:
  // The device of config.kind alone, without its host place.
  static std::unique_ptr<Device> create_device(const DeviceConfig& config);
  void* allocate_impl(uint64_t bytes, Category category, const std::string& what,
                      const std::string& owner, bool report);
  // What memory looks like when `bytes` of `category` could not be had.
  OomReport oom_report(uint64_t bytes, Category category, const std::string& what) const;
  // Whether `bytes` more fit the memory limit as a budget of live bytes (always, where the backend
  // enforces the limit itself, or without one): only then is the backend or allocator asked.
  bool within_budget(uint64_t bytes) const;

  struct Block {
    uint64_t bytes;
    Category category;
    std::string owner;  // Category::kPlugin: the plugin's name
  };
  std::string place_;
  uint64_t limit_;
  std::unique_ptr<Device> host_;  // the host place (Device::create)
  std::unique_ptr<Backend> dry_;
  DeviceAllocator* allocator_ = nullptr;
  MemoryTracker tracker_;
  std::map<const void*, Block> blocks_;  // ordered: contains() finds the buffer below a pointer
  std::vector<AllocationObserver*> observers_;
};

// An observer registered on a device for as long as this lives. As a class's last member it is
// destroyed first, so the device stops calling the observer before any other member is gone,
// whether the owner is destroyed or its constructor throws half way.
class ObserverRegistration {
 public:
  ObserverRegistration() = default;
  ~ObserverRegistration() { detach(); }
  // The device stops calling the observer now (an owner whose destructor frees things first).
  void detach() {
    if (device_) device_->remove_observer(observer_);
    device_ = nullptr;
  }
  ObserverRegistration(const ObserverRegistration&) = delete;
  ObserverRegistration& operator=(const ObserverRegistration&) = delete;

  void attach(Device& device, AllocationObserver* observer) {
    device.add_observer(observer);
    device_ = &device;
    observer_ = observer;
  }

 private:
  Device* device_ = nullptr;
  AllocationObserver* observer_ = nullptr;
};

#if defined(HEADROOM_HAVE_CUDA)
// The CUDA device (core/device/cuda/cuda_device.cpp): [device] kind = "cuda". Throws ConfigError
// when no CUDA device with that index is present.
std::unique_ptr<Device> make_cuda_device(const DeviceConfig& config);
#endif

// A device buffer that frees itself. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device& device, uint64_t bytes, Category category, const std::string& what)
      : device_(&device), ptr_(device.allocate(bytes, category, what)), bytes_(bytes) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept : device_(o.device_), ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
  }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = o.device_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset() {
    if (ptr_) device_->free(ptr_);
    ptr_ = nullptr;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  uint64_t bytes() const { return bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace headroom
