// headroom: the host binary. `headroom train CONFIG`, `headroom check CONFIG`,
// `headroom replay TRACE`, ...
//
// Exit codes (docs/guide/exit-codes.md): 0 done, 1 any other failure, 2 bad input or usage (and
// anything that stops a run before its first step), 3 out of memory, 4 an output could not be
// written, 5 the training diverged, 6 another rank failed or died (the message names it),
// 130 / 143 stopped by SIGINT / SIGTERM.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/config/hf_config.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/shards.h"
#include "core/device/device.h"
#include "core/model/hf_folder.h"
#include "core/model/safetensors.h"
#include "core/os/host_memory.h"
#include "core/os/interrupt.h"
#include "core/os/output_file.h"
#include "core/plan/measure.h"
#include "core/plan/plan.h"
#include "core/plan/search.h"
#include "core/plugin_host/plugin_host.h"
#include "core/report/advice.h"
#include "core/report/alloc_trace.h"
#include "core/run/sample.h"
#include "core/run/trainer.h"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitOutOfMemory = 3;
constexpr int kExitOutput = 4;
constexpr int kExitDiverged = 5;
constexpr int kExitPeerFailed = 6;
// 7: a plugin stopped the run (headroom.step/1 stop_run): PluginStopped::exit_code(), as a
// signal's Interrupted carries 128 + signal.

// A number flag checked as the config's numbers are: finite (no nan, no inf) and from lo to hi.
// CLI11's Range alone lets NaN through (every comparison with it is false).
CLI::Validator finite_number(double lo, double hi) {
  char range[96];
  std::snprintf(range, sizeof range, "a finite number from %g to %g", lo, hi);
  const std::string want = range;
  return CLI::Validator(
      [lo, hi, want](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size())
          return "expected " + want + ", got '" + text + "'";
        if (!std::isfinite(v) || v < lo || v > hi) return "must be " + want + ", got " + text;
        return std::string();
      },
      want);
}

// A flag that takes a whole number from lo to hi, checked on its text: a sign, a fraction, an
// exponent or a value past hi is refused naming the range (the conversion alone wrapped a seed of
// 10^23 and took it).
CLI::Validator whole_number(uint64_t lo, uint64_t hi) {
  const std::string want =
      "a whole number from " + std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, want](std::string& text) -> std::string {
        const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
          return c >= '0' && c <= '9';
        });
        if (!digits) return "must be " + want + ", got '" + text + "'";
        errno = 0;
        const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
        if (errno == ERANGE || v < lo || v > hi)
          return "must be " + want + ", got " + text + " (out of range)";
        return std::string();
      },
      want);
}

// train.init_from's tensors, by name and shape, against the config's model (what the trainer's
// load checks), from the file's header alone.
void check_init_from(const headroom::Config& config) {
  const std::string& path = config.train.init_from;
  const std::string at = config.train.init_from_pos.str() + ": train.init_from: " + path + ": ";
  std::vector<headroom::SafetensorsEntry> entries;
  try {
    // A Hugging Face folder: its config.json, index and shards' headers, as the load checks them.
    // A PEFT adapter folder: its base folder (none: train.seed's init); the adapters are checked
    // against the run's lora plugin when the run loads them.
    if (headroom::is_peft_adapter_folder(path)) {
      const std::string base = headroom::read_peft_adapter_config(path).base;
      if (!base.empty()) headroom::check_hf_folder(base, config.model);
      return;
    }
    if (headroom::is_hf_folder(path)) return headroom::check_hf_folder(path, config.model);
    entries = headroom::read_safetensors_header(path);
  } catch (const headroom::ConfigError& e) {
    throw headroom::ConfigError(config.train.init_from_pos.str() +
                                ": train.init_from: " + e.what());
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const headroom::SafetensorsEntry& e : entries)
    shapes[e.name.rfind("transformer.", 0) == 0 ? e.name.substr(12) : e.name] = e.shape;
  for (const headroom::ParamShape& p : headroom::gpt_param_shapes(config.model)) {
    std::vector<int64_t> want = p.shape;
    const bool conv1d =
        p.name.find(".attn.c_") != std::string::npos || p.name.find(".mlp.c_") != std::string::npos;
    if (conv1d && want.size() == 2 && p.name.find(".weight") != std::string::npos)
      std::swap(want[0], want[1]);  // Hugging Face's Conv1D stores (in, out)
    const auto it = shapes.find(p.name);
    if (it == shapes.end()) throw headroom::ConfigError(at + "missing tensor " + p.name);
    if (it->second != want)
      throw headroom::ConfigError(at + "tensor " + p.name + " does not have the shape of " +
                                  "the config's model");
  }
}

