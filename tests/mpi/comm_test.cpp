// The MPI communicator, run on every rank under mpirun (-np 2 and -np 3, tests/mpi/CMakeLists.txt).
// Inputs are small multiples of 1/2, so every sum is exact in f32, bf16 and f16 whatever order
// MPI adds in: the expected values below are exact, not approximate.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "kernels/common/dtype.h"

namespace headroom {
namespace {

std::unique_ptr<Device> cpu() {
  DeviceConfig dc;
  return Device::create(dc);
}

DistributedConfig config(double timeout_s) {
  DistributedConfig c;
  c.timeout_s = timeout_s;
  return c;
}

// Rank r's i-th input: (i mod 13) - 6 + r / 2.
float input(int r, uint64_t i) {
  return float(int(i % 13) - 6) + 0.5f * float(r);
}

uint16_t to16(Dtype dt, float x) {
  return dt == Dtype::kBF16 ? float_to_bf16(x) : float_to_f16(x);
}
float from16(Dtype dt, uint16_t h) {
  return dt == Dtype::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}

class CommMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(rank_info().launched) << "run me under mpirun";
    device_ = cpu();
    comm_ = make_communicator(*device_, config(20));
    rank_ = comm_->rank();
    world_ = comm_->world_size();
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Communicator> comm_;
  int rank_ = 0, world_ = 1;
};

TEST_F(CommMpi, Ranks) {
  int r = -1, w = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  EXPECT_STREQ(comm_->kind(), "mpi");
  EXPECT_EQ(rank_, r);
  EXPECT_EQ(world_, w);
  EXPECT_GE(w, 2);
  const RankInfo& info = comm_->ranks();
  // One host here: every rank is local.
  EXPECT_EQ(info.local_size, w);
  EXPECT_EQ(info.local_rank, r);
  EXPECT_FALSE(info.host.empty());
  EXPECT_EQ(comm_->stream(), nullptr);
}

TEST_F(CommMpi, AllReduceF32) {
  const uint64_t n = 1000;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    std::vector<float> x(n);
    for (uint64_t i = 0; i < n; ++i)
      x[i] = input(rank_, i);
    comm_->all_reduce(x.data(), n, Dtype::kF32, op).wait();
    for (uint64_t i = 0; i < n; ++i) {
      float sum = 0;
      for (int r = 0; r < world_; ++r)
        sum += input(r, i);
      const float want = op == ReduceOp::kSum ? sum : sum / float(world_);
      ASSERT_EQ(x[i], want) << "element " << i << " op " << int(op);
    }
  }
}

TEST_F(CommMpi, AllReduceBf16F16) {
  const uint64_t n = 999;
  for (Dtype dt : {Dtype::kBF16, Dtype::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
      std::vector<uint16_t> x(n);
      for (uint64_t i = 0; i < n; ++i)
        x[i] = to16(dt, input(rank_, i));
      comm_->all_reduce(x.data(), n, dt, op).wait();
      for (uint64_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < world_; ++r)
          sum += input(r, i);
        const uint16_t want = to16(dt, op == ReduceOp::kSum ? sum : sum / float(world_));
        ASSERT_EQ(x[i], want) << dtype_name(dt) << " element " << i << " op " << int(op);
      }
    }
  }
}

// The 2-byte sums round once, to nearest even: ranks 0 and 1 contribute (the others add zeros,
// which are exact), 1 + half a unit ties down to 1, (1 + a unit) + half a unit ties up.
TEST_F(CommMpi, HalfSumsRoundToNearestEven) {
  for (Dtype dt : {Dtype::kBF16, Dtype::kF16}) {
    const float unit = dt == Dtype::kBF16 ? 1.0f / 128 : 1.0f / 1024;  // spacing at 1
    std::vector<uint16_t> x(2, to16(dt, 0.f));
    if (rank_ == 0) {
      x[0] = to16(dt, 1.f);
      x[1] = to16(dt, 1.f + unit);
    } else if (rank_ == 1) {
      x[0] = x[1] = to16(dt, unit / 2);
    }
    comm_->all_reduce(x.data(), 2, dt, ReduceOp::kSum).wait();
    EXPECT_EQ(from16(dt, x[0]), 1.f) << dtype_name(dt);
    EXPECT_EQ(from16(dt, x[1]), 1.f + 2 * unit) << dtype_name(dt);
  }
}

