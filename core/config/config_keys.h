// The keys of a config file, section by section: the names the parser accepts (an unknown key is
// an error listing these, in this order) and, for each, its type and one line saying what it does.
// The parser (config.cpp) checks names against these tables, and the config reference
// (docs/config-reference.md) is rendered from them (config_reference.h), so the two cannot drift;
// tests/config_reference_test.cpp fails when a key lacks its line or the page is stale.
#pragma once

#include <string>
#include <vector>

namespace headroom {

// What a key's value is, as the parser reads it.
enum class KeyType {
  kInteger,     // a TOML integer
  kFloat,       // a TOML float or integer
  kBoolean,     // true or false
  kString,      // a TOML string
  kChoice,      // a string, one of ConfigKey::choices
  kPath,        // a string naming a file, folder or glob, relative to the config file
  kSize,        // "64MiB", or an integer number of bytes
  kSizeString,  // "25MiB": a size written as a string only
  kStrings,     // an array of strings
};

struct ConfigKey {
  const char* name;
  KeyType type;
  const char* description;           // one line: what it does, its range, what 0 or unset means
  std::vector<std::string> choices;  // kChoice: the values the parser accepts
};

struct ConfigSection {
  const char* name;      // "train"; "plugins" is written [[plugins]]
  bool array_of_tables;  // [[plugins]]: one table per entry
  const char* description;
  std::vector<ConfigKey> keys;

  const ConfigKey* find(const std::string& key) const;  // nullptr when the section has none
  std::vector<std::string> key_names() const;           // in table order
};

// Every section, in the order messages list them: model, train, data, device, snapshot,
// distributed, plugins.
const std::vector<ConfigSection>& config_sections();

// The section called `name`, or nullptr.
const ConfigSection* find_config_section(const std::string& name);

}  // namespace headroom
