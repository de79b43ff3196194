// What a run tells as it goes: one JSON object per optimizer step in the --metrics file (rank
// 0's), the progress line (rank 0's; redrawn in place on a terminal, with the time left), and the
// peak-by-category memory report at the end.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/device/device.h"
#include "core/events/step_state.h"
#include "core/os/output_file.h"

namespace headroom {

class RunLog {
 public:
  // `metrics_path`: "" for no metrics file (every rank but 0). `log`: the progress stream, nullptr
  // for none (every rank but 0 prints none).
  RunLog(const Config& config, Device& device, Communicator& comm, const std::string& metrics_path,
         std::ostream* log, bool live_progress);

  // The run's steps begin (the first is `first_step`, > 1 after a resume): the progress line's
  // pace is measured from now.
  void start(int64_t first_step);
  // The model's parameters and those that train (all but the frozen ones, [train] freeze): the
  // first metrics record carries them.
  void set_params(uint64_t params, uint64_t trainable) {
    params_ = params;
    trainable_params_ = trainable;
  }
  // Step `s` has ended: its metrics row and, when its turn comes, its progress line. Every rank
  // calls it (rank 0's row carries every rank's peak: a collective). `skipped_steps` and
  // `best_val_loss`: the run's so far.
  void step(const StepState& s, int64_t skipped_steps, double best_val_loss);
  // The metrics file, complete (OutputError when it cannot be written).
  void close();
  // The peak-by-category table ("rank N: memory report: ..." when the world size is above 1).
  std::string memory_report() const;

 private:
  const Config& config_;
  Device& device_;
  Communicator& comm_;
  std::unique_ptr<AppendFile> metrics_;
  uint64_t params_ = 0, trainable_params_ = 0;
  bool metrics_header_written_ = false;  // the first record carries the backend's description
  std::ostream* log_;
  bool live_progress_;
  int64_t first_step_ = 1;
  double start_ms_ = 0.0;
};

// "0.0123", "1e+30", and "nan" / "inf" without the sign printf may give a NaN.
std::string format_number(double v);
// Milliseconds on a steady clock.
double now_ms();

}  // namespace headroom
