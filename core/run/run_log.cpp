#include "core/run/run_log.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace headroom {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

std::string format_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

RunLog::RunLog(const Config& config, Device& device, Communicator& comm,
               const std::string& metrics_path, std::ostream* log, bool live_progress)
    : config_(config), device_(device), comm_(comm), log_(log), live_progress_(live_progress) {
  if (!metrics_path.empty()) metrics_ = std::make_unique<AppendFile>(metrics_path, "--metrics");
}

void RunLog::start(int64_t first_step) {
  first_step_ = first_step;
  start_ms_ = now_ms();
}

void RunLog::close() {
  if (metrics_) metrics_->close();
}

void RunLog::step(const StepState& r, int64_t skipped_steps, double best_val_loss) {
  const MemoryTracker& mt = device_.tracker();
  // Every rank's peak, for rank 0's metrics: a collective, so every rank takes part.
  std::vector<uint64_t> peaks;
  if (comm_.world_size() > 1) peaks = comm_.all_gather_host(mt.peak_total());
  if (metrics_) {
    nlohmann::json j;
    j["step"] = r.step;
    // The first record a run writes says what computed it (the GEMM library and its kernel).
    if (!metrics_header_written_) {
      j["backend"] = device_.kind() + ": " + device_.backend().describe();
      j["params"] = params_;
      j["trainable_params"] = trainable_params_;
      metrics_header_written_ = true;
    }
    j["loss"] = r.loss;
    j["lr"] = r.lr;
    j["grad_norm"] = r.grad_norm;
    j["step_ms"] = r.step_ms;
    j["tokens_per_s"] = r.tokens_per_s;
    j["data_wait_ms"] = r.data_wait_ms;
    j["comm_wait_ms"] = r.comm_wait_ms;
    j["host_syncs"] = r.host_syncs;
    j["skipped"] = r.skipped;
    if (r.skipped) j["skip_reason"] = r.veto_reason;
    j["skipped_steps"] = skipped_steps;
    j["loss_scale"] = r.loss_scale;
    if (r.evaluated) {
      j["val_loss"] = r.val_loss;
      j["best_val_loss"] = best_val_loss;
    }
    j["micro_batch"] = r.micro_batch;
    j["grad_accum"] = r.grad_accum;
    j["restarts"] = r.restarts;
    j["mem_live_bytes"] = mt.live_total();
    j["mem_peak_bytes"] = mt.peak_total();
    j["mem_num_allocs"] = mt.num_allocs();
    nlohmann::json by = nlohmann::json::object();
    for (int i = 0; i < kNumCategories; ++i)
      by[category_name(category_at(i))] = mt.peak_by_category()[i];
    j["mem_peak_by_category"] = by;
    // The plugin category by the plugin that holds it (its own peak), when any plugin holds some.
    if (!mt.plugin_owners().empty()) {
      nlohmann::json owners = nlohmann::json::object();
      for (const auto& [name, o] : mt.plugin_owners())
        owners[name] = o.peak;
      j["mem_peak_by_plugin"] = owners;
    }
    if (!peaks.empty()) j["mem_peak_bytes_by_rank"] = peaks;
    // The host ledger (docs/design.md "Places"), as the device's above.
    if (const Device* host = device_.host_place()) {
      const MemoryTracker& ht = host->tracker();
      j["host_live_bytes"] = ht.live_total();
      j["host_peak_bytes"] = ht.peak_total();
      nlohmann::json hby = nlohmann::json::object();
      for (int i = 0; i < kNumCategories; ++i)
        hby[category_name(category_at(i))] = ht.peak_by_category()[i];
      j["host_peak_by_category"] = hby;
    }
    metrics_->write(j.dump() + "\n");
    metrics_->flush();
  }
  if (!log_) return;  // the progress line is rank 0's
  const int64_t every = config_.train.log_every;
  const bool last = r.step == config_.train.steps;
  if (!live_progress_ && r.step % every != 0 && r.step != 1 && !last && !r.skipped && !r.evaluated)
    return;
  // An overflowing fp16 step (amp vetoes it) has an infinite or NaN norm: say so plainly.
  char norm[32];
  std::snprintf(norm, sizeof norm, "%.3f", r.grad_norm);
  const std::string norm_text = std::isfinite(r.grad_norm) ? norm : format_number(r.grad_norm);
  char line[256];
  std::snprintf(line, sizeof line,
                "step %6lld/%lld | loss %.4f | lr %.2e | norm %s | %9.0f tok/s | %7.1f ms | "
                "peak %s",
                static_cast<long long>(r.step), static_cast<long long>(config_.train.steps), r.loss,
                r.lr, norm_text.c_str(), r.tokens_per_s, r.step_ms,
                format_bytes(mt.peak_total()).c_str());
  // A vetoed step says who vetoed it and why, whatever the cadence.
  std::string extra = r.skipped ? " | update skipped by " + r.veto_reason : "";
  if (r.evaluated) {
    char val[64];
    std::snprintf(val, sizeof val, " | val %.4f (best %.4f)", r.val_loss, best_val_loss);
    extra = val + extra;
  }
  if (live_progress_) {
    // On a terminal: the time left at the average pace of this run so far.
    const double per_step = (now_ms() - start_ms_) / double(r.step - first_step_ + 1);
    const long long eta_s = llround(per_step * double(config_.train.steps - r.step) / 1000.0);
    char eta[48];
    std::snprintf(eta, sizeof eta, " | ETA %lldh%02lldm%02llds", eta_s / 3600, eta_s / 60 % 60,
                  eta_s % 60);
    *log_ << '\r' << line << extra << (last ? "" : eta) << "\033[K"
          << (last || r.skipped ? "\n" : "") << std::flush;
  } else {
    *log_ << line << extra << '\n' << std::flush;
  }
}

