// The config reference, docs/config-reference.md, rendered from the parser's key tables
// (config_keys.h) and its defaults (format_config of an empty config). scripts/gen-config-reference
// writes it; tests/config_reference_test.cpp fails when the page differs from this.
#pragma once

#include <string>

namespace headroom {

// The whole page, Markdown: every section, and per key its type, default and one line.
std::string config_reference_markdown();

}  // namespace headroom
