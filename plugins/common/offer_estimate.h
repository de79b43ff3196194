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

// A plugin's documented modes (hr_ext_estimate.modes): `static constexpr hr_estimate_mode
// kModes[] = {mode("policy every", ""), ...};` and offer_estimate<f, kModes>.
constexpr hr_estimate_mode mode(const char* what, const char* toml) {
  return {sizeof(hr_estimate_mode), 0, what, toml};
}

template <EstimateFn F, const hr_estimate_mode* Modes = nullptr, uint32_t N = 0>
inline constexpr hr_ext_estimate kEstimateExtension = {
    sizeof(hr_ext_estimate), 0, estimate_noexcept<F>, N, 0, Modes};

template <EstimateFn F>
const void* offer_estimate(const char* id) {
  return id && std::strcmp(id, HR_EXT_ESTIMATE) == 0 ? &kEstimateExtension<F> : nullptr;
}

// The same with its modes.
template <EstimateFn F, const auto& Modes>
const void* offer_estimate_modes(const char* id) {
  constexpr uint32_t n = sizeof(Modes) / sizeof(Modes[0]);
  return id && std::strcmp(id, HR_EXT_ESTIMATE) == 0 ? &kEstimateExtension<F, Modes, n> : nullptr;
}

}  // namespace headroom_plugin
