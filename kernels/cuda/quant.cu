// Dequantizing a frozen weight (QLoRA's storage: NF4, bitsandbytes' dynamic 8-bit, bf16) into a
// compute-dtype transient before each GEMM that reads it; the layout, tables and per-element math
// are kernels/common/quant.h's, the same the CPU reference (kernels/cpu/quant.h) computes. Never
// run on a GPU yet: the op tests (tests/cuda_ops_test.cpp) skip without one.
#include "kernels/common/quant.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// The two code tables, passed by value (1.1 KB of kernel parameters, under the 4 KB limit).
struct QuantTables {
  Nf4Table nf4;
  DynamicMap dyn;
};

// out (n): one thread an element, grid-stride.
template <class T>
__global__ void dequantize_kernel(T* out, const unsigned char* q, QuantKind kind, bool double_quant,
                                  size_t n, QuantTables tables) {
  const QuantLayout l = quant_layout(kind, n, double_quant);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = from_float<T>(quant_element(kind, q, l, double_quant, tables.nf4.v, tables.dyn.v, i));
  }
}

template <class T>
void dequantize(T* out, const unsigned char* q, uint32_t kind, bool double_quant, size_t n,
                cudaStream_t stream) {
  if (n == 0) return;
  const QuantKind k = static_cast<QuantKind>(kind);
  if (k != QuantKind::kBF16 && k != QuantKind::kInt8 && k != QuantKind::kNF4)
    throw std::invalid_argument("dequantize: no quantized kind " + std::to_string(kind));
  const QuantTables tables = {nf4_table(), dynamic_map()};
  const int block = 256;
  dequantize_kernel<<<grid_for(n, block), block, 0, stream>>>(out, q, k, double_quant, n, tables);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T) \
  template void dequantize<T>(T*, const unsigned char*, uint32_t, bool, size_t, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
