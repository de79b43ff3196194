// headroom.ops/1 (headroom/ext/ops.h): element-wise device ops and the built-in AdamW's fused
// update on a plugin's buffers, for optimizers that run on the device. Every function checks its
// arguments, enqueues on the compute stream and returns: none waits for the device.
#include <string>

#include "core/plugin_host/services.h"
#include "headroom/ext/ops.h"

namespace headroom {
namespace services {

static_assert(HR_OP_ADD == uint32_t(BinaryOp::kAdd) && HR_OP_SUB == uint32_t(BinaryOp::kSub) &&
                  HR_OP_MUL == uint32_t(BinaryOp::kMul) && HR_OP_DIV == uint32_t(BinaryOp::kDiv) &&
                  HR_OP_MAX == uint32_t(BinaryOp::kMax) && HR_OP_MIN == uint32_t(BinaryOp::kMin),
              "HR_OP_* binary values are BinaryOp's");
static_assert(HR_OP_SIGN == uint32_t(UnaryOp::kSign) && HR_OP_SQRT == uint32_t(UnaryOp::kSqrt) &&
                  HR_OP_ABS == uint32_t(UnaryOp::kAbs) && HR_OP_NEG == uint32_t(UnaryOp::kNeg) &&
                  HR_OP_RECIPROCAL == uint32_t(UnaryOp::kReciprocal),
              "HR_OP_* unary values are UnaryOp's");

namespace {

// HR_ERROR_INVALID with "<fn>: <what>" as the plugin's error.
hr_status invalid(hr_host* h, const char* fn, const std::string& what) {
  plugin(h).error = std::string(HR_EXT_OPS " ") + fn + ": " + what;
  return HR_ERROR_INVALID;
}

bool float_dtype(uint32_t d) {
  return d == HR_DTYPE_F32 || d == HR_DTYPE_BF16 || d == HR_DTYPE_F16;
}

// Whether dtype is one the ops compute; sets the error when not.
bool check_dtype(hr_host* h, const char* fn, uint32_t dtype) {
  if (float_dtype(dtype)) return true;
  invalid(h, fn,
          "dtype " + std::to_string(dtype) + " is not HR_DTYPE_F32, HR_DTYPE_BF16 or HR_DTYPE_F16");
  return false;
}

// Whether every pointer is set (n > 0); sets the error naming the first that is not.
bool check_pointers(hr_host* h, const char* fn, uint64_t n,
                    std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  if (n == 0) return true;
  for (const auto& [name, p] : ptrs)
    if (!p) {
      invalid(h, fn, std::string(name) + " is NULL with n = " + std::to_string(n));
      return false;
    }
  return true;
}

}  // namespace

constexpr Rule kBinary = {HR_EXT_OPS " binary", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status binary(hr_host* h, uint32_t op, void* z, const void* x, const void* y,
                        uint32_t dtype, uint64_t n) {
  if (op > HR_OP_MIN)
    return invalid(h, "binary", "op " + std::to_string(op) + " is not HR_OP_ADD .. HR_OP_MIN");
  if (!check_dtype(h, "binary", dtype) ||
      !check_pointers(h, "binary", n, {{"z", z}, {"x", x}, {"y", y}}))
    return HR_ERROR_INVALID;
  if (n == 0) return HR_OK;
  return guarded(h,
                 [&] { run(h).device->backend().binary(BinaryOp(op), Dtype(dtype), z, x, y, n); });
}

constexpr Rule kUnary = {HR_EXT_OPS " unary", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status unary(hr_host* h, uint32_t op, void* y, const void* x, uint32_t dtype,
                       uint64_t n) {
  if (op > HR_OP_RECIPROCAL)
    return invalid(h, "unary",
                   "op " + std::to_string(op) + " is not HR_OP_SIGN .. HR_OP_RECIPROCAL");
  if (!check_dtype(h, "unary", dtype) || !check_pointers(h, "unary", n, {{"y", y}, {"x", x}}))
    return HR_ERROR_INVALID;
  if (n == 0) return HR_OK;
  return guarded(h, [&] { run(h).device->backend().unary(UnaryOp(op), Dtype(dtype), y, x, n); });
}

constexpr Rule kLerp = {HR_EXT_OPS " lerp", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status lerp(hr_host* h, void* z, const void* x, const void* y, double w, uint32_t dtype,
                      uint64_t n) {
  if (!check_dtype(h, "lerp", dtype) ||
      !check_pointers(h, "lerp", n, {{"z", z}, {"x", x}, {"y", y}}))
    return HR_ERROR_INVALID;
  if (n == 0) return HR_OK;
  return guarded(
      h, [&] { run(h).device->backend().lerp(Dtype(dtype), z, x, y, static_cast<float>(w), n); });
}

constexpr Rule kAffine = {HR_EXT_OPS " affine", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status affine(hr_host* h, void* y, const void* x, double a, double b, uint32_t dtype,
                        uint64_t n) {
  if (!check_dtype(h, "affine", dtype) || !check_pointers(h, "affine", n, {{"y", y}, {"x", x}}))
    return HR_ERROR_INVALID;
  if (n == 0) return HR_OK;
  return guarded(h, [&] {
    run(h).device->backend().affine(Dtype(dtype), y, x, static_cast<float>(a),
                                    static_cast<float>(b), n);
  });
}

constexpr Rule kAdamw = {HR_EXT_OPS " adamw", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status adamw(hr_host* h, void* param, const void* grad, void* m, void* v, uint64_t n,
                       uint32_t param_dtype, uint32_t grad_dtype, uint32_t state_dtype, double lr,
                       double beta1, double beta2, double eps, double weight_decay, int64_t step,
                       uint32_t seed) {
  const auto stored = [](uint32_t d) { return d == HR_DTYPE_F32 || d == HR_DTYPE_BF16; };
  if (!stored(param_dtype) || !stored(grad_dtype) || !stored(state_dtype))
    return invalid(h, "adamw",
                   "param_dtype, grad_dtype and state_dtype must each be HR_DTYPE_F32 or "
                   "HR_DTYPE_BF16 (got " +
                       std::to_string(param_dtype) + ", " + std::to_string(grad_dtype) + ", " +
                       std::to_string(state_dtype) + ")");
  if (step < 1)
    return invalid(h, "adamw", "step " + std::to_string(step) + " is not 1-based (>= 1)");
  if (!check_pointers(h, "adamw", n, {{"param", param}, {"grad", grad}, {"m", m}, {"v", v}}))
    return HR_ERROR_INVALID;
  if (n == 0) return HR_OK;
  Backend::Stored o;
  o.param = Dtype(param_dtype);
  o.grad = Dtype(grad_dtype);
  o.state = Dtype(state_dtype);
  o.seed = seed;
  // The built-in AdamW's call (core/optim/optim.cpp): its scalars in float, the same function.
  return guarded(h, [&] {
    run(h).device->backend().adamw_update_stored(
        o, param, grad, m, v, n, static_cast<float>(lr), static_cast<float>(beta1),
        static_cast<float>(beta2), static_cast<float>(eps), static_cast<float>(weight_decay), step);
  });
}

extern const hr_ext_ops kOpsExtension;
const hr_ext_ops kOpsExtension = {sizeof(hr_ext_ops),       0,
                                  checked<kBinary, binary>, checked<kUnary, unary>,
                                  checked<kLerp, lerp>,     checked<kAffine, affine>,
                                  checked<kAdamw, adamw>};

}  // namespace services
}  // namespace headroom
