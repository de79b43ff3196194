// The communicator: collectives across the ranks of a run, on device buffers. One interface, three
// implementations: a single process (world size 1: every collective is local), MPI (the CPU
// backend: device buffers are host memory) and NCCL (CUDA; its unique id broadcast over MPI).
// headroom writes no transport of its own: MPI and NCCL are the engines.
//
// Every collective is asynchronous: it returns a CommRequest to wait on. On CUDA the work goes on
// the communicator's stream, ordered after what the compute stream has queued when it is called
// (an event), and wait() makes the compute stream wait for it; on the CPU it is MPI's non-blocking
// call, progressed by test() and wait(). A wait that does not finish within the configured timeout,
// or that learns another rank failed, throws CommError naming the rank.
//
// Failure across ranks. Every wait (and every new collective) reads the notices other ranks send
// on a communicator of their own: a rank that calls announce_failure makes its peers' waits throw
// PeerFailed("rank N ran out of memory", N). A wait past [distributed] timeout_s throws CommError
// naming the ranks that have not said they wait for the same collective (ranks tell their peers
// once a wait of theirs has lasted min(0.5 s, timeout / 4)). A rank killed without a word
// (SIGKILL) makes mpirun send SIGTERM to the others: a wait that sees a stop signal gives the
// collective a grace of 0.25 s, then throws CommError saying it was stopped while waiting.
// After any of these the communicator is failed: each later collective or wait throws the same
// error at once (a collective abandoned on one rank cannot be matched again), and buffers of the
// abandoned collective may still be written until the process ends. On CUDA, NCCL's asynchronous
// errors end a wait too, and the NCCL communicator is aborted. Requests must not outlive their
// communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/backend.h"
#include "core/device/device.h"

namespace headroom {

// Where this process stands among the ranks, from the launcher (mpirun, srun) through MPI. A
// process started without a launcher is rank 0 of 1 and touches no MPI.
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // among the ranks on this host
  int local_size = 1;
  std::string host;       // this host's name
  bool launched = false;  // started by a launcher: MPI is initialised
};

// A collective could not complete: a rank died or failed, or the wait timed out. `rank` is the
// rank that failed (-1 when not known); the message names it and what was being waited for.
class CommError : public std::runtime_error {
 public:
  CommError(const std::string& what, int rank) : std::runtime_error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// Another rank announced that it is failing (CommError's kind for a peer's own error): its rank
// and its words ("ran out of memory", "failed: ...").
class PeerFailed : public CommError {
 public:
  using CommError::CommError;
};

enum class ReduceOp { kSum, kAverage };

// One collective in flight. Move-only; waiting is required before its buffers are reused (the
// destructor of a request not waited for waits, swallowing errors).
class CommRequest {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual bool test() = 0;  // true once done; throws CommError
    virtual void wait() = 0;  // throws CommError
  };
  CommRequest() = default;
  explicit CommRequest(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  CommRequest(CommRequest&&) = default;
  CommRequest& operator=(CommRequest&&) = default;
  ~CommRequest();
  bool test();  // a request with nothing in flight is done
  void wait();
  // Gives it up without waiting, for a collective a failure cut short, which the other ranks will
  // never complete: the communicator may go on progressing it, so its buffers stay valid (kept by
  // the caller) until the process ends.
  void abandon() { impl_.reset(); }

 private:
  std::unique_ptr<Impl> impl_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual const RankInfo& ranks() const = 0;
  int rank() const { return ranks().rank; }
  int world_size() const { return ranks().world_size; }
  virtual const char* kind() const = 0;  // "self", "mpi", "nccl"

  // In place over n elements of dtype (f32, bf16, f16): every rank ends with the sum (or the mean)
  // of every rank's buf.
  virtual CommRequest all_reduce(void* buf, uint64_t n, Dtype dtype, ReduceOp op) = 0;
  // send: world_size * n elements; rank r ends with the reduction of every rank's r-th n-element
  // block in recv (n elements). In place when recv is the rank's own block of send (send + r·n):
  // the other blocks of send are then left undefined.
  virtual CommRequest reduce_scatter(const void* send, void* recv, uint64_t n, Dtype dtype,
                                     ReduceOp op) = 0;
  // send: n elements; recv: world_size * n elements, rank r's block at r * n. In place when send
  // is the rank's own block of recv (recv + r·n). The two moves (this and broadcast) carry i32
  // too: bytes as 4-byte words (a quantized base's, core/shard/sharding.h).
  virtual CommRequest all_gather(const void* send, void* recv, uint64_t n, Dtype dtype) = 0;
  // root's buf to every rank's.
  virtual CommRequest broadcast(void* buf, uint64_t n, Dtype dtype, int root) = 0;
  virtual CommRequest barrier() = 0;

  // Host values, blocking: the sum or mean over ranks of each of n doubles, in place (the loss for
  // the metrics); the max of each of n unsigned values; every rank's `value` gathered (the peaks
  // by rank for the metrics).
  virtual void all_reduce_host(double* values, int n, ReduceOp op) = 0;
  virtual void all_max_host(uint64_t* values, int n) = 0;
  virtual std::vector<uint64_t> all_gather_host(uint64_t value) = 0;

  // The stream collectives run on (cudaStream_t); nullptr on the CPU.
  virtual void* stream() = 0;

  // Tells every other rank that this one is failing, with `what` ("ran out of memory"), so that
  // their waits end with PeerFailed naming this rank instead of a timeout. Best effort, never
  // throws; call it once, before leaving the run.
  virtual void announce_failure(const std::string& what) noexcept = 0;
};

// This process's place among the ranks, from the launcher's environment (Open MPI's mpirun, srun
// with PMIx or PMI2). The first call initialises MPI when launched (MPI_THREAD_FUNNELED); MPI is
// finalised at exit. Not launched: rank 0 of 1, no MPI.
const RankInfo& rank_info();

// The communicator for `device`: "self" at world size 1, else MPI on the CPU backend and NCCL on
// CUDA. Buffers it owns are tagged Category::kCommunication (today none does: the MPI one reduces
// in place, NCCL in its own memory). Every rank must call it at the same point (it is collective).
// Throws ConfigError when the run is launched on several ranks but this build has no MPI, or on
// CUDA without NCCL (MPI cannot be assumed to read device pointers). On a dry device
// (`plan --measure`) with several ranks, the collectives on device buffers move nothing; the host
// values and the barrier still cross the ranks.
std::unique_ptr<Communicator> make_communicator(Device& device, const DistributedConfig& config);
// The stop request (SIGINT / SIGTERM: core/os/interrupt.h) of any rank, or 0: a max over the
// ranks (a collective, so every rank stops at the same point of a loop of collectives, such as
// the validation's batches); this process's own at world size 1.
int stop_signal_of_any_rank(Communicator& comm);

// Rank 0 of 1, this process alone, whatever launched it: for what runs on one rank of its own
// (checking plugins, estimates, an out-of-memory report's advice). Not collective.
std::unique_ptr<Communicator> make_local_communicator(Device& device);

}  // namespace headroom
