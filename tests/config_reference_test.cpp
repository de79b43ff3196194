// The config reference (docs/config-reference.md) and the key tables the parser uses
// (core/config/config_keys.cpp): every key has its line, the parser reads every key with the type
// its table gives, the choices and defaults the page shows are the parser's, and the page is what
// the tables render.
#include "core/config/config_reference.h"

#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <set>
#include <string>

#include "core/config/config.h"
#include "core/config/config_keys.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

using test::contains;

std::string error_of_set(const std::string& override_text) {
  return test::error_of([&] { parse_config("", "ref.toml", {override_text}); });
}

TEST(ConfigReference, EveryKeyHasItsLine) {
  for (const ConfigSection& s : config_sections()) {
    EXPECT_FALSE(std::string(s.description).empty()) << "[" << s.name << "] has no description";
    std::set<std::string> seen;
    for (const ConfigKey& k : s.keys) {
      const std::string d = k.description;
      EXPECT_FALSE(d.empty()) << s.name << "." << k.name
                              << " has no description in core/config/config_keys.cpp";
      EXPECT_EQ(d.find('\n'), std::string::npos) << s.name << "." << k.name << ": one line";
      EXPECT_EQ(d.find('|'), std::string::npos) << s.name << "." << k.name << ": '|' ends a cell";
      EXPECT_TRUE(seen.insert(k.name).second) << s.name << "." << k.name << " is listed twice";
      EXPECT_EQ(k.type == KeyType::kChoice, !k.choices.empty())
          << s.name << "." << k.name << ": choices go with KeyType::kChoice, and only there";
    }
  }
}

// A key in a table that the parser never reads would be accepted and ignored; one read as another
// type would be documented wrongly. A value of the wrong type must be refused, naming the key.
TEST(ConfigReference, TheParserReadsEveryKeyAsItsTableSays) {
  for (const ConfigSection& s : config_sections()) {
    for (const ConfigKey& k : s.keys) {
      const std::string key = std::string(s.name) + "." + k.name;
      const std::string wrong = k.type == KeyType::kBoolean ? "1" : "true";
      std::string msg;
      if (s.array_of_tables) {
        // [[plugins]]: name is checked before path, so path's entry has a name.
        const std::string name = k.name;
        const std::string entry = name == "name"
                                      ? "[[plugins]]\nname = " + wrong + "\n"
                                      : "[[plugins]]\nname = \"p\"\n" + name + " = " + wrong + "\n";
        msg = test::error_of([&] { parse_config(entry, "ref.toml"); });
      } else {
        msg = error_of_set(key + "=" + wrong);
      }
      EXPECT_TRUE(contains(msg, "expected")) << key << " = " << wrong << ": " << msg;
      EXPECT_TRUE(contains(msg, k.name)) << key << " = " << wrong << ": " << msg;
    }
  }
}

// A value that is none of a choice key's choices: the parser's message lists exactly the table's.
TEST(ConfigReference, ChoicesAreTheParsers) {
  for (const ConfigSection& s : config_sections()) {
    for (const ConfigKey& k : s.keys) {
      if (k.type != KeyType::kChoice) continue;
      const std::string key = std::string(s.name) + "." + k.name;
      const std::string msg = error_of_set(key + "=no_such_choice");
      for (const std::string& c : k.choices)
        EXPECT_TRUE(contains(msg, "\"" + c + "\"")) << key << ": " << msg;
      size_t quoted = 0;  // "a", "b" and the value given: 2 quotes each
      for (char ch : msg)
        quoted += ch == '"';
      EXPECT_EQ(quoted, 2 * (k.choices.size() + 1)) << key << ": " << msg;
    }
  }
}

// The defaults the page shows are what `headroom check` prints for an empty file; each has the
// TOML type of its key.
TEST(ConfigReference, DefaultsHaveTheirKeysTypes) {
  const toml::table resolved = toml::parse(format_config(parse_config("", "ref.toml")));
  int checked = 0;
  for (const ConfigSection& s : config_sections()) {
    const toml::table* section = resolved[s.name].as_table();
    if (!section) continue;  // [[plugins]]: none by default
    for (auto&& [name, value] : *section) {
      const ConfigKey* k = s.find(std::string(name.str()));
      ASSERT_NE(k, nullptr) << "check prints " << s.name << "." << name.str()
                            << ", which its table lacks";
      bool ok = false;
      switch (k->type) {
        case KeyType::kInteger:
          ok = value.is_integer();
          break;
        case KeyType::kFloat:
          ok = value.is_floating_point();
          break;
        case KeyType::kBoolean:
          ok = value.is_boolean();
          break;
        case KeyType::kString:
        case KeyType::kPath:
        case KeyType::kSizeString:
          ok = value.is_string();
          break;
        case KeyType::kStrings:
          ok = value.is_array() && value.as_array()->is_homogeneous(toml::node_type::string);
          break;
        case KeyType::kChoice: {
          const std::string v = value.value_or(std::string());
          ok = value.is_string() &&
               std::find(k->choices.begin(), k->choices.end(), v) != k->choices.end();
          break;
        }
        case KeyType::kSize:
          ok = value.is_string() || value.is_integer();
          break;
      }
      EXPECT_TRUE(ok) << s.name << "." << name.str() << "'s default has another type";
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
}

TEST(ConfigReference, ThePageIsWhatTheTablesRender) {
  const std::string path = std::string(HEADROOM_SOURCE_DIR) + "/docs/config-reference.md";
  const std::string page = test::read_file(path);
  const std::string want = config_reference_markdown();
  EXPECT_TRUE(page == want) << path << " differs from the key tables (core/config/config_keys.cpp)"
                            << ": run scripts/gen-config-reference";
  for (const ConfigSection& s : config_sections())
    for (const ConfigKey& k : s.keys)
      EXPECT_TRUE(contains(want, "| `" + std::string(k.name) + "` |")) << s.name << "." << k.name;
}

}  // namespace
}  // namespace headroom
