// The MPI communicator: the CPU backend's buffers are host memory, so collectives are MPI's
// non-blocking calls on them. f32 travels as MPI_FLOAT with MPI_SUM (i32, only moved, as
// MPI_INT32_T); bf16 and f16 as 2-byte elements with sums of our own that widen each pair to
// f32, add, and round back to nearest even
// (kernels/common/dtype.h, the same conversions the backends use). An average is the sum, then
// each element divided by the world size in f32 and rounded back.
//
// Requests progress only inside MPI calls (Open MPI has no progress thread by default): test() and
// wait() call MPI_Testall. Waiting also reads the notice communicator, a duplicate of the world on
// which ranks tell each other that they fail (announce_failure) or which collective they wait
// for, so that a timeout can name the ranks that never came.
#include "core/comm/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "core/comm/comm_impl.h"
#include "core/os/interrupt.h"
#include "kernels/common/dtype.h"

namespace headroom {
namespace comm_detail {
namespace {

constexpr int kWaitingTag = 1;  // payload: the uint64 number of the collective waited for
constexpr int kFailureTag = 2;  // payload: the failing rank's words ("ran out of memory")
// A stop signal during a wait: the collective gets this long to complete (every rank is usually
// signalled at once and will arrive), then the wait ends naming the ranks that never came. Short,
// because mpirun that stops a job after a rank died sends SIGKILL 1 s after SIGTERM.
constexpr double kStopGrace_s = 0.25;
constexpr uint64_t kMaxCount = INT_MAX;  // MPI counts are int

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

void f16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = float_to_f16(f16_to_float(a[i]) + f16_to_float(b[i]));
}

// x[i] /= world in f32, rounded back to the storage dtype.
void divide(void* x, uint64_t n, Dtype dtype, int world) {
  const float w = float(world);
  if (dtype == Dtype::kF32) {
    float* f = static_cast<float*>(x);
    for (uint64_t i = 0; i < n; ++i)
      f[i] /= w;
  } else if (dtype == Dtype::kBF16) {
    uint16_t* h = static_cast<uint16_t*>(x);
    for (uint64_t i = 0; i < n; ++i)
      h[i] = float_to_bf16(bf16_to_float(h[i]) / w);
  } else {
    uint16_t* h = static_cast<uint16_t*>(x);
    for (uint64_t i = 0; i < n; ++i)
      h[i] = float_to_f16(f16_to_float(h[i]) / w);
  }
}

std::string mpi_error(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, size_t(len));
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += i + 1 == ranks.size() ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// One collective (or a few, for counts beyond an int) in flight.
class MpiRequest final : public CommRequest::Impl {
 public:
  MpiRequest(MpiCommunicator& comm, std::vector<MPI_Request> requests, std::string what,
             uint64_t seq, std::function<void()> finish)
      : comm_(comm),
        requests_(std::move(requests)),
        what_(std::move(what)),
        seq_(seq),
        finish_(std::move(finish)) {}
  ~MpiRequest() override {
    if (!done_) comm_.abandon(requests_);
  }
  bool test() override {
    if (done_) return true;
    comm_.check_alive();
    if (!complete()) return false;
    finish();
    return true;
  }
  void wait() override {
    if (done_) return;
    comm_.wait_until([this] { return complete(); }, what_, seq_);
    finish();
  }

