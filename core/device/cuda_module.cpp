// Loading libheadroom_cuda.so (core/device/cuda_module.h): from the folder libheadroom.so was
// loaded from, which is where both are built (build/lib) and installed (<prefix>/lib).
#include "core/device/cuda_module.h"

#include <dlfcn.h>

// std::filesystem in Boost.DLL's interface, as the plugin loader has it (plugin_internal.h).
#ifndef BOOST_DLL_USE_STD_FS
#define BOOST_DLL_USE_STD_FS
#endif
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <mutex>
#include <system_error>

#include "core/config/config.h"
#include "core/device/device.h"

namespace headroom {

namespace {

constexpr const char* kModuleFile = "libheadroom_cuda.so";

// Loaded once, kept for the life of the process: the CUDA runtime and cuBLAS are not made to be
// unloaded while their handles may still be destroyed at exit.
boost::dll::shared_library& cuda_module() {
  static std::once_flag once;
  static boost::dll::shared_library* module = nullptr;
  static std::string why;
  std::call_once(once, [] {
    const boost::dll::fs::path path = boost::dll::this_line_location().parent_path() / kModuleFile;
    auto* lib = new boost::dll::shared_library();
    std::error_code load_error;
    dlerror();  // clear any earlier message: the one read below is this load's
    lib->load(path, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local,
              load_error);
    if (load_error || !lib->is_loaded()) {
      const char* said = dlerror();
      why = path.string() + ": the CUDA backend's library does not load (" +
            (said != nullptr ? std::string(said) : load_error.message()) +
            "); it is built and installed beside libheadroom.so";
      delete lib;
      return;
    }
    module = lib;
  });
  if (module == nullptr) throw ConfigError("device.kind = \"cuda\": " + why);
  return *module;
}

}  // namespace

void* cuda_module_symbol(const char* name) {
  boost::dll::shared_library& module = cuda_module();
  if (!module.has(name))
    throw ConfigError(std::string("device.kind = \"cuda\": ") + kModuleFile + " has no " + name +
                      " (a libheadroom_cuda.so of another build?)");
  return dlsym(module.native(), name);
}

// The factory's definition is in the module (core/device/cuda/cuda_device.cpp).
std::unique_ptr<Device> make_cuda_device(const DeviceConfig& config) {
  using Make = Device* (*)(const DeviceConfig&);
  return std::unique_ptr<Device>(cuda_module_function<Make>("headroom_cuda_make_device")(config));
}

}  // namespace headroom