int cmd_check(const std::string& file, const std::vector<std::string>& sets) {
  const headroom::Config config = headroom::load_config(file, sets);
  headroom::validate_plugins(config);  // each plugin checks its own keys, as in `train`
  headroom::check_freeze(config.model, config.train);  // [train] freeze's patterns, as in `train`
  // What the plugins choose together, as `train` refuses it before step 1 (amp's layouts with
  // ranks or shards, the parameter shards on the host without zero3): the estimate's refusals.
  headroom::estimate_config(config);
  // What `train` opens before its first step is opened here too, so that a config `check` accepts
  // is one `train` starts: the data (files, shards, their tokenizer) and the init_from weights.
  headroom::make_data_source(config.data, config.model, config.train.micro_batch,
                             config.model.seq_len);
  // The validation data train.eval_every reads (data.val_path, val_pattern or the held-out tail).
  if (config.train.eval_every > 0)
    headroom::make_validation_source(config.data, config.model, config.train.micro_batch,
                                     config.model.seq_len);
  if (!config.train.init_from.empty()) check_init_from(config);
  // A CUDA device: that this build and machine have one (train refuses otherwise, exit 2).
  if (config.device.kind != "cpu") headroom::Device::create(config.device);
  std::cout << headroom::format_config(config);
  return kExitOk;
}

struct PlanFlags {
  bool measure = false, search = false, json = false;
  std::string budget, write;
  double deadline_s = headroom::kSearchDeadlineS;
  bool deadline_set = false;
};

