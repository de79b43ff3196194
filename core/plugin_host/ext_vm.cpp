// headroom.vm/1 (headroom/ext/vm.h): the backend's memory and virtual memory, for the allocator
// role only. The functions are the 1.4 table's (services_v1.cpp) under this extension's rules.
#include "core/plugin_host/services.h"
#include "headroom/ext/vm.h"

namespace headroom {
namespace services {

// The 1.4 table's functions (services_v1.cpp), under this extension's rules.
constexpr Rule kRawAlloc = {HR_EXT_VM " raw_alloc", kAllocatorRole, When::kAnyTime, kNotAllowed};
constexpr Rule kRawFree = {HR_EXT_VM " raw_free", kAllocatorRole, When::kAnyTime, kNotAllowed};
constexpr Rule kGranularity = {HR_EXT_VM " granularity", kAllocatorRole, When::kAnyTime,
                               kNotAllowed};
constexpr Rule kReserve = {HR_EXT_VM " reserve", kAllocatorRole, When::kAnyTime, kNotAllowed};
constexpr Rule kMap = {HR_EXT_VM " map", kAllocatorRole, When::kAnyTime, kNotAllowed};
constexpr Rule kUnmap = {HR_EXT_VM " unmap", kAllocatorRole, When::kAnyTime, kNotAllowed};
constexpr Rule kRelease = {HR_EXT_VM " release", kAllocatorRole, When::kAnyTime, kNotAllowed};

extern const hr_ext_vm kVmExtension;
const hr_ext_vm kVmExtension = {sizeof(hr_ext_vm),
                                0,
                                checked<kRawAlloc, raw_alloc>,
                                checked<kRawFree, raw_free>,
                                checked<kGranularity, vm_granularity>,
                                checked<kReserve, vm_reserve>,
                                checked<kMap, vm_map>,
                                checked<kUnmap, vm_unmap>,
                                checked<kRelease, vm_release>};

}  // namespace services
}  // namespace headroom
