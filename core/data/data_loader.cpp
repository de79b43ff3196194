#include "core/data/data_loader.h"

#include <chrono>
#include <cstring>

namespace headroom {

DataLoader::DataLoader(DataSource& source, int workers, int prefetch, int B, int T)
    : source_(source), workers_(workers), prefetch_(prefetch), B_(B), T_(T) {}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  space_.notify_all();
  ready_.notify_all();
  for (std::thread& t : threads_)
    t.join();
}

void DataLoader::start() {
  for (int i = 0; i < workers_; ++i)
    threads_.emplace_back([this] { work(); });
}

void DataLoader::work() {
  const size_t n = size_t(B_) * T_;
  for (;;) {
    // Wait for room: at most prefetch_ batches produced ahead of the consumer.
    {
      std::unique_lock<std::mutex> lock(mutex_);
      space_.wait(lock, [&] { return stop_ || reserved_ < consume_seq_ + uint64_t(prefetch_); });
      if (stop_) return;
      ++reserved_;
    }
    Batch b;
    b.inputs.resize(n);
    b.targets.resize(n);
    uint64_t seq = 0;
    try {
      std::lock_guard<std::mutex> src(source_mutex_);
      seq = next_seq_++;
      {
        std::lock_guard<std::mutex> st(state_mutex_);
        state_before_[seq] = source_.state();
      }
      source_.next(b.inputs.data(), b.targets.data(), B_, T_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      ready_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.emplace(seq, std::move(b));
    }
    ready_.notify_all();
  }
}

double DataLoader::next(int32_t* inputs, int32_t* targets) {
  const size_t n = size_t(B_) * T_;
  const auto t0 = std::chrono::steady_clock::now();
  if (workers_ == 0) {
    source_.next(inputs, targets, B_, T_);
    ++consume_seq_;
  } else {
    if (threads_.empty()) start();
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return error_ || done_.count(consume_seq_); });
    if (!done_.count(consume_seq_)) std::rethrow_exception(error_);
    Batch b = std::move(done_.at(consume_seq_));
    done_.erase(consume_seq_);
    ++consume_seq_;
    lock.unlock();
    space_.notify_all();
    std::memcpy(inputs, b.inputs.data(), n * sizeof(int32_t));
    std::memcpy(targets, b.targets.data(), n * sizeof(int32_t));
    std::lock_guard<std::mutex> st(state_mutex_);
    state_before_.erase(consume_seq_ - 1);
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string DataLoader::state() {
  std::lock_guard<std::mutex> src(source_mutex_);  // no batch is half-reserved now
  if (workers_ > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::lock_guard<std::mutex> st(state_mutex_);
    const auto it = state_before_.find(consume_seq_);
    if (it != state_before_.end()) return it->second;
  }
  // Nothing produced ahead of the consumer: the source itself is at the next batch.
  return source_.state();
}

void DataLoader::restore(const std::string& state) {
  if (!threads_.empty() || consume_seq_ != 0)
    throw std::logic_error("DataLoader::restore after the first batch");
  source_.restore(state);
}

}  // namespace headroom