// `headroom plan CONFIG`: the run's peak by category as the config is written, its [[plugins]]
// included, against its memory_limit; when it does not fit, what would. Exit 0 when the estimate
// fits, 3 when it does not. --measure: the peak from dry runs of cheap variants
// (core/plan/measure.h); --search: the fastest setup that fits, by the same dry runs
// (core/plan/search.h).
int cmd_plan(const std::string& file, const std::vector<std::string>& sets,
             const PlanFlags& flags) {
  if (flags.search && !flags.measure)
    throw headroom::ConfigError("--search needs --measure: the search decides by dry runs");
  if (!flags.write.empty() && !flags.search)
    throw headroom::ConfigError("--write needs --search: it writes the setup the search picks");
  if (!flags.budget.empty() && !flags.search)
    throw headroom::ConfigError("--budget needs --search: it is the memory the search fits");
  if (flags.json && !flags.measure) throw headroom::ConfigError("--json needs --measure");
  if (flags.deadline_set && !flags.search)
    throw headroom::ConfigError("--deadline needs --search: it bounds the search's time");
  const headroom::Config config = headroom::load_config(file, sets);
  // --write is checked (and held) before the search, as train checks its outputs before step 1:
  // a search must not run for minutes and then find it cannot write its pick. A path it cannot
  // write exits 4, as it did when the check came after the search (docs/guide/exit-codes.md: an
  // output that cannot be written); another run holding it exits 2, as for train's outputs.
  std::unique_ptr<headroom::OutputLock> write_lock;
  if (!flags.write.empty()) {
    try {
      headroom::check_output_path(flags.write, "--write");
    } catch (const headroom::ConfigError& e) {
      throw headroom::OutputError(e.what());
    }
    write_lock = std::make_unique<headroom::OutputLock>(flags.write, "--write");
  }
  if (!flags.measure) {
    const headroom::PlanResult r = headroom::plan(config);  // creates the plugins, as check does
    std::printf("%s", r.text.c_str());
    return r.fits ? kExitOk : kExitOutOfMemory;
  }
  uint64_t budget = config.device.memory_limit;
  if (!flags.budget.empty()) budget = headroom::parse_size(flags.budget, "--budget");
  try {
    if (flags.search) {
      if (!budget)
        throw headroom::ConfigError(
            "--search needs a budget: --budget SIZE, or [device] memory_limit in " + file);
      const headroom::SearchResult r = headroom::search(config, budget, flags.deadline_s);
      if (flags.json) {
        std::printf("%s\n", headroom::search_json(r).c_str());
      } else {
        std::printf("%s", headroom::format_search(config, r).c_str());
      }
      if (r.best < 0) return kExitOutOfMemory;
      if (!flags.write.empty()) {
        headroom::write_config_file(flags.write, r.candidates[r.best].config);
        if (!flags.json) std::printf("wrote %s\n", flags.write.c_str());
      }
      return kExitOk;
    }
    const headroom::Measured m = headroom::measure(config);
    // The wall: memory_limit, and on the CPU the host's memory when it is lower.
    const uint64_t limit = config.device.memory_limit;
    const headroom::HostMemory host =
        config.device.kind == "cpu" ? headroom::host_available_memory() : headroom::HostMemory{};
    const bool host_wall = host.bytes && (!limit || host.bytes < limit);
    const uint64_t wall = host_wall ? host.bytes : limit;
    const bool fits = !wall || m.reserved <= wall;
    if (flags.json) {
      std::printf("%s\n", headroom::measured_json(m).c_str());
    } else {
      std::printf("%s", headroom::format_measured(config, m).c_str());
      if (host_wall && !fits)
        std::printf(
            "does not fit this host: the CPU device's memory is the host's, %s available "
            "(%s)\n",
            headroom::format_bytes(host.bytes).c_str(), host.source.c_str());
      else if (limit)
        std::printf("%s memory_limit %s\n", fits ? "fits" : "does not fit",
                    headroom::format_bytes(limit).c_str());
    }
    return fits ? kExitOk : kExitOutOfMemory;
  } catch (const headroom::PlanRefused& e) {
    std::cerr << "headroom: plan --measure: " << e.what() << "\n";
    return kExitOutOfMemory;
  }
}

// Every plugin on the search path, loaded and asked for its descriptor.
int cmd_plugins() {
  std::printf("plugin search path:\n");
  for (const std::string& d : headroom::plugin_search_path())
    std::printf("  %s\n", d.c_str());
  const std::vector<headroom::PluginInfo> found = headroom::discover_plugins();
  if (found.empty()) {
    std::printf("no plugins found\n");
    return kExitOk;
  }
  for (const headroom::PluginInfo& p : found) {
    if (!p.error.empty()) {
      std::printf("\n(not loadable) %s\n  %s\n", p.file.c_str(), p.error.c_str());
      continue;
    }
    std::printf("\n%s %s (ABI %s)\n", p.name.c_str(), p.version.c_str(),
                headroom::format_abi_version(p.abi_version).c_str());
    if (!p.description.empty()) std::printf("  %s\n", p.description.c_str());
    std::printf("  events: %s\n  roles:  %s\n  file:   %s\n",
                headroom::describe_events(p.events).c_str(),
                headroom::describe_roles(p.roles).c_str(), p.file.c_str());
  }
  return kExitOk;
}

// `headroom shard TEXTFILE OUTDIR [--tokenizer FILE]`: llm.c token shards of a file's bytes, or
// of its ids under a byte-level BPE tokenizer. The shard paths on stdout, one a line; what the
// tokens are on stderr.
int cmd_shard(const std::string& text, const std::string& out_dir, uint64_t tokens_per_shard,
              const std::string& tokenizer_file) {
  std::unique_ptr<headroom::Tokenizer> tokenizer = tokenizer_file.empty()
                                                       ? headroom::make_byte_tokenizer()
                                                       : headroom::load_tokenizer(tokenizer_file);
  headroom::install_stop_handlers();  // a stop leaves no half set of shards behind
  std::fprintf(stderr, "headroom: tokens: %s\n", tokenizer->describe().c_str());
  for (const std::string& path : headroom::write_text_shards(
           text, out_dir, tokens_per_shard, tokenizer_file.empty() ? nullptr : tokenizer.get()))
    std::printf("%s\n", path.c_str());
  return kExitOk;
}

