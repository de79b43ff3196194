#include "core/config/config_reference.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

#include "core/config/config.h"
#include "core/config/config_keys.h"

namespace headroom {

namespace {

// section -> key -> value, as `headroom check` prints an empty config resolved: the defaults
// the parser fills in. A key it leaves out (an optional path, a key unset by default) has none.
std::map<std::string, std::map<std::string, std::string>> resolved_defaults() {
  std::map<std::string, std::map<std::string, std::string>> out;
  std::istringstream lines(format_config(parse_config("", "defaults.toml")));
  std::string line, section;
  while (std::getline(lines, line)) {
    if (line.size() > 2 && line.front() == '[' && line.back() == ']') {
      section = line.substr(1, line.size() - 2);
      continue;
    }
    const size_t eq = line.find(" = ");
    if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
    out[section][line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

// `"a"`, `"b"` or `"c"`.
std::string choices_text(const std::vector<std::string>& choices) {
  std::string s;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i) s += i + 1 == choices.size() ? " or " : ", ";
    s += "`\"" + choices[i] + "\"`";
  }
  return s;
}

std::string type_text(const ConfigKey& k) {
  switch (k.type) {
    case KeyType::kInteger:
      return "integer";
    case KeyType::kFloat:
      return "number";
    case KeyType::kBoolean:
      return "boolean";
    case KeyType::kString:
      return "string";
    case KeyType::kChoice:
      return choices_text(k.choices);
    case KeyType::kPath:
      return "path";
    case KeyType::kSize:
      return "size or bytes";
    case KeyType::kSizeString:
      return "size";
    case KeyType::kStrings:
      return "array of strings";
  }
  return "";
}

// A default as `check` prints it, but a whole number of a float key as "60.0" rather than the
// shortest form that reads back ("6e+01").
std::string default_text(const ConfigKey& k, const std::string& value) {
  if (k.type != KeyType::kFloat) return value;
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (*end != '\0' || v != std::floor(v) || std::fabs(v) >= 1e15) return value;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string header(const ConfigSection& s) {
  return s.array_of_tables ? "[[" + std::string(s.name) + "]]" : "[" + std::string(s.name) + "]";
}

}  // namespace

std::string config_reference_markdown() {
  const auto defaults = resolved_defaults();
  std::ostringstream os;
  os << "# Config reference\n"
        "\n"
        "<!-- Generated from the parser's key tables (core/config/config_keys.cpp) by\n"
        "     scripts/gen-config-reference; tests/config_reference_test.cpp fails when this page\n"
        "     differs from them. Edit the tables, not this page. -->\n"
        "\n"
        "A run is configured by one TOML file of the sections below; every key is optional\n"
        "unless its line says otherwise. Parsing is strict: an unknown key, a wrong type, an\n"
        "out-of-range value or a bad size is an error naming `file:line:column` and what would\n"
        "be valid (exit 2). `headroom check CONFIG` prints a config resolved, every default\n"
        "filled in: the defaults below are what it prints for an empty file.\n"
        "\n"
        "- A **size** is a string, a number with a unit `B`, `KiB`, `MiB` or `GiB` (`\"64MiB\"`,\n"
        "  `\"1.5GiB\"`); \"size or bytes\" also takes an integer number of bytes.\n"
        "- A **path** is relative to the config file (to the current directory when it comes\n"
        "  from `--set`).\n"
        "- `--set section.key=value` overrides any key, validated like the file; the value is\n"
        "  TOML, a bare word a string (`--set train.lr=1e-3`, `--set device.memory_limit=64MiB`).\n"
        "  `--set plugins.NAME.key=value` sets a key of the listed plugin NAME.\n"
        "- A plugin's own keys are in its README, listed in [the plugins "
        "guide](guide/plugins.md).\n";
  for (const ConfigSection& s : config_sections()) {
    os << "\n## " << header(s) << "\n\n" << s.description << "\n\n";
    os << "| key | type | default | what it does |\n| --- | --- | --- | --- |\n";
    const auto d = defaults.find(s.name);
    for (const ConfigKey& k : s.keys) {
      std::string def = "—";
      if (d != defaults.end()) {
        const auto v = d->second.find(k.name);
        if (v != d->second.end()) def = "`" + default_text(k, v->second) + "`";
      }
      os << "| `" << k.name << "` | " << type_text(k) << " | " << def << " | " << k.description
         << " |\n";
    }
  }
  return os.str();
}

}  // namespace headroom
