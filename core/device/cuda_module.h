// The CUDA backend lives in a library of its own, libheadroom_cuda.so, beside libheadroom.so, and
// is loaded the first time a run asks for device.kind = "cuda" (or NCCL ranks). A CPU run never
// loads cuBLAS: its static initialisation alone takes about 90 ms of CPU and 0.25 s of wall time
// per process, which every headroom process paid when libheadroom linked it (issue 32: the test
// suite starts thousands of processes).
//
// The two libraries are built together from one tree, so C++ types and exceptions cross between
// them; the functions are looked up by C names (extern "C" in the module) only so that dlsym finds
// them without mangling.
#pragma once

#include <string>

namespace headroom {

// The address of `name` in libheadroom_cuda.so, loading it on first use (never unloaded). Throws
// ConfigError naming the file and the loader's reason when it is missing or does not load.
void* cuda_module_symbol(const char* name);

template <class Function>
Function cuda_module_function(const char* name) {
  return reinterpret_cast<Function>(cuda_module_symbol(name));
}

}  // namespace headroom
