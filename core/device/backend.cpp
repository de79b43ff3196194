// Storage dtypes: names and sizes.
#include "core/device/backend.h"

#include <string>

#include "plugins/common/units.h"

namespace headroom {

const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::kF32:
      return "f32";
    case Dtype::kBF16:
      return "bf16";
    case Dtype::kF16:
      return "f16";
    case Dtype::kF64:
      return "f64";
    case Dtype::kI32:
      return "i32";
  }
  return "unknown";
}

uint64_t dtype_size(Dtype d) {
  return headroom_units::dtype_size(static_cast<uint32_t>(d));
}

namespace {

[[noreturn]] void no_llama_kernel(const char* op) {
  throw OpError(std::string(op) +
                ": this backend has no kernel for it (arch = \"llama\" runs on "
                "the CPU and CUDA backends)");
}

}  // namespace

void Backend::gelu_backward_bias(Dtype dt, void* dinp, void* dbias, const void* inp,
                                 const void* dout, int N, int OC) {
  gelu_backward(dt, dinp, inp, dout, uint64_t(N) * OC, Grad::kWrite);
  // The bias gradient alone (no input or weight gradient: C is not read; 1 passes the size checks).
  if (dbias) matmul_backward(dt, nullptr, nullptr, dbias, dinp, nullptr, nullptr, N, 1, OC);
}
void Backend::residual_layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, void* res,
                                         const void* x, const void* weight, const void* bias, int N,
                                         int C) {
  add_inplace(dt, res, x, uint64_t(N) * C);
  layernorm_forward(dt, out, mean, rstd, res, weight, bias, N, C);
}
void Backend::rmsnorm_forward(Dtype, void*, void*, const void*, const void*, int, int, double) {
  no_llama_kernel("rmsnorm_forward");
}
void Backend::rmsnorm_backward(Dtype, void*, void*, const void*, const void*, const void*,
                               const void*, int, int, Grad, const void*) {
  no_llama_kernel("rmsnorm_backward");
}
void Backend::swiglu_forward(Dtype, void*, const void*, int, int) {
  no_llama_kernel("swiglu_forward");
}
void Backend::swiglu_backward(Dtype, void*, const void*, const void*, int, int, Grad) {
  no_llama_kernel("swiglu_backward");
}
void Backend::rope_forward(Dtype, void*, int, int, int, int, int, const RopeParams&) {
  no_llama_kernel("rope_forward");
}
void Backend::rope_backward(Dtype, void*, int, int, int, int, int, const RopeParams&) {
  no_llama_kernel("rope_backward");
}
void Backend::attention_gqa_forward(Dtype dt, void* out, void* lse, const void* qkv, int B, int T,
                                    int C, int NH, int NKV) {
  if (NKV != NH) no_llama_kernel("attention_gqa_forward (NKV < NH)");
  attention_tiled_forward(dt, out, lse, qkv, B, T, C, NH);
}
void Backend::attention_gqa_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                                     const void* out, const void* lse, int B, int T, int C, int NH,
                                     int NKV) {
  if (NKV != NH) no_llama_kernel("attention_gqa_backward (NKV < NH)");
  attention_tiled_backward(dt, dqkv, dout, qkv, out, lse, B, T, C, NH);
}

}  // namespace headroom