struct TrainFlags {
  std::string metrics, resume, save_weights, record_allocs, memory_timeline;
  int64_t timeline_step = 0;
  bool quiet = false;
  bool verbose = false;
  bool merge = false;
};

// "; wrote metrics m.jsonl, memory timeline t.html": what a run that stopped early still wrote.
std::string written_outputs(const TrainFlags& flags) {
  std::vector<std::string> parts;
  if (!flags.metrics.empty()) parts.push_back("metrics " + flags.metrics);
  if (!flags.memory_timeline.empty()) parts.push_back("memory timeline " + flags.memory_timeline);
  if (!flags.record_allocs.empty()) parts.push_back("allocation trace " + flags.record_allocs);
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i)
    s += (i == 0 ? "; wrote " : ", ") + parts[i];
  if (!flags.save_weights.empty()) s += "; --save-weights not written: the run did not finish";
  return s;
}

int cmd_train(const std::string& file, const std::vector<std::string>& sets,
              const TrainFlags& flags) {
  const headroom::Config config = headroom::load_config(file, sets);
  const bool quiet = flags.quiet;
  headroom::TrainOptions options;
  options.metrics_path = flags.metrics;
  options.resume_dir = flags.resume;
  options.save_weights_path = flags.save_weights;
  options.merge = flags.merge;
  options.record_allocs_path = flags.record_allocs;
  options.memory_timeline_path = flags.memory_timeline;
  options.memory_timeline_step = flags.timeline_step;
  options.log = quiet ? nullptr : &std::cout;
  options.live_progress = !quiet && isatty(STDOUT_FILENO);

  // From here a first SIGINT / SIGTERM stops the run at its next safe point, with its work saved.
  headroom::install_stop_handlers();
  std::unique_ptr<headroom::Trainer> trainer;
  try {
    try {
      trainer = std::make_unique<headroom::Trainer>(config, std::move(options));
    } catch (const headroom::OutOfMemory&) {
      throw;
    } catch (const headroom::OutputError&) {
      throw;
    } catch (const headroom::ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      // A plugin that fails to start, or anything else before step 1: nothing has run yet, so
      // this is the setup's input (exit 2), not a failure of the run.
      throw headroom::ConfigError(std::string("setup failed: ") + e.what());
    }
    if (!quiet && trainer->rank() == 0) {  // with ranks, rank 0 speaks for the run
      const auto& m = config.model;
      std::printf(
          "headroom: model %s n_layer=%d n_head=%d n_embd=%d seq_len=%d vocab_size=%d, %llu "
          "parameters\n",
          m.preset.empty() ? "(explicit)" : m.preset.c_str(), m.n_layer, m.n_head, m.n_embd,
          m.seq_len, m.vocab_size, static_cast<unsigned long long>(trainer->model().num_params()));
      std::printf("headroom: data: %s\n", trainer->data().describe().c_str());
      std::printf("headroom: device %s, memory_limit %s; micro_batch %d x grad_accum %d\n",
                  config.device.kind.c_str(),
                  config.device.memory_limit
                      ? headroom::format_bytes(config.device.memory_limit).c_str()
                      : "none",
                  config.train.micro_batch, config.train.grad_accum);
      const std::string compute = trainer->device().backend().describe();
      if (flags.verbose && !compute.empty())
        std::printf("headroom: %s backend: %s\n", config.device.kind.c_str(), compute.c_str());
      std::fflush(stdout);
    }
    trainer->run();
  } catch (const headroom::OutOfMemory& e) {
    std::cout.flush();
    const headroom::OomReport& r = e.report();
    // With ranks the report names this one (the trainer told the others it ran out of memory).
    const headroom::RankInfo& ranks = headroom::rank_info();
    const std::string who =
        ranks.world_size > 1 ? "rank " + std::to_string(ranks.rank) + ": " : std::string();
    std::cerr << "\nheadroom: " << who << r.str();
    // What the run needs by the estimate of the config as written, and what would make it fit:
    // the built-in knobs and the plugins this headroom can find. The trainer's memory goes first.
    trainer.reset();
    std::cerr << "headroom: " << who << headroom::oom_advice(config, r);
    if (!flags.memory_timeline.empty())
      std::cerr << "headroom: memory timeline up to the failure: " << flags.memory_timeline << "\n";
    return kExitOutOfMemory;
  } catch (const headroom::Interrupted& e) {
    std::cout.flush();
    std::cerr << "\nheadroom: " << e.what() << written_outputs(flags) << "\n";
    return e.exit_code();
  } catch (const headroom::Diverged& e) {
    std::cout.flush();
    std::cerr << "headroom: error: " << e.what() << written_outputs(flags) << "\n";
    return kExitDiverged;
  } catch (const headroom::CommError& e) {
    // Another rank died or failed (PeerFailed: "rank N ran out of memory"), or a collective timed
    // out: this rank stops too, saying which.
    std::cout.flush();
    std::cerr << "headroom: rank " << headroom::rank_info().rank << ": stopping: " << e.what()
              << "\n";
    return kExitPeerFailed;
  }
  if (!quiet) std::cout << trainer->memory_report();
  if (!quiet && !flags.memory_timeline.empty())
    std::cout << "memory timeline: " << flags.memory_timeline << "\n";
  return kExitOk;
}

