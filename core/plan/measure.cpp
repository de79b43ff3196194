#include "core/plan/measure.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/device/device.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"

namespace headroom {

namespace {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// What the device holds at this moment: the allocator role's reserved bytes when it keeps
// statistics, else the backend's used bytes (the CPU arena under a memory_limit: padding
// included), else the live bytes (nothing is cached).
uint64_t reserved_now(const Device& d) {
  AllocatorStats s;
  if (d.allocator_stats(&s)) return s.reserved;
  const Device::BackendStats b = d.backend_stats();
  return std::max(b.used, d.tracker().live_total());
}

// Samples the reserved bytes at every allocation: their highest over the run.
class ReservedProbe final : public EventListener {
 public:
  explicit ReservedProbe(Device& d) : device_(d), max_(reserved_now(d)) {}
  void on_event(const EventInfo& info) override {
    if (info.event == Event::kAlloc) max_ = std::max(max_, reserved_now(device_));
  }
  uint64_t max() const { return std::max(max_, reserved_now(device_)); }

 private:
  Device& device_;
  uint64_t max_;
};

// The grid's value of one quantity: v[0] (1,1), v[1] (2,1), v[2] (1,2), v[3] (2,2).
Fit fit_of(const int64_t v[4]) {
  Fit f;
  f.v11 = v[0];
  f.db = v[1] - v[0];
  f.dl = v[2] - v[0];
  f.dx = v[3] - v[1] - v[2] + v[0];
  return f;
}

// "block 1" of a 2-block variant is the top block of the full model: a phase named for it.
std::string full_phase(const Phase& p, int variant_layers, int n_layer) {
  Phase q = p;
  if (q.layer_name.rfind("block ", 0) == 0) {
    const int i = std::atoi(q.layer_name.c_str() + 6);
    const int full = i == variant_layers - 1 ? n_layer - 1 : i;
    q.layer_name = "block " + std::to_string(full);
    q.layer = full + 1;
  } else if (q.layer_name == "head") {
    q.layer = n_layer + 1;
  }
  q.step = 0;
  q.micro_step = 0;
  std::string s = q.str();
  // The step of a dry run says nothing about the full run.
  const size_t cut = s.find(", step");
  return cut == std::string::npos ? s : s.substr(0, cut);
}

}  // namespace

int64_t Fit::at(int b, int l) const {
  return v11 + int64_t(b - 1) * db + int64_t(l - 1) * dl + int64_t(b - 1) * (l - 1) * dx;
}

Config variant_of(const Config& config, int micro_batch, int n_layer, int grad_accum, int steps) {
  Config v = config;
  v.model.n_layer = n_layer;
  v.train.micro_batch = micro_batch;
  v.train.grad_accum = grad_accum > 0 ? grad_accum : std::min(config.train.grad_accum, 2);
  v.train.steps = steps;
  v.train.warmup_steps = std::min<int64_t>(v.train.warmup_steps, 1);
  v.train.eval_every = 0;
  v.train.log_every = 1;
  v.snapshot.every = 0;
  return v;
}

VariantRun run_variant(const Config& config, int micro_batch, int n_layer, int grad_accum,
                       int steps) {
  VariantRun r;
  r.micro_batch = micro_batch;
  r.n_layer = n_layer;
  const Config v = variant_of(config, micro_batch, n_layer, grad_accum, steps);
  const uint64_t limit = v.device.memory_limit;
  if (limit) {
    // Refused before it allocates: the closed form of the variant (its plugins' estimates
    // included) over the wall.
    const uint64_t need = estimate_config(v, {}, 1).peak.total();
    if (need > limit) {
      r.refused = "micro_batch " + std::to_string(micro_batch) + " with " +
                  std::to_string(n_layer) + " block(s) needs about " + format_bytes(need) +
                  " by the closed form, over memory_limit " + format_bytes(limit);
      return r;
    }
  }
  const double t0 = now_ms();
  try {
    TrainOptions options;  // silent, writes nothing
    Trainer t(v, std::move(options));
    ReservedProbe probe(t.device());
    t.add_listener(&probe);
    t.run();
    const MemoryTracker& mt = t.device().tracker();
    r.at_peak = mt.live_at_peak();
    r.peak = mt.peak_total();
    r.peak_phase = mt.peak_phase();
    r.reserved = std::max(probe.max(), r.peak);
    r.step_ms = 0;
    for (const StepRecord& h : t.history())
      if (r.step_ms == 0 || h.step_ms < r.step_ms) r.step_ms = h.step_ms;
    r.ran = true;
  } catch (const OutOfMemory& e) {
    r.refused = "micro_batch " + std::to_string(micro_batch) + " with " + std::to_string(n_layer) +
                " block(s) ran out of memory: " + e.report().str();
  }
  r.wall_ms = now_ms() - t0;
  return r;
}

Measured measure(const Config& config) {
  Measured m;
  const int B = config.train.micro_batch, N = config.model.n_layer;
  const double t0 = now_ms();
  const int grid[4][2] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}};
  for (const auto& g : grid) {
    VariantRun r = run_variant(config, g[0], g[1]);
    if (!r.ran) {
      if (g[0] == 1 && g[1] == 1)
        throw PlanRefused("even the smallest variant cannot run: " + r.refused);
      throw PlanRefused("the dry run needs micro_batch 1 and 2 with 1 and 2 blocks; " + r.refused);
    }
    m.runs.push_back(std::move(r));
  }
  int64_t v[4];
  for (int c = 0; c < kNumCategories; ++c) {
    for (int i = 0; i < 4; ++i)
      v[i] = static_cast<int64_t>(m.runs[i].at_peak[c]);
    m.by_category[c] = static_cast<uint64_t>(std::max<int64_t>(0, fit_of(v).at(B, N)));
    m.peak += m.by_category[c];
  }
  for (int i = 0; i < 4; ++i)
    v[i] = static_cast<int64_t>(m.runs[i].reserved - m.runs[i].peak);
  const Fit frag = fit_of(v);
  m.fragmentation = static_cast<uint64_t>(std::max<int64_t>(0, frag.at(B, N)));
  m.reserved = m.peak + m.fragmentation;
  // Step time, fitted the same way (microseconds) and scaled to the config's accumulation.
  for (int i = 0; i < 4; ++i)
    v[i] = static_cast<int64_t>(m.runs[i].step_ms * 1000);
  const int accum_v = variant_of(config, 1, 1).train.grad_accum;
  m.step_ms = std::max<int64_t>(1, fit_of(v).at(B, N)) / 1000.0 * config.train.grad_accum / accum_v;
  m.phase = full_phase(m.runs[3].peak_phase, 2, N);

  // The check: a point off the grid, as near the config as is cheap.
  if (B > 2 || N > 2) {
    m.check_b = std::min(B, 3);
    m.check_l = std::min(N, 3);
    VariantRun r = run_variant(config, m.check_b, m.check_l);
    if (r.ran) {
      int64_t pred = 0;
      int64_t vv[4];
      for (int c = 0; c < kNumCategories; ++c) {
        for (int i = 0; i < 4; ++i)
          vv[i] = static_cast<int64_t>(m.runs[i].at_peak[c]);
        pred += std::max<int64_t>(0, fit_of(vv).at(m.check_b, m.check_l));
      }
      m.check_peak_error = static_cast<int64_t>(r.peak) - pred;
      const int64_t pred_res = pred + std::max<int64_t>(0, frag.at(m.check_b, m.check_l));
      m.check_reserved_error = static_cast<int64_t>(r.reserved) - pred_res;
    }
    m.runs.push_back(std::move(r));
  }
  m.wall_ms = now_ms() - t0;
  return m;
}

