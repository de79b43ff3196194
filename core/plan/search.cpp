#include "core/plan/search.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/device/backend.h"
#include "core/model/model.h"
#include "core/os/host_memory.h"
#include "core/os/output_file.h"
#include "core/report/advice.h"

namespace headroom {

namespace {

// A closed form this far over the budget is not worth a dry run: the closed forms are exact for
// what core knows, and a plugin that offers no estimate is rarely worth a quarter of the memory.
constexpr double kPruneOver = 1.25;

// The config with `toml` appended (after dropping the plugin table at `replaces`, when set) and
// `sets` applied: parsed again as a file would be, so every plugin table is checked as written.
Config with_changes(const Config& config, const std::string& replaces, const std::string& toml,
                    const std::vector<std::string>& sets) {
  Config base = config;
  if (!replaces.empty())
    base.plugins.erase(
        std::remove_if(base.plugins.begin(), base.plugins.end(),
                       [&](const PluginEntry& p) { return p.pos.str() == replaces; }),
        base.plugins.end());
  return parse_config(format_config(base) + "\n" + toml, config.file, sets);
}

// "+ amp + checkpoint, micro_batch=8": what a remedy changes, short.
std::string short_what(const Remedy& rem) {
  std::string s;
  for (const std::string& p : rem.plugins)
    s += (s.empty() ? "+ " : " + ") + p;
  for (const std::string& set : rem.sets)
    s += (s.empty() ? "" : ", ") + set;
  return s.empty() ? rem.what : s;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v)
    s += (s.empty() ? "" : " ") + std::string("--set ") + x;
  return s;
}

}  // namespace

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// (slowest - fastest) / fastest of a candidate's rounds.
double spread(const Candidate& c) {
  if (c.times.empty()) return 0;
  const auto [lo, hi] = std::minmax_element(c.times.begin(), c.times.end());
  return *lo > 0 ? (*hi - *lo) / *lo : 0;
}

constexpr double kNoiseFloor = 0.03;

}  // namespace

OffloadRates measure_offload_rates() {
  OffloadRates rates;
  const uint64_t bytes = 64ull << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const double t0 = now_s();
    std::memcpy(dst.data(), src.data(), bytes);
    const double dt = now_s() - t0;
    if (dt > 0 && (best == 0 || dt < best)) best = dt;
  }
  if (best > 0) rates.copy_bytes_per_s = double(bytes) / best;
  const uint64_t n = 4ull << 20;
  std::vector<float> p(n, 0.5f), g(n, 0.01f), m(n, 0), v(n, 0);
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  best = 0;
  for (int i = 0; i < 3; ++i) {
    const double t0 = now_s();
    cpu->adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                      i + 1);
    const double dt = now_s() - t0;
    if (dt > 0 && (best == 0 || dt < best)) best = dt;
  }
  if (best > 0) rates.adamw_elements_per_s = double(n) / best;
  return rates;
}

void pick_recommended(SearchResult& r) {
  r.best = -1;
  r.within_noise = 0;
  r.offload_only = false;
  // Offload candidates compete only when nothing on the device alone fits.
  bool device_only_fits = false;
  for (const Candidate& c : r.candidates)
    if (c.fits && c.step_ms > 0 && c.m.host_peak == 0) device_only_fits = true;
  auto eligible = [&](const Candidate& c) {
    return c.fits && c.step_ms > 0 && (!device_only_fits || c.m.host_peak == 0);
  };
  int fastest = -1;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const Candidate& c = r.candidates[i];
    if (eligible(c) && (fastest < 0 || c.step_ms < r.candidates[fastest].step_ms))
      fastest = static_cast<int>(i);
  }
  if (fastest < 0) return;
  const Candidate& f = r.candidates[fastest];
  r.best = fastest;
  r.offload_only = !device_only_fits;
  // The timing noise: the median, over the timed candidates that fit, of each one's spread of
  // rounds (and at least the floor). One candidate's spread, the fastest's, moved with the load
  // from one search to the next, and the band with it, which changed the pick; the median of
  // all of them holds still.
  std::vector<double> spreads;
  for (const Candidate& c : r.candidates)
    if (eligible(c) && c.times.size() > 1) spreads.push_back(spread(c));
  double noise = kNoiseFloor;
  if (!spreads.empty()) {
    std::nth_element(spreads.begin(), spreads.begin() + spreads.size() / 2, spreads.end());
    noise = std::max(noise, spreads[spreads.size() / 2]);
  }
  r.noise = noise;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const Candidate& c = r.candidates[i];
    if (!eligible(c)) continue;
    if (c.step_ms > f.step_ms * (1 + noise)) continue;  // no telling them apart within the noise
    ++r.within_noise;
    const Candidate& b = r.candidates[r.best];
    if (c.m.reserved < b.m.reserved || (c.m.reserved == b.m.reserved && c.step_ms < b.step_ms))
      r.best = static_cast<int>(i);
  }
}

