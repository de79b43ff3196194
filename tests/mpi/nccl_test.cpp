// The NCCL communicator on GPU ranks, under mpirun like the MPI tests: one CUDA device per rank
// (its local rank), every collective on device buffers against exact values. Every rank skips
// when any rank has no GPU of its own — a build without CUDA, a machine without a GPU, fewer GPUs
// than ranks — decided together over MPI first, so that no rank waits in NCCL for one that
// skipped. Never yet run on a GPU: on this project's machines it skips.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "kernels/common/dtype.h"

namespace headroom {
namespace {

class CommNccl : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(rank_info().launched) << "run me under mpirun";
    std::string why = "this build has no CUDA backend";
#if defined(HEADROOM_HAVE_CUDA)
    DeviceConfig dc;
    dc.kind = "cuda";
    dc.index = rank_info().local_rank;
    try {
      device_ = make_cuda_device(dc);
    } catch (const ConfigError& e) {
      why = e.what();
    }
#endif
    int have = device_ ? 1 : 0, all = 0;
    MPI_Allreduce(&have, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all) {
      device_.reset();
      GTEST_SKIP() << "no GPU for every rank: the NCCL tests need one each (" << why << ")";
    }
    DistributedConfig c;
    c.timeout_s = 20;
    comm_ = make_communicator(*device_, c);
  }
  // The n f32 values `host` on the device, all-reduced by `op`, back on the host.
  std::vector<float> reduced(const std::vector<float>& host, ReduceOp op) {
    Backend& ops = device_->backend();
    Buffer buf(*device_, host.size() * sizeof(float), Category::kCommunication, "test (n)");
    ops.upload(buf.as<void>(), host.data(), host.size() * sizeof(float));
    comm_->all_reduce(buf.as<void>(), host.size(), Dtype::kF32, op).wait();
    std::vector<float> out(host.size());
    ops.download(out.data(), buf.as<void>(), out.size() * sizeof(float));
    ops.synchronize();
    return out;
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Communicator> comm_;
};

// Rank r holds i + r / 2 (exact in f32 whatever order NCCL adds in).
TEST_F(CommNccl, AllReduceSumAndAverageF32) {
  const int r = comm_->rank(), w = comm_->world_size();
  EXPECT_STREQ(comm_->kind(), "nccl");
  std::vector<float> in(1000);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = float(i % 17) + 0.5f * float(r);
  const std::vector<float> sum = reduced(in, ReduceOp::kSum);
  const std::vector<float> mean = reduced(in, ReduceOp::kAverage);
  for (size_t i = 0; i < in.size(); ++i) {
    const float s = float(w) * float(i % 17) + 0.25f * float(w) * float(w - 1);
    ASSERT_EQ(sum[i], s) << i;
    ASSERT_EQ(mean[i], s / float(w)) << i;
  }
}

TEST_F(CommNccl, AllGatherAndBroadcastF32) {
  const int r = comm_->rank(), w = comm_->world_size();
  Backend& ops = device_->backend();
  const float mine[2] = {float(r + 1), float(10 * (r + 1))};
  Buffer send(*device_, sizeof mine, Category::kCommunication, "send (2)");
  Buffer recv(*device_, w * sizeof mine, Category::kCommunication, "recv (W, 2)");
  ops.upload(send.as<void>(), mine, sizeof mine);
  comm_->all_gather(send.as<void>(), recv.as<void>(), 2, Dtype::kF32).wait();
  std::vector<float> all(2 * size_t(w));
  ops.download(all.data(), recv.as<void>(), all.size() * sizeof(float));
  comm_->broadcast(send.as<void>(), 2, Dtype::kF32, w - 1).wait();
  float root[2] = {0, 0};
  ops.download(root, send.as<void>(), sizeof root);
  ops.synchronize();
  for (int q = 0; q < w; ++q) {
    EXPECT_EQ(all[2 * q], float(q + 1));
    EXPECT_EQ(all[2 * q + 1], float(10 * (q + 1)));
  }
  EXPECT_EQ(root[0], float(w));
  EXPECT_EQ(root[1], float(10 * w));
}

}  // namespace
}  // namespace headroom