TEST_F(CommMpi, ReduceScatterAllGatherBroadcastBarrier) {
  const uint64_t n = 17;
  // reduce_scatter: rank r ends with block r of the sum (and of the mean).
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    std::vector<float> send(n * uint64_t(world_)), recv(n, -1.f);
    for (uint64_t i = 0; i < send.size(); ++i)
      send[i] = input(rank_, i);
    comm_->reduce_scatter(send.data(), recv.data(), n, Dtype::kF32, op).wait();
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t g = uint64_t(rank_) * n + i;
      float sum = 0;
      for (int r = 0; r < world_; ++r)
        sum += input(r, g);
      ASSERT_EQ(recv[i], op == ReduceOp::kSum ? sum : sum / float(world_)) << i;
    }
  }
  std::vector<uint16_t> hsend(n * uint64_t(world_)), hrecv(n);
  for (uint64_t i = 0; i < hsend.size(); ++i)
    hsend[i] = float_to_bf16(input(rank_, i));
  comm_->reduce_scatter(hsend.data(), hrecv.data(), n, Dtype::kBF16, ReduceOp::kSum).wait();
  for (uint64_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int r = 0; r < world_; ++r)
      sum += input(r, uint64_t(rank_) * n + i);
    ASSERT_EQ(hrecv[i], float_to_bf16(sum)) << i;
  }

  // all_gather: rank r's block at r * n.
  std::vector<uint16_t> mine(n), all(n * uint64_t(world_), 0);
  for (uint64_t i = 0; i < n; ++i)
    mine[i] = float_to_f16(input(rank_, i));
  comm_->all_gather(mine.data(), all.data(), n, Dtype::kF16).wait();
  for (int r = 0; r < world_; ++r)
    for (uint64_t i = 0; i < n; ++i)
      ASSERT_EQ(all[uint64_t(r) * n + i], float_to_f16(input(r, i))) << r << " " << i;

  // all_gather of i32 words moves bytes as they are (a quantized base's, whatever float they
  // would spell: NaN patterns too).
  std::vector<uint32_t> words(n), gathered(n * uint64_t(world_), 0);
  for (uint64_t i = 0; i < n; ++i)
    words[i] = 0x7fc00001u + uint32_t(rank_) * 0x10000u + uint32_t(i);
  comm_->all_gather(words.data(), gathered.data(), n, Dtype::kI32).wait();
  for (int r = 0; r < world_; ++r)
    for (uint64_t i = 0; i < n; ++i)
      ASSERT_EQ(gathered[uint64_t(r) * n + i], 0x7fc00001u + uint32_t(r) * 0x10000u + uint32_t(i));

  // broadcast from the last rank.
  const int root = world_ - 1;
  std::vector<float> b(n);
  for (uint64_t i = 0; i < n; ++i)
    b[i] = input(rank_, i);
  comm_->broadcast(b.data(), n, Dtype::kF32, root).wait();
  for (uint64_t i = 0; i < n; ++i)
    ASSERT_EQ(b[i], input(root, i));
  EXPECT_THROW(comm_->broadcast(b.data(), n, Dtype::kF32, world_), std::invalid_argument);
  EXPECT_THROW(comm_->all_reduce(b.data(), n, Dtype::kI32, ReduceOp::kSum), std::invalid_argument);

  comm_->barrier().wait();
}

TEST_F(CommMpi, HostHelpers) {
  double d[3] = {double(rank_), 0.25, -1.0 * rank_};
  comm_->all_reduce_host(d, 3, ReduceOp::kSum);
  const double ranks_sum = world_ * (world_ - 1) / 2.0;
  EXPECT_EQ(d[0], ranks_sum);
  EXPECT_EQ(d[1], 0.25 * world_);
  EXPECT_EQ(d[2], -ranks_sum);
  double a[1] = {double(rank_ + 1)};
  comm_->all_reduce_host(a, 1, ReduceOp::kAverage);
  EXPECT_EQ(a[0], (world_ + 1) / 2.0);
  uint64_t m[2] = {uint64_t(rank_) * 1000, uint64_t(100 - rank_)};
  comm_->all_max_host(m, 2);
  EXPECT_EQ(m[0], uint64_t(world_ - 1) * 1000);
  EXPECT_EQ(m[1], 100u);
  std::vector<uint64_t> want;
  for (int r = 0; r < world_; ++r)
    want.push_back(uint64_t(r) * 7 + 1);
  EXPECT_EQ(comm_->all_gather_host(uint64_t(rank_) * 7 + 1), want);
}

