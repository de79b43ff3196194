// The communicator of a single process (world size 1): every collective is local and exact. The
// sum and the mean over one rank are the buffer itself; reduce-scatter and all-gather are copies.
#include "core/comm/comm.h"
#include "core/comm/comm_impl.h"

namespace headroom {
namespace comm_detail {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(Device& device) : device_(device) {
    ranks_ = rank_info();  // its host name; world size 1 by construction
    ranks_.rank = 0;
    ranks_.world_size = 1;
    ranks_.local_rank = 0;
    ranks_.local_size = 1;
  }
  const RankInfo& ranks() const override { return ranks_; }
  const char* kind() const override { return "self"; }

  CommRequest all_reduce(void*, uint64_t, Dtype dtype, ReduceOp) override {
    check_dtype(dtype, "all_reduce");
    return CommRequest();
  }
  CommRequest reduce_scatter(const void* send, void* recv, uint64_t n, Dtype dtype,
                             ReduceOp) override {
    check_dtype(dtype, "reduce_scatter");
    copy(recv, send, n, dtype);
    return CommRequest();
  }
  CommRequest all_gather(const void* send, void* recv, uint64_t n, Dtype dtype) override {
    check_dtype(dtype, "all_gather", true);
    copy(recv, send, n, dtype);
    return CommRequest();
  }
  CommRequest broadcast(void*, uint64_t, Dtype dtype, int root) override {
    check_dtype(dtype, "broadcast", true);
    check_root(root, 1);
    return CommRequest();
  }
  CommRequest barrier() override { return CommRequest(); }

  void all_reduce_host(double*, int, ReduceOp) override {}
  void all_max_host(uint64_t*, int) override {}
  std::vector<uint64_t> all_gather_host(uint64_t value) override { return {value}; }
  // Collectives here enqueue only copies, on the compute stream itself.
  void* stream() override { return device_.backend().native_stream(); }
  void announce_failure(const std::string&) noexcept override {}

 private:
  // A device copy (ordered on the compute stream on CUDA); nothing when the caller reduces in
  // place.
  void copy(void* dst, const void* src, uint64_t n, Dtype dtype) {
    if (dst != src && n > 0) device_.backend().copy(dst, src, n * dtype_size(dtype));
  }

  Device& device_;
  RankInfo ranks_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(Device& device) {
  return std::make_unique<SelfCommunicator>(device);
}

}  // namespace comm_detail
}  // namespace headroom
