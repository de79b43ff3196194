// Data files a config points at that cannot be used: a ConfigError (exit 2) naming the config line
// of data.path or data.pattern, the file, and what is wrong with it.
#include "core/config/config.h"
#include "core/data/data.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

const char* kSmallModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n";

DataConfig text_data(const std::string& path) {
  DataConfig d;
  d.kind = "text";
  d.path = path;
  d.path_pos = SourcePos{"run.toml", 9, 8};
  return d;
}

DataConfig shard_data(const std::string& pattern) {
  DataConfig d;
  d.kind = "shards";
  d.pattern = pattern;
  d.path_pos = SourcePos{"run.toml", 9, 11};
  return d;
}

ModelConfig byte_model() {
  ModelConfig m;
  m.vocab_size = 256;
  return m;
}

std::string data_error(const DataConfig& d) {
  return test::error_of([&] { make_data_source(d, byte_model(), 2, 8); });
}

bool is_root() {
  return ::geteuid() == 0;
}

TEST(DataErrors, TextPathIsADirectory) {
  const std::string dir = test::temp_dir();
  EXPECT_EQ(data_error(text_data(dir)),
            "run.toml:9:8: data.path '" + dir +
                "' is a directory, not a text file; data.kind = \"text\" trains on the bytes of "
                "one file (for many files, write them as shards with `headroom shard` and use "
                "data.kind = \"shards\")");
  fs::remove_all(dir);
}

TEST(DataErrors, TextPathMissing) {
  const std::string dir = test::temp_dir();
  EXPECT_EQ(data_error(text_data(dir + "/none.txt")),
            "run.toml:9:8: data.path '" + dir +
                "/none.txt': cannot open the text file: No such file or directory");
  fs::remove_all(dir);
}

TEST(DataErrors, TextFileEmpty) {
  const std::string dir = test::temp_dir();
  const std::string p = test::write_file(dir, "empty.txt", "");
  EXPECT_EQ(data_error(text_data(p)),
            "run.toml:9:8: data.path '" + p + "': the text file is empty (0 bytes)");
  fs::remove_all(dir);
}

TEST(DataErrors, TextFileTooSmall) {
  const std::string dir = test::temp_dir();
  const std::string p = test::write_file(dir, "small.txt", "hello");
  EXPECT_EQ(
      data_error(text_data(p)),
      "run.toml:9:8: data.path '" + p +
          "': has 5 bytes, fewer than one micro-batch needs (micro_batch * seq_len + 1 = 17)");
  fs::remove_all(dir);
}

TEST(DataErrors, TextFileUnreadable) {
  if (is_root()) GTEST_SKIP() << "root reads a file whatever its mode";
  const std::string dir = test::temp_dir();
  const std::string p = test::write_file(dir, "secret.txt", std::string(100, 'x'));
  ASSERT_EQ(::chmod(p.c_str(), 0), 0);
  EXPECT_EQ(data_error(text_data(p)),
            "run.toml:9:8: data.path '" + p + "': cannot open the text file: Permission denied");
  fs::remove_all(dir);
}

// A file that opens but cannot be read (the kernel refuses reads of unmapped memory).
TEST(DataErrors, TextFileReadFails) {
  if (!fs::exists("/proc/self/mem")) GTEST_SKIP() << "no /proc/self/mem";
  const std::string msg = data_error(text_data("/proc/self/mem"));
  EXPECT_TRUE(test::starts_with(
      msg, "run.toml:9:8: data.path '/proc/self/mem': cannot read the text file: "))
      << msg;
}

// A DataConfig made in code names no config line: the message starts with the key.
TEST(DataErrors, TextWithoutAPosition) {
  const std::string dir = test::temp_dir();
  DataConfig d = text_data(dir);
  d.path_pos = SourcePos{};
  const std::string msg = data_error(d);
  EXPECT_TRUE(test::starts_with(msg, "data.path '" + dir + "' is a directory")) << msg;
  fs::remove_all(dir);
}