// `headroom replay TRACE [--config CFG] [--memory-limit SIZE]`: a recorded allocation trace
// against the default allocator or the allocator plugin the config lists. Exit 3 when an
// allocation fails, as a training run would.
int cmd_replay(const std::string& file, const std::string& config_file,
               const std::vector<std::string>& sets, const std::string& memory_limit) {
  const headroom::AllocTrace trace = headroom::read_alloc_trace(file);
  headroom::Config config;
  if (!config_file.empty()) {
    config = headroom::load_config(config_file, sets);
  } else if (!sets.empty()) {
    throw headroom::ConfigError("--set needs --config: there is no config to override");
  }
  if (!memory_limit.empty())
    config.device.memory_limit = headroom::parse_size(memory_limit, "--memory-limit");
  std::printf("replay of %s: %zu records (%llu allocations), recorded by %s on %s\n", file.c_str(),
              trace.records.size(), static_cast<unsigned long long>(trace.num_allocs()),
              trace.version.empty() ? "(unknown)" : trace.version.c_str(), trace.device.c_str());
  const headroom::ReplayResult r = headroom::replay_alloc_trace(trace, config);
  std::printf("%s", r.str().c_str());
  return r.failed ? kExitOutOfMemory : kExitOk;
}

// Levenshtein distance, for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The first argument when it is neither an option nor a command: name it, and the nearest command.
int unknown_command(const CLI::App& app, const std::string& word) {
  std::string names, nearest;
  size_t best = SIZE_MAX;
  for (const CLI::App* sub : app.get_subcommands({})) {
    const std::string& n = sub->get_name();
    names += (names.empty() ? "" : ", ") + n;
    const size_t d = edit_distance(word, n);
    if (d < best) best = d, nearest = n;
  }
  std::cerr << "headroom: error: unknown command '" << word << "'";
  if (best <= 2) std::cerr << "; did you mean '" << nearest << "'?";
  std::cerr << "\nheadroom: the commands are " << names << " (headroom --help)\n";
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) makes writes fail with EFBIG, reported like a full disk,
  // instead of killing the process with the output half written.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"headroom: train transformer language models when GPU memory is the wall"};
  app.set_version_flag("--version", HEADROOM_VERSION_STRING);
  app.require_subcommand(1);

  std::string config_file;
  std::vector<std::string> sets;
  TrainFlags flags;

  CLI::App* train = app.add_subcommand("train", "train the model a config describes");
  train->add_option("config", config_file, "the TOML config file")->required();
  train->add_option("--set", sets,
                    "override a config key: --set section.key=value, or plugins.NAME.key=value for "
                    "a listed plugin (repeatable)");
  train->add_option("--metrics", flags.metrics, "write one JSON object per optimizer step to FILE");
  train->add_option("--resume", flags.resume,
                    "continue from the newest snapshot in DIR (see [snapshot] in the config)");
  train->add_option("--save-weights", flags.save_weights,
                    "write the trained weights to FILE (safetensors, Hugging Face GPT-2 names), or "
                    "to DIR/ (a path ending in / or a folder): config.json and model.safetensors, "
                    "a folder transformers' from_pretrained loads; a LoRA run's DIR/ is its "
                    "adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)");
  train
      ->add_flag("--merge", flags.merge,
                 "with --save-weights, a LoRA run writes the merged weights (the adapters folded "
                 "into the weights they adapt, as PEFT's merge_and_unload) instead of the adapter")
      ->needs("--save-weights");
  train->add_option("--record-allocs", flags.record_allocs,
                    "write every device allocation and free to FILE, for `headroom replay`");
  train->add_option("--memory-timeline", flags.memory_timeline,
                    "write the memory timeline to FILE.html (one self-contained file), also when "
                    "the run stops out of memory");
  train
      ->add_option("--timeline-step", flags.timeline_step,
                   "the step --memory-timeline draws phase by phase (default: the step of the "
                   "peak)")
      ->check(whole_number(1, INT64_MAX));
  train->add_flag("-q,--quiet", flags.quiet, "print nothing but errors");
  train->add_flag("-v,--verbose", flags.verbose,
                  "also say what computes: the backend's GEMM library, its kernel, its threads");

  CLI::App* plan = app.add_subcommand(
      "plan", "estimate the run's peak memory by category and what would make it fit");
  plan->add_option("config", config_file, "the TOML config file")->required();
  plan->add_option("--set", sets,
                   "override a config key: --set section.key=value, or plugins.NAME.key=value for "
                   "a listed plugin (repeatable)");
  PlanFlags plan_flags;
  plan->add_flag("--measure", plan_flags.measure,
                 "predict the peak from a two-step dry run of the config itself (on the CPU "
                 "always; elsewhere when it fits), else of variants at micro_batch 1-2 with "
                 "1-2 blocks, fitted and extrapolated");
  plan->add_flag("--search", plan_flags.search,
                 "with --measure: measure micro_batch x grad_accum splits and the installed "
                 "plugins' proposals, and pick the fastest that fits");
  plan->add_option("--budget", plan_flags.budget,
                   "with --search: the memory to fit (\"8GiB\"; default: memory_limit)");
  plan->add_option("--write", plan_flags.write,
                   "with --search: write the recommended config, whole, to FILE");
  plan->add_flag("--json", plan_flags.json, "with --measure: print one JSON object");
  plan->add_option("--deadline", plan_flags.deadline_s,
                   "with --search: seconds the search may take (default 120); candidates left "
                   "when it comes are listed as such")
      ->check(finite_number(0.0, 86400.0))
      ->each([&](const std::string&) { plan_flags.deadline_set = true; });

  CLI::App* check = app.add_subcommand(
      "check", "validate a config and print it resolved, with every default filled in");
  check->add_option("config", config_file, "the TOML config file")->required();
  check->add_option("--set", sets,
                    "override a config key: --set section.key=value, or plugins.NAME.key=value for "
                    "a listed plugin (repeatable)");

  std::string shard_text, shard_dir, shard_tokenizer;
  uint64_t tokens_per_shard = 100000000;
  CLI::App* shard = app.add_subcommand(
      "shard",
      "write a text file as llm.c token shards for [data] kind = shards: its bytes (vocab 256), "
      "or its ids under a byte-level BPE tokenizer (--tokenizer)");
  shard->add_option("text", shard_text, "the text file")->required();
  shard->add_option("outdir", shard_dir, "the folder to write shard_000000.bin, ... into")
      ->required();
  shard
      ->add_option("--tokens-per-shard", tokens_per_shard,
                   "at most this many tokens per shard (1 to 2147483647)")
      ->check(whole_number(1, INT32_MAX));
  shard->add_option("--tokenizer", shard_tokenizer,
                    "a Hugging Face tokenizer.json (byte-level BPE, as GPT-2's), or GPT-2's "
                    "vocab.json with merges.txt beside it; the shards record its vocab size");

  std::string replay_file, replay_config, replay_limit;
  std::vector<std::string> replay_sets;
  CLI::App* replay = app.add_subcommand(
      "replay",
      "replay an allocation trace (train --record-allocs) against the default allocator or the "
      "allocator plugin a config lists; prints peak reserved, fragmentation, the first failure "
      "and allocations per second");
  replay->add_option("trace", replay_file, "the trace file")->required();
  replay->add_option("--config", replay_config,
                     "take [device] and [[plugins]] from this config (default: the CPU device and "
                     "allocator, under the trace's memory_limit)");
  replay->add_option("--set", replay_sets, "override a key of --config (repeatable)");
  replay->add_option("--memory-limit", replay_limit,
                     "replay under SIZE (\"96MiB\") instead of the config's or the trace's limit");

  headroom::SampleRequest sample_req;
  CLI::App* sample = app.add_subcommand(
      "sample",
      "generate text from a trained model (a config, a snapshot or a weights file) with a KV "
      "cache, decoded by the data's tokenizer");
  sample
      ->add_option("source", sample_req.source,
                   "a config (.toml: its newest snapshot, else train.init_from), a snapshot "
                   "(.hrsnap, or a folder of them: the newest), a weights file (.safetensors) or a "
                   "Hugging Face folder (config.json beside the weights)")
      ->required();
  sample->add_option("--prompt", sample_req.prompt, "the text to continue")->required();
  sample->add_option("--tokens", sample_req.tokens, "how many tokens to generate")
      ->required()
      ->check(whole_number(0, 1000000));
  sample
      ->add_option("--temperature", sample_req.params.temperature,
                   "divides the logits; 0 always takes the most likely token (default 1)")
      ->check(finite_number(0.0, 100.0));
  sample
      ->add_option("--top-k", sample_req.params.top_k,
                   "draw among the K most likely tokens; 0: among all (default)")
      ->check(whole_number(0, INT32_MAX));
  sample->add_option("--seed", sample_req.params.seed, "the draws' seed (default 1)")
      ->check(whole_number(0, UINT64_MAX));
  sample->add_option("--config", sample_req.config_file,
                     "the config whose [model] and [data] tokenizer a snapshot or weights file "
                     "was trained with");
  sample->add_option("--tokenizer", sample_req.tokenizer,
                     "decode with this tokenizer.json (or vocab.json) instead of the config's");
  sample->add_option("--set", sample_req.sets, "override a key of the config (repeatable)");
  sample->add_flag("--ids", sample_req.ids, "print token ids instead of text");

  CLI::App* plugins = app.add_subcommand(
      "plugins", "list every plugin on the plugin path: name, version, ABI, events, roles, file");

  if (argc > 1 && argv[1][0] != '-') {
    const auto subs = app.get_subcommands({});
    if (std::none_of(subs.begin(), subs.end(),
                     [&](const CLI::App* sub) { return sub->check_name(argv[1]); }))
      return unknown_command(app, argv[1]);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }

  try {
    if (*train) return cmd_train(config_file, sets, flags);
    if (*shard) return cmd_shard(shard_text, shard_dir, tokens_per_shard, shard_tokenizer);
    if (*check) return cmd_check(config_file, sets);
    if (*plan) return cmd_plan(config_file, sets, plan_flags);
    if (*replay) return cmd_replay(replay_file, replay_config, replay_sets, replay_limit);
    if (*plugins) return cmd_plugins();
    if (*sample) {
      headroom::run_sample(sample_req, std::cout, std::cerr);
      return kExitOk;
    }
  } catch (const headroom::ConfigError& e) {
    std::cerr << "headroom: error: " << e.what() << "\n";
    return kExitUsage;
  } catch (const headroom::OutputError& e) {
    std::cerr << "headroom: error: cannot write an output: " << e.what() << "\n";
    return kExitOutput;
  } catch (const headroom::Interrupted& e) {
    std::cerr << "headroom: " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "headroom: failed: " << e.what() << "\n";
    return kExitFailure;
  }
  return kExitUsage;
}
