// headroom.adapters/1 (headroom/ext/adapters.h): LoRA adapters a plugin adds while created.
#include <stdexcept>
#include <string>

#include "core/plugin_host/services.h"
#include "headroom/ext/adapters.h"

namespace headroom {
namespace services {

// The adapters' choices (RunChoices) throw std::invalid_argument for a bad value — a config error
// at the plugin's `key` when it gave one — and std::logic_error for a call out of turn.
template <class F>
static hr_status choose(hr_host* h, const char* fn, const char* key, F&& f) {
  LoadedPlugin& p = plugin(h);
  try {
    f(run(h));
    return HR_OK;
  } catch (const std::invalid_argument& e) {
    if (key) {
      p.error = key_where(p, key) + ": " + e.what();
      return HR_ERROR_CONFIG;
    }
    p.error = std::string(fn) + e.what();
    return HR_ERROR_INVALID;
  } catch (const std::logic_error& e) {
    p.error = std::string(fn) + e.what();
    return HR_ERROR_NOT_ALLOWED;
  }
}

constexpr Rule kAddLora = {HR_EXT_ADAPTERS " add_lora", kAnyone, When::kCreate, kNotAllowed};
static hr_status add_lora(hr_host* h, const hr_lora_spec* spec) {
  const char* fn = HR_EXT_ADAPTERS " add_lora: ";
  if (!spec || !spec->target) {
    plugin(h).error = std::string(fn) + (spec ? "spec->target" : "spec") + " must not be NULL";
    return HR_ERROR_INVALID;
  }
  LoraSpec s;
  s.target = spec->target;
  s.rank = int(spec->rank);
  s.alpha = spec->alpha;
  if (HR_HAS_FIELD(spec, hr_lora_spec, dropout)) s.dropout = spec->dropout;
  const std::string& name = plugin(h).entry.name;
  return choose(h, fn, spec->key, [&](const RunInterfaces& r) { r.adapters->add_lora(name, s); });
}

constexpr Rule kSetBase = {HR_EXT_ADAPTERS " set_base", kAnyone, When::kCreate, kNotAllowed};
static hr_status set_base(hr_host* h, const hr_base_spec* spec) {
  const char* fn = HR_EXT_ADAPTERS " set_base: ";
  if (!spec || !spec->dtype) {
    plugin(h).error = std::string(fn) + (spec ? "spec->dtype" : "spec") + " must not be NULL";
    return HR_ERROR_INVALID;
  }
  const std::string& name = plugin(h).entry.name;
  return choose(h, fn, spec->key, [&](const RunInterfaces& r) {
    r.adapters->set_base(name, parse_base_dtype(spec->dtype), spec->double_quant != 0);
  });
}

extern const hr_ext_adapters kAdaptersExtension;
const hr_ext_adapters kAdaptersExtension = {sizeof(hr_ext_adapters), 0, checked<kAddLora, add_lora>,
                                            checked<kSetBase, set_base>};

}  // namespace services
}  // namespace headroom
