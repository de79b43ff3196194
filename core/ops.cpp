#include "core/ops.h"

#include <cmath>
#include <cstring>
#include <string>

#include "kernels/common/dtype.h"

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
  switch (d) {
    case Dtype::kF32:
      return 4;
    case Dtype::kBF16:
      return 2;
    case Dtype::kF16:
      return 2;
    case Dtype::kF64:
      return 8;
    case Dtype::kI32:
      return 4;
  }
  return 0;
}

namespace ops {
namespace {

// The CPU backend is the only one so far; the CUDA backend adds its own dispatch here.
void require_cpu(const Device& device, const char* op) {
  if (device.kind() != "cpu")
    throw OpError(std::string(op) + ": not available on the " + device.kind() + " backend");
}

// Reads element i of x as a double, for the floating-point dtypes.
double load(const void* x, Dtype d, uint64_t i) {
  switch (d) {
    case Dtype::kF32:
      return static_cast<const float*>(x)[i];
    case Dtype::kF64:
      return static_cast<const double*>(x)[i];
    case Dtype::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(x)[i]);
    case Dtype::kF16:
      return f16_to_float(static_cast<const uint16_t*>(x)[i]);
    case Dtype::kI32:
      return static_cast<const int32_t*>(x)[i];
  }
  return 0.0;
}

void store(void* x, Dtype d, uint64_t i, double v) {
  switch (d) {
    case Dtype::kF32:
      static_cast<float*>(x)[i] = static_cast<float>(v);
      return;
    case Dtype::kF64:
      static_cast<double*>(x)[i] = v;
      return;
    // Through float first, as the storage formats are defined from it.
    case Dtype::kBF16:
      static_cast<uint16_t*>(x)[i] = float_to_bf16(static_cast<float>(v));
      return;
    case Dtype::kF16:
      static_cast<uint16_t*>(x)[i] = float_to_f16(static_cast<float>(v));
      return;
    case Dtype::kI32:
      static_cast<int32_t*>(x)[i] = static_cast<int32_t>(v);
      return;
  }
}

void require_dtype(Dtype d, const char* op) {
  if (dtype_size(d) == 0)
    throw OpError(std::string(op) + ": unknown dtype " + std::to_string(uint32_t(d)));
}

void require_float(Dtype d, const char* op) {
  require_dtype(d, op);
  if (d == Dtype::kI32) throw OpError(std::string(op) + ": needs a floating-point dtype, got i32");
}

}  // namespace

void fill(Device& device, void* x, Dtype dtype, uint64_t n, double value) {
  require_cpu(device, "fill");
  require_dtype(dtype, "fill");
  for (uint64_t i = 0; i < n; ++i)
    store(x, dtype, i, value);
}

void copy(Device& device, void* dst, const void* src, uint64_t bytes) {
  require_cpu(device, "copy");
  std::memmove(dst, src, bytes);
}

void cast(Device& device, void* dst, Dtype dst_dtype, const void* src, Dtype src_dtype,
          uint64_t n) {
  require_cpu(device, "cast");
  require_dtype(dst_dtype, "cast");
  require_dtype(src_dtype, "cast");
  if (dst_dtype == src_dtype) {
    std::memmove(dst, src, n * dtype_size(dst_dtype));
    return;
  }
  for (uint64_t i = 0; i < n; ++i)
    store(dst, dst_dtype, i, load(src, src_dtype, i));
}

void scale(Device& device, void* x, Dtype dtype, uint64_t n, double s) {
  require_cpu(device, "scale");
  require_float(dtype, "scale");
  if (dtype == Dtype::kF32) {
    float* f = static_cast<float*>(x);
    const float fs = static_cast<float>(s);
    for (uint64_t i = 0; i < n; ++i)
      f[i] *= fs;
    return;
  }
  for (uint64_t i = 0; i < n; ++i)
    store(x, dtype, i, load(x, dtype, i) * s);
}

void axpy(Device& device, void* y, const void* x, Dtype dtype, uint64_t n, double a) {
  require_cpu(device, "axpy");
  require_float(dtype, "axpy");
  if (dtype == Dtype::kF32) {
    float* fy = static_cast<float*>(y);
    const float* fx = static_cast<const float*>(x);
    const float fa = static_cast<float>(a);
    for (uint64_t i = 0; i < n; ++i)
      fy[i] += fa * fx[i];
    return;
  }
  for (uint64_t i = 0; i < n; ++i)
    store(y, dtype, i, load(y, dtype, i) + a * load(x, dtype, i));
}

double sum_squares(Device& device, const void* x, Dtype dtype, uint64_t n) {
  require_cpu(device, "sum_squares");
  require_float(dtype, "sum_squares");
  double s = 0.0;
  for (uint64_t i = 0; i < n; ++i) {
    const double v = load(x, dtype, i);
    s += v * v;
  }
  return s;
}

bool any_nonfinite(Device& device, const void* x, Dtype dtype, uint64_t n) {
  require_cpu(device, "nonfinite");
  require_float(dtype, "nonfinite");
  for (uint64_t i = 0; i < n; ++i)
    if (!std::isfinite(load(x, dtype, i))) return true;
  return false;
}

}  // namespace ops
}  // namespace headroom
