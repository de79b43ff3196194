// docs/guide/own-text.md, "Train on your own text": every command of its sh block, as written, in a
// copy of the files it names (so the source tree gets no shards or snapshots), with
// build/bin/headroom the binary under test.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using test::contains;

TEST(ReadmeOwnText, CommandsRunAsWritten) {
  const std::string src = HEADROOM_SOURCE_DIR;
  const std::vector<std::string> cmds = test::commands_under(
      test::read_file(src + "/docs/guide/own-text.md"), "# Train on your own text");
  ASSERT_EQ(cmds.size(), 4u);
  const std::string dir = test::temp_dir();
  fs::create_directories(dir + "/docs");
  fs::create_directories(dir + "/examples/own-text");
  fs::copy_file(src + "/docs/design.md", dir + "/docs/design.md");
  for (const char* f : {"config.toml", "tokenizer.json"})
    fs::copy_file(src + "/examples/own-text/" + f, dir + "/examples/own-text/" + f);
  const std::string prefix = "build/bin/headroom ";
  std::vector<test::RunResult> runs;
  for (const std::string& c : cmds) {
    ASSERT_EQ(c.compare(0, prefix.size(), prefix), 0) << c;
    runs.push_back(
        test::run_command("cd " + dir + " && " + HEADROOM_BINARY + " " + c.substr(prefix.size())));
    ASSERT_EQ(runs.back().exit_code, 0) << c << "\n" << runs.back().output;
  }
  EXPECT_TRUE(contains(runs[0].output, "(vocab 512")) << runs[0].output;
  EXPECT_TRUE(contains(runs[1].output, " 120/120 | loss")) << runs[1].output;
  EXPECT_TRUE(contains(runs[1].output, "| val ")) << runs[1].output;  // eval_every
  EXPECT_TRUE(contains(runs[2].output, "sampling from snapshot ")) << runs[2].output;
  EXPECT_TRUE(contains(runs[2].output, "\nThe plugin")) << runs[2].output;
  EXPECT_TRUE(contains(runs[3].output, "fits memory_limit 64.00 MiB")) << runs[3].output;
}

}  // namespace
}  // namespace headroom