// The pattern's own errors name it once, not twice.
TEST(DataErrors, ShardPatternMatchingNothing) {
  const std::string dir = test::temp_dir();
  EXPECT_EQ(data_error(shard_data(dir + "/train_*.bin")),
            "run.toml:9:11: data.pattern '" + dir +
                "/train_*.bin' matches no files (expected llm.c token shards, e.g. "
                "data/train_*.bin)");
  fs::remove_all(dir);
}

TEST(DataErrors, ShardPatternMatchingADirectory) {
  const std::string dir = test::temp_dir();
  fs::create_directory(dir + "/train_0.bin");
  EXPECT_EQ(data_error(shard_data(dir + "/train_*.bin")),
            "run.toml:9:11: data.pattern '" + dir + "/train_*.bin': " + dir +
                "/train_0.bin: not a regular file (expected an llm.c token shard)");
  fs::remove_all(dir);
}

TEST(DataErrors, ShardUnreadable) {
  if (is_root()) GTEST_SKIP() << "root reads a file whatever its mode";
  const std::string dir = test::temp_dir();
  const std::string p = test::write_file(dir, "train_0.bin", std::string(2048, '\0'));
  ASSERT_EQ(::chmod(p.c_str(), 0), 0);
  EXPECT_EQ(data_error(shard_data(dir + "/train_*.bin")), "run.toml:9:11: data.pattern '" + dir +
                                                              "/train_*.bin': " + p +
                                                              ": cannot open: Permission denied");
  fs::remove_all(dir);
}

// Through the host: exit 2 (not 1, a library error), the config line, the path.
TEST(DataErrors, TextDirectoryExits2NamingTheConfigLine) {
  const std::string dir = test::temp_dir();
  fs::create_directory(dir + "/corpus");
  const std::string cfg =
      test::write_file(dir, "run.toml",
                       std::string(kSmallModel) +
                           "[train]\nsteps = 1\n[data]\nkind = \"text\"\npath = \"corpus\"\n");
  const auto r = test::run_headroom("train " + cfg + " -q");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(
      r.output, cfg + ":11:8: data.path '" + dir + "/corpus' is a directory, not a text file"))
      << r.output;
  // The same from --set, which names the override.
  const auto s = test::run_headroom("train " + cfg + " -q --set data.path=" + dir);
  EXPECT_EQ(s.exit_code, 2) << s.output;
  EXPECT_TRUE(test::contains(s.output, "--set data.path=" + dir + ": data.path '" + dir +
                                           "' is a directory, not a text file"))
      << s.output;
  fs::remove_all(dir);
}

TEST(DataErrors, EmptyTextFileExits2NamingTheConfigLine) {
  const std::string dir = test::temp_dir();
  test::write_file(dir, "empty.txt", "");
  const std::string cfg =
      test::write_file(dir, "run.toml",
                       std::string(kSmallModel) +
                           "[train]\nsteps = 1\n[data]\nkind = \"text\"\npath = \"empty.txt\"\n");
  const auto r = test::run_headroom("train " + cfg + " -q");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(
      r.output, cfg + ":11:8: data.path '" + dir + "/empty.txt': the text file is empty (0 bytes)"))
      << r.output;
  fs::remove_all(dir);
}

// check and plan read the config only, and refuse text data with a vocabulary smaller than bytes.
TEST(DataErrors, CheckRefusesTextWithASmallVocabulary) {
  const std::string dir = test::temp_dir();
  test::write_file(dir, "c.txt", std::string(1000, 'a'));
  const std::string cfg = test::write_file(
      dir, "run.toml",
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 100\n"
      "[data]\nkind = \"text\"\npath = \"c.txt\"\n");
  for (const std::string cmd : {"check", "plan"}) {
    const auto r = test::run_headroom(cmd + " " + cfg);
    EXPECT_EQ(r.exit_code, 2) << cmd << ": " << r.output;
    EXPECT_TRUE(test::contains(r.output, cfg +
                                             ":6:14: model.vocab_size is 100, but data.kind = "
                                             "\"text\" (" +
                                             cfg + ":8:8) trains on bytes"))
        << cmd << ": " << r.output;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace headroom
