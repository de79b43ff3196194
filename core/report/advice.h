// What a run needs and what would make it fit: `headroom plan` and the advice that follows an
// out-of-memory report. Core knows what its mechanisms cost (the closed form of the peak given a
// compute dtype and which layers drop their activations); the plugins know which mechanisms their
// policy sets and what it costs in step time (headroom.estimate/1, headroom/ext/estimate.h). This
// file names no plugin.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/backend.h"
#include "core/device/memory.h"
#include "core/model/model.h"
#include "core/plugin_host/plugin_host.h"
#include "headroom/ext/estimate.h"

namespace headroom {

// The peak bytes of one training run by category, in closed form: parameters, gradients and
// optimizer state, plus the activations and workspace at the start of the head's backward (every
// activation still held) or of a block's backward, whichever is higher.
struct PeakEstimate {
  ByCategory at_peak{};
  // The host ledger's bytes by category (docs/design.md "Places"): what the host place holds the
  // whole run (the optimizer on the host: an f32 copy of the weights, the gradients' copies, the
  // state), so its peak. Not in total(), which is the device's.
  ByCategory host{};
  uint64_t total() const;
  uint64_t host_total() const;
};

// What core's mechanisms are set to, as far as the peak is concerned (hr_mechanisms).
struct Mechanisms {
  Dtype compute = Dtype::kF32;
  int micro_batch = 1, grad_accum = 1;
  std::vector<uint8_t> drop;  // per layer (n_layer + 2): HR_KEEP_ACTIVATIONS, HR_DROP_ALL or
                              // HR_DROP_CHEAP
  int world_size = 1;         // the run's ranks
  uint32_t shard = 0;         // the HR_SHARD_* bits (headroom/ext/shard.h); 0: nothing sharded
  uint32_t grad_reduce = 0;   // HR_GRAD_REDUCE_* bits (with HR_SHARD_GRADIENTS)
  int prefetch_layers = 1;    // with HR_SHARD_PARAMETERS (zero3)
  uint64_t param_persistence_threshold = 100000;  // with HR_SHARD_PARAMETERS: elements
  // The state layout with compute copies (amp): gradients accumulated in the compute dtype, f32
  // masters or none, the built-in optimizer's state dtype (core/model/model.h Precision).
  bool grad_in_compute = false;
  bool masters = true;
  Dtype state = Dtype::kF32;
  // An optimizer-role plugin's state bytes on this rank, or kBuiltinOptimizer: AdamW / SGD.
  static constexpr uint64_t kBuiltinOptimizer = UINT64_MAX;
  uint64_t optimizer_bytes = kBuiltinOptimizer;
  // What the plugins hold in Category::kPlugin for the whole run (hr_mechanisms.plugin_bytes).
  uint64_t plugin_bytes = 0;
  // The built-in optimizer on the host place (hr_mechanisms.optimizer_place HR_PLACE_HOST).
  bool optimizer_on_host = false;
  // ... with its state in a file (HR_PLACE_NVME, core/optim/state_layout.h): the host holds two
  // staging buffers of the largest parameter's state instead of all of it.
  bool optimizer_on_nvme = false;
  // Each layer's output in the host ledger between the next layer's forward and backward
  // (hr_mechanisms.activation_place HR_PLACE_HOST, Gpt::set_activation_place).
  bool activations_on_host = false;
  // zero3's parameter and gradient shards in the host ledger (hr_mechanisms.parameter_place
  // HR_PLACE_HOST; core/shard/sharding.h "Offloaded parameters").
  bool parameters_on_host = false;
  // ... with their compute, frozen and quantized shards in a file (core/shard/shard_file.h).
  bool parameters_on_nvme = false;
  // LoRA adapters (headroom.adapters/1, hr_mechanisms.adapters): each spec on the modules its
  // target names, every other parameter frozen; and how the frozen block weights are stored
  // (hr_mechanisms.base_dtype: kNone, as the other frozen parameters).
  std::vector<LoraSpec> lora;
  QuantKind base = QuantKind::kNone;
  bool double_quant = false;
};
// The config's micro_batch and grad_accum, fp32, every layer keeping its activations, nothing
// sharded, at `world_size` ranks (0: the launcher's, rank_info()): the run as it is without
// plugins.
Mechanisms mechanisms_of(const Config& config, int world_size = 0);

// The closed form of one rank's peak. Exact on the CPU backend for each layer kept, dropped whole
// (HR_DROP_ALL) or dropped selectively (HR_DROP_CHEAP: the cheap tensors,
// gpt_block_cheap_activation_bytes, freed until the block's backward), with the optimizer state
// and the gradients sharded or not. The rank is this process's when
// m.world_size is the launcher's, else rank 0 (the fullest: the padding is in the last ranks').
PeakEstimate estimate_peak(const Config& config, const Mechanisms& m);
PeakEstimate estimate_peak(const Config& config, const Mechanisms& m, int rank);
PeakEstimate estimate_peak(const Config& config, int micro_batch);  // no plugins

// The numbers of an out-of-memory failure (all 0 for `headroom plan`).
struct OomNumbers {
  uint64_t requested = 0, free_bytes = 0, largest_free = 0;
};

// One plugin's headroom.estimate/1 answer.
struct PluginEstimate {
  std::string plugin;
  bool offered = false;      // the plugin offers headroom.estimate/1
  hr_status status = HR_OK;  // its answer (HR_ERROR_UNSUPPORTED: nothing to offer here)
  Mechanisms after;          // as it leaves them
  PeakEstimate peak;         // the peak it leaves
  uint64_t makes_usable = 0;
  double step_time_factor = 1;
  std::string what, toml;  // toml: its table's keys, one `key = value` a line
  bool ok() const { return offered && status == HR_OK; }
};

// The config as written: its [[plugins]] created (as `train` creates them) and their estimates
// chained in TOML order, each given the mechanisms the ones before it left. A plugin that offers
// no estimate, or answers with an error, is counted as changing nothing.
struct ConfigEstimate {
  Mechanisms mechanisms;  // as the last plugin leaves them
  PeakEstimate peak;
  double step_time_factor = 1;  // the product of the plugins'
  std::vector<PluginEstimate> plugins;
  uint32_t roles =
      0;  // the HR_ROLE_*s the config's plugins take: a proposal taking one is no remedy
};
// Throws as validate_plugins does for a config whose plugins cannot be created. `world_size`: the
// ranks the config runs on (0: the launcher's).
ConfigEstimate estimate_config(const Config& config, const OomNumbers& oom = {},
                               int world_size = 0);

// One way to fit: pasteable as `--set` flags, or as [[plugins]] tables to append to the config.
struct Remedy {
  std::string what;               // "micro_batch 8 x grad_accum 4 (the same 32 sequences a step)"
  std::vector<std::string> sets;  // "train.micro_batch=8", for --set
  std::string toml;               // the [[plugins]] tables to append (or to put in place of one)
  std::string replaces;           // where the table `toml` replaces is ("demo.toml:27:1"); ""
                                  // when toml is appended
  std::vector<std::string> plugins;  // the plugins it adds, in the order of `toml`
  ByCategory saves{};                // estimated peak bytes saved, by category
  ByCategory costs{};                // ... and added
  uint64_t unstranded = 0;           // free bytes in holes too small that it makes usable
  uint64_t peak_after = 0;           // the estimated peak with it
  bool fits = false;                 // the estimate says the run then fits memory_limit
  double step_time_factor = 1;       // step time with it over without it
  bool step_time_measured = true;    // false: step_time_factor is not a measurement
  std::string step_time_note;        // what is known instead, with its source
  int ranks = 0;  // the world size it needs, when not the run's (a zero plugin's proposal); 0: the
                  // run's
};

struct Advice {
  ConfigEstimate config;           // the config as written
  std::string file;                // its file, for the launch line of a remedy on more ranks
  int world_size = 1;              // the ranks it runs on
  uint64_t limit = 0;              // memory_limit (0: none)
  bool fits = true;                // the config as written fits by the estimate
  std::vector<Remedy> remedies;    // each fits by the estimate
  std::vector<Remedy> not_enough;  // each helps but does not fit alone
};

// Remedies for `config` when it does not fit its memory_limit: the built-in smaller micro-batch at
// the same effective batch; each plugin of `installed` (what PluginCatalog::offered gives for
// HR_EXT_ESTIMATE) that the config does not list, as it proposes itself (unless it takes a role a
// listed plugin has); each listed plugin that proposes a different table of its own (as --set
// flags, or the whole table to put in place of its own when its keys do not merge); and when none
// fits alone, the proposals that help, added one after the other (the largest saving first) until
// they fit.
Advice advise(const Config& config, const std::vector<OfferedExtension>& installed,
              const OomNumbers& oom = {});
// The same with the plugins installed on the search path.
Advice advise(const Config& config, const OomNumbers& oom = {});

// One documented mode of an installed plugin (hr_ext_estimate.modes): what `plan --measure
// --search` tries besides the plugin's own proposal.
struct PluginMode {
  std::string plugin;  // its name
  std::string what;    // "checkpoint (policy selective)"
  std::string toml;    // its whole [[plugins]] table
  uint32_t roles = 0;  // the HR_ROLE_*s the plugin takes
};
// Every mode of every plugin on the search path that offers headroom.estimate/1 with modes, in
// the order of the catalog and of each plugin's list.
std::vector<PluginMode> plugin_modes();

// "  NAME: what it does; step time about x1.15" for each configured plugin, then the peak by
// category and its total.
std::string format_estimate(const ConfigEstimate& e);
// The remedies as `plan` and the out-of-memory report print them.
std::string format_remedies(const Advice& advice);

}  // namespace headroom
