// The NCCL communicator (CUDA ranks): collectives on device buffers on a communication stream of
// its own. Each collective is ordered after what the compute stream has queued when it is called
// (an event the comm stream waits for) and records a done event; wait() makes the compute stream
// wait for that event, and blocks the host until it fires, so that the timeout, NCCL's
// asynchronous errors and peers' failure notices are seen. NCCL's unique id goes from rank 0 to
// the others over MPI; the host values, the notices and the wait loop are the MPI communicator's,
// which this one keeps beside its NCCL communicator.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "core/comm/comm_impl.h"
#include "core/comm/mpi_comm.h"

namespace headroom {
namespace comm_detail {
namespace {

std::string cuda_text(cudaError_t e) {
  return cudaGetErrorString(e);
}

ncclDataType_t nccl_type(Dtype dtype) {
  return dtype == Dtype::kF32    ? ncclFloat
         : dtype == Dtype::kBF16 ? ncclBfloat16
         : dtype == Dtype::kI32  ? ncclInt32
                                 : ncclFloat16;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::kSum ? ncclSum : ncclAvg;
}

class NcclCommunicator;

class NcclRequest final : public CommRequest::Impl {
 public:
  NcclRequest(NcclCommunicator& comm, cudaEvent_t done, std::string what, uint64_t seq)
      : comm_(comm), done_(done), what_(std::move(what)), seq_(seq) {}
  ~NcclRequest() override;
  bool test() override;
  void wait() override;

