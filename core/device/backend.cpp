// Storage dtypes: names and sizes.
#include "core/device/backend.h"

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

}  // namespace headroom
