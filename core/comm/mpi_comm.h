// The MPI communicator (inside core/comm/ only): collectives on host memory through MPI's
// non-blocking calls, the wait loop every implementation uses (deadline, peers' failure notices,
// stop signals), and the failure notices themselves. The NCCL communicator keeps one for its host
// values and its notices.
#pragma once

#include <mpi.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.h"

namespace headroom {
namespace comm_detail {

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(Device& device, const DistributedConfig& config);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  const RankInfo& ranks() const override { return ranks_; }
  const char* kind() const override { return "mpi"; }
  CommRequest all_reduce(void* buf, uint64_t n, Dtype dtype, ReduceOp op) override;
  CommRequest reduce_scatter(const void* send, void* recv, uint64_t n, Dtype dtype,
                             ReduceOp op) override;
  CommRequest all_gather(const void* send, void* recv, uint64_t n, Dtype dtype) override;
  CommRequest broadcast(void* buf, uint64_t n, Dtype dtype, int root) override;
  CommRequest barrier() override;
  void all_reduce_host(double* values, int n, ReduceOp op) override;
  void all_max_host(uint64_t* values, int n) override;
  std::vector<uint64_t> all_gather_host(uint64_t value) override;
  void* stream() override { return nullptr; }
  void announce_failure(const std::string& what) noexcept override;

  // --- for the implementations ----------------------------------------------------------------
  // The next collective's number: every rank calls collectives in the same order, so the numbers
  // agree across ranks, and a waiting rank can tell its peers which one it waits for.
  uint64_t next_seq() { return ++seq_; }
  // Calls done() until it returns true. Meanwhile: a peer's failure notice throws PeerFailed; a
  // stop signal (SIGINT / SIGTERM) throws CommError after a short grace (the other ranks, signalled
  // too, finish the collective in it); past the timeout throws CommError naming the ranks that
  // have not said they wait for collective `seq`. Any throw leaves the communicator failed: every
  // later collective and wait throws at once (a collective abandoned on one rank cannot be
  // matched again).
  void wait_until(const std::function<bool()>& done, const std::string& what, uint64_t seq);
  // Throws the failure that ended this communicator, if any; reads peers' notices first.
  void check_alive();
  // Leaves the communicator failed with `error` and throws it (PeerFailed stays PeerFailed).
  [[noreturn]] void fail(const CommError& error);
  // An MPI call's result: CommError naming `what` unless MPI_SUCCESS.
  void check(int rc, const char* what);
  // Requests that a failed wait left in flight; tested later, so MPI can finish with them.
  // `keep` holds memory the requests may still write (their own buffers), until they finish.
  void abandon(std::vector<MPI_Request>& requests, std::shared_ptr<void> keep = nullptr);
  MPI_Comm comm() const { return comm_; }
  double timeout_s() const { return timeout_s_; }

 private:
  void poll_notices();
  void tell_waiting(uint64_t seq);
  // A blocking host collective: posted by `post` into `buf` (owned, so that a failed wait can leave
  // it to MPI), waited for like any other.
  void wait_host(const std::function<int(MPI_Request*)>& post, std::shared_ptr<void> buf,
                 const std::string& what);
  void test_abandoned();
  MPI_Datatype mpi_type(Dtype dtype) const;
  MPI_Op mpi_sum(Dtype dtype) const;

  RankInfo ranks_;
  double timeout_s_;
  MPI_Comm comm_ = MPI_COMM_NULL;    // the collectives
  MPI_Comm notice_ = MPI_COMM_NULL;  // failure and waiting notices, apart from any collective
  uint64_t seq_ = 0;
  std::vector<uint64_t> peer_waiting_;  // by rank: the latest collective it said it waits for
  std::vector<MPI_Request> sends_;      // notices in flight
  std::vector<std::vector<char>> send_bufs_;
  struct Abandoned {
    MPI_Request request;
    std::shared_ptr<void> keep;
  };
  std::vector<Abandoned> abandoned_;
  MPI_Op bf16_sum_ = MPI_OP_NULL, f16_sum_ = MPI_OP_NULL;
  bool failed_ = false;
  bool failed_peer_ = false;
  std::string failure_;
  int failure_rank_ = -1;
};

}  // namespace comm_detail
}  // namespace headroom
