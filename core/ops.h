// Device ops on the current backend, over raw device memory of a storage dtype: what plugins get
// through the services table (fill, copy, cast, scale, axpy, sum of squares, non-finite check).
// Each throws OpError for a dtype or combination the backend does not have.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "core/device.h"

namespace headroom {

enum class Dtype : uint32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kI32 = 4 };
const char* dtype_name(Dtype d);
uint64_t dtype_size(Dtype d);  // 0 for a value outside the enum

class OpError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace ops {

void fill(Device& device, void* x, Dtype dtype, uint64_t n, double value);
void copy(Device& device, void* dst, const void* src, uint64_t bytes);
// Converts n elements; float -> bf16 / fp16 rounds to nearest even.
void cast(Device& device, void* dst, Dtype dst_dtype, const void* src, Dtype src_dtype, uint64_t n);
void scale(Device& device, void* x, Dtype dtype, uint64_t n, double s);
void axpy(Device& device, void* y, const void* x, Dtype dtype, uint64_t n, double a);  // y += a x
double sum_squares(Device& device, const void* x, Dtype dtype, uint64_t n);
bool any_nonfinite(Device& device, const void* x, Dtype dtype, uint64_t n);

}  // namespace ops
}  // namespace headroom
