// Where training tokens come from: a synthetic Markov source whose entropy rate is known (so a test
// knows the loss a model should reach), and the raw bytes of a text file (vocab 256).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace headroom {

class DataSource {
 public:
  virtual ~DataSource() = default;
  // The next micro-batch: B·T+1 consecutive tokens of the stream, inputs the first B·T and targets
  // the same shifted by one (as llm.c). Both (B, T).
  virtual void next(int32_t* inputs, int32_t* targets, int B, int T) = 0;
  // One line for the log: what the data is.
  virtual std::string describe() const = 0;
  // The best loss a model can reach on this data in nats/token, or a negative number if unknown.
  virtual double entropy() const { return -1.0; }
  // The position in the stream, for training snapshots: a source restored from state() yields
  // exactly the batches this one would have yielded next. Opaque bytes.
  virtual std::string state() const = 0;
  // Throws ConfigError when the state does not belong to this source (another file or config).
  virtual void restore(const std::string& state) = 0;
};

// A seeded random Markov chain over the vocabulary: each token has `branching` distinct successors
// with random probabilities. Its entropy rate, sum_i pi_i H(P_i) under the long-run distribution
// pi of the stream, is the loss a perfect model reaches.
class MarkovChain {
 public:
  MarkovChain(int vocab_size, int branching, uint64_t seed);
  int32_t start() const { return start_; }
  int vocab_size() const { return vocab_; }
  int32_t sample(int32_t from, std::mt19937_64& rng) const;
  // Computed at the first call (the long-run distribution takes 2000 passes over the chain: seconds
  // at a Llama vocabulary, which a run that never asks, e.g. plan --measure's dry runs, skips).
  double entropy_rate() const;
  // The successors of `from` and their probabilities.
  const int32_t* successors(int32_t from) const { return &next_[size_t(from) * k_]; }
  const double* probabilities(int32_t from) const { return &prob_[size_t(from) * k_]; }

 private:
  int vocab_;
  int k_;
  int32_t start_;
  std::vector<int32_t> next_;  // (V, k)
  std::vector<double> prob_;   // (V, k)
  double compute_entropy_rate() const;

  mutable std::once_flag entropy_once_;
  mutable double entropy_rate_ = 0.0;
};

// Throws ConfigError (naming the config file and line) when the data cannot be used: an unreadable
// or too small text file, a vocabulary too small for the data.
//
// Ranks (data parallelism): the source of rank r of `world` reads its part of each global batch.
// The global batch of a micro-step is what one rank with micro_batch world·B would read; rank r
// gets its rows r·B .. r·B+B-1, i.e. the r-th B·T tokens of it (shards: llm.c's stride, rank r at
// batch · world·B·T + r·B·T). So W ranks with micro_batch B read, over their ranks, exactly the
// sequences one rank with micro_batch W·B reads, and — for synthetic data, and for text until it
// first wraps to its start — one rank with micro_batch B and grad_accum W (its micro-steps are
// the global batch's B·T slices in order). world = 1 is the single-process source, unchanged.
std::unique_ptr<DataSource> make_data_source(const DataConfig& data, const ModelConfig& model,
                                             int B, int T, int rank = 0, int world = 1);

// The validation data of train.eval_every, read as make_data_source reads the training data:
// data.val_path (text) or data.val_pattern (shards), or the tail data.val_fraction holds out of
// the training data (which make_data_source then leaves out); for synthetic data the same chain
// sampled with another seed. nullptr when text or shards name no validation data.
std::unique_ptr<DataSource> make_validation_source(const DataConfig& data, const ModelConfig& model,
                                                   int B, int T, int rank = 0, int world = 1);

}  // namespace headroom