std::string RunLog::memory_report() const {
  const MemoryTracker& mt = device_.tracker();
  std::string s;
  char line[256];
  if (comm_.world_size() > 1) s += "rank " + std::to_string(comm_.rank()) + ": ";
  s += "memory report: peak " + format_bytes(mt.peak_total());
  if (device_.memory_limit()) s += " of memory_limit " + format_bytes(device_.memory_limit());
  s += ", at " + mt.peak_phase().str() + "\n";
  std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", "category", "at peak", "own peak");
  s += line;
  for (int i = 0; i < kNumCategories; ++i) {
    std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", category_name(category_at(i)),
                  format_bytes(mt.live_at_peak()[i]).c_str(),
                  format_bytes(mt.peak_by_category()[i]).c_str());
    s += line;
    if (category_at(i) != Category::kPlugin) continue;
    for (const auto& [name, o] : mt.plugin_owners()) {
      std::snprintf(line, sizeof line, "    %-14s %14s %14s\n", ("'" + name + "'").c_str(),
                    format_bytes(o.at_peak).c_str(), format_bytes(o.peak).c_str());
      s += line;
    }
  }
  // The host ledger, when it held anything or has a wall.
  const Device* host = device_.host_place();
  if (host && (host->tracker().num_allocs() > 0 || host->memory_limit() > 0)) {
    const MemoryTracker& ht = host->tracker();
    s += "  host: peak " + format_bytes(ht.peak_total());
    if (host->memory_limit()) s += " of [host] memory_limit " + format_bytes(host->memory_limit());
    s += ", at " + ht.peak_phase().str() + "\n";
    for (int i = 0; i < kNumCategories; ++i) {
      if (!ht.peak_by_category()[i]) continue;
      std::snprintf(line, sizeof line, "  %-16s %14s %14s\n",
                    ("host " + std::string(category_name(category_at(i)))).c_str(),
                    format_bytes(ht.live_at_peak()[i]).c_str(),
                    format_bytes(ht.peak_by_category()[i]).c_str());
      s += line;
    }
  }
  // What the allocator role holds at the end (its ABI 1.2 stats hook), when it keeps any.
  AllocatorStats a;
  if (device_.allocator_stats(&a))
    s += "  " + device_.allocator()->name() + ": allocated " + format_bytes(a.allocated) +
         ", reserved " + format_bytes(a.reserved) + ", largest free block " +
         format_bytes(a.largest_free_block) + ", " + std::to_string(a.device_allocs) +
         " device allocations, " + std::to_string(a.retries) + " retries, " +
         std::to_string(a.ooms) + " refused\n";
  return s;
}

}  // namespace headroom
