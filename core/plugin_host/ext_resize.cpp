// headroom.resize/1 (headroom/ext/resize.h): a block's MLP width and attention heads; keeping some
// of its units or heads, between steps.
#include <exception>
#include <stdexcept>
#include <vector>

#include "core/plugin_host/services.h"
#include "headroom/ext/resize.h"

namespace headroom {
namespace services {

constexpr Rule kResizeMlpWidth = {HR_EXT_RESIZE " mlp_width", kAnyone, When::kAnyTime,
                                  kAnswersValue};
static int32_t mlp_width(hr_host* h, int32_t layer) {
  Gpt<float>* m = run(h).model->built_model();
  if (!m || layer < 1 || layer > m->config().n_layer) return -1;
  return m->config().mlp_width(layer - 1);
}

// keep_mlp_units and keep_attn_heads: `resize` shrinks the block; its failures become the
// status the header names, with the message.
template <class Resize>
static hr_status keep_some(hr_host* h, const char* fn, const char* what, const uint32_t* keep,
                           uint32_t count, Resize&& resize) {
  LoadedPlugin& p = plugin(h);
  const std::string prefix = std::string(HR_EXT_RESIZE " ") + fn + ": ";
  if (!keep || count == 0) {
    p.error = prefix + "keep must name at least one " + what;
    return HR_ERROR_INVALID;
  }
  try {
    resize(p.entry.name, std::vector<uint32_t>(keep, keep + count));
    return HR_OK;
  } catch (const std::invalid_argument& e) {
    p.error = prefix + e.what();
    return HR_ERROR_INVALID;
  } catch (const ResizeRefused& e) {
    p.error = prefix + e.what();
    return HR_ERROR_UNSUPPORTED;
  } catch (const OutOfMemory& e) {
    p.run_failure = std::current_exception();
    p.error = prefix + e.what();
    return HR_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    p.error = prefix + e.what();
    return HR_ERROR;
  }
}

constexpr Rule kResizeKeepMlpUnits = {HR_EXT_RESIZE " keep_mlp_units", kAnyone, When::kBetweenSteps,
                                      kNotAllowed};
static hr_status keep_mlp_units(hr_host* h, int32_t layer, const uint32_t* keep, uint32_t count) {
  return keep_some(h, "keep_mlp_units", "unit", keep, count,
                   [&](const std::string& plugin, const std::vector<uint32_t>& k) {
                     run(h).resize->resize_mlp(plugin, layer, k);
                   });
}

constexpr Rule kResizeAttnHeads = {HR_EXT_RESIZE " attn_heads", kAnyone, When::kAnyTime,
                                   kAnswersValue};
static int32_t attn_heads(hr_host* h, int32_t layer) {
  Gpt<float>* m = run(h).model->built_model();
  if (!m || layer < 1 || layer > m->config().n_layer) return -1;
  return m->config().heads(layer - 1);
}

constexpr Rule kResizeKeepAttnHeads = {HR_EXT_RESIZE " keep_attn_heads", kAnyone,
                                       When::kBetweenSteps, kNotAllowed};
static hr_status keep_attn_heads(hr_host* h, int32_t layer, const uint32_t* keep, uint32_t count) {
  return keep_some(h, "keep_attn_heads", "head", keep, count,
                   [&](const std::string& plugin, const std::vector<uint32_t>& k) {
                     run(h).resize->resize_heads(plugin, layer, k);
                   });
}

extern const hr_ext_resize kResizeExtension;
const hr_ext_resize kResizeExtension = {sizeof(hr_ext_resize),
                                        0,
                                        checked<kResizeMlpWidth, mlp_width>,
                                        checked<kResizeKeepMlpUnits, keep_mlp_units>,
                                        checked<kResizeAttnHeads, attn_heads>,
                                        checked<kResizeKeepAttnHeads, keep_attn_heads>};

}  // namespace services
}  // namespace headroom