SearchResult search(const Config& config, uint64_t budget, double deadline_s) {
  SearchResult r;
  r.budget = budget;
  r.deadline_s = deadline_s;
  const double t0 = now_s();
  auto past_deadline = [&] { return now_s() - t0 >= deadline_s; };
  // The dry runs run under the budget: a variant that would not fit it is refused before it
  // allocates.
  Config base = config;
  base.device.memory_limit = budget;

  std::vector<Candidate> cands;
  auto add = [&](std::string what, std::vector<std::string> sets, const std::string& replaces,
                 std::string toml) {
    Candidate c;
    c.what = std::move(what);
    c.sets = std::move(sets);
    c.toml = std::move(toml);
    try {
      c.config = with_changes(base, replaces, c.toml, c.sets);
    } catch (const ConfigError& e) {
      c.skipped = std::string("not a valid config: ") + e.what();
    }
    cands.push_back(std::move(c));
  };
  add("as written", {}, "", "");

  // micro_batch x grad_accum with the same sequences per step.
  const int E = config.train.micro_batch * config.train.grad_accum;
  for (int b = E; b >= 1; --b) {
    if (E % b != 0 || b == config.train.micro_batch) continue;
    add("micro_batch " + std::to_string(b) + " x grad_accum " + std::to_string(E / b),
        {"train.micro_batch=" + std::to_string(b), "train.grad_accum=" + std::to_string(E / b)}, "",
        "");
  }

  // The installed plugins' proposals for this budget, and pairs of those that help but do not fit
  // alone (by the closed forms: the measurement decides).
  const Advice a = advise(base);
  std::vector<const Remedy*> helps;
  for (const std::vector<Remedy>* list : {&a.remedies, &a.not_enough}) {
    for (const Remedy& rem : *list) {
      if (rem.toml.empty() && !rem.sets.empty() && rem.sets[0].rfind("train.micro_batch=", 0) == 0)
        continue;  // a split: measured above
      if (rem.ranks > 1) {
        Candidate c;
        c.what = short_what(rem);
        c.skipped = "needs " + std::to_string(rem.ranks) + " ranks: a dry run is one process";
        cands.push_back(std::move(c));
        continue;
      }
      add(short_what(rem), rem.sets, rem.replaces, rem.toml);
      if (list == &a.not_enough && rem.replaces.empty()) helps.push_back(&rem);
    }
  }
  for (size_t i = 0; i < helps.size(); ++i)
    for (size_t j = i + 1; j < helps.size(); ++j) {
      std::vector<std::string> sets = helps[i]->sets;
      sets.insert(sets.end(), helps[j]->sets.begin(), helps[j]->sets.end());
      add(short_what(*helps[i]) + " & " + short_what(*helps[j]), sets, "",
          helps[i]->toml + "\n" + helps[j]->toml);
    }

  // The plugins' documented modes (checkpoint policies, amp precisions, ...), each alone, and in
  // pairs across plugins where neither alone fits by the closed form (otherwise the pair only adds
  // the second one's time). The plugins name their modes; the search knows none of them.
  auto listed = [&](const std::string& name) {
    return std::any_of(config.plugins.begin(), config.plugins.end(),
                       [&](const PluginEntry& p) { return p.name == name; });
  };
  const std::vector<PluginMode> modes = plugin_modes();
  std::vector<const PluginMode*> usable;
  std::vector<bool> fits_alone;
  for (const PluginMode& m : modes) {
    if (listed(m.plugin) || (m.roles & a.config.roles)) continue;
    add("+ " + m.what, {}, "", m.toml);
    bool alone = false;
    if (cands.back().skipped.empty()) {
      try {
        alone = estimate_config(cands.back().config, {}, 1).peak.total() <= budget;
      } catch (const ConfigError&) {
        // refused alone: the pruning below says so for this candidate
      }
    }
    usable.push_back(&m);
    fits_alone.push_back(alone);
  }
  for (size_t i = 0; i < usable.size(); ++i)
    for (size_t j = i + 1; j < usable.size(); ++j) {
      if (usable[i]->plugin == usable[j]->plugin || (usable[i]->roles & usable[j]->roles)) continue;
      if (fits_alone[i] || fits_alone[j]) continue;
      add("+ " + usable[i]->what + " + " + usable[j]->what, {}, "",
          usable[i]->toml + "\n" + usable[j]->toml);
    }

  // Prune by the closed form, then measure.
  std::vector<std::string> seen;  // each config once (a pair may be a proposal already listed)
  for (Candidate& c : cands) {
    if (!c.skipped.empty()) continue;
    const std::string text = format_config(c.config);
    if (std::find(seen.begin(), seen.end(), text) != seen.end()) {
      c.skipped = "the same config as a candidate above";
      continue;
    }
    seen.push_back(text);
    uint64_t host_closed = 0;
    try {
      const PeakEstimate e = estimate_config(c.config, {}, 1).peak;
      c.closed_form = e.total();
      host_closed = e.host_total();
    } catch (const ConfigError& e) {
      c.skipped = std::string("its plugins refuse it: ") + e.what();
      continue;
    }
    // The host ledger's closed form is exact (plan --measure checks it): over [host]
    // memory_limit, the dry run would stop there with an out-of-memory report.
    const uint64_t host_limit = c.config.device.host_memory_limit;
    if (host_limit && host_closed > host_limit) {
      c.skipped = "its host ledger needs " + format_bytes(host_closed) +
                  " by the closed form, over [host] memory_limit " + format_bytes(host_limit);
      c.host_fits = false;
      continue;
    }
    if (c.closed_form > budget * kPruneOver) {
      c.skipped = "the closed form says " + format_bytes(c.closed_form) + ", far over the budget";
      continue;
    }
    if (past_deadline()) {
      c.skipped = "past the search's deadline";
      ++r.past_deadline;
      continue;
    }
    try {
      c.m = measure(c.config);
      c.fits = c.m.reserved <= budget - static_cast<uint64_t>(budget * r.margin);
      c.measured = true;
      if (c.m.host_peak) {
        // The host's wall: [host] memory_limit when set, else what this host has available now.
        const uint64_t host_limit = c.config.device.host_memory_limit;
        const HostMemory h = host_limit ? HostMemory{} : host_available_memory();
        const uint64_t wall = host_limit ? host_limit : h.bytes;
        c.host_wall =
            host_limit ? "[host] memory_limit " + format_bytes(host_limit)
                       : "this host's " + format_bytes(h.bytes) + " available (" + h.source + ")";
        c.host_fits = !wall || c.m.host_peak <= wall;
        c.fits = c.fits && c.host_fits;
        // The step cost: the gradients down and the updated weights up (the host ledger's
        // gradients and parameters rows, as measured), the AdamW update of every element the
        // host holds a weight of.
        if (r.rates.copy_bytes_per_s == 0) r.rates = measure_offload_rates();
        c.transfer_bytes = c.m.host_by_category[static_cast<int>(Category::kGradients)] +
                           c.m.host_by_category[static_cast<int>(Category::kParameters)];
        // The parameter shards on the host: every micro-step uploads the weights the layers read
        // twice more (the forward's gathering and the backward's), in the compute dtype.
        const Mechanisms mech = estimate_config(c.config, {}, 1).mechanisms;
        if (mech.parameters_on_host)
          c.transfer_bytes += 2 * uint64_t(std::max(1, c.config.train.grad_accum)) *
                              gpt_num_params(c.config.model) * dtype_size(mech.compute);
        c.update_elements = gpt_num_params(c.config.model);
        if (r.rates.copy_bytes_per_s > 0)
          c.transfer_ms = 1000.0 * double(c.transfer_bytes) / r.rates.copy_bytes_per_s;
        if (r.rates.adamw_elements_per_s > 0)
          c.update_ms = 1000.0 * double(c.update_elements) / r.rates.adamw_elements_per_s;
        c.offload_ms = c.transfer_ms + c.update_ms;
      }
    } catch (const PlanRefused& e) {
      c.skipped = e.what();
    } catch (const ConfigError& e) {
      c.skipped = std::string("its dry run refused: ") + e.what();
    }
  }
  // Step times, only of those that fit (the others cannot be recommended), in interleaved rounds,
  // each candidate's fastest kept: a moment of load on the machine then slows one round of one
  // candidate, not its ratio. Rounds go on until the fastest stayed the fastest for two of them
  // (at least 2, at most kMaxTimingRounds). 0: its 2 blocks do not run.
  int leader = -1;
  for (int round = 0; round < kMaxTimingRounds; ++round) {
    for (Candidate& c : cands) {
      if (!c.fits || (round > 0 && c.step_ms <= 0) || c.untimed) continue;
      if (past_deadline()) {
        if (c.times.empty()) {
          c.untimed = true;
          ++r.past_deadline;
        }
        continue;
      }
      try {
        const double ms = measure_step_ms(c.config);
        if (ms > 0) c.times.push_back(ms);
        c.step_ms = c.times.empty() ? 0 : *std::min_element(c.times.begin(), c.times.end());
      } catch (const ConfigError&) {
        c.step_ms = 0;
      }
    }
    r.rounds = round + 1;
    int now = -1;
    for (size_t i = 0; i < cands.size(); ++i)
      if (cands[i].fits && cands[i].step_ms > 0 &&
          (now < 0 || cands[i].step_ms < cands[size_t(now)].step_ms))
        now = static_cast<int>(i);
    if (round > 0 && now == leader) {
      r.ranking_stable = true;
      break;
    }
    leader = now;
    if (past_deadline()) break;
  }
  r.candidates = std::move(cands);
  for (const Candidate& c : r.candidates) {
    c.measured ? ++r.measured : ++r.skipped;
    if (!c.times.empty()) ++r.timed;
  }
  for (size_t i = 0; i < r.candidates.size(); ++i)
    if (r.candidates[i].step_ms > 0) {
      r.baseline = static_cast<int>(i);
      break;
    }
  r.wall_s = now_s() - t0;
  if (r.baseline < 0) return r;
  const double base_ms = r.candidates[r.baseline].step_ms;
  for (Candidate& c : r.candidates)
    if (c.step_ms > 0) c.step_time_ratio = c.step_ms / base_ms;
  pick_recommended(r);
  // The written config keeps the caller's own memory_limit.
  for (Candidate& c : r.candidates)
    if (c.measured) c.config.device.memory_limit = config.device.memory_limit;
  return r;
}

