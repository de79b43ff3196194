#include "core/run/validation.h"

#include <cstring>

#include "core/os/interrupt.h"

namespace headroom {

Validation::Validation(const Config& config, Communicator& comm, std::ostream* log)
    : config_(config), comm_(comm), log_(log) {
  data_ = make_validation_source(config_.data, config_.model, config_.train.micro_batch,
                                 config_.model.seq_len, comm_.rank(), comm_.world_size());
  if (!data_)
    throw ConfigError(config_.train.eval_every_pos.str() +
                      ": train.eval_every needs validation data: set data.val_path, "
                      "data.val_pattern or data.val_fraction");
  start_ = data_->state();
}

std::optional<Evaluation> Validation::evaluate(Gpt<float>& model, Batch batch, int32_t* host_inputs,
                                               int32_t* host_targets, int64_t step) {
  Backend& ops = model.device().backend();
  const int B = config_.train.micro_batch, T = batch.T;
  const int b = batch.B;
  const size_t BT = size_t(B) * T, bt = size_t(b) * T;
  std::vector<int32_t> rows(2 * BT);
  batch.dloss = 0.0;       // the head's gradient of the loss is not used
  batch.dropout_seed = 0;  // evaluation drops nothing
  data_->restore(start_);
  double sum = 0.0;
  uint64_t tokens = 0;
  for (int i = 0; i < config_.train.eval_batches; ++i) {
    if (const int sig = stop_signal_of_any_rank(comm_)) {
      if (log_)
        *log_ << "validation after step " << step << ": stopped by " << signal_name(sig)
              << " after " << i << " of " << config_.train.eval_batches << " batches; not counted\n"
              << std::flush;
      return std::nullopt;
    }
    data_->next(rows.data(), rows.data() + BT, B, T);
    for (size_t at = 0; at < BT; at += bt) {
      std::memcpy(host_inputs, rows.data() + at, bt * sizeof(int32_t));
      std::memcpy(host_targets, rows.data() + BT + at, bt * sizeof(int32_t));
      ops.upload(const_cast<int32_t*>(batch.tokens), host_inputs, bt * sizeof(int32_t));
      ops.upload(const_cast<int32_t*>(batch.targets), host_targets, bt * sizeof(int32_t));
      const double loss = model.evaluate(batch);
      const uint64_t n = model.loss_tokens();
      sum += loss * double(n);
      tokens += n;
      ops.synchronize();  // the next upload overwrites the staging buffers
    }
  }
  double loss = tokens ? sum / double(tokens) : 0.0;
  if (comm_.world_size() > 1) comm_.all_reduce_host(&loss, 1, ReduceOp::kAverage);
  return Evaluation{loss, tokens};
}

}  // namespace headroom
