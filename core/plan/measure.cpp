#include "core/plan/measure.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/device/device.h"
#include "core/os/host_memory.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"

namespace headroom {

namespace {

// What the device holds at this moment: the allocator role's reserved bytes when it keeps
// statistics, else the backend's used bytes (the CPU arena under a memory_limit: padding
// included), else the live bytes (nothing is cached).
uint64_t reserved_now(const Device& d) {
  AllocatorStats s;
  if (d.allocator_stats(&s)) return s.reserved;
  const Device::BackendStats b = d.backend_stats();
  return std::max(b.used, d.tracker().live_total());
}

// Samples the reserved bytes at every allocation: their highest over the run; and the live bytes
// by category after each allocation, with its phase (VariantRun::after_alloc).
class ReservedProbe final : public EventListener {
 public:
  explicit ReservedProbe(Device& d) : device_(d), max_(reserved_now(d)) {
    const MemoryTracker& t = d.tracker();
    after_alloc_.push_back(t.live_at_peak());  // the setup's highest point
    phases_.push_back(t.peak_phase());
    alloc_phase_.push_back(0);
  }
  void on_event(const EventInfo& info) override {
    if (info.event == Event::kAlloc) {
      max_ = std::max(max_, reserved_now(device_));
      const MemoryTracker& t = device_.tracker();
      const Phase &p = t.phase(), &q = phases_.back();
      if (p.kind != q.kind || p.layer != q.layer || p.step != q.step ||
          p.micro_step != q.micro_step)
        phases_.push_back(p);
      after_alloc_.push_back(t.live_by_category());
      alloc_phase_.push_back(static_cast<uint32_t>(phases_.size() - 1));
    }
    if (info.event == Event::kStepEnd && info.step == 1) {
      step1_peak_ = device_.tracker().peak_total();
      step1_reserved_ = max();
    }
  }
  uint64_t max() const { return std::max(max_, reserved_now(device_)); }
  uint64_t step1_peak() const { return step1_peak_; }
  uint64_t step1_reserved() const { return step1_reserved_; }
  void move_points_into(VariantRun& r) {
    r.after_alloc = std::move(after_alloc_);
    r.alloc_phase = std::move(alloc_phase_);
    r.phases = std::move(phases_);
  }

