// The CUDA device: [device] kind = "cuda". Device memory comes from cudaMalloc (or, for allocator
// plugins, from pages mapped with the driver's virtual memory API), ops run on the CudaBackend.
//
// memory_limit caps the card below its size, a rehearsal of a smaller card: every byte taken from
// the device counts against it — buffers from backend_allocate and pages from vm_map, so an
// allocator's cache counts as it would on the smaller card. Device::allocate checks the tracker's
// live bytes against the limit before asking (backend_enforces_limit() stays false); a cudaMalloc
// that fails for want of memory takes the same out-of-memory path. Not counted: the CUDA context,
// cuBLAS's handles and the backend's workspace and scratch (about 32 MiB), as on a real card
// those are taken before training starts.
//
// The driver API (cuMem*) is reached through cudaGetDriverEntryPointByVersion, so libheadroom
// needs no libcuda at link time and loads on machines without a driver (the CPU backend still
// works there; asking for "cuda" then says no device is present).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "core/config/config.h"
#include "core/device/cuda/backend_cuda.h"
#include "core/device/device.h"
#include "kernels/cuda/check.h"

namespace headroom {

namespace {

// The driver entry points the virtual-memory functions need, each the version of CUDA 12.0's
// driver API (the cuMem* ones unchanged since 10.2).
struct DriverVm {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 get_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;

  // False (and the reason in *why) when the driver does not have one of them.
  bool load(std::string* why) {
    return get("cuDeviceGet", &device_get, why) &&
           get("cuDeviceGetAttribute", &device_attribute, why) &&
           get("cuMemGetAllocationGranularity", &get_granularity, why) &&
           get("cuMemAddressReserve", &address_reserve, why) &&
           get("cuMemAddressFree", &address_free, why) && get("cuMemCreate", &create, why) &&
           get("cuMemRelease", &release, why) && get("cuMemMap", &map, why) &&
           get("cuMemUnmap", &unmap, why) && get("cuMemSetAccess", &set_access, why) &&
           get("cuGetErrorString", &error_string, why);
  }

  std::string describe(CUresult r) const {
    const char* s = nullptr;
    if (error_string != nullptr && error_string(r, &s) == CUDA_SUCCESS && s != nullptr)
      return std::string(s) + " (CUresult " + std::to_string(static_cast<int>(r)) + ")";
    return "CUresult " + std::to_string(static_cast<int>(r));
  }