 private:
  NcclCommunicator& comm_;
  cudaEvent_t done_;
  std::string what_;
  uint64_t seq_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Device& device, const DistributedConfig& config) : mpi_(device, config) {
    compute_ = static_cast<cudaStream_t>(device.backend().native_stream());
    cuda(cudaGetDevice(&cuda_device_), "cudaGetDevice");
    cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    ncclUniqueId id{};
    if (mpi_.rank() == 0) nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    mpi_.check(MPI_Bcast(&id, int(sizeof(id)), MPI_BYTE, 0, mpi_.comm()), "MPI_Bcast (NCCL id)");
    nccl(ncclCommInitRank(&nccl_, mpi_.world_size(), id, mpi_.rank()), "ncclCommInitRank");
  }
  ~NcclCommunicator() override {
    if (nccl_ != nullptr) (void)ncclCommDestroy(nccl_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  const RankInfo& ranks() const override { return mpi_.ranks(); }
  const char* kind() const override { return "nccl"; }

  CommRequest all_reduce(void* buf, uint64_t n, Dtype dtype, ReduceOp op) override {
    check_dtype(dtype, "all_reduce");
    cudaEvent_t done = begin();
    nccl(ncclAllReduce(buf, buf, n, nccl_type(dtype), nccl_op(op), nccl_, stream_),
         "ncclAllReduce");
    return end(done, describe("all_reduce", n, dtype, op_name(op)));
  }
  CommRequest reduce_scatter(const void* send, void* recv, uint64_t n, Dtype dtype,
                             ReduceOp op) override {
    check_dtype(dtype, "reduce_scatter");
    cudaEvent_t done = begin();
    nccl(ncclReduceScatter(send, recv, n, nccl_type(dtype), nccl_op(op), nccl_, stream_),
         "ncclReduceScatter");
    return end(done, describe("reduce_scatter", n, dtype, op_name(op)));
  }
  CommRequest all_gather(const void* send, void* recv, uint64_t n, Dtype dtype) override {
    check_dtype(dtype, "all_gather", true);
    cudaEvent_t done = begin();
    nccl(ncclAllGather(send, recv, n, nccl_type(dtype), nccl_, stream_), "ncclAllGather");
    return end(done, describe("all_gather", n, dtype));
  }
  CommRequest broadcast(void* buf, uint64_t n, Dtype dtype, int root) override {
    check_dtype(dtype, "broadcast", true);
    check_root(root, world_size());
    cudaEvent_t done = begin();
    nccl(ncclBroadcast(buf, buf, n, nccl_type(dtype), root, nccl_, stream_), "ncclBroadcast");
    return end(done, describe("broadcast", n, dtype) + " from rank " + std::to_string(root));
  }
  // Host-side: every rank's queued device work is not part of a barrier's meaning.
  CommRequest barrier() override { return mpi_.barrier(); }

  void all_reduce_host(double* values, int n, ReduceOp op) override {
    mpi_.all_reduce_host(values, n, op);
  }
  void all_max_host(uint64_t* values, int n) override { mpi_.all_max_host(values, n); }
  std::vector<uint64_t> all_gather_host(uint64_t value) override {
    return mpi_.all_gather_host(value);
  }
  void* stream() override { return stream_; }
  void announce_failure(const std::string& what) noexcept override { mpi_.announce_failure(what); }

  // --- for NcclRequest ---
  bool query(cudaEvent_t done, const std::string& what) {
    const cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) fail_cuda(e, what);
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(nccl_, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress) {
      abort_nccl();
      mpi_.fail(CommError(
          "rank " + std::to_string(rank()) + ": " + what + ": NCCL: " + ncclGetErrorString(async),
          -1));
    }
    return false;
  }
  bool test(cudaEvent_t done, const std::string& what) {
    mpi_.check_alive();
    if (!query(done, what)) return false;
    cuda(cudaStreamWaitEvent(compute_, done, 0), "cudaStreamWaitEvent");
    return true;
  }
  void wait(cudaEvent_t done, const std::string& what, uint64_t seq) {
    // The compute stream's later work reads what the collective wrote.
    cuda(cudaStreamWaitEvent(compute_, done, 0), "cudaStreamWaitEvent");
    try {
      mpi_.wait_until([&] { return query(done, what); }, what, seq);
    } catch (const CommError&) {
      // Kernels that wait for a peer that never comes would hold the device: abort them.
      abort_nccl();
      throw;
    }
  }
  void release(cudaEvent_t done) { (void)cudaEventDestroy(done); }

 private:
  // The done event of a new collective, with the comm stream ordered after the compute stream.
  cudaEvent_t begin() {
    mpi_.check_alive();
    cuda(cudaSetDevice(cuda_device_), "cudaSetDevice");
    cudaEvent_t ready = nullptr;
    cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda(cudaEventRecord(ready, compute_), "cudaEventRecord");
    const cudaError_t e = cudaStreamWaitEvent(stream_, ready, 0);
    (void)cudaEventDestroy(ready);  // destroyed once the wait it feeds is queued: allowed
    cuda(e, "cudaStreamWaitEvent");
    cudaEvent_t done = nullptr;
    cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    return done;
  }
  CommRequest end(cudaEvent_t done, const std::string& what) {
    const cudaError_t e = cudaEventRecord(done, stream_);
    if (e != cudaSuccess) {
      (void)cudaEventDestroy(done);
      cuda(e, "cudaEventRecord");
    }
    return CommRequest(std::make_unique<NcclRequest>(*this, done, what, mpi_.next_seq()));
  }
  void cuda(cudaError_t e, const char* what) {
    if (e != cudaSuccess) fail_cuda(e, what);
  }
  [[noreturn]] void fail_cuda(cudaError_t e, const std::string& what) {
    mpi_.fail(
        CommError("rank " + std::to_string(rank()) + ": " + what + ": CUDA: " + cuda_text(e), -1));
  }
  void nccl(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return;
    abort_nccl();
    mpi_.fail(CommError(
        "rank " + std::to_string(rank()) + ": " + what + ": NCCL: " + ncclGetErrorString(r), -1));
  }
  // Ends NCCL's kernels that wait for peers that will not come; the communicator is failed after.
  void abort_nccl() {
    if (nccl_ == nullptr) return;
    (void)ncclCommAbort(nccl_);
    nccl_ = nullptr;
  }

  MpiCommunicator mpi_;
  cudaStream_t compute_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int cuda_device_ = 0;
  ncclComm_t nccl_ = nullptr;
};

NcclRequest::~NcclRequest() {
  // A done event not waited for: leave it to the comm stream (destroying a recorded event is
  // allowed; it is released once it fires).
  comm_.release(done_);
}
bool NcclRequest::test() {
  if (finished_) return true;
  finished_ = comm_.test(done_, what_);
  return finished_;
}
void NcclRequest::wait() {
  if (finished_) return;
  comm_.wait(done_, what_, seq_);
  finished_ = true;
}

}  // namespace

// The module's factory (core/device/cuda_module.h): make_nccl_communicator in libheadroom
// (core/comm/comm.cpp) calls it. C linkage: the name dlsym looks up, whatever the namespace.
extern "C" __attribute__((visibility("default"))) Communicator*
headroom_cuda_make_nccl_communicator(Device& device, const DistributedConfig& config) {
  return new NcclCommunicator(device, config);
}

}  // namespace comm_detail
}  // namespace headroom
