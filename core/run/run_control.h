// How a run ends before its last step, in words the user can act on: a stop request (SIGINT /
// SIGTERM, core/os/interrupt.h) seen at a safe point — the end of a micro-step or of a step —
// and a step whose loss or gradient norm is not finite with no plugin having vetoed it.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/config/config.h"
#include "core/events/step_state.h"
#include "core/os/interrupt.h"
#include "core/run/snapshot_io.h"

namespace headroom {

// Thrown by Trainer::run when a step's loss or gradient norm is not finite and no plugin vetoed
// the step: the update is not applied, so the last snapshot holds the last good weights.
class Diverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown by Trainer::run when a plugin stopped the run (headroom.step/1 stop_run) and the run has
// written what it has, as for a signal: exit code 7 (docs/guide/exit-codes.md).
class PluginStopped : public Interrupted {
 public:
  static constexpr int kExitCode = 7;
  explicit PluginStopped(const std::string& what) : Interrupted(0, kExitCode, what) {}
};

class RunControl {
 public:
  RunControl(const Config& config, SnapshotIO& snapshots)
      : config_(config), snapshots_(snapshots) {}

  // The signal that asked the run to stop, or 0.
  int stop_requested() const { return stop_signal(); }
  // A stop request at a safe point of `step`: a snapshot of the last completed step (when
  // [snapshot] is on and it has none yet) and the Interrupted to throw once TRAIN_END has fired.
  // `mid_step`: its `micro_steps_done` of `micro_steps` are dropped, and the step is read again
  // on resume.
  Interrupted stop(int signal, int64_t step, bool mid_step, int micro_steps_done, int micro_steps);
  // A plugin's stop request (`plugin` its name, `reason` its words; `other_rank` >= 0: the plugin
  // of that rank asked, and its reason is in that rank's output), honoured before `step`: a
  // snapshot of step - 1 as for a signal, and the PluginStopped to throw once TRAIN_END has fired.
  PluginStopped plugin_stop(const std::string& plugin, const std::string& reason, int64_t step,
                            int other_rank = -1);
  // Step `s` computed a non-finite loss or gradient norm and nothing vetoed it: the update is not
  // applied, and the message says what to do.
  Diverged diverged(const StepState& s) const;
  // Whether step `s` can be applied: a finite loss and norm, or a veto.
  static bool finite(const StepState& s);

 private:
  const Config& config_;
  SnapshotIO& snapshots_;
};

}  // namespace headroom
