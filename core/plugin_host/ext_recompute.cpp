// headroom.recompute/1 (headroom/ext/recompute.h): drop a block's activations (the 1.4 table's
// drop_activations, services_v1.cpp, refused here as HR_ERROR_NOT_ALLOWED), and the bytes a layer
// holds.
#include "core/plugin_host/services.h"
#include "headroom/ext/recompute.h"

namespace headroom {
namespace services {

// The 1.4 table's drop_activations (services_v1.cpp), under this extension's rule.
constexpr Rule kDropActivations = {HR_EXT_RECOMPUTE " drop_activations", kAnyone,
                                   When::kForwardEndOfLayer, kNotAllowed};

constexpr Rule kLayerActivationBytes = {HR_EXT_RECOMPUTE " layer_activation_bytes", kAnyone,
                                        When::kAnyTime, kNotAllowed};
static uint64_t layer_activation_bytes(hr_host* h, int32_t index) {
  Layer<float>* l = layer(h, index);
  if (!l) return 0;
  uint64_t bytes = 0;
  for (const SavedActivation& a : l->saved())
    if (a.buffer) bytes += a.buffer.bytes();
  return bytes;
}

extern const hr_ext_recompute kRecomputeExtension;
const hr_ext_recompute kRecomputeExtension = {
    sizeof(hr_ext_recompute), 0, checked<kDropActivations, drop_activations>,
    checked<kLayerActivationBytes, layer_activation_bytes>};

}  // namespace services
}  // namespace headroom
