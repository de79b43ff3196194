// Storage dtypes: names and sizes.
#include "core/device/backend.h"

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

}  // namespace headroom
