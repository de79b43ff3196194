// CommRequest, the argument checks every implementation shares, and make_communicator: which
// implementation a run gets.
#include <stdexcept>
#include <string>

#include "core/comm/comm.h"

#include "core/comm/comm_impl.h"
#include "core/os/interrupt.h"
#if HEADROOM_HAVE_MPI
#include "core/comm/mpi_comm.h"
#endif
#if HEADROOM_HAVE_NCCL
#include "core/device/cuda_module.h"
#endif

namespace headroom {

CommRequest::~CommRequest() {
  if (!impl_) return;
  // Its buffers may still be read or written by the transport: wait, but a destructor that runs
  // while an error unwinds must not throw (the error that made us unwind is the one to report).
  try {
    impl_->wait();
  } catch (...) {
  }
}

bool CommRequest::test() {
  return !impl_ || impl_->test();
}

void CommRequest::wait() {
  if (!impl_) return;
  impl_->wait();
  impl_.reset();
}

namespace comm_detail {

namespace {
bool g_mpi_unusable = false;  // training thread only (MPI_THREAD_FUNNELED), then the exit
}  // namespace

void mark_mpi_unusable() {
  g_mpi_unusable = true;
}
bool mpi_unusable() {
  return g_mpi_unusable;
}

void check_dtype(Dtype dtype, const char* collective, bool moves) {
  if (dtype == Dtype::kI32 && moves) return;
  if (dtype != Dtype::kF32 && dtype != Dtype::kBF16 && dtype != Dtype::kF16)
    throw std::invalid_argument(
        std::string(collective) + ": dtype " + dtype_name(dtype) + " is not one a collective " +
        (moves ? "carries (f32, bf16, f16, i32)" : "reduces (f32, bf16, f16)"));
}

void check_root(int root, int world_size) {
  if (root < 0 || root >= world_size)
    throw std::invalid_argument("broadcast: root " + std::to_string(root) + " is not a rank (0.." +
                                std::to_string(world_size - 1) + ")");
}

const char* op_name(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : "average";
}

std::string describe(const char* collective, uint64_t n, Dtype dtype, const char* op) {
  std::string s = std::string(collective) + " (" + std::to_string(n) + " " + dtype_name(dtype);
  if (op != nullptr) s += std::string(", ") + op;
  return s + ")";
}

}  // namespace comm_detail

int stop_signal_of_any_rank(Communicator& comm) {
  uint64_t signal = uint64_t(stop_signal());
  if (comm.world_size() > 1) comm.all_max_host(&signal, 1);
  return int(signal);
}

std::unique_ptr<Communicator> make_local_communicator(Device& device) {
  return comm_detail::make_self_communicator(device);
}

namespace {

// A dry run's communicator (Device::dry(): `headroom plan --measure`): the collectives on device
// buffers move nothing, as the dry op table computes nothing, so that a dry run of zero on an 8B
// model neither sends its gigabytes through MPI nor commits the pages MPI would read and write.
// Host values (the loss, a stop request, the peaks) and the barrier still go across the ranks:
// every rank takes the same decisions as in the real run.
class DryCommunicator : public Communicator {
 public:
  explicit DryCommunicator(std::unique_ptr<Communicator> real) : real_(std::move(real)) {}
  const RankInfo& ranks() const override { return real_->ranks(); }
  const char* kind() const override { return real_->kind(); }
  CommRequest all_reduce(void*, uint64_t, Dtype, ReduceOp) override { return {}; }
  CommRequest reduce_scatter(const void*, void*, uint64_t, Dtype, ReduceOp) override { return {}; }
  CommRequest all_gather(const void*, void*, uint64_t, Dtype) override { return {}; }
  CommRequest broadcast(void*, uint64_t, Dtype, int) override { return {}; }
  CommRequest barrier() override { return real_->barrier(); }
  void all_reduce_host(double* values, int n, ReduceOp op) override {
    real_->all_reduce_host(values, n, op);
  }
  void all_max_host(uint64_t* values, int n) override { real_->all_max_host(values, n); }
  std::vector<uint64_t> all_gather_host(uint64_t value) override {
    return real_->all_gather_host(value);
  }
  void* stream() override { return real_->stream(); }
  void announce_failure(const std::string& what) noexcept override {
    real_->announce_failure(what);
  }

 private:
  std::unique_ptr<Communicator> real_;
};

std::unique_ptr<Communicator> make_real_communicator(Device& device,
                                                     const DistributedConfig& config);

}  // namespace

std::unique_ptr<Communicator> make_communicator(Device& device, const DistributedConfig& config) {
  std::unique_ptr<Communicator> c = make_real_communicator(device, config);
  if (device.dry() && c->world_size() > 1) return std::make_unique<DryCommunicator>(std::move(c));
  return c;
}

namespace {

std::unique_ptr<Communicator> make_real_communicator(Device& device,
                                                     const DistributedConfig& config) {
  const RankInfo& ranks = rank_info();
  if (ranks.world_size == 1) return comm_detail::make_self_communicator(device);
#if HEADROOM_HAVE_MPI
  if (device.backend().native_stream() != nullptr) {
#if HEADROOM_HAVE_NCCL
    return comm_detail::make_nccl_communicator(device, config);
#else
    // MPI would need CUDA-aware transports to read device pointers; NCCL is the engine for GPUs.
    throw ConfigError("launched on " + std::to_string(ranks.world_size) + " ranks on " +
                      device.kind() + ", but this build has no NCCL (rebuild with NCCL found)");
#endif
  }
  return comm_detail::make_mpi_communicator(device, config);
#else
  (void)device;
  (void)config;
  throw ConfigError("launched on " + std::to_string(ranks.world_size) +
                    " ranks, but this build of headroom has no MPI (rebuild with -DHEADROOM_MPI=ON "
                    "and Open MPI installed: scripts/setup)");
#endif
}

}  // namespace

#if HEADROOM_HAVE_NCCL
// NCCL's communicator is in the CUDA backend's library (core/comm/nccl_comm.cpp, built into
// libheadroom_cuda.so; core/device/cuda_module.h), loaded by then: only a CUDA device asks for it.
std::unique_ptr<Communicator> comm_detail::make_nccl_communicator(Device& device,
                                                                  const DistributedConfig& config) {
  using Make = Communicator* (*)(Device&, const DistributedConfig&);
  return std::unique_ptr<Communicator>(
      cuda_module_function<Make>("headroom_cuda_make_nccl_communicator")(device, config));
}
#endif

}  // namespace headroom
