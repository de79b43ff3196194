// For in-tree plugins written in C++: offering headroom.estimate/1 (headroom/ext/estimate.h).
// offer_estimate<f> is a descriptor's get_extension that returns the table of one estimate
// function; nothing f throws crosses the C ABI. An estimate may run for a plugin that was never
// created, with no host services to hand a message to: a throw is a plain HR_ERROR, which the
// advice reports as "no estimate".
#pragma once

#include <cstring>

#include "headroom/ext/estimate.h"
#include "headroom/plugin.h"

namespace headroom_plugin {

using EstimateFn = hr_status (*)(void* instance, const hr_estimate_query* query,
                                 hr_estimate_result* result);

template <EstimateFn F>
hr_status estimate_noexcept(void* instance, const hr_estimate_query* query,
                            hr_estimate_result* result) noexcept {
  try {
    return F(instance, query, result);
  } catch (...) {
    return HR_ERROR;
  }
}

template <EstimateFn F>
inline constexpr hr_ext_estimate kEstimateExtension = {sizeof(hr_ext_estimate), 0,
                                                       estimate_noexcept<F>};

template <EstimateFn F>
const void* offer_estimate(const char* id) {
  return id && std::strcmp(id, HR_EXT_ESTIMATE) == 0 ? &kEstimateExtension<F> : nullptr;
}

}  // namespace headroom_plugin
