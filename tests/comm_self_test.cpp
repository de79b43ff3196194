// The self communicator (no launcher: this test binary runs as one plain process): world size 1,
// every collective local and exact.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/comm/comm.h"
#include "kernels/common/dtype.h"

namespace headroom {
namespace {

std::unique_ptr<Device> cpu() {
  DeviceConfig dc;
  return Device::create(dc);
}

TEST(CommSelf, RanksWithoutLauncher) {
  const RankInfo& r = rank_info();
  EXPECT_FALSE(r.launched);
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.local_rank, 0);
  EXPECT_EQ(r.local_size, 1);
  EXPECT_FALSE(r.host.empty());
}

TEST(CommSelf, CollectivesAreExact) {
  auto device = cpu();
  auto comm = make_communicator(*device, DistributedConfig{});
  EXPECT_STREQ(comm->kind(), "self");
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->stream(), nullptr);

  // Values no rounding could leave alone: bf16 and f16 of odd fractions.
  const uint64_t n = 37;
  std::vector<float> f(n);
  std::vector<uint16_t> b(n), h(n);
  for (uint64_t i = 0; i < n; ++i) {
    f[i] = 0.1f * float(i) - 1.7f;
    b[i] = float_to_bf16(f[i]);
    h[i] = float_to_f16(f[i]);
  }
  auto f0 = f;
  auto b0 = b;
  auto h0 = h;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    comm->all_reduce(f.data(), n, Dtype::kF32, op).wait();
    comm->all_reduce(b.data(), n, Dtype::kBF16, op).wait();
    comm->all_reduce(h.data(), n, Dtype::kF16, op).wait();
    EXPECT_EQ(std::memcmp(f.data(), f0.data(), n * 4), 0);
    EXPECT_EQ(b, b0);
    EXPECT_EQ(h, h0);
  }
  std::vector<float> out(n, 0.f);
  comm->reduce_scatter(f.data(), out.data(), n, Dtype::kF32, ReduceOp::kAverage).wait();
  EXPECT_EQ(out, f0);
  std::vector<uint16_t> gathered(n, 0);
  comm->all_gather(b.data(), gathered.data(), n, Dtype::kBF16).wait();
  EXPECT_EQ(gathered, b0);
  comm->broadcast(h.data(), n, Dtype::kF16, 0).wait();
  EXPECT_EQ(h, h0);
  comm->barrier().wait();
  EXPECT_THROW(comm->broadcast(h.data(), n, Dtype::kF16, 1), std::invalid_argument);
  EXPECT_THROW(comm->all_reduce(f.data(), n, Dtype::kF64, ReduceOp::kSum), std::invalid_argument);

  double d[2] = {1.25, -3.5};
  comm->all_reduce_host(d, 2, ReduceOp::kAverage);
  EXPECT_EQ(d[0], 1.25);
  EXPECT_EQ(d[1], -3.5);
  uint64_t m[1] = {42};
  comm->all_max_host(m, 1);
  EXPECT_EQ(m[0], 42u);
  EXPECT_EQ(comm->all_gather_host(7), std::vector<uint64_t>{7});
  comm->announce_failure("failed: nobody listens");  // nothing to tell, nothing thrown
  comm->barrier().wait();
}

}  // namespace
}  // namespace headroom
