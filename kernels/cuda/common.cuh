// Internal to the CUDA backend's .cu files: the cuBLAS check, launch helpers, the storage-type
// loads and stores, and the warp / block reductions the row kernels share.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

#include "kernels/common/dtype.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

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

// --- storage types -----------------------------------------------------------------------------
// Loads widen to float exactly; stores round to nearest even through kernels/common/dtype.h, the
// functions the CPU backend uses, so both backends round every stored value identically.
HR_HD inline float to_float(float x) {
  return x;
}
HR_HD inline float to_float(bf16 x) {
  return bf16_to_float(x.bits);
}
HR_HD inline float to_float(f16 x) {
  return f16_to_float(x.bits);
}

template <class T>
HR_HD inline T from_float(float f);
template <>
HR_HD inline float from_float<float>(float f) {
  return f;
}
template <>
HR_HD inline bf16 from_float<bf16>(float f) {
  return bf16{float_to_bf16(f)};
}
template <>
HR_HD inline f16 from_float<f16>(float f) {
  return f16{float_to_f16(f)};
}

// True for NaN and +-infinity, from the bits (an all-ones exponent), so no compiler flag can fold
// it away.
HR_HD inline bool is_nonfinite(float x) {
  return (float_bits(x) & 0x7F800000u) == 0x7F800000u;
}
HR_HD inline bool is_nonfinite(bf16 x) {
  return (x.bits & 0x7F80u) == 0x7F80u;
}
HR_HD inline bool is_nonfinite(f16 x) {
  return (x.bits & 0x7C00u) == 0x7C00u;
}

// The cuBLAS data type of a storage type.
template <class T>
struct CublasType;
template <>
struct CublasType<float> {
  static constexpr cudaDataType_t value = CUDA_R_32F;
};
template <>
struct CublasType<bf16> {
  static constexpr cudaDataType_t value = CUDA_R_16BF;
};
template <>
struct CublasType<f16> {
  static constexpr cudaDataType_t value = CUDA_R_16F;
};

// Explicit instantiation of a launcher template for the three storage types.
#define HR_INSTANTIATE_FLOAT_TYPES(MACRO) \
  MACRO(float)                            \
  MACRO(bf16)                             \
  MACRO(f16)

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

// Reduces over the block with `warp_reduce` (warp_sum, warp_max): blockDim.x a multiple of 32, at
// most 1024; every thread gets the result. `identity` stands in for the warps the block lacks.
// Safe to call repeatedly in one kernel.
template <class T, T (*warp_reduce)(T)>
__device__ inline T block_reduce(T v, T identity) {
  __shared__ T partial[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  v = warp_reduce(v);
  __syncthreads();  // a previous call may still be reading `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < nwarps ? partial[lane] : identity;
  return warp_reduce(v);
}

template <class T>
__device__ inline T block_sum(T v) {
  return block_reduce<T, warp_sum<T>>(v, T(0));
}

__device__ inline float block_max(float v) {
  return block_reduce<float, warp_max>(v, -INFINITY);
}

}  // namespace headroom::cuda