double measure_step_ms(const Config& config) {
  {
    const int blocks = std::min(config.model.n_layer, 2);
    const VariantRun one = run_variant(config, config.train.micro_batch, blocks, 1, 2);
    if (!one.ran) return 0;
    const VariantRun two = run_variant(config, config.train.micro_batch, blocks, 2, 2);
    if (!two.ran) return 0;
    // two = 2·micro + opt, one = micro + opt; timing noise can make micro look cheaper than it
    // is: never below half of `one`.
    const double micro = std::max(two.step_ms - one.step_ms, one.step_ms / 2);
    const double opt = std::max(0.0, one.step_ms - micro);
    return config.train.grad_accum * micro + opt;
  }
  return 0;
}

std::string format_measured(const Config& config, const Measured& m) {
  std::string s;
  char line[256];
  s += "measured: " + std::to_string(m.runs.size()) + " dry runs of 2 steps (micro_batch x blocks:";
  for (const VariantRun& r : m.runs) {
    std::snprintf(line, sizeof line, " %dx%d%s", r.micro_batch, r.n_layer, r.ran ? "" : " refused");
    s += line;
  }
  std::snprintf(line, sizeof line, ") in %.2f s\n", m.wall_ms / 1000);
  s += line;
  s += "predicted peak at micro_batch " + std::to_string(config.train.micro_batch) + " with " +
       std::to_string(config.model.n_layer) + " blocks, at " + m.phase + ":\n";
  for (int i = 0; i < kNumCategories; ++i) {
    if (!m.by_category[i]) continue;
    std::snprintf(line, sizeof line, "  %-16s %14s\n", category_name(category_at(i)),
                  format_bytes(m.by_category[i]).c_str());
    s += line;
  }
  std::snprintf(line, sizeof line, "  %-16s %14s (%llu bytes)\n", "total",
                format_bytes(m.peak).c_str(), static_cast<unsigned long long>(m.peak));
  s += line;
  s += "  reserved " + format_bytes(m.reserved) + ", fragmentation " +
       format_bytes(m.fragmentation) + "\n";
  if (m.check_b) {
    const VariantRun& c = m.runs.back();
    if (c.ran) {
      std::snprintf(line, sizeof line,
                    "fit checked at micro_batch %d x %d blocks: measured peak %s, off the fit by "
                    "%lld bytes (reserved: %lld)\n",
                    m.check_b, m.check_l, format_bytes(c.peak).c_str(),
                    static_cast<long long>(m.check_peak_error),
                    static_cast<long long>(m.check_reserved_error));
    } else {
      std::snprintf(line, sizeof line, "fit not checked: %s\n", c.refused.c_str());
    }
    s += line;
  }
  return s;
}

std::string measured_json(const Measured& m, bool pretty) {
  nlohmann::ordered_json j;
  j["peak_bytes"] = m.peak;
  nlohmann::ordered_json cats = nlohmann::ordered_json::object();
  for (int i = 0; i < kNumCategories; ++i)
    cats[category_name(category_at(i))] = m.by_category[i];
  j["by_category"] = cats;
  j["reserved_bytes"] = m.reserved;
  j["fragmentation"] = m.fragmentation;
  j["phase"] = m.phase;
  j["step_ms"] = m.step_ms;
  if (m.check_b && m.runs.back().ran) {
    j["check"] = {{"micro_batch", m.check_b},
                  {"n_layer", m.check_l},
                  {"measured_peak_bytes", m.runs.back().peak},
                  {"peak_error_bytes", m.check_peak_error},
                  {"reserved_error_bytes", m.check_reserved_error}};
  }
  j["dry_run_s"] = m.wall_ms / 1000;
  return j.dump(pretty ? 2 : -1);
}

}  // namespace headroom