 private:
  bool complete() {
    int flag = 0;
    comm_.check(MPI_Testall(int(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE),
                what_.c_str());
    return flag != 0;
  }
  void finish() {
    done_ = true;
    if (finish_) finish_();
  }

  MpiCommunicator& comm_;
  std::vector<MPI_Request> requests_;
  std::string what_;
  uint64_t seq_;
  std::function<void()> finish_;
  bool done_ = false;
};

}  // namespace

MpiCommunicator::MpiCommunicator(Device& device, const DistributedConfig& config)
    : ranks_(rank_info()), timeout_s_(config.timeout_s) {
  (void)device;  // its buffers are host memory: MPI reads and writes them directly
  if (!ranks_.launched)
    throw std::logic_error("the MPI communicator needs a launched run (mpirun, srun)");
  if (!(timeout_s_ > 0))
    throw std::invalid_argument("[distributed] timeout_s must be > 0, not " +
                                std::to_string(timeout_s_));
  // Every rank constructs its communicator at the same point of the run (collective calls).
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &notice_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(notice_, MPI_ERRORS_RETURN);
  check(MPI_Op_create(&bf16_sum, 1, &bf16_sum_), "MPI_Op_create");
  check(MPI_Op_create(&f16_sum, 1, &f16_sum_), "MPI_Op_create");
  peer_waiting_.assign(size_t(ranks_.world_size), 0);
}

MpiCommunicator::~MpiCommunicator() {
  if (mpi_finalized()) return;
  // Give MPI a moment to finish the notices in flight (up to 2 s: the peers must hear of a
  // failure) and what failed waits left (a peer that joins late completes them at once; one that
  // gave them up on a failure's notice never does, and every rank would sit out the whole moment
  // before MPI_Finalize: a quarter of a second); what is still in flight after it is left to MPI,
  // not freed: freeing a non-blocking collective's request is erroneous.
  const auto start = Clock::now();
  while ((!sends_.empty() && seconds_since(start) < std::min(timeout_s_, 2.0)) ||
         (!abandoned_.empty() && seconds_since(start) < std::min(timeout_s_, 0.25))) {
    test_abandoned();
    int flag = 0;
    if (!sends_.empty() &&
        MPI_Testall(int(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
        flag) {
      sends_.clear();
      send_bufs_.clear();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // Kept until the process ends, reachable from a static (LeakSanitizer reports what nothing
  // points to): a moved vector keeps its buffer where MPI may still read it.
  static auto* kept = new std::vector<std::shared_ptr<void>>();
  for (Abandoned& a : abandoned_)
    kept->push_back(std::move(a.keep));
  if (!sends_.empty())
    for (auto& b : send_bufs_)
      kept->push_back(std::make_shared<std::vector<char>>(std::move(b)));  // MPI may still read
  MPI_Op_free(&bf16_sum_);
  MPI_Op_free(&f16_sum_);
  MPI_Comm_free(&notice_);
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::check(int rc, const char* what) {
  if (rc != MPI_SUCCESS)
    fail(CommError("rank " + std::to_string(ranks_.rank) + ": " + what + ": " + mpi_error(rc), -1));
}

MPI_Datatype MpiCommunicator::mpi_type(Dtype dtype) const {
  return dtype == Dtype::kF32 ? MPI_FLOAT : dtype == Dtype::kI32 ? MPI_INT32_T : MPI_UINT16_T;
}

MPI_Op MpiCommunicator::mpi_sum(Dtype dtype) const {
  return dtype == Dtype::kF32 ? MPI_SUM : dtype == Dtype::kBF16 ? bf16_sum_ : f16_sum_;
}

CommRequest MpiCommunicator::all_reduce(void* buf, uint64_t n, Dtype dtype, ReduceOp op) {
  check_dtype(dtype, "all_reduce");
  check_alive();
  const std::string what = describe("all_reduce", n, dtype, op_name(op));
  std::vector<MPI_Request> requests;
  char* p = static_cast<char*>(buf);
  for (uint64_t at = 0; at < n; at += kMaxCount) {
    const int count = int(std::min(kMaxCount, n - at));
    requests.push_back(MPI_REQUEST_NULL);
    check(MPI_Iallreduce(MPI_IN_PLACE, p + at * dtype_size(dtype), count, mpi_type(dtype),
                         mpi_sum(dtype), comm_, &requests.back()),
          "MPI_Iallreduce");
  }
  std::function<void()> finish;
  if (op == ReduceOp::kAverage) {
    const int world = ranks_.world_size;
    finish = [buf, n, dtype, world] { divide(buf, n, dtype, world); };
  }
  return CommRequest(std::make_unique<MpiRequest>(*this, std::move(requests), what, next_seq(),
                                                  std::move(finish)));
}

CommRequest MpiCommunicator::reduce_scatter(const void* send, void* recv, uint64_t n, Dtype dtype,
                                            ReduceOp op) {
  check_dtype(dtype, "reduce_scatter");
  if (n > kMaxCount)
    throw std::invalid_argument("reduce_scatter: " + std::to_string(n) +
                                " elements per rank is more than MPI counts (2^31 - 1)");
  check_alive();
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  // In place (recv is this rank's block of send): MPI leaves the result at the buffer's start,
  // moved to the rank's block once done.
  const uint64_t bytes = n * dtype_size(dtype);
  char* const base = static_cast<char*>(const_cast<void*>(send));
  const bool in_place = recv == base + uint64_t(ranks_.rank) * bytes;
  check(MPI_Ireduce_scatter_block(in_place ? MPI_IN_PLACE : send, in_place ? base : recv, int(n),
                                  mpi_type(dtype), mpi_sum(dtype), comm_, &requests[0]),
        "MPI_Ireduce_scatter_block");
  const int world = ranks_.world_size;
  std::function<void()> finish = [=] {
    if (in_place && recv != base) std::memcpy(recv, base, bytes);  // blocks never overlap
    if (op == ReduceOp::kAverage) divide(recv, n, dtype, world);
  };
  return CommRequest(std::make_unique<MpiRequest>(*this, std::move(requests),
                                                  describe("reduce_scatter", n, dtype, op_name(op)),
                                                  next_seq(), std::move(finish)));
}

CommRequest MpiCommunicator::all_gather(const void* send, void* recv, uint64_t n, Dtype dtype) {
  check_dtype(dtype, "all_gather", true);
  if (n > kMaxCount)
    throw std::invalid_argument("all_gather: " + std::to_string(n) +
                                " elements per rank is more than MPI counts (2^31 - 1)");
  check_alive();
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  // In place: send is this rank's block of recv.
  const bool in_place =
      send == static_cast<char*>(recv) + uint64_t(ranks_.rank) * n * dtype_size(dtype);
  check(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, in_place ? 0 : int(n),
                       in_place ? MPI_DATATYPE_NULL : mpi_type(dtype), recv, int(n),
                       mpi_type(dtype), comm_, &requests[0]),
        "MPI_Iallgather");
  return CommRequest(std::make_unique<MpiRequest>(
      *this, std::move(requests), describe("all_gather", n, dtype), next_seq(), nullptr));
}

CommRequest MpiCommunicator::broadcast(void* buf, uint64_t n, Dtype dtype, int root) {
  check_dtype(dtype, "broadcast", true);
  check_root(root, ranks_.world_size);
  check_alive();
  std::vector<MPI_Request> requests;
  char* p = static_cast<char*>(buf);
  for (uint64_t at = 0; at < n; at += kMaxCount) {
    requests.push_back(MPI_REQUEST_NULL);
    check(MPI_Ibcast(p + at * dtype_size(dtype), int(std::min(kMaxCount, n - at)), mpi_type(dtype),
                     root, comm_, &requests.back()),
          "MPI_Ibcast");
  }
  return CommRequest(std::make_unique<MpiRequest>(
      *this, std::move(requests),
      describe("broadcast", n, dtype) + " from rank " + std::to_string(root), next_seq(), nullptr));
}

CommRequest MpiCommunicator::barrier() {
  check_alive();
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  check(MPI_Ibarrier(comm_, &requests[0]), "MPI_Ibarrier");
  return CommRequest(
      std::make_unique<MpiRequest>(*this, std::move(requests), "barrier", next_seq(), nullptr));
}

void MpiCommunicator::wait_host(const std::function<int(MPI_Request*)>& post,
                                std::shared_ptr<void> buf, const std::string& what) {
  check_alive();
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  check(post(&requests[0]), what.c_str());
  const uint64_t seq = next_seq();
  try {
    wait_until(
        [&] {
          int flag = 0;
          check(MPI_Test(&requests[0], &flag, MPI_STATUS_IGNORE), what.c_str());
          return flag != 0;
        },
        what, seq);
  } catch (...) {
    abandon(requests, std::move(buf));
    throw;
  }
}

void MpiCommunicator::all_reduce_host(double* values, int n, ReduceOp op) {
  if (n <= 0) return;
  auto buf = std::make_shared<std::vector<double>>(values, values + n);
  wait_host(
      [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, buf->data(), n, MPI_DOUBLE, MPI_SUM, comm_, r);
      },
      buf, "all_reduce_host (" + std::to_string(n) + " f64, " + op_name(op) + ")");
  for (int i = 0; i < n; ++i)
    values[i] =
        op == ReduceOp::kAverage ? (*buf)[size_t(i)] / ranks_.world_size : (*buf)[size_t(i)];
}

void MpiCommunicator::all_max_host(uint64_t* values, int n) {
  if (n <= 0) return;
  auto buf = std::make_shared<std::vector<uint64_t>>(values, values + n);
  wait_host(
      [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, buf->data(), n, MPI_UINT64_T, MPI_MAX, comm_, r);
      },
      buf, "all_max_host (" + std::to_string(n) + " u64)");
  std::copy(buf->begin(), buf->end(), values);
}

std::vector<uint64_t> MpiCommunicator::all_gather_host(uint64_t value) {
  // [0]: this rank's value; [1..]: every rank's, by rank.
  auto buf = std::make_shared<std::vector<uint64_t>>(size_t(ranks_.world_size) + 1, 0);
  (*buf)[0] = value;
  wait_host(
      [&](MPI_Request* r) {
        return MPI_Iallgather(buf->data(), 1, MPI_UINT64_T, buf->data() + 1, 1, MPI_UINT64_T, comm_,
                              r);
      },
      buf, "all_gather_host (1 u64)");
  return std::vector<uint64_t>(buf->begin() + 1, buf->end());
}

void MpiCommunicator::wait_until(const std::function<bool()>& done, const std::string& what,
                                 uint64_t seq) {
  check_alive();
  if (done()) return;
  const auto start = Clock::now();
  // Peers learn which collective this rank waits for once the wait is no longer short, so that a
  // timeout anywhere can tell the ranks that wait from the ones that never came.
  const double tell_after = std::min(0.5, timeout_s_ / 4);
  bool told = false;
  Clock::time_point stop_at{};
  for (uint64_t spins = 0;; ++spins) {
    poll_notices();
    test_abandoned();
    if (done()) return;
    const double waited = seconds_since(start);
    if (!told && waited >= tell_after) {
      tell_waiting(seq);
      told = true;
    }
    const int signal = stop_signal();
    if (signal != 0 && stop_at == Clock::time_point{}) stop_at = Clock::now();
    const bool stopped =
        signal != 0 && seconds_since(stop_at) >= std::min(kStopGrace_s, timeout_s_);
    if (stopped || waited >= timeout_s_) {
      std::vector<int> missing;
      for (int r = 0; r < ranks_.world_size; ++r)
        if (r != ranks_.rank && peer_waiting_[size_t(r)] < seq) missing.push_back(r);
      std::string who;
      if (missing.empty())
        who = "every other rank waits for it too (the transport is stuck)";
      else
        who = std::string(missing.size() == 1 ? "rank " : "ranks ") + rank_list(missing) +
              (missing.size() == 1 ? " has" : " have") +
              " not said it waits for it (dead, hung, or elsewhere in the run)";
      const std::string head =
          "rank " + std::to_string(ranks_.rank) + ": " + what + " #" + std::to_string(seq) + ": ";
      const int rank = missing.size() == 1 ? missing[0] : -1;
      if (stopped)
        fail(CommError(head + "stopped by " + signal_name(signal) +
                           " while waiting for the other ranks; " + who,
                       rank));
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%g", timeout_s_);
      fail(CommError(head + "not done after " + secs + " s ([distributed] timeout_s); " + who,
                     rank));
    }
    // Yield while the wait is young (another rank may need this core to progress), then sleep.
    if (waited < 0.001 || spins < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void MpiCommunicator::check_alive() {
  if (failed_) {
    if (failed_peer_) throw PeerFailed(failure_, failure_rank_);
    throw CommError(failure_, failure_rank_);
  }
  poll_notices();
}

[[noreturn]] void MpiCommunicator::fail(const CommError& error) {
  failed_ = true;
  failed_peer_ = dynamic_cast<const PeerFailed*>(&error) != nullptr;
  // A peer that announced its failure is alive and finalizes too; one that never came may not be.
  if (!failed_peer_) mark_mpi_unusable();
  failure_ = error.what();
  failure_rank_ = error.rank();
  if (failed_peer_) throw PeerFailed(failure_, failure_rank_);
  throw CommError(failure_, failure_rank_);
}

void MpiCommunicator::poll_notices() {
  if (!sends_.empty()) {
    int flag = 0;
    if (MPI_Testall(int(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
        flag) {
      sends_.clear();
      send_bufs_.clear();
    }
  }
  for (;;) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, notice_, &flag, &status) != MPI_SUCCESS || !flag)
      return;
    int count = 0;
    MPI_Get_count(&status, MPI_CHAR, &count);
    std::vector<char> msg(size_t(std::max(count, 0)));
    if (MPI_Recv(msg.data(), count, MPI_CHAR, status.MPI_SOURCE, status.MPI_TAG, notice_,
                 MPI_STATUS_IGNORE) != MPI_SUCCESS)
      return;
    const int from = status.MPI_SOURCE;
    if (status.MPI_TAG == kWaitingTag && msg.size() == sizeof(uint64_t)) {
      uint64_t seq = 0;
      std::memcpy(&seq, msg.data(), sizeof(seq));
      uint64_t& known = peer_waiting_[size_t(from)];
      known = std::max(known, seq);
    } else if (status.MPI_TAG == kFailureTag) {
      fail(PeerFailed("rank " + std::to_string(from) + " " + std::string(msg.begin(), msg.end()),
                      from));
    }
  }
}

void MpiCommunicator::tell_waiting(uint64_t seq) {
  for (int r = 0; r < ranks_.world_size; ++r) {
    if (r == ranks_.rank) continue;
    send_bufs_.emplace_back(sizeof(seq));
    std::memcpy(send_bufs_.back().data(), &seq, sizeof(seq));
    sends_.push_back(MPI_REQUEST_NULL);
    if (MPI_Isend(send_bufs_.back().data(), int(sizeof(seq)), MPI_CHAR, r, kWaitingTag, notice_,
                  &sends_.back()) != MPI_SUCCESS)
      sends_.back() = MPI_REQUEST_NULL;
  }
}

void MpiCommunicator::announce_failure(const std::string& what) noexcept {
  try {
    const std::string text = what.substr(0, 1024);
    for (int r = 0; r < ranks_.world_size; ++r) {
      if (r == ranks_.rank) continue;
      send_bufs_.emplace_back(text.begin(), text.end());
      sends_.push_back(MPI_REQUEST_NULL);
      if (MPI_Isend(send_bufs_.back().data(), int(text.size()), MPI_CHAR, r, kFailureTag, notice_,
                    &sends_.back()) != MPI_SUCCESS)
        sends_.back() = MPI_REQUEST_NULL;
    }
    // Small messages leave at once (eager); a peer that is gone must not hold this rank up.
    const auto start = Clock::now();
    while (!sends_.empty() && seconds_since(start) < std::min(timeout_s_, 5.0)) {
      int flag = 0;
      if (MPI_Testall(int(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
        break;
      if (flag) {
        sends_.clear();
        send_bufs_.clear();
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  } catch (...) {
  }
}

void MpiCommunicator::abandon(std::vector<MPI_Request>& requests, std::shared_ptr<void> keep) {
  for (MPI_Request& r : requests)
    if (r != MPI_REQUEST_NULL) abandoned_.push_back({r, keep});
  requests.clear();
}

void MpiCommunicator::test_abandoned() {
  for (size_t i = 0; i < abandoned_.size();) {
    int flag = 0;
    if (MPI_Test(&abandoned_[i].request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
      abandoned_.erase(abandoned_.begin() + long(i));
    } else {
      ++i;
    }
  }
}

std::unique_ptr<MpiCommunicator> make_mpi_communicator(Device& device,
                                                       const DistributedConfig& config) {
  return std::make_unique<MpiCommunicator>(device, config);
}

}  // namespace comm_detail
}  // namespace headroom