 private:
  template <class Fn>
  static bool get(const char* name, Fn* fn, std::string* why) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
      (void)cudaGetLastError();
      *why = std::string("the driver has no ") + name +
             (err != cudaSuccess ? std::string(" (") + cudaGetErrorString(err) + ")" : "");
      return false;
    }
    *fn = reinterpret_cast<Fn>(p);
    return true;
  }
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const DeviceConfig& config)
      : Device(config.memory_limit), index_(config.index) {
    CUDA_CHECK(cudaSetDevice(index_));
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    total_ = total_bytes;

    // Virtual memory: needs the device's support and the driver's entry points; without them the
    // vm_* functions report failure and allocators fall back to backend_allocate.
    vm_ok_ = vm_.load(&vm_why_);
    if (vm_ok_) {
      CUdevice dev = 0;
      int vmm = 0;
      vm_ok_ = vm_.device_get(&dev, index_) == CUDA_SUCCESS &&
               vm_.device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                    dev) == CUDA_SUCCESS &&
               vmm != 0;
      if (!vm_ok_) vm_why_ = "the device does not support virtual memory management";
    }
    if (vm_ok_) {
      prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop_.location.id = index_;
      size_t g = 0;
      const CUresult r = vm_.get_granularity(&g, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      if (r == CUDA_SUCCESS && g > 0) {
        granularity_ = g;
      } else {
        vm_ok_ = false;
        vm_why_ = "cuMemGetAllocationGranularity: " + vm_.describe(r);
      }
    }
    backend_ = make_cuda_backend(index_);
  }

  ~CudaDevice() override {
    // Whatever is still held goes back to the driver (buffers are normally freed by then).
    (void)cudaSetDevice(index_);
    (void)cudaDeviceSynchronize();
    for (const auto& [ptr, bytes] : allocs_)
      (void)cudaFree(ptr);
    for (const auto& [addr, handle] : pages_) {
      (void)vm_.unmap(addr, granularity_);
      (void)vm_.release(handle);
    }
    backend_.reset();
  }

  std::string kind() const override { return "cuda"; }
  Backend& own_backend() override { return *backend_; }

  void* backend_allocate(uint64_t bytes) override {
    if (over_limit(bytes)) return nullptr;
    on_device();
    void* p = nullptr;
    // cudaMalloc(0) gives no pointer; every buffer gets an address of its own.
    const cudaError_t err = cudaMalloc(&p, std::max<uint64_t>(bytes, 1));
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky, but leave no error behind for a later check
      return nullptr;
    }
    CUDA_CHECK(err);
    allocs_.emplace(p, bytes);
    used_ += bytes;
    return p;
  }
  void backend_free(void* ptr) override {
    if (ptr == nullptr) return;
    auto it = allocs_.find(ptr);
    if (it == allocs_.end()) {
      std::fprintf(stderr, "headroom: backend_free of %p, which cudaMalloc never handed out\n",
                   ptr);
      return;
    }
    used_ -= it->second;
    allocs_.erase(it);
    // Called from destructors (Buffer): reports, never throws. Ops still in flight may use the
    // buffer: wait for them (cudaFree would too), then free.
    on_device_noexcept();
    const cudaError_t sync = cudaDeviceSynchronize();
    const cudaError_t err = cudaFree(ptr);
    if (sync != cudaSuccess || err != cudaSuccess) {
      (void)cudaGetLastError();
      std::fprintf(stderr, "headroom: cudaFree(%p): %s\n", ptr,
                   cudaGetErrorString(sync != cudaSuccess ? sync : err));
    }
  }

  // Virtual memory, page by page: every granularity-sized page of a mapped range has its own
  // physical allocation (cuMemCreate) and handle, because cuMemUnmap cannot unmap part of one
  // mapping and allocators unmap any page-aligned part of what they mapped. Errors other than
  // running out of memory are printed and reported as failure (these functions are called from
  // plugins through the C ABI: nothing may throw through them).
  uint64_t vm_granularity() const override { return granularity_; }
  void* vm_reserve(uint64_t bytes) override {
    if (!vm_ok_) {
      if (!vm_warned_)
        std::fprintf(stderr, "headroom: cuda virtual memory is unavailable: %s\n", vm_why_.c_str());
      vm_warned_ = true;
      return nullptr;
    }
    if (bytes == 0) return nullptr;
    on_device_noexcept();
    CUdeviceptr addr = 0;
    const CUresult r = vm_.address_reserve(&addr, bytes, granularity_, 0, 0);
    if (r != CUDA_SUCCESS) {
      std::fprintf(stderr, "headroom: cuMemAddressReserve(%llu bytes): %s\n",
                   static_cast<unsigned long long>(bytes), vm_.describe(r).c_str());
      return nullptr;
    }
    return reinterpret_cast<void*>(addr);
  }
  bool vm_map(void* addr, uint64_t bytes) override {
    if (!vm_ok_ || addr == nullptr || bytes == 0) return false;
    if (over_limit(bytes)) return false;
    on_device_noexcept();
    const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(addr);
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = index_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    uint64_t done = 0;
    for (; done < bytes; done += granularity_) {
      const CUdeviceptr page = base + done;
      CUmemGenericAllocationHandle handle = 0;
      CUresult r = vm_.create(&handle, granularity_, &prop_, 0);
      if (r != CUDA_SUCCESS) {
        if (r != CUDA_ERROR_OUT_OF_MEMORY)
          std::fprintf(stderr, "headroom: cuMemCreate(%llu bytes): %s\n",
                       static_cast<unsigned long long>(granularity_), vm_.describe(r).c_str());
        break;
      }
      r = vm_.map(page, granularity_, 0, handle, 0);
      if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "headroom: cuMemMap(%p): %s\n", reinterpret_cast<void*>(page),
                     vm_.describe(r).c_str());
        (void)vm_.release(handle);
        break;
      }
      r = vm_.set_access(page, granularity_, &access, 1);
      if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "headroom: cuMemSetAccess(%p): %s\n", reinterpret_cast<void*>(page),
                     vm_.describe(r).c_str());
        (void)vm_.unmap(page, granularity_);
        (void)vm_.release(handle);
        break;
      }
      pages_.emplace(page, handle);
      used_ += granularity_;
    }
    if (done >= bytes) return true;
    unmap_pages(base, done);  // all or nothing
    return false;
  }
  void vm_unmap(void* addr, uint64_t bytes) override {
    if (!vm_ok_ || addr == nullptr) return;
    on_device_noexcept();
    // Unmapping while kernels may still read the pages would fault them: wait for the device.
    (void)cudaDeviceSynchronize();
    unmap_pages(reinterpret_cast<CUdeviceptr>(addr), bytes);
  }
  void vm_release(void* addr, uint64_t bytes) override {
    if (!vm_ok_ || addr == nullptr) return;
    on_device_noexcept();
    const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(addr);
    (void)cudaDeviceSynchronize();
    unmap_pages(base, bytes);  // pages the caller left mapped
    const CUresult r = vm_.address_free(base, bytes);
    if (r != CUDA_SUCCESS)
      std::fprintf(stderr, "headroom: cuMemAddressFree(%p): %s\n", addr, vm_.describe(r).c_str());
  }

  // capacity: the memory limit, else the card's memory. used: bytes handed out by
  // backend_allocate (as requested; the driver's rounding to its 2 MiB pages is not seen) plus
  // mapped pages. largest_free: the driver maps physical pages into a fresh virtual range for each
  // cudaMalloc, so below an allocator there is no external fragmentation: the largest block one
  // request can get is the free memory — the driver's free bytes (cudaMemGetInfo), and no more
  // than the limit leaves.
  BackendStats backend_stats() const override {
    BackendStats s;
    s.capacity = memory_limit() > 0 ? memory_limit() : total_;
    s.used = used_;
    size_t free_bytes = 0, total_bytes = 0;
    on_device_noexcept();
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      free_bytes = 0;
    }
    uint64_t largest = free_bytes;
    if (memory_limit() > 0)
      largest = std::min(largest, s.capacity > used_ ? s.capacity - used_ : 0);
    s.largest_free = largest;
    return s;
  }

 private:
  bool over_limit(uint64_t bytes) const {
    return memory_limit() > 0 && (used_ + bytes > memory_limit() || used_ + bytes < used_);
  }
  void on_device() const { CUDA_CHECK(cudaSetDevice(index_)); }
  void on_device_noexcept() const {
    if (cudaSetDevice(index_) != cudaSuccess) (void)cudaGetLastError();
  }
  // Unmaps and releases the pages of [base, base + bytes) that are mapped.
  void unmap_pages(CUdeviceptr base, uint64_t bytes) {
    for (uint64_t off = 0; off < bytes; off += granularity_) {
      auto it = pages_.find(base + off);
      if (it == pages_.end()) continue;
      CUresult r = vm_.unmap(it->first, granularity_);
      if (r != CUDA_SUCCESS)
        std::fprintf(stderr, "headroom: cuMemUnmap(%p): %s\n", reinterpret_cast<void*>(it->first),
                     vm_.describe(r).c_str());
      r = vm_.release(it->second);
      if (r != CUDA_SUCCESS)
        std::fprintf(stderr, "headroom: cuMemRelease: %s\n", vm_.describe(r).c_str());
      pages_.erase(it);
      used_ -= granularity_;
    }
  }

  int index_;
  uint64_t total_ = 0;
  uint64_t used_ = 0;  // backend_allocate'd bytes + mapped pages
  std::unordered_map<void*, uint64_t> allocs_;
  DriverVm vm_;
  bool vm_ok_ = false;
  std::string vm_why_;      // why vm_ok_ is false
  bool vm_warned_ = false;  // vm_why_ printed
  CUmemAllocationProp prop_{};
  uint64_t granularity_ = uint64_t(2) << 20;  // the usual minimum; the driver's when vm works
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> pages_;  // mapped page -> its memory
  std::unique_ptr<Backend> backend_;
};

}  // namespace

