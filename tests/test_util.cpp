#include "tests/test_util.h"

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "core/model/safetensors.h"
#include "core/run/trainer.h"

namespace headroom::test {

void expect_resume_is_bitwise(const std::string& toml, Trainer& whole) {
  const int64_t steps = int64_t(whole.history().size()), half = steps / 2;
  ASSERT_GE(half, 1) << "a run of at least 2 steps";
  const std::string dir = temp_dir();
  const std::string snap =
      "[snapshot]\nevery = " + std::to_string(half) + "\ndir = \"" + dir + "/s\"\n";
  {
    Trainer first(config_from(toml + snap, {"train.steps=" + std::to_string(half)}),
                  TrainOptions{});
    first.run();
  }
  TrainOptions o;
  o.resume_dir = dir + "/s";
  Trainer resumed(config_from(toml + snap), std::move(o));
  resumed.run();
  ASSERT_EQ(int64_t(resumed.history().size()), steps - half);
  for (int64_t i = 0; i < steps - half; ++i)
    EXPECT_EQ(resumed.history()[size_t(i)].loss, whole.history()[size_t(half + i)].loss)
        << "step " << half + i + 1;
  const auto& a = whole.model().params();
  const auto& b = resumed.model().params();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i]->quant != QuantKind::kNone) continue;  // values only around an access: below
    EXPECT_EQ(std::memcmp(a[i]->compute().value, b[i]->compute().value,
                          a[i]->numel * dtype_size(a[i]->compute_dtype)),
              0)
        << a[i]->name;
  }
  // A quantized frozen weight's values, dequantized.
  bool quantized = false;
  for (const Param<float>* p : a)
    quantized = quantized || p->quant != QuantKind::kNone;
  if (!quantized) return;
  const auto va = download_params(whole.model(), whole.model().master_access(true, false));
  const auto vb = download_params(resumed.model(), resumed.model().master_access(true, false));
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i]->quant == QuantKind::kNone) continue;
    EXPECT_TRUE(bitwise_equal(va[i], vb[i])) << a[i]->name;
  }
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

namespace {

// The temporary directories of the test now running: removed when it ends, kept (and named) when
// it failed, for a look at what it left. (Left behind, the suite's runs filled /tmp with 9 GiB.)
struct TempDirs {
  std::mutex mutex;
  std::vector<std::string> dirs;
};
TempDirs& temp_dirs() {
  static TempDirs* dirs = new TempDirs();  // never destroyed: listeners run until exit
  return *dirs;
}

class TempDirCleaner : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    TempDirs& t = temp_dirs();
    std::lock_guard<std::mutex> lock(t.mutex);
    for (const std::string& dir : t.dirs) {
      if (info.result()->Failed()) {
        std::printf("[ kept     ] %s (the failed test's files)\n", dir.c_str());
        continue;
      }
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
    t.dirs.clear();
  }
};

// Registered before main: every test program that links test_util.cpp gets it.
const bool temp_dir_cleaner_registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new TempDirCleaner());
  return true;
}();

}  // namespace

std::string temp_dir() {
  char tmpl[] = "/tmp/headroom-test-XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  TempDirs& t = temp_dirs();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.dirs.push_back(tmpl);
  return tmpl;
}

std::string process_temp_dir() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/headroom-test-XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    return std::string(tmpl);
  }();
  static const bool removed_at_exit = [] {
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    });
    return true;
  }();
  (void)removed_at_exit;
  return dir;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

Config config_from(const std::string& toml, const std::vector<std::string>& overrides) {
  return parse_config(toml, "test.toml", overrides);
}

RunResult run_headroom(const std::string& args) {
  return run_command(std::string(HEADROOM_BINARY) + " " + args);
}

RunResult run_command(const std::string& command) {
  RunResult r;
  const std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0)
    r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

std::vector<std::string> commands_under(const std::string& text, const std::string& heading) {
  std::vector<std::string> out;
  const size_t at = text.find(heading);
  if (at == std::string::npos) return out;
  const size_t start = text.find("```sh\n", at);
  if (start == std::string::npos) return out;
  const size_t end = text.find("```\n", start + 6);
  std::istringstream block(text.substr(start + 6, end - start - 6));
  std::string line;
  while (std::getline(block, line))
    if (!line.empty() && line[0] != '#') out.push_back(line);
  return out;
}

Batch TokenBatch::batch(double dloss, uint64_t dropout_seed) const {
  Batch b;
  b.tokens = tokens.data();
  b.targets = targets.data();
  b.B = B;
  b.T = T;
  b.dloss = dloss;
  b.dropout_seed = dropout_seed;
  return b;
}

double TokenBatch::mean_dloss() const {
  int counted = 0;
  for (int32_t t : targets)
    counted += t >= 0;
  return 1.0 / counted;
}

TokenBatch arithmetic_batch(int B, int T, int vocab, int a, int c, int b, int d) {
  TokenBatch out;
  out.B = B;
  out.T = T;
  for (int64_t i = 0; i < int64_t(B) * T; ++i) {
    out.tokens.push_back(int32_t((i * a + c) % vocab));
    out.targets.push_back(int32_t((i * b + d) % vocab));
  }
  return out;
}

TokenBatch read_batch_json(const std::string& path) {
  const nlohmann::json j = nlohmann::json::parse(read_file(path));
  TokenBatch out;
  for (const auto& row : j["tokens"])
    for (const auto& v : row)
      out.tokens.push_back(v.get<int32_t>());
  for (const auto& row : j["targets"])
    for (const auto& v : row)
      out.targets.push_back(v.get<int32_t>());
  out.B = int(j["tokens"].size());
  out.T = out.B ? int(j["tokens"][0].size()) : 0;
  return out;
}

}  // namespace headroom::test
