/* headroom.ops/1 — element-wise device ops for optimizers that run on the device (ABI 1.7).
 *
 * What a third-party optimizer (Lion, a variant of Adam) needs to update its parameters and state
 * where they live, without staging them through headroom.tensors/1 read/write: element-wise
 * binary and unary ops, lerp, an affine map, and the built-in AdamW's fused update on buffers the
 * plugin names. Together with the 1.4 services (op_fill, op_copy, op_cast, op_scale, op_axpy,
 * which this extension does not repeat) and buffers from services->alloc, an optimizer step needs
 * no host wait at all.
 *
 * Every function:
 *   - Thread: the training thread, from any hook (it allocates nothing).
 *   - Stream: the compute stream, asynchronous: it enqueues its work and returns without waiting
 *     for the device. Its results are visible to later ops on the stream, to the host's own work
 *     and to headroom.tensors/1 read() (which waits). It adds no host synchronisation.
 *   - Operands: n elements of `dtype` in device memory (from services->alloc, layer_param, ...);
 *     dtype is HR_DTYPE_F32, HR_DTYPE_BF16 or HR_DTYPE_F16. The math is f32: 16-bit inputs are
 *     widened exactly, results rounded to the dtype to nearest even. With f32 the CPU backend
 *     computes each element with the f32 operations written below, one rounding each (no fused
 *     multiply-add); the CUDA backend computes the same, bitwise.
 *   - Aliasing: an output may be the very buffer of any input (in place), never a partial
 *     overlap of one.
 *   - n = 0 does nothing (the pointers may then be NULL).
 *   - Errors: HR_ERROR_INVALID, with a message (the host reports it), for a NULL pointer with n >
 *     0, a dtype or an op outside the lists here; HR_ERROR for a device failure. */
#ifndef HEADROOM_EXT_OPS_H
#define HEADROOM_EXT_OPS_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_OPS "headroom.ops/1"

/* binary()'s `op`: z = x op y. */
#define HR_OP_ADD 0 /* x + y */
#define HR_OP_SUB 1 /* x - y */
#define HR_OP_MUL 2 /* x * y */
#define HR_OP_DIV 3 /* x / y (IEEE: x / 0 is +-infinity or NaN) */
#define HR_OP_MAX 4 /* the larger; NaN when either is NaN */
#define HR_OP_MIN 5 /* the smaller; NaN when either is NaN */

/* unary()'s `op`: y = op(x). */
#define HR_OP_SIGN 0       /* -1, 0 or 1 (0 for +-0; NaN for NaN) */
#define HR_OP_SQRT 1       /* sqrt(x), correctly rounded; NaN for x < 0 */
#define HR_OP_ABS 2        /* |x| */
#define HR_OP_NEG 3        /* -x */
#define HR_OP_RECIPROCAL 4 /* 1 / x */

typedef struct hr_ext_ops {
  uint32_t struct_size;
  uint32_t reserved0;
  /* z = x op y, element by element (op: HR_OP_ADD .. HR_OP_MIN). */
  hr_status (*binary)(hr_host* host, uint32_t op, void* z, const void* x, const void* y,
                      uint32_t dtype, uint64_t n);
  /* y = op(x), element by element (op: HR_OP_SIGN .. HR_OP_RECIPROCAL). */
  hr_status (*unary)(hr_host* host, uint32_t op, void* y, const void* x, uint32_t dtype,
                     uint64_t n);
  /* z = x + w * (y - x) with w = (float)w: f32 y - x, then the product, then the sum, each
   * rounded (torch.lerp's weight form; Lion's and Adam's moment update with w = beta). */
  hr_status (*lerp)(hr_host* host, void* z, const void* x, const void* y, double w, uint32_t dtype,
                    uint64_t n);
  /* y = a * x + b with a = (float)a, b = (float)b: the product, then the sum, each rounded (a
   * scalar added, eps, a decay factor). */
  hr_status (*affine)(hr_host* host, void* y, const void* x, double a, double b, uint32_t dtype,
                      uint64_t n);
  /* One step of the built-in AdamW (torch.optim.AdamW: decoupled weight decay) on n elements:
   * param, m and v are updated in place from grad; step is the 1-based step (the bias
   * corrections). Exactly what the built-in optimizer computes for the same operands (the same
   * backend function): bitwise on the CPU backend. param_dtype, grad_dtype and state_dtype (m and
   * v) are each HR_DTYPE_F32 or HR_DTYPE_BF16 (amp's layouts); bf16 param and state are stored
   * rounded stochastically with noise from `seed` (ignored when all three are f32). param, m and
   * v must not overlap one another or grad. HR_ERROR_INVALID also for step < 1. */
  hr_status (*adamw)(hr_host* host, void* param, const void* grad, void* m, void* v, uint64_t n,
                     uint32_t param_dtype, uint32_t grad_dtype, uint32_t state_dtype, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step,
                     uint32_t seed);
} hr_ext_ops;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_OPS_H */