std::string format_search(const Config& config, const SearchResult& r) {
  char deadline[64];
  std::snprintf(deadline, sizeof deadline, "%.0f s", r.deadline_s);
  std::string s = "search under " + format_bytes(r.budget) + " (a margin of " +
                  std::to_string(static_cast<int>(r.margin * 100)) + "% kept free), " +
                  std::to_string(r.candidates.size()) + " candidates, deadline " + deadline + ":\n";
  char line[512];
  std::snprintf(line, sizeof line, "  %-3s %-80s %12s %12s %7s\n", "", "candidate", "peak",
                "reserved", "time");
  s += line;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const Candidate& c = r.candidates[i];
    const char* mark = static_cast<int>(i) == r.best ? "=>" : (c.fits ? "ok" : "");
    if (c.measured) {
      char ratio[32] = "    -";
      if (c.step_ms > 0) std::snprintf(ratio, sizeof ratio, "x%.2f", c.step_time_ratio);
      if (c.untimed) std::snprintf(ratio, sizeof ratio, "not timed: past the deadline");
      std::snprintf(line, sizeof line, "  %-3s %-80.80s %12s %12s  %s%s\n", mark, c.what.c_str(),
                    format_bytes(c.m.peak).c_str(), format_bytes(c.m.reserved).c_str(), ratio,
                    c.fits ? "" : "  does not fit");
    } else {
      std::snprintf(line, sizeof line, "  %-3s %-80.80s not measured: %.200s\n", mark,
                    c.what.c_str(), c.skipped.c_str());
    }
    s += line;
    if (c.measured && c.m.host_peak) {
      std::snprintf(line, sizeof line,
                    "        host ledger %s (%s)%s; offload's step cost, estimated: %.1f ms "
                    "(transfer %s: %.1f ms, host AdamW of %llu elements: %.1f ms)\n",
                    format_bytes(c.m.host_peak).c_str(), c.host_wall.c_str(),
                    c.host_fits ? "" : ", over it", c.offload_ms,
                    format_bytes(c.transfer_bytes).c_str(), c.transfer_ms,
                    static_cast<unsigned long long>(c.update_elements), c.update_ms);
      s += line;
    }
  }
  if (r.rates.copy_bytes_per_s > 0) {
    std::snprintf(line, sizeof line,
                  "offload's step cost: the transfer (the gradients down, the updated weights up: "
                  "the host ledger's gradients and parameters rows) at %.2f GB/s, a host memcpy "
                  "of 64 MiB timed now, and the update at %.0f M elements/s, the CPU AdamW kernel "
                  "on 4 Mi elements timed now (the fastest of 3 each: this machine's rates, not a "
                  "table's); on a GPU the PCIe copy, not measured here, bounds the transfer "
                  "instead\n",
                  r.rates.copy_bytes_per_s / 1e9, r.rates.adamw_elements_per_s / 1e6);
    s += line;
    s += "the nvme tier (offload optimizer = \"nvme\") is not a candidate: it needs nvme_path, a "
         "folder on the disk the state would use, which the search cannot pick; its device bytes "
         "are the host tier's and its host ledger two staging buffers instead of the state "
         "(`headroom plan` with it prints both)\n";
  }
  if (r.baseline >= 0)
    s += "time: the step time against " + r.candidates[r.baseline].what +
         "'s, measured side by side in short runs on 2 blocks at each one's micro-batch, " +
         std::to_string(r.rounds) + " round" + (r.rounds == 1 ? "" : "s") +
         (r.ranking_stable ? " (the fastest held its place in the last two)"
                           : " (the fastest changed until the last round)") +
         "\n";
  char took[256];
  std::snprintf(took, sizeof took,
                "searched in %.1f s of its %.0f s deadline: %zu candidates, %d measured (%d "
                "timed), %d skipped (each says why on its line)",
                r.wall_s, r.deadline_s, r.candidates.size(), r.measured, r.timed, r.skipped);
  s += took;
  s += r.past_deadline ? "; " + std::to_string(r.past_deadline) +
                             " candidate(s) left past the deadline (not measured, or not timed)\n"
                       : "; every candidate considered before the deadline\n";
  if (r.best < 0) return s + "no candidate fits " + format_bytes(r.budget) + "\n";
  if (r.within_noise > 1) {
    char noise[64];
    std::snprintf(noise, sizeof noise, "%.0f%%", 100 * r.noise);
    s += std::to_string(r.within_noise) + " candidates are within the timing noise (" + noise +
         ", the median spread of the candidates' rounds) of the fastest: the one with the lowest "
         "peak is picked\n";
  }
  const Candidate& b = r.candidates[r.best];
  if (r.offload_only) {
    std::snprintf(line, sizeof line,
                  "no candidate fits on the device alone; offloading to the host does, at about "
                  "%.1f ms more a step (estimated above)\n",
                  b.offload_ms);
    s += line;
  }
  s += "recommended: " + b.what;
  if (!b.sets.empty()) s += "\n  headroom train " + config.file + " " + joined(b.sets);
  if (!b.toml.empty()) s += "\n  with these tables appended to " + config.file + ":\n" + b.toml;
  return s + "\n";
}

