// The validation loss (train.eval_every): the first eval_batches micro-batches of the validation
// data, the same ones every time, forward only (Gpt::evaluate), through the step's batch buffers;
// with ranks, the mean over them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/data/data.h"
#include "core/model/model.h"

namespace headroom {

// One evaluation: the mean loss over the validation tokens (over ranks), and this rank's tokens.
struct Evaluation {
  double loss = 0.0;
  uint64_t tokens = 0;
};

class Validation {
 public:
  // The validation data of [data] (a file, shards, or a held-out tail), for this rank. ConfigError
  // naming train.eval_every when the config has none.
  // `log`: rank 0's progress stream, nullptr elsewhere or when silent.
  Validation(const Config& config, Communicator& comm, std::ostream* log);

  // After step `step`: every eval_every steps and after the last.
  bool due(int64_t step) const {
    return step % config_.train.eval_every == 0 || step == config_.train.steps;
  }
  // The mean loss over the validation tokens. The data comes in configured micro-batches; each
  // runs in slices of `batch.B` (the micro-batch the steps run at now, which headroom.batch/1 may
  // have lowered), so that evaluation needs no more memory than a step. `host_inputs` and
  // `host_targets`: staging buffers of a configured micro-batch, which `batch` uploads from.
  // Nothing when a stop request (of any rank: every rank leaves at the same batch) ends it
  // between its batches; `step`, the step it follows, for that log line.
  std::optional<Evaluation> evaluate(Gpt<float>& model, Batch batch, int32_t* host_inputs,
                                     int32_t* host_targets, int64_t step);

 private:
  const Config& config_;
  Communicator& comm_;
  std::ostream* log_;
  std::unique_ptr<DataSource> data_;
  std::string start_;  // rewound to before each evaluation
};

}  // namespace headroom
