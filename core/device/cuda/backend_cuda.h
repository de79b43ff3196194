// The CUDA backend's op table (core/device/cuda/backend_cuda.cpp), private to core: the CUDA device
// (core/device/cuda/cuda_device.cpp) owns one. Only built with HEADROOM_HAVE_CUDA.
#pragma once

#include <memory>

#include "core/device/backend.h"

namespace headroom {

// The op table for CUDA device `device` (an ordinal already validated by the caller). Creates
// its compute and copy streams, the cuBLAS / cuBLASLt handles and workspace, and the small scratch
// the reductions hand their results back through; all of that memory is outside the device's
// memory tracker. Throws std::runtime_error (file:line and CUDA's message) when CUDA fails.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace headroom
