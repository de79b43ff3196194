// Helpers shared by the test files: configs from TOML text, running the host binary.
#pragma once

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"

// A test against a Python reference (tests/hf/, .venv-test) runs in the release pass only where
// the headroom code it runs is run under the sanitizers by the tests `others` names: most of its
// time is the reference's Python (uninstrumented, the same in every pass), importing torch alone
// some seconds a process.
#ifdef HEADROOM_SANITIZE_BUILD
#define HEADROOM_REFERENCE_IN_RELEASE_PASS(others)                                             \
  GTEST_SKIP() << "a Python reference: the release pass runs it; the sanitizer pass runs its " \
                  "headroom code in "                                                          \
               << (others)
#else
#define HEADROOM_REFERENCE_IN_RELEASE_PASS(others) static_cast<void>(0)
#endif

namespace headroom {
class Trainer;
}

namespace headroom::test {

// `whole` ran `toml` (which sets no [snapshot]) to its end. Runs `toml` again for half its steps
// with a snapshot there, resumes that to the end, and expects the resumed steps' losses and
// every parameter's weights as the layers read them (the compute copy, or the f32 values) bitwise
// `whole`'s.
void expect_resume_is_bitwise(const std::string& toml, Trainer& whole);

// The same floats bit for bit (NaNs, signed zeros); two empty vectors are equal. (memcmp on an
// empty vector's data() would pass it a null pointer, which UBSan reports.)
bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b);

// A fresh directory under /tmp for one test: removed when the test ends, kept when it failed.
std::string temp_dir();
// One directory under /tmp for what tests of one process share (a result made once and cached):
// removed when the process exits.
std::string process_temp_dir();
// The whole file, as bytes ("" when it cannot be read).
std::string read_file(const std::string& path);
// The command lines (not blank, not comments) of the first ```sh block after `heading` in the
// Markdown `text`: what a README shows, for a test that runs it as written.
std::vector<std::string> commands_under(const std::string& text, const std::string& heading);
// Writes `text` to dir/name and returns the path.
std::string write_file(const std::string& dir, const std::string& name, const std::string& text);

// B sequences of T token ids and their targets, owned here. batch() is the model's view of them:
// pointers into this, so it must outlive the Batch.
struct TokenBatch {
  std::vector<int32_t> tokens, targets;
  int B = 0, T = 0;
  Batch batch(double dloss, uint64_t dropout_seed = 0) const;
  // 1 / the targets the loss counts (those >= 0): the dloss of their mean.
  double mean_dloss() const;
};
// Tokens (i·a + c) mod vocab and targets (i·b + d) mod vocab, i each one's place in the batch.
TokenBatch arithmetic_batch(int B, int T, int vocab, int a, int c, int b, int d);
// tests/hf's batch.json: {"tokens": [[...], ...], "targets": [[...], ...]}, B rows of T.
TokenBatch read_batch_json(const std::string& path);

// A Config from TOML text, as if read from `file` (default "test.toml").
Config config_from(const std::string& toml, const std::vector<std::string>& overrides = {});

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};
// Runs build/bin/headroom with `args` (already shell-quoted where needed).
RunResult run_headroom(const std::string& args);
// Runs a shell command line, stdout and stderr together.
RunResult run_command(const std::string& command);

// The message of the ConfigError that `f` throws; fails the test when it throws nothing.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

inline bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}
inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ||a - b|| / ||b|| over two equally long vectors.
double relative_error(const std::vector<double>& a, const std::vector<double>& b);

// Moves every parameter off its init (LayerNorm gains 1, biases 0) by up to ±0.1, drawn from
// `rng`, so that no term of a gradient check vanishes.
template <class Model, class Rng>
void perturb_params(Model& model, Rng& rng) {
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  for (auto* p : model.params())
    for (uint64_t i = 0; i < p->numel; ++i)
      p->master().value[i] += 0.2 * u(rng);
}

// Every parameter's gradient as the model's last backward left it (analytic) beside the central
// difference of the loss with step h (numeric), parameter by parameter, element by element: what
// the double-precision gradient checks compare. The losses are evaluate()'s (forward only).
template <class Model, class BatchT>
void finite_differences(Model& model, const BatchT& batch, double h, std::vector<double>* analytic,
                        std::vector<double>* numeric) {
  for (auto* p : model.params()) {
    for (uint64_t i = 0; i < p->numel; ++i) {
      const double saved = p->master().value[i];
      p->master().value[i] = saved + h;
      const double lp = model.evaluate(batch);
      p->master().value[i] = saved - h;
      const double lm = model.evaluate(batch);
      p->master().value[i] = saved;
      analytic->push_back(p->master().grad[i]);
      numeric->push_back((lp - lm) / (2 * h));
    }
  }
}

}  // namespace headroom::test
