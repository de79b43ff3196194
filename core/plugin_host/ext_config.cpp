// headroom.config/1 (headroom/ext/config.h): the plugin's own table's arrays of strings.
#include <cstring>
#include <string>
#include <vector>

#include "core/config/toml_type_name.h"
#include "core/plugin_host/services.h"
#include "headroom/ext/config.h"

namespace headroom {
namespace services {

namespace {

// key's node, marked as asked for (no unknown key); nullptr when absent.
const toml::node* lookup_key(hr_host* h, const char* key) {
  LoadedPlugin& p = plugin(h);
  p.asked.insert(key);
  return p.table.get(key);
}

// key's strings, or HR_ERROR_CONFIG with a message naming it (and the element that is none).
hr_status strings_of(hr_host* h, const char* key, std::vector<const std::string*>* out) {
  LoadedPlugin& p = plugin(h);
  if (!key) {
    p.error = HR_EXT_CONFIG ": key must not be NULL";
    return HR_ERROR_INVALID;
  }
  const toml::node* n = lookup_key(h, key);
  out->clear();
  if (!n) return HR_OK;
  if (n->is_string()) {
    out->push_back(&n->as_string()->get());
    return HR_OK;
  }
  const toml::array* arr = n->as_array();
  if (!arr) {
    p.error =
        key_where(p, key) + ": expected an array of strings, got " + type_name_with_article(*n);
    return HR_ERROR_CONFIG;
  }
  for (size_t i = 0; i < arr->size(); ++i) {
    const toml::node& e = *arr->get(i);
    if (!e.is_string()) {
      p.error = key_where(p, key) + ": entry " + std::to_string(i + 1) + " is " +
                type_name_with_article(e) + ", expected a string";
      return HR_ERROR_CONFIG;
    }
    out->push_back(&e.as_string()->get());
  }
  return HR_OK;
}

}  // namespace

constexpr Rule kStringCount = {HR_EXT_CONFIG " string_count", kAnyone, When::kCreate, kNotAllowed};
static hr_status string_count(hr_host* h, const char* key, uint32_t* count) {
  std::vector<const std::string*> v;
  const hr_status st = strings_of(h, key, &v);
  if (st != HR_OK) return st;
  if (!count) {
    plugin(h).error = HR_EXT_CONFIG " string_count: count must not be NULL";
    return HR_ERROR_INVALID;
  }
  *count = uint32_t(v.size());
  return HR_OK;
}

constexpr Rule kStringAt = {HR_EXT_CONFIG " string_at", kAnyone, When::kCreate, kNotAllowed};
static hr_status string_at(hr_host* h, const char* key, uint32_t index, char* out, size_t size) {
  std::vector<const std::string*> v;
  const hr_status st = strings_of(h, key, &v);
  if (st != HR_OK) return st;
  LoadedPlugin& p = plugin(h);
  if (index >= v.size()) {
    p.error = key_where(p, key) + ": " HR_EXT_CONFIG " string_at: index " + std::to_string(index) +
              " is past its " + std::to_string(v.size()) + " string(s)";
    return HR_ERROR_INVALID;
  }
  const std::string& s = *v[index];
  if (!out || s.size() + 1 > size) {
    p.error = key_where(p, key) + ": entry " + std::to_string(index + 1) + " is " +
              std::to_string(s.size()) + " bytes, longer than the plugin's buffer";
    return HR_ERROR_INVALID;
  }
  std::memcpy(out, s.c_str(), s.size() + 1);
  return HR_OK;
}

extern const hr_ext_config kConfigExtension;
const hr_ext_config kConfigExtension = {
    sizeof(hr_ext_config), 0, checked<kStringCount, string_count>, checked<kStringAt, string_at>};

}  // namespace services
}  // namespace headroom
