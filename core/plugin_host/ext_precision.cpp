// headroom.precision/1 (headroom/ext/precision.h): the compute dtype and the loss scale, set and
// read (the setters are the 1.4 table's, services_v1.cpp); appended: the state layout's setters and
// getters, and one fused overflow check over many tensors.
#include <vector>

#include "core/plugin_host/services.h"
#include "headroom/ext/precision.h"

namespace headroom {
namespace services {

// The 1.4 table's setters (services_v1.cpp), under this extension's rules.
constexpr Rule kSetComputeDtype = {HR_EXT_PRECISION " set_compute_dtype", kAnyone, When::kCreate,
                                   kNotAllowed};
constexpr Rule kSetLossScale = {HR_EXT_PRECISION " set_loss_scale", kAnyone, When::kAnyTime,
                                kNotAllowed};

constexpr Rule kComputeDtype = {HR_EXT_PRECISION " compute_dtype", kAnyone, When::kAnyTime,
                                kNotAllowed};
static uint32_t compute_dtype(hr_host* h) {
  return uint32_t(run(h).precision->precision().compute);
}

constexpr Rule kLossScale = {HR_EXT_PRECISION " loss_scale", kAnyone, When::kAnyTime, kNotAllowed};
static double loss_scale(hr_host* h) {
  return step_loss_scale(h);
}

// The state layout: each setter changes one field of the run's Precision.
template <class F>
static hr_status change_precision(hr_host* h, const char* fn, F&& change) {
  LoadedPlugin& p = plugin(h);
  try {
    Precision q = run(h).precision->precision();
    change(q);
    run(h).precision->set_precision(p.entry.name, q);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string(fn) + ": " + e.what();
    return HR_ERROR_INVALID;
  }
}

constexpr Rule kSetGradDtype = {HR_EXT_PRECISION " set_grad_dtype", kAnyone, When::kCreate,
                                kNotAllowed};
static hr_status set_grad_dtype(hr_host* h, uint32_t dtype) {
  return change_precision(h, "set_grad_dtype", [&](Precision& q) {
    if (dtype != HR_DTYPE_F32 && dtype != uint32_t(q.compute))
      throw std::invalid_argument("gradients accumulate in f32 or in the compute dtype (" +
                                  std::string(dtype_name(q.compute)) + "), not dtype " +
                                  std::to_string(dtype));
    q.grad_in_compute = dtype != HR_DTYPE_F32;
  });
}

constexpr Rule kSetMasterWeights = {HR_EXT_PRECISION " set_master_weights", kAnyone, When::kCreate,
                                    kNotAllowed};
static hr_status set_master_weights(hr_host* h, int32_t keep) {
  return change_precision(h, "set_master_weights", [&](Precision& q) { q.masters = keep != 0; });
}

constexpr Rule kSetStateDtype = {HR_EXT_PRECISION " set_state_dtype", kAnyone, When::kCreate,
                                 kNotAllowed};
static hr_status set_state_dtype(hr_host* h, uint32_t dtype) {
  return change_precision(h, "set_state_dtype", [&](Precision& q) {
    if (dtype != HR_DTYPE_F32 && dtype != HR_DTYPE_BF16)
      throw std::invalid_argument("the optimizer state is f32 or bf16, not dtype " +
                                  std::to_string(dtype));
    q.state = Dtype(dtype);
  });
}

constexpr Rule kGradDtype = {HR_EXT_PRECISION " grad_dtype", kAnyone, When::kAnyTime, kNotAllowed};
static uint32_t grad_dtype(hr_host* h) {
  const Precision q = run(h).precision->precision();
  return q.grad_in_compute ? uint32_t(q.compute) : uint32_t(HR_DTYPE_F32);
}

constexpr Rule kMasterWeights = {HR_EXT_PRECISION " master_weights", kAnyone, When::kAnyTime,
                                 kAnswersValue};
static int32_t master_weights(hr_host* h) {
  return run(h).precision->precision().masters ? 1 : 0;
}

constexpr Rule kStateDtype = {HR_EXT_PRECISION " state_dtype", kAnyone, When::kAnyTime,
                              kNotAllowed};
static uint32_t state_dtype(hr_host* h) {
  return uint32_t(run(h).precision->precision().state);
}

constexpr Rule kNonfiniteMany = {HR_EXT_PRECISION " nonfinite_many", kAnyone, When::kAnyTime,
                                 kNotAllowed};
static hr_status nonfinite_many(hr_host* h, uint64_t count, const void* const* data,
                                const uint32_t* dtypes, const uint64_t* numels, int32_t* out) {
  if (!out || (count > 0 && (!data || !dtypes || !numels))) return HR_ERROR_INVALID;
  return guarded(h, [&] {
    // Each span by its place's ops (an offloaded gradient shard is host memory).
    Device& device = *run(h).device;
    std::vector<Backend::Span> on_device, on_host;
    for (uint64_t i = 0; i < count; ++i) {
      const Device* host = device.host_place();
      (host && host->contains(data[i]) ? on_host : on_device)
          .push_back({Dtype(dtypes[i]), data[i], numels[i]});
    }
    bool any = !on_device.empty() && device.backend().any_nonfinite_many(on_device);
    if (!any && !on_host.empty()) any = device.host_place()->backend().any_nonfinite_many(on_host);
    *out = any ? 1 : 0;
  });
}

extern const hr_ext_precision kPrecisionExtension;
const hr_ext_precision kPrecisionExtension = {sizeof(hr_ext_precision),
                                              0,
                                              checked<kSetComputeDtype, set_compute_dtype>,
                                              checked<kSetLossScale, set_loss_scale>,
                                              checked<kComputeDtype, compute_dtype>,
                                              checked<kLossScale, loss_scale>,
                                              checked<kSetGradDtype, set_grad_dtype>,
                                              checked<kSetMasterWeights, set_master_weights>,
                                              checked<kSetStateDtype, set_state_dtype>,
                                              checked<kGradDtype, grad_dtype>,
                                              checked<kMasterWeights, master_weights>,
                                              checked<kStateDtype, state_dtype>,
                                              checked<kNonfiniteMany, nonfinite_many>};

}  // namespace services
}  // namespace headroom
