#include "core/run/run_control.h"

#include <cmath>

#include "core/run/run_log.h"

namespace headroom {

bool RunControl::finite(const StepState& s) {
  return std::isfinite(s.loss) && std::isfinite(s.grad_norm);
}

Interrupted RunControl::stop(int signal, int64_t step, bool mid_step, int micro_steps_done,
                             int micro_steps) {
  // The last completed step: the weights and optimizer state are still those after it (no update
  // has run in the current step).
  const int64_t completed = step - 1;
  const std::string saved = snapshots_.write_at_stop(completed, mid_step);
  std::string what = "stopped by " + signal_name(signal) + " before step " + std::to_string(step) +
                     " of " + std::to_string(config_.train.steps);
  if (mid_step)
    what = "stopped by " + signal_name(signal) + " in step " + std::to_string(step) + " (its " +
           std::to_string(micro_steps_done) + " of " + std::to_string(micro_steps) +
           " micro-steps are dropped)";
  what += "; " + std::to_string(completed) + " step" + (completed == 1 ? "" : "s") + " done";
  if (!saved.empty()) {
    what += "; " + saved + " (resume with --resume " + config_.snapshot.dir + ")";
  } else {
    what += config_.snapshot.every > 0 ? "; no step completed, so no snapshot"
                                       : "; no snapshot ([snapshot] every = 0)";
  }
  return Interrupted(signal, what);
}

PluginStopped RunControl::plugin_stop(const std::string& plugin, const std::string& reason,
                                      int64_t step, int other_rank) {
  const int64_t completed = step - 1;
  const std::string saved = snapshots_.write_at_stop(completed, false);
  std::string what = "stopped by plugin '" + plugin + "'" +
                     (other_rank >= 0 ? " of rank " + std::to_string(other_rank) : "") +
                     " after step " + std::to_string(completed) + " of " +
                     std::to_string(config_.train.steps);
  what += other_rank >= 0 ? " (its reason is in rank " + std::to_string(other_rank) + "'s output)"
                          : ": " + reason;
  if (!saved.empty()) {
    what += "; " + saved + " (resume with --resume " + config_.snapshot.dir + ")";
  } else {
    what += config_.snapshot.every > 0 ? "; no step completed, so no snapshot"
                                       : "; no snapshot ([snapshot] every = 0)";
  }
  return PluginStopped(what);
}

Diverged RunControl::diverged(const StepState& s) const {
  const TrainConfig& t = config_.train;
  std::string msg = "training diverged at step " + std::to_string(s.step) + ": the loss is " +
                    format_number(s.loss) + " and the gradient norm " + format_number(s.grad_norm) +
                    ", and no plugin skipped the step. The update was not applied; ";
  msg += snapshots_.newest().empty()
             ? "no snapshot was written ([snapshot] every = " +
                   std::to_string(config_.snapshot.every) + ")"
             : "the last good snapshot is " + snapshots_.newest() + " (step " +
                   std::to_string(snapshots_.newest_step()) + ")";
  msg += ". Lower train.lr (now " + format_number(t.lr) + ")" +
         (t.grad_clip > 0 ? "" : " or turn on train.grad_clip") + ", then resume or restart";
  return Diverged(msg);
}

}  // namespace headroom
