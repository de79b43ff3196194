// What a TOML value's type is called in messages, for every file that reads TOML itself: the
// config parser and the plugin host's config getters. Apart from config.h because it needs
// toml++, which libheadroom links privately: config.h is included by embedders, who have none.
#pragma once

#include <toml++/toml.h>

#include <string>

namespace headroom {

// "integer", "float", "string", "boolean", "table", "array", "date", "time", "date-time".
std::string type_name(const toml::node& node);
// The same with its article: "an integer", "a string", "an array", "a date-time".
std::string type_name_with_article(const toml::node& node);

}  // namespace headroom
