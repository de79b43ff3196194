// README.md's example: its ```toml block is examples/demo-plugins.toml without the comments and
// the core keys it sets to their defaults, so the two resolve to the same config (what
// scripts/demo runs is what the README shows).
#include <gtest/gtest.h>

#include <string>

#include "core/config/config.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

TEST(ReadmeExample, IsTheDemoConfig) {
  const std::string src = HEADROOM_SOURCE_DIR;
  const std::string readme = test::read_file(src + "/README.md");
  const size_t start = readme.find("```toml\n");
  ASSERT_NE(start, std::string::npos) << "README.md has no ```toml block";
  const size_t end = readme.find("```\n", start + 8);
  ASSERT_NE(end, std::string::npos);
  const std::string shown = readme.substr(start + 8, end - start - 8);

  const Config readme_config = parse_config(shown, src + "/examples/demo-plugins.toml");
  const Config demo = load_config(src + "/examples/demo-plugins.toml");
  EXPECT_EQ(format_config(readme_config), format_config(demo));
}

}  // namespace
}  // namespace headroom
