// Prefetching: worker threads fill a bounded queue of batches from a DataSource while the model
// computes, so the loop waits for data only when the source is slower than a step.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/data/data.h"

namespace headroom {

class DataLoader {
 public:
  // workers = 0 reads inline in next(). Otherwise `workers` threads keep up to `prefetch` batches
  // ready. They take turns on the source (a stream: batches come out in order, the same as
  // inline), so what they hide is the source's time, not more of it in parallel. Threads start at
  // the first next(), after any restore().
  DataLoader(DataSource& source, int workers, int prefetch, int B, int T);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Copies the next batch into inputs and targets, both (B, T). Returns the milliseconds spent
  // waiting for it. Rethrows an error a worker met.
  double next(int32_t* inputs, int32_t* targets);

  // The source position of the batch next() returns next: what a snapshot records.
  std::string state();
  // Before the first next() only.
  void restore(const std::string& state);

 private:
  struct Batch {
    std::vector<int32_t> inputs, targets;
  };
  void work();
  void start();

  DataSource& source_;
  const int workers_, prefetch_, B_, T_;

  std::mutex source_mutex_;  // one worker on the source at a time
  uint64_t next_seq_ = 0;    // sequence number of the next batch a worker produces
  // Source state before each batch not yet consumed. Its own lock: the consumer must not wait
  // for a worker that holds the source through a slow batch.
  std::mutex state_mutex_;
  std::map<uint64_t, std::string> state_before_;

  std::mutex mutex_;  // the queue and everything below
  std::condition_variable ready_, space_;
  std::map<uint64_t, Batch> done_;  // finished batches by sequence number
  uint64_t consume_seq_ = 0;        // the batch next() returns next
  uint64_t reserved_ = 0;           // batches handed to workers so far
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace headroom
