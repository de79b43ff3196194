// headroom.adapters/1 (headroom/ext/adapters.h): LoRA adapters a plugin adds while created.
#include <stdexcept>
#include <string>

#include "core/plugin_host/services.h"
#include "headroom/ext/adapters.h"

namespace headroom {
namespace services {

constexpr Rule kAddLora = {HR_EXT_ADAPTERS " add_lora", kAnyone, When::kCreate, kNotAllowed};
static hr_status add_lora(hr_host* h, const hr_lora_spec* spec) {
  LoadedPlugin& p = plugin(h);
  const std::string fn = HR_EXT_ADAPTERS " add_lora: ";
  if (!spec || !spec->target) {
    p.error = fn + (spec ? "spec->target" : "spec") + " must not be NULL";
    return HR_ERROR_INVALID;
  }
  LoraSpec s;
  s.target = spec->target;
  s.rank = int(spec->rank);
  s.alpha = spec->alpha;
  if (HR_HAS_FIELD(spec, hr_lora_spec, dropout)) s.dropout = spec->dropout;
  try {
    run(h).adapters->add_lora(p.entry.name, s);
    return HR_OK;
  } catch (const std::invalid_argument& e) {
    if (spec->key) {
      p.error = key_where(p, spec->key) + ": " + e.what();
      return HR_ERROR_CONFIG;
    }
    p.error = fn + e.what();
    return HR_ERROR_INVALID;
  } catch (const std::logic_error& e) {
    p.error = fn + e.what();
    return HR_ERROR_NOT_ALLOWED;
  }
}

constexpr Rule kSetBase = {HR_EXT_ADAPTERS " set_base", kAnyone, When::kCreate, kNotAllowed};
static hr_status set_base(hr_host* h, const hr_base_spec* spec) {
  LoadedPlugin& p = plugin(h);
  const std::string fn = HR_EXT_ADAPTERS " set_base: ";
  if (!spec || !spec->dtype) {
    p.error = fn + (spec ? "spec->dtype" : "spec") + " must not be NULL";
    return HR_ERROR_INVALID;
  }
  try {
    const QuantKind k = parse_base_dtype(spec->dtype);
    run(h).adapters->set_base(p.entry.name, k, spec->double_quant != 0);
    return HR_OK;
  } catch (const std::invalid_argument& e) {
    if (spec->key) {
      p.error = key_where(p, spec->key) + ": " + e.what();
      return HR_ERROR_CONFIG;
    }
    p.error = fn + e.what();
    return HR_ERROR_INVALID;
  } catch (const std::logic_error& e) {
    p.error = fn + e.what();
    return HR_ERROR_NOT_ALLOWED;
  }
}

extern const hr_ext_adapters kAdaptersExtension;
const hr_ext_adapters kAdaptersExtension = {sizeof(hr_ext_adapters), 0, checked<kAddLora, add_lora>,
                                            checked<kSetBase, set_base>};

}  // namespace services
}  // namespace headroom