 private:
  Device& device_;
  uint64_t max_;
  uint64_t step1_peak_ = 0, step1_reserved_ = 0;
  std::vector<ByCategory> after_alloc_;
  std::vector<uint32_t> alloc_phase_;
  std::vector<Phase> phases_;
};

// "block 1" of a 2-block variant is the top block of the full model: a phase named for it.
std::string full_phase(const Phase& p, int variant_layers, int n_layer) {
  Phase q = p;
  if (q.layer_name.rfind("block ", 0) == 0) {
    const int i = std::atoi(q.layer_name.c_str() + 6);
    const int full = i == variant_layers - 1 ? n_layer - 1 : i;  // the top block is the top
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
                       int steps, Arithmetic arithmetic) {
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
    options.dry = arithmetic == Arithmetic::kDry;
    Trainer t(v, std::move(options));
    ReservedProbe probe(t.device());
    t.add_listener(&probe);
    t.run();
    const MemoryTracker& mt = t.device().tracker();
    r.at_peak = mt.live_at_peak();
    r.peak = mt.peak_total();
    r.peak_phase = mt.peak_phase();
    probe.move_points_into(r);
    r.reserved = std::max(probe.max(), r.peak);
    r.step1_peak = probe.step1_peak();
    r.step1_reserved = std::max(probe.step1_reserved(), r.step1_peak);
    if (const Device* host = t.device().host_place()) {
      r.host_at_peak = host->tracker().live_at_peak();
      r.host_peak = host->tracker().peak_total();
    }
    r.step_ms = 0;
    if (arithmetic == Arithmetic::kCompute) {
      for (const StepState& h : t.history())
        if (r.step_ms == 0 || h.step_ms < r.step_ms) r.step_ms = h.step_ms;
    }
    r.ran = true;
  } catch (const OutOfMemory& e) {
    r.refused = "micro_batch " + std::to_string(micro_batch) + " with " + std::to_string(n_layer) +
                " block(s) ran out of memory: " + e.report().str();
  }
  r.wall_ms = now_ms() - t0;
  return r;
}

namespace {

// The grid at blocks l1 < l2, fitted and evaluated at (b, l): bilinear, its block slope
// (v(l2) - v(l1)) / (l2 - l1), rounded to the byte.
struct Grid {
  const VariantRun* r[4];  // (1, l1) (2, l1) (1, l2) (2, l2)
  int l1, l2;
  int64_t at(int64_t (*get)(const VariantRun&, int), int c, int b, int l) const {
    const int64_t a = get(*r[0], c) + int64_t(b - 1) * (get(*r[1], c) - get(*r[0], c));
    const int64_t z = get(*r[2], c) + int64_t(b - 1) * (get(*r[3], c) - get(*r[2], c));
    const int64_t num = int64_t(l - l1) * (z - a), den = l2 - l1;
    const int64_t q = num >= 0 ? (num + den / 2) / den : -((-num + den / 2) / den);
    return a + q;
  }
};
int64_t cat_of(const VariantRun& r, int c) {
  return static_cast<int64_t>(r.at_peak[c]);
}
int64_t host_of(const VariantRun& r, int c) {
  return static_cast<int64_t>(r.host_at_peak[c]);
}
int64_t frag_of(const VariantRun& r, int) {
  return static_cast<int64_t>(r.reserved - r.peak);
}

// The sum over categories, each at least 0.
int64_t peak_at(const Grid& g, int b, int l) {
  int64_t p = 0;
  for (int c = 0; c < kNumCategories; ++c)
    p += std::max<int64_t>(0, g.at(cat_of, c, b, l));
  return p;
}

// The micro-batch fit, allocation by allocation: runs `one` and `two` (micro_batch 1 and 2, the
// same blocks: the same allocations in the same order, of other sizes) give each allocation's
// point (the live bytes by category after it), fitted as v(b) = v1 + (b-1)·(v2 - v1), each
// category at least 0; the prediction at `b` is the point whose fitted total is the highest (the
// first of equals, as the tracker keeps the first). The run's peak is the highest of its points,
// a maximum that is not affine in the micro-batch when it moves from one point to another (zero2
// peaks with its gradients reduced at micro_batch 1 and 2, in a forward at 8): fitting each point
// keeps the prediction exact wherever every allocation's size is affine in the micro-batch.
// Not ok when the two runs allocate differently (a plugin whose choices follow the batch's bytes).
struct PointFit {
  bool ok = false;
  ByCategory at_peak{};
  uint64_t peak = 0;
  Phase phase;
};
PointFit fit_points(const VariantRun& one, const VariantRun& two, int b) {
  PointFit f;
  if (one.after_alloc.size() != two.after_alloc.size() || one.after_alloc.empty()) return f;
  for (size_t i = 0; i < one.after_alloc.size(); ++i) {
    ByCategory v{};
    uint64_t total = 0;
    for (int c = 0; c < kNumCategories; ++c) {
      const int64_t v1 = static_cast<int64_t>(one.after_alloc[i][c]);
      const int64_t v2 = static_cast<int64_t>(two.after_alloc[i][c]);
      v[c] = static_cast<uint64_t>(std::max<int64_t>(0, v1 + int64_t(b - 1) * (v2 - v1)));
      total += v[c];
    }
    if (!f.ok || total > f.peak) {
      f.ok = true;
      f.at_peak = v;
      f.peak = total;
      f.phase = two.phases[two.alloc_phase[i]];
    }
  }
  return f;
}

}  // namespace

Measured measure(const Config& config, Arithmetic arithmetic, uint64_t host_bytes) {
  Measured m;
  const int B = config.train.micro_batch, N = config.model.n_layer;
  const double t0 = now_ms();
  // The config itself, when it can run here: the CPU device's memory is the host's (a GPU's is
  // its memory_limit, when set: its own size is not known before the device is made).
  const bool cpu = config.device.kind == "cpu";
  uint64_t room = host_bytes;
  std::string room_what = "the host memory given (" + format_bytes(host_bytes) + ")";
  if (host_bytes == kHostAvailable) {
    const HostMemory h = cpu ? host_available_memory() : HostMemory{};
    room = cpu ? h.bytes : config.device.memory_limit;
    room_what = cpu ? "this host's " + format_bytes(room) + " available (" + h.source + ")"
                    : "memory_limit " + format_bytes(room);
  }
  uint64_t need = 0;
  try {
    need = estimate_config(variant_of(config, B, N), {}, 1).peak.total();
  } catch (const ConfigError&) {
    need = 0;  // the variants' own runs say what is wrong
  }
  // A dry run on the CPU commits no host memory (its buffers are mapped without backing and hold
  // no values: core/device/dry_backend.h), so the host's RAM is no bound on the config it runs
  // itself; a host size the caller gives still is.
  const bool uncommitted = cpu && arithmetic == Arithmetic::kDry && host_bytes == kHostAvailable;
  if ((room && need && need + need / 4 <= room) || (uncommitted && need)) {
    VariantRun self = run_variant(config, B, N, 0, 2, arithmetic);
    if (self.ran) {
      m.method = Measured::Method::kDirect;
      m.grid_blocks = {N, N};
      m.by_category = self.at_peak;
      m.peak = self.peak;
      m.reserved = std::max(self.reserved, self.peak);
      m.fragmentation = m.reserved - m.peak;
      m.phase = full_phase(self.peak_phase, N, N);
      m.host_by_category = self.host_at_peak;
      m.host_peak = self.host_peak;
      m.runs.push_back(std::move(self));
      m.wall_ms = now_ms() - t0;
      return m;
    }
    m.why_extrapolated = "the config itself did not run dry: " + self.refused;
  } else if (!room) {
    m.why_extrapolated = host_bytes == 0 ? "extrapolation asked for"
                         : cpu           ? "this host's available memory is not known"
                                         : "a GPU's memory is not known without memory_limit";
  } else {
    m.why_extrapolated = "the config itself needs about " + format_bytes(need) +
                         " by the closed form (a quarter more kept for what it does not count), "
                         "more than " +
                         room_what;
  }
  // Every dry run made, by (micro_batch, blocks): a wider grid reuses what it can.
  std::vector<VariantRun> runs;
  runs.reserve(16);
  auto run = [&](int b, int l) -> const VariantRun& {
    for (const VariantRun& r : runs)
      if (r.micro_batch == b && r.n_layer == l) return r;
    runs.push_back(run_variant(config, b, l, 0, m.steps, arithmetic));
    return runs.back();
  };
  auto fits_room = [&](int b, int l) {
    try {
      const uint64_t n = estimate_config(variant_of(config, b, l), {}, 1).peak.total();
      return room && n && n + n / 4 <= room;
    } catch (const ConfigError&) {
      return false;
    }
  };
  // The prediction from a fitted grid, evaluated at the config.
  auto predict = [&](const Grid& g) {
    for (int c = 0; c < kNumCategories; ++c) {
      m.by_category[c] = static_cast<uint64_t>(std::max<int64_t>(0, g.at(cat_of, c, B, N)));
      m.peak += m.by_category[c];
    }
    m.fragmentation = static_cast<uint64_t>(std::max<int64_t>(0, g.at(frag_of, 0, B, N)));
    m.reserved = m.peak + m.fragmentation;
    // The host ledger's own peak, fitted as the device's categories are (its bytes follow the
    // parameters: affine in the blocks, constant in the micro-batch).
    m.host_peak = 0;
    for (int c = 0; c < kNumCategories; ++c) {
      m.host_by_category[c] = static_cast<uint64_t>(std::max<int64_t>(0, g.at(host_of, c, B, N)));
      m.host_peak += m.host_by_category[c];
    }
  };
  // Next: the configured blocks at micro_batch 1 and 2, fitted over the micro-batch alone (what a
  // policy does with the number of blocks, these runs do), and checked at micro_batch 3.
  if (B > 2 && fits_room(2, N)) {
    const VariantRun &one = run(1, N), &two = run(2, N);
    if (one.ran && two.ran) {
      Grid g{};
      g.r[0] = g.r[2] = &one;
      g.r[1] = g.r[3] = &two;
      g.l1 = N;
      g.l2 = N + 1;  // no slope over blocks: both rows are the configured blocks
      const PointFit at_b = fit_points(one, two, B);
      if (fits_room(3, N)) {
        const VariantRun& c = run(3, N);
        if (c.ran) {
          const PointFit at_3 = fit_points(one, two, 3);
          const int64_t pred = at_3.ok ? static_cast<int64_t>(at_3.peak) : peak_at(g, 3, N);
          m.check_b = 3;
          m.check_l = N;
          m.check_peak_error = static_cast<int64_t>(c.peak) - pred;
          m.check_reserved_error = static_cast<int64_t>(c.reserved) -
                                   (pred + std::max<int64_t>(0, g.at(frag_of, 0, 3, N)));
          m.check_run = c;
        }
      }
      m.method = Measured::Method::kMicroBatch;
      m.grid_blocks = {N, N};
      predict(g);  // the fragmentation's fit, and the whole peak's where the phases differ
      if (at_b.ok) {
        m.by_category = at_b.at_peak;
        m.peak = at_b.peak;
        m.reserved = m.peak + m.fragmentation;
      }
      m.phase = full_phase(at_b.ok ? at_b.phase : two.peak_phase, N, N);
      m.runs = std::move(runs);
      m.wall_ms = now_ms() - t0;
      return m;
    }
    runs.clear();
  }
  // The smallest variant runs two steps. When the second raised neither the peak nor the reserved
  // bytes (the optimizer state and every plugin's lazy allocations exist from step 1), one step is
  // the same measurement at half the cost, and every other variant runs one.
  {
    const VariantRun& first = run(1, 1);
    if (first.ran && first.peak == first.step1_peak && first.reserved == first.step1_reserved)
      m.steps = 1;
  }
  // Blocks 1 and 2 first. A plugin whose policy repeats over blocks (a checkpoint of every n-th)
  // is not affine there: when the check point misses, the grid widens to blocks k and 2k, which
  // hold whole periods, as long as 2k <= n_layer.
  Grid best{};
  int64_t best_err = -1, best_res_err = 0;
  int best_cb = 0, best_cl = 0;
  double best_rel = 0;
  for (int k = 1; k == 1 || (2 * k <= N && k <= 4); ++k) {
    Grid g{};
    g.l1 = k;
    g.l2 = 2 * k;
    const int grid[4][2] = {{1, k}, {2, k}, {1, 2 * k}, {2, 2 * k}};
    bool ok = true;
    for (int i = 0; i < 4; ++i) {
      const VariantRun& r = run(grid[i][0], grid[i][1]);
      if (!r.ran) {
        if (k > 1) {
          ok = false;
          break;
        }
        if (i == 0) throw PlanRefused("even the smallest variant cannot run: " + r.refused);
        throw PlanRefused("the dry run needs micro_batch 1 and 2 with 1 and 2 blocks; " +
                          r.refused);
      }
    }
    if (!ok) break;
    for (int i = 0; i < 4; ++i)
      g.r[i] = &run(grid[i][0], grid[i][1]);
    // The check: a point off the grid, as near the config as is cheap.
    const int cb = std::min(B, 3), cl = std::min(N, 3 * k);
    int64_t err = 0, res_err = 0;
    double rel = 0;
    const bool on_grid = (cb <= 2) && (cl == k || cl == 2 * k);
    if (!on_grid && (B > 2 || N > 2 * k)) {
      const VariantRun& c = run(cb, cl);
      if (c.ran) {
        const int64_t pred = peak_at(g, cb, cl);
        err = static_cast<int64_t>(c.peak) - pred;
        res_err = static_cast<int64_t>(c.reserved) -
                  (pred + std::max<int64_t>(0, g.at(frag_of, 0, cb, cl)));
        rel = std::abs(double(err)) / double(c.peak);
      } else {
        rel = 0;  // cannot check: take this grid
      }
    } else {
      m.check_b = 0;
    }
    if (best_err < 0 || rel < best_rel) {
      best = g;
      best_err = std::abs(err);
      best_res_err = res_err;
      best_rel = rel;
      best_cb = on_grid ? 0 : cb;
      best_cl = on_grid ? 0 : cl;
      m.check_peak_error = err;
      m.check_reserved_error = res_err;
    }
    if (rel <= 0.001) break;  // within 0.1%: this grid holds
  }
  (void)best_res_err;
  m.check_b = (B > 2 || N > 2 * best.l1) ? best_cb : 0;
  m.check_l = m.check_b ? best_cl : 0;
  m.grid_blocks = {best.l1, best.l2};
  predict(best);
  m.phase = full_phase(best.r[3]->peak_phase, best.l2, N);
  if (m.check_b) {
    for (const VariantRun& r : runs)
      if (r.micro_batch == m.check_b && r.n_layer == m.check_l) m.check_run = r;
  }
  m.runs = std::move(runs);
  m.wall_ms = now_ms() - t0;
  return m;
}

double measure_step_ms(const Config& config) {
  {
    const int blocks = std::min(config.model.n_layer, 2);
    // 3 steps each, the fastest taken: the first step allocates, the others say what a step costs.
    const VariantRun one =
        run_variant(config, config.train.micro_batch, blocks, 1, 3, Arithmetic::kCompute);
    if (!one.ran) return 0;
    const VariantRun two =
        run_variant(config, config.train.micro_batch, blocks, 2, 3, Arithmetic::kCompute);
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
  const std::string shape = "micro_batch " + std::to_string(config.train.micro_batch) + " with " +
                            std::to_string(config.model.n_layer) + " blocks";
  if (m.method == Measured::Method::kDirect) {
    std::snprintf(line, sizeof line, " in %.2f s\n", m.wall_ms / 1000);
    s += "measured: the config itself (" + shape +
         "), dry: 2 steps of every allocation, free and copy, no arithmetic" + line;
    s += "peak at " + m.phase + ":\n";
  } else {
    s += "extrapolated: " + m.why_extrapolated + "\n";
    s += "measured: " + std::to_string(m.runs.size()) + " dry runs of " + std::to_string(m.steps) +
         (m.steps == 1 ? " step (the first of 2;" : " steps (") + " micro_batch x blocks:";
    for (const VariantRun& r : m.runs) {
      std::snprintf(line, sizeof line, " %dx%d%s", r.micro_batch, r.n_layer,
                    r.ran ? "" : " refused");
      s += line;
    }
    std::snprintf(line, sizeof line, ") in %.2f s\n", m.wall_ms / 1000);
    s += line;
    s += m.method == Measured::Method::kMicroBatch
             ? "fitted over micro_batch at the configured " + std::to_string(config.model.n_layer) +
                   " blocks: exact unless a plugin's choices follow the bytes a micro-batch "
                   "takes (a recomputation budget, a batch that shrinks near the limit)\n"
             : std::string(
                   "fitted over micro_batch and blocks: exact for what is affine in the "
                   "blocks; what is not (recomputing every n-th block, sqrt(L) of them or to a "
                   "budget; zero2's and zero3's sharded gradients and gathers) can miss by tens "
                   "of percent, up to 39% in docs/results/planner.md (\"Every policy\"), without "
                   "its check point seeing it: measure on a host that holds micro_batch 2 of "
                   "the config's blocks\n");
    s += "predicted peak at " + shape + ", at " + m.phase + ":\n";
  }
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
  // The host ledger beside its closed form (what `plan` prints as "estimated host memory").
  uint64_t host_closed = 0;
  ByCategory host_closed_by{};
  try {
    const PeakEstimate e = estimate_config(config).peak;
    host_closed = e.host_total();
    host_closed_by = e.host;
  } catch (const ConfigError&) {
    // the plugins refuse the config: the dry runs said so already
  }
  if (m.host_peak || host_closed) {
    s += "host ledger (measured; the closed form beside it):\n";
    for (int i = 0; i < kNumCategories; ++i) {
      if (!m.host_by_category[i] && !host_closed_by[i]) continue;
      std::snprintf(line, sizeof line, "  %-16s %14s   closed form %14s\n",
                    category_name(category_at(i)), format_bytes(m.host_by_category[i]).c_str(),
                    format_bytes(host_closed_by[i]).c_str());
      s += line;
    }
    const int64_t off = static_cast<int64_t>(m.host_peak) - static_cast<int64_t>(host_closed);
    std::snprintf(line, sizeof line,
                  "  %-16s %14s   closed form %14s (measured - closed form: %lld bytes)\n", "total",
                  format_bytes(m.host_peak).c_str(), format_bytes(host_closed).c_str(),
                  static_cast<long long>(off));
    s += line;
  }
  if (m.check_b) {
    const VariantRun& c = m.check_run;
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
    if (c.ran && std::abs(double(m.check_peak_error)) > 0.001 * double(c.peak)) {
      std::snprintf(line, sizeof line,
                    "warning: the fit misses its check by %.2f%%: a policy that is not affine in "
                    "the fit's terms is predicted about that far off; measure on a host that holds "
                    "the config to have it exact\n",
                    100.0 * std::abs(double(m.check_peak_error)) / double(c.peak));
      s += line;
    }
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
  j["host_peak_bytes"] = m.host_peak;
  nlohmann::ordered_json host = nlohmann::ordered_json::object();
  for (int i = 0; i < kNumCategories; ++i)
    host[category_name(category_at(i))] = m.host_by_category[i];
  j["host_by_category"] = host;
  if (m.check_b && m.check_run.ran) {
    j["check"] = {{"micro_batch", m.check_b},
                  {"n_layer", m.check_l},
                  {"measured_peak_bytes", m.check_run.peak},
                  {"peak_error_bytes", m.check_peak_error},
                  {"reserved_error_bytes", m.check_reserved_error}};
  }
  j["method"] = m.method == Measured::Method::kDirect       ? "the config itself"
                : m.method == Measured::Method::kMicroBatch ? "fitted over micro_batch"
                                                            : "fitted over micro_batch and blocks";
  if (m.method != Measured::Method::kDirect) j["why_extrapolated"] = m.why_extrapolated;
  j["dry_run_s"] = m.wall_ms / 1000;
  j["dry_run_steps"] = m.steps;
  return j.dump(pretty ? 2 : -1);
}

}  // namespace headroom
