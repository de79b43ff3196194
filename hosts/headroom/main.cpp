// headroom: the host binary. `headroom train CONFIG`, `headroom check CONFIG`.
//
// Exit codes: 0 done, 1 any other failure, 2 bad config or usage, 3 out of memory.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/device.h"
#include "core/plugin_host.h"
#include "core/trainer.h"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitOutOfMemory = 3;

int cmd_check(const std::string& file, const std::vector<std::string>& sets) {
  const headroom::Config config = headroom::load_config(file, sets);
  std::cout << headroom::format_config(config);
  return kExitOk;
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

int cmd_train(const std::string& file, const std::vector<std::string>& sets,
              const std::string& metrics, bool quiet) {
  const headroom::Config config = headroom::load_config(file, sets);
  headroom::TrainOptions options;
  options.metrics_path = metrics;
  options.log = quiet ? nullptr : &std::cout;
  options.live_progress = !quiet && isatty(STDOUT_FILENO);

  std::unique_ptr<headroom::Trainer> trainer;
  try {
    trainer = std::make_unique<headroom::Trainer>(config, options);
    if (!quiet) {
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
      std::fflush(stdout);
    }
    trainer->run();
  } catch (const headroom::OutOfMemory& e) {
    std::cout.flush();
    std::cerr << "\nheadroom: " << e.report().str();
    std::cerr << "headroom: the run does not fit in memory_limit; lower train.micro_batch (raise "
                 "train.grad_accum to keep the batch) or raise device.memory_limit\n";
    return kExitOutOfMemory;
  }
  if (!quiet) std::cout << trainer->memory_report();
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"headroom: train transformer language models when GPU memory is the wall"};
  app.set_version_flag("--version", HEADROOM_VERSION_STRING);
  app.require_subcommand(1);

  std::string config_file, metrics;
  std::vector<std::string> sets;
  bool quiet = false;

  CLI::App* train = app.add_subcommand("train", "train the model a config describes");
  train->add_option("config", config_file, "the TOML config file")->required();
  train->add_option("--set", sets, "override a config key: --set section.key=value (repeatable)");
  train->add_option("--metrics", metrics, "write one JSON object per optimizer step to FILE");
  train->add_flag("-q,--quiet", quiet, "print nothing but errors");

  CLI::App* check = app.add_subcommand(
      "check", "validate a config and print it resolved, with every default filled in");
  check->add_option("config", config_file, "the TOML config file")->required();
  check->add_option("--set", sets, "override a config key: --set section.key=value (repeatable)");

  CLI::App* plugins = app.add_subcommand(
      "plugins", "list every plugin on the plugin path: name, version, ABI, events, roles, file");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }

  try {
    if (*train) return cmd_train(config_file, sets, metrics, quiet);
    if (*check) return cmd_check(config_file, sets);
    if (*plugins) return cmd_plugins();
  } catch (const headroom::ConfigError& e) {
    std::cerr << "headroom: error: " << e.what() << "\n";
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "headroom: failed: " << e.what() << "\n";
    return kExitFailure;
  }
  return kExitUsage;
}