std::string search_json(const SearchResult& r) {
  nlohmann::ordered_json j;
  j["budget_bytes"] = r.budget;
  j["margin"] = r.margin;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const Candidate& c : r.candidates) {
    nlohmann::ordered_json o;
    o["what"] = c.what;
    o["sets"] = c.sets;
    o["toml"] = c.toml;
    o["measured"] = c.measured;
    if (c.measured) {
      o["peak_bytes"] = c.m.peak;
      o["reserved_bytes"] = c.m.reserved;
      o["fragmentation"] = c.m.fragmentation;
      o["fits"] = c.fits;
      if (c.untimed) o["untimed"] = true;
      o["step_time_ratio"] = c.step_time_ratio;
      if (c.m.host_peak) {
        o["host_peak_bytes"] = c.m.host_peak;
        o["host_fits"] = c.host_fits;
        o["offload_step_ms_estimate"] = c.offload_ms;
        o["offload_transfer_ms"] = c.transfer_ms;
        o["offload_update_ms"] = c.update_ms;
      }
    } else {
      o["skipped"] = c.skipped;
    }
    list.push_back(o);
  }
  j["candidates"] = list;
  j["recommended"] = r.best;
  j["deadline_s"] = r.deadline_s;
  j["search_s"] = r.wall_s;
  j["past_deadline"] = r.past_deadline;
  j["measured"] = r.measured;
  j["skipped"] = r.skipped;
  j["timed"] = r.timed;
  j["timing_rounds"] = r.rounds;
  j["within_noise"] = r.within_noise;
  j["timing_noise"] = r.noise;
  j["offload_only"] = r.offload_only;
  if (r.rates.copy_bytes_per_s > 0) {
    j["host_copy_bytes_per_s"] = r.rates.copy_bytes_per_s;
    j["host_adamw_elements_per_s"] = r.rates.adamw_elements_per_s;
  }
  if (r.best >= 0) {
    const Measured& m = r.candidates[r.best].m;
    j["peak_bytes"] = m.peak;
    j["reserved_bytes"] = m.reserved;
    j["fragmentation"] = m.fragmentation;
  }
  return j.dump();
}

void write_config_file(const std::string& path, const Config& config) {
  AtomicFile f(path, "--write");
  f.write(format_config(config));
  f.commit();
}

}  // namespace headroom
