// `plan --measure` against the full run (docs/results/planner.md): for each config, the predicted
// peak (active bytes, by the fit) and reserved bytes against the full run's (two steps of the
// config itself, through the same trainer), their errors, and the dry runs' wall time against one
// real step. `--only-plan NAME` runs only the dry runs of a config whose full run does not fit
// this machine (gpt2-1558m).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/plan/measure.h"

namespace {

struct Row {
  std::string name, toml;
  bool full = true;  // the full run fits this machine
};

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::string model(int n_layer, int n_head, int n_embd, int seq_len, int vocab, int micro_batch,
                  int grad_accum = 1) {
  return "[model]\nn_layer = " + std::to_string(n_layer) + "\nn_head = " + std::to_string(n_head) +
         "\nn_embd = " + std::to_string(n_embd) + "\nseq_len = " + std::to_string(seq_len) +
         "\nvocab_size = " + std::to_string(vocab) +
         "\n[train]\nsteps = 2\nmicro_batch = " + std::to_string(micro_batch) +
         "\ngrad_accum = " + std::to_string(grad_accum) + "\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"plan --measure against the full run"};
  std::string plugin_dir, only;
  app.add_option("--test-plugins", plugin_dir, "the build's tests/plugins (per_block.so)")
      ->required();
  app.add_option("--only", only, "run only the row of this name");
  CLI11_PARSE(app, argc, argv);
  const std::string per_block = "[[plugins]]\nname = \"per_block\"\npath = \"" + plugin_dir +
                                "/per_block.so\"\nbytes = 1000003\n";
  const std::vector<Row> rows = {
      {"tiny (4x64), B=8, T=64", model(4, 4, 64, 64, 256, 8)},
      {"tiny, B=8, T=64, amp bf16", model(4, 4, 64, 64, 256, 8) + "[[plugins]]\nname = \"amp\"\n"},
      {"tiny, B=8, T=64, checkpoint every",
       model(4, 4, 64, 64, 256, 8) + "[[plugins]]\nname = \"checkpoint\"\n"},
      {"tiny, B=8, T=64, checkpoint every_n 2",
       model(4, 4, 64, 64, 256, 8) +
           "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every_n\"\nn = 2\n"},
      {"tiny, B=8, T=64, checkpoint selective",
       model(4, 4, 64, 64, 256, 8) +
           "[[plugins]]\nname = \"checkpoint\"\npolicy = \"selective\"\n"},
      {"demo (6x128), B=32, T=128", model(6, 4, 128, 128, 256, 32)},
      {"demo, B=16 x 2, T=128, defrag_allocator, limit 200MiB",
       model(6, 4, 128, 128, 256, 16, 2) +
           "[device]\nmemory_limit = \"200MiB\"\n[[plugins]]\nname = \"defrag_allocator\"\n"},
      {"demo, B=32, T=128, limit 400MiB (arena)",
       model(6, 4, 128, 128, 256, 32) + "[device]\nmemory_limit = \"400MiB\"\n"},
      {"demo, B=32, T=128, out-of-tree per_block (1000003 B/block)",
       model(6, 4, 128, 128, 256, 32) + per_block},
      {"demo, B=32, T=128, amp + checkpoint",
       model(6, 4, 128, 128, 256, 32) +
           "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"},
      {"gpt2-124m shape, B=4, T=256", model(12, 12, 768, 256, 50257, 4)},
      {"gpt2-350m shape, B=2, T=128", model(24, 16, 1024, 128, 50257, 2)},
      {"gpt2-350m shape, B=2, T=128, amp + checkpoint",
       model(24, 16, 1024, 128, 50257, 2) +
           "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"},
      {"gpt2-1558m, B=4, T=1024 (dry run only)", model(48, 25, 1600, 1024, 50257, 4), false},
  };
  std::printf(
      "| config | predicted peak | full-run peak | error | predicted reserved | full-run reserved "
      "| error | fit check (bytes) | phase | dry run s | one step s | ratio |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    if (!only.empty() && row.name.find(only) == std::string::npos) continue;
    const headroom::Config c = headroom::parse_config(row.toml, "bench.toml");
    const double t0 = now_s();
    const headroom::Measured m = headroom::measure(c);
    const double dry = now_s() - t0;
    std::string check = m.check_b ? std::to_string(m.check_peak_error) : "-";
    if (!row.full) {
      std::printf("| %s | %s | - | - | %s | - | - | %s | %s | %.1f | - | - |\n", row.name.c_str(),
                  headroom::format_bytes(m.peak).c_str(),
                  headroom::format_bytes(m.reserved).c_str(), check.c_str(), m.phase.c_str(), dry);
      std::fflush(stdout);
      continue;
    }
    // The full run computes: its step time is the cost the dry run is weighed against.
    const headroom::VariantRun f = headroom::run_variant(c, c.train.micro_batch, c.model.n_layer, 0,
                                                         2, headroom::Arithmetic::kCompute);
    if (!f.ran) {
      std::printf("| %s | full run refused: %s |\n", row.name.c_str(), f.refused.c_str());
      continue;
    }
    const double e_active = 100.0 * (double(m.peak) - double(f.peak)) / double(f.peak);
    const double e_res = 100.0 * (double(m.reserved) - double(f.reserved)) / double(f.reserved);
    std::printf("| %s | %s | %s | %+.3f%% | %s | %s | %+.3f%% | %s | %s | %.2f | %.3f | %.1f |\n",
                row.name.c_str(), headroom::format_bytes(m.peak).c_str(),
                headroom::format_bytes(f.peak).c_str(), e_active,
                headroom::format_bytes(m.reserved).c_str(),
                headroom::format_bytes(f.reserved).c_str(), e_res, check.c_str(), m.phase.c_str(),
                dry, f.step_ms / 1000, dry / (f.step_ms / 1000));
    std::fflush(stdout);
  }
  return 0;
}
