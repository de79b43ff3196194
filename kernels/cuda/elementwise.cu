// Element-wise ops over any storage type (fill, cast, scale, axpy) and the two reductions that
// hand a value to the host (sum of squares for the gradient norm, the non-finite check for amp).
// Where the CPU backend (core/device/backend_cpu.cpp) computes a 16-bit op in double, so does this:
// the same product, rounded to float and then to the storage type, gives the same bits.
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

// Grid-stride loops of element-wise kernels.
constexpr int kBlock = 256;

}  // namespace

// x (n) = value (already in the storage type)
template <class T>
__global__ void fill_kernel(T* x, size_t n, T value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] = value;
  }
}

template <class T>
void fill(T* x, size_t n, double value, cudaStream_t stream) {
  if (n == 0) return;
  if (value == 0.0) {  // zero bits in every storage type (-0.0 too, as on the CPU backend)
    CUDA_CHECK(cudaMemsetAsync(x, 0, n * sizeof(T), stream));
    return;
  }
  fill_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(x, n,
                                                          from_float<T>(static_cast<float>(value)));
  CUDA_CHECK_LAUNCH();
}

// dst (n) = src (n) through float: widening is exact, narrowing rounds to nearest even.
template <class Dst, class Src>
__global__ void cast_kernel(Dst* dst, const Src* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = from_float<Dst>(to_float(src[i]));
  }
}

template <class Dst, class Src>
void cast(Dst* dst, const Src* src, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if constexpr (std::is_same_v<Dst, Src>) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(Dst), cudaMemcpyDeviceToDevice, stream));
  } else {
    cast_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(dst, src, n);
    CUDA_CHECK_LAUNCH();
  }
}

// x (n) *= s. float: x * float(s) in fp32; bf16 / f16: x * s in double (exact for a 16-bit x and
// a float s), then rounded to float and to T, as the CPU backend computes it.
template <class T>
__global__ void scale_kernel(T* x, size_t n, double s) {
  const float sf = static_cast<float>(s);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, float>) {
      x[i] = __fmul_rn(x[i], sf);
    } else {
      x[i] = from_float<T>(static_cast<float>(static_cast<double>(to_float(x[i])) * s));
    }
  }
}

template <class T>
void scale(T* x, size_t n, double s, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(x, n, s);
  CUDA_CHECK_LAUNCH();
}

// y (n) += a * x (n). float: float(a) * x then the add, each rounded (no fused multiply-add, as
// the CPU); bf16 / f16: in double, as the CPU backend.
template <class T>
__global__ void axpy_kernel(T* y, const T* x, size_t n, double a) {
  const float af = static_cast<float>(a);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, float>) {
      y[i] = __fadd_rn(y[i], __fmul_rn(af, x[i]));
    } else {
      // Rounded multiply, then rounded add: nvcc would otherwise fuse them into an fma, which
      // the CPU (and the bitwise test) does not do.
      const double v = __dadd_rn(static_cast<double>(to_float(y[i])),
                                 __dmul_rn(a, static_cast<double>(to_float(x[i]))));
      y[i] = from_float<T>(static_cast<float>(v));
    }
  }
}

template <class T>
void axpy(T* y, const T* x, size_t n, double a, cudaStream_t stream) {
  if (n == 0) return;
  axpy_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(y, x, n, a);
  CUDA_CHECK_LAUNCH();
}

// y (n, f32) += x (n) widened: a compute-dtype gradient added into its fp32 master.
template <class T>
__global__ void accumulate_kernel(float* y, const T* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] = __fadd_rn(y[i], to_float(x[i]));
  }
}

template <class T>
void accumulate(float* y, const T* x, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  accumulate_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(y, x, n);
  CUDA_CHECK_LAUNCH();
}

constexpr int kSumSquaresThreads = 512;

// Stage 1: kSumSquaresBlocks blocks, each a grid-stride sum of squares in double -> partials.
template <class T>
__global__ void sum_squares_partial_kernel(double* partials, const T* x, size_t n) {
  double acc = 0.0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const double xi = to_float(x[i]);
    acc += xi * xi;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Stage 2: one block adds the partials in a fixed order.
__global__ void sum_squares_final_kernel(double* out, const double* partials, int count) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    acc += partials[i];
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] = acc;
}

template <class T>
void sum_squares(double* out, double* scratch, const T* x, size_t n, cudaStream_t stream) {
  sum_squares_partial_kernel<<<kSumSquaresBlocks, kSumSquaresThreads, 0, stream>>>(scratch, x, n);
  CUDA_CHECK_LAUNCH();
  sum_squares_final_kernel<<<1, kSumSquaresThreads, 0, stream>>>(out, scratch, kSumSquaresBlocks);
  CUDA_CHECK_LAUNCH();
}

// flag[0] = 1 where any element is NaN or infinite. The flag is cleared first (on the stream);
// threads that find one all write the same 1, so the result does not depend on the order.
template <class T>
__global__ void any_nonfinite_kernel(int* flag, const T* x, size_t n) {
  int found = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    found |= is_nonfinite(x[i]) ? 1 : 0;
  }
  if (__syncthreads_or(found) && threadIdx.x == 0) *flag = 1;
}

template <class T>
void any_nonfinite(int* flag, const T* x, size_t n, cudaStream_t stream, bool clear) {
  if (clear) CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
  if (n == 0) return;
  any_nonfinite_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(flag, x, n);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                         \
  template void fill<T>(T*, size_t, double, cudaStream_t);                        \
  template void scale<T>(T*, size_t, double, cudaStream_t);                       \
  template void axpy<T>(T*, const T*, size_t, double, cudaStream_t);              \
  template void accumulate<T>(float*, const T*, size_t, cudaStream_t);            \
  template void sum_squares<T>(double*, double*, const T*, size_t, cudaStream_t); \
  template void any_nonfinite<T>(int*, const T*, size_t, cudaStream_t, bool);     \
  template void cast<T, float>(T*, const float*, size_t, cudaStream_t);           \
  template void cast<T, bf16>(T*, const bf16*, size_t, cudaStream_t);             \
  template void cast<T, f16>(T*, const f16*, size_t, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