// The module's factory (core/device/cuda_module.h): make_cuda_device in libheadroom calls it.
// Throws ConfigError when no CUDA device with that index is present. C linkage: the name dlsym
// looks up, whatever the namespace.
extern "C" __attribute__((visibility("default"))) Device* headroom_cuda_make_device(
    const DeviceConfig& config) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    int runtime = 0;
    (void)cudaRuntimeGetVersion(&runtime);
    // What the runtime says when there is no driver at all, too.
    const std::string hint =
        err == cudaErrorInsufficientDriver
            ? "; no NVIDIA driver is loaded, or it is older than this build's CUDA " +
                  std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10)
            : "";
    throw ConfigError(std::string("device.kind = \"cuda\": no CUDA device is present "
                                  "(cudaGetDeviceCount: ") +
                      cudaGetErrorString(err) + hint + ")");
  }
  if (count == 0)
    throw ConfigError(
        "device.kind = \"cuda\": no CUDA device is present (cudaGetDeviceCount: 0 devices)");
  if (config.index < 0 || config.index >= count)
    throw ConfigError("device.index = " + std::to_string(config.index) + ": only " +
                      std::to_string(count) + " CUDA device(s) present (0.." +
                      std::to_string(count - 1) + ")");
  return new CudaDevice(config);
}

}  // namespace headroom
