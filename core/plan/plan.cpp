#include "core/plan/plan.h"

#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "core/os/host_memory.h"
#include "core/report/advice.h"

namespace headroom {

namespace {

// ", N trainable ([train] freeze)" when some parameters are frozen; a pattern that matches
// nothing is the ConfigError train would give.
std::string trainable_note(const Config& config) {
  if (config.train.freeze.empty()) return "";
  check_freeze(config.model, config.train);
  uint64_t trainable = 0;
  for (const ParamShape& p : gpt_param_shapes(config.model)) {
    if (is_frozen(config.train.freeze, p.name)) continue;
    uint64_t n = 1;
    for (int64_t d : p.shape)
      n *= uint64_t(d);
    trainable += n;
  }
  return ", " + std::to_string(trainable) + " trainable (the others frozen by train.freeze)";
}

}  // namespace

PlanResult plan(const Config& given) {
  // A run that starts from a pruned model's weights ([train] init_from) builds the model at
  // their per-block MLP widths: so does its estimate. A file that cannot be read is train's to
  // report; the estimate is then of the config's shape.
  Config config = given;
  if (!config.train.init_from.empty() && config.model.mlp_hidden.empty()) {
    try {
      config.model.mlp_hidden = safetensors_mlp_widths(config.train.init_from, config.model);
      config.model.attn_heads = safetensors_attn_heads(config.train.init_from, config.model);
    } catch (const ConfigError&) {
    }
  }
  PlanResult r;
  const uint64_t limit = config.device.memory_limit;
  const ConfigEstimate e = estimate_config(config);
  // The model first: its preset (or "explicit"), arch and parameter count (closed form, so an 8B
  // shape is planned without allocating it).
  const ModelConfig& m = config.model;
  r.text = "model " + (m.preset.empty() ? std::string("(explicit)") : m.preset) + ", arch " +
           m.arch + ", " + std::to_string(gpt_num_params(m)) + " parameters" +
           trainable_note(config) + "\n" + format_estimate(e);
  const uint64_t total = e.peak.total();
  // The host ledger's wall ([host] memory_limit), when something lives there.
  const uint64_t host_limit = config.device.host_memory_limit, host_total = e.peak.host_total();
  if (host_limit && host_total) {
    if (host_total > host_limit) {
      r.fits = false;
      r.text += "does not fit [host] memory_limit " + format_bytes(host_limit) +
                ": the host ledger needs about " + format_bytes(host_total) + ", over by " +
                format_bytes(host_total - host_limit) +
                "; raise it, or keep the optimizer on the device\n";
    } else {
      r.text += "host ledger fits [host] memory_limit " + format_bytes(host_limit) + " with " +
                format_bytes(host_limit - host_total) + " to spare\n";
    }
  }
  // On the CPU the device's memory is the host's: what the host can give now is a wall as well,
  // when it is the lower one (or there is no memory_limit).
  const HostMemory host = config.device.kind == "cpu" ? host_available_memory() : HostMemory{};
  if (host.bytes && (!limit || host.bytes < limit)) {
    const std::string has = format_bytes(host.bytes) + " available (" + host.source + ")";
    const std::string wall =
        limit ? "memory_limit " + format_bytes(limit) + " is more than this host has: "
              : std::string("memory_limit: none; ");
    if (total <= host.bytes) {
      r.text += wall + "the CPU device's memory is the host's, " + has + ": fits with " +
                format_bytes(host.bytes - total) + " to spare\n";
      return r;
    }
    r.fits = false;
    r.text += "does not fit this host: needs about " + format_bytes(total) + ", and the CPU " +
              "device's memory is the host's, " + has + "; over by " +
              format_bytes(total - host.bytes) + "\n";
    Config within = config;
    within.device.memory_limit = host.bytes;
    r.text += format_remedies(advise(within));
    return r;
  }
  if (!limit) {
    r.text += "memory_limit: none\n";
    return r;
  }
  if (total <= limit) {
    r.text += "fits memory_limit " + format_bytes(limit) + " with " + format_bytes(limit - total) +
              " to spare\n";
    return r;
  }
  r.fits = false;
  r.text += "does not fit memory_limit " + format_bytes(limit) + ": needs about " +
            format_bytes(total) + ", over by " + format_bytes(total - limit) + "\n";
  r.text += format_remedies(advise(config));
  return r;
}

std::string oom_advice(const Config& config, const OomReport& report) {
  if (report.place == "host") {
    // The host ledger's wall: what lives there is the offloaded optimizer's (closed form).
    const ConfigEstimate e = estimate_config(config);
    return "the host ledger needs about " + format_bytes(e.peak.host_total()) + "; [host] " +
           "memory_limit " + format_bytes(report.limit) +
           "; raise [host] memory_limit, or keep the optimizer on the device (no offload)\n";
  }
  OomNumbers oom;
  oom.requested = report.requested;
  oom.free_bytes = report.free_bytes();
  oom.largest_free = report.largest_free;
  const Advice a = advise(config, oom);
  const uint64_t total = a.config.peak.total();
  std::string s = "needs about " + format_bytes(total) + "; " +
                  (report.limit ? format_bytes(report.limit) : std::string("no limit")) +
                  " available";
  if (a.fits)
    s += " (the estimate fits: what failed is outside it — free memory in pieces, or bytes the "
         "estimate does not count)";
  s += "\n" + format_remedies(a);
  // The estimate above is closed form; a dry run of this setup measures it, whatever the plugins.
  if (!config.file.empty())
    s += "to measure what fits and pick the fastest setup: headroom plan --measure --search " +
         config.file + "\n";
  return s;
}

}  // namespace headroom
