// Error checks for the CUDA backend: every CUDA runtime call goes through CUDA_CHECK, which throws
// std::runtime_error naming the file, the line and CUDA's error string. Plain C++ (no nvcc needed),
// so tests and host code can use it too. CUBLAS_CHECK lives in common.cuh, next to cuBLAS.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace headroom::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what + ": " +
                           cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace headroom::cuda

#define CUDA_CHECK(call)                                                           \
  do {                                                                             \
    const cudaError_t hr_cuda_err_ = (call);                                       \
    if (hr_cuda_err_ != cudaSuccess) {                                             \
      ::headroom::cuda::throw_cuda_error(hr_cuda_err_, #call, __FILE__, __LINE__); \
    }                                                                              \
  } while (0)
