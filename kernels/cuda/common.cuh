// Internal to the CUDA backend's .cu files: the cuBLAS check, launch helpers and the warp / block
// reductions the row kernels share.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

#include "kernels/cuda/check.h"

namespace headroom::cuda {

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* what,
                                            const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what + ": " +
                           cublasGetStatusName(status) + ": " + cublasGetStatusString(status));
}

}  // namespace headroom::cuda

#define CUBLAS_CHECK(call)                                                                \
  do {                                                                                    \
    const cublasStatus_t hr_cublas_status_ = (call);                                      \
    if (hr_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                     \
      ::headroom::cuda::throw_cublas_error(hr_cublas_status_, #call, __FILE__, __LINE__); \
    }                                                                                     \
  } while (0)

// After a kernel launch: a bad configuration surfaces here, with the launch's file and line.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace headroom::cuda {

constexpr int kWarpSize = 32;

inline size_t ceil_div(size_t a, size_t b) {
  return (a + b - 1) / b;
}

// Blocks for a grid-stride loop over n elements: enough to fill the device, capped so the grid
// stays a legal launch for any n (the loop covers the rest).
inline unsigned grid_for(size_t n, int block) {
  const size_t blocks = ceil_div(n, static_cast<size_t>(block));
  const size_t kMaxBlocks = size_t(1) << 16;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

template <class T>
__device__ inline T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  }
  return v;
}

// NaNs are skipped (fmaxf), like the CPU's max_of: a NaN then propagates through the exps.
__device__ inline float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// Safe to call repeatedly in one kernel.
template <class T>
__device__ inline T block_sum(T v) {
  __shared__ T partial[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  __syncthreads();  // a previous call may still be reading `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < nwarps ? partial[lane] : T(0);
  return warp_sum(v);
}

__device__ inline float block_max(float v) {
  __shared__ float partial[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < nwarps ? partial[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace headroom::cuda