// Several collectives in flight at once complete whatever order they are waited in (the trainer
// waits for its buckets in launch order; a plugin may not).
TEST_F(CommMpi, OverlappingRequestsAnyWaitOrder) {
  const int k = 4;
  const uint64_t n = 257;
  std::vector<std::vector<float>> bufs(k, std::vector<float>(n));
  for (int order = 0; order < 2; ++order) {
    std::vector<CommRequest> reqs;
    for (int j = 0; j < k; ++j) {
      for (uint64_t i = 0; i < n; ++i)
        bufs[size_t(j)][i] = input(rank_, i) * float(j + 1);
      reqs.push_back(comm_->all_reduce(bufs[size_t(j)].data(), n, Dtype::kF32, ReduceOp::kSum));
    }
    if (order == 0) {
      for (int j = k - 1; j >= 0; --j)
        reqs[size_t(j)].wait();
    } else {
      // By test(): progressed without blocking until each is done.
      for (bool all = false; !all;) {
        all = true;
        for (CommRequest& r : reqs)
          all = r.test() && all;
      }
    }
    for (int j = 0; j < k; ++j)
      for (uint64_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < world_; ++r)
          sum += input(r, i) * float(j + 1);
        ASSERT_EQ(bufs[size_t(j)][i], sum) << "order " << order << " request " << j;
      }
  }
}

// Rank 1 does not join a barrier: every other rank's wait throws CommError naming rank 1. Then
// (told so by the test itself, over MPI_COMM_WORLD) rank 1 joins late, so nothing stays in flight.
TEST_F(CommMpi, TimeoutNamesTheMissingRank) {
  auto comm = make_communicator(*device_, config(1.0));
  if (rank_ != 1) {
    CommRequest req = comm->barrier();
    try {
      req.wait();
      ADD_FAILURE() << "the barrier finished without rank 1";
    } catch (const PeerFailed& e) {
      ADD_FAILURE() << "not a peer failure: " << e.what();
    } catch (const CommError& e) {
      EXPECT_EQ(e.rank(), 1) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 has not said it waits"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("barrier"), std::string::npos) << e.what();
    }
    // Failed for good: the next collective says so at once.
    EXPECT_THROW(comm->barrier(), CommError);
    int go = 1;
    MPI_Send(&go, 1, MPI_INT, 1, 77, MPI_COMM_WORLD);
  } else {
    for (int r = 0; r < world_; ++r) {
      if (r == 1) continue;
      int go = 0;
      MPI_Recv(&go, 1, MPI_INT, r, 77, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    comm->barrier().wait();
  }
  comm.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

// Rank 1 announces that it ran out of memory while the others wait in an all-reduce it has not
// joined: their waits throw PeerFailed naming rank 1, with its words.
TEST_F(CommMpi, AnnouncedFailureEndsPeersWaits) {
  auto comm = make_communicator(*device_, config(20));
  std::vector<float> x(8, 1.f);
  if (rank_ != 1) {
    CommRequest req = comm->all_reduce(x.data(), x.size(), Dtype::kF32, ReduceOp::kSum);
    // Posted everywhere before rank 1 speaks, so that it can join the all-reduce late.
    MPI_Barrier(MPI_COMM_WORLD);
    try {
      req.wait();
      ADD_FAILURE() << "the all_reduce finished without rank 1";
    } catch (const PeerFailed& e) {
      EXPECT_EQ(e.rank(), 1);
      EXPECT_STREQ(e.what(), "rank 1 ran out of memory");
    } catch (const CommError& e) {
      ADD_FAILURE() << "not PeerFailed: " << e.what();
    }
    // Every later wait says the same at once.
    EXPECT_THROW(comm->barrier(), PeerFailed);
    int go = 1;
    MPI_Send(&go, 1, MPI_INT, 1, 78, MPI_COMM_WORLD);
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
    comm->announce_failure("ran out of memory");
    for (int r = 0; r < world_; ++r) {
      if (r == 1) continue;
      int go = 0;
      MPI_Recv(&go, 1, MPI_INT, r, 78, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    // Join late, so that the others' all-reduce completes and nothing stays in flight.
    comm->all_reduce(x.data(), x.size(), Dtype::kF32, ReduceOp::kSum).wait();
  }
  comm.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace headroom
