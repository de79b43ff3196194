// headroom.comm/1 (headroom/ext/comm.h): the ranks and the collectives between them, on device
// buffers. Collectives wait for other ranks: never from inside an allocation (an allocator hook or
// an ALLOC / FREE / OOM hook), where the training thread is in the middle of another operation.
#include <memory>

#include "core/plugin_host/services.h"
#include "headroom/ext/comm.h"

// A collective in flight, the host's until the plugin waits for it.
struct hr_comm_request {
  headroom::CommRequest request;
};

namespace headroom {
namespace services {

// A collective posted by `post` (a CommRequest) into *out; its errors as statuses: a bad
// argument is HR_ERROR_INVALID, a failed communicator HR_ERROR, each with its message.
template <class F>
static hr_status post_collective(hr_host* h, hr_comm_request** out, F&& post) {
  if (!out) {
    plugin(h).error = "headroom.comm/1: out must not be NULL";
    return HR_ERROR_INVALID;
  }
  *out = nullptr;
  try {
    *out = new hr_comm_request{post(comm(h))};
    return HR_OK;
  } catch (const std::invalid_argument& e) {
    plugin(h).error = e.what();
    return HR_ERROR_INVALID;
  } catch (const std::exception& e) {
    plugin(h).error = e.what();
    return HR_ERROR;
  }
}

static ReduceOp reduce_op(uint32_t op) {
  if (op == HR_COMM_SUM) return ReduceOp::kSum;
  if (op == HR_COMM_AVERAGE) return ReduceOp::kAverage;
  throw std::invalid_argument("headroom.comm/1: op " + std::to_string(op) +
                              " is not HR_COMM_SUM or HR_COMM_AVERAGE");
}

constexpr Rule kCommRank = {HR_EXT_COMM " rank", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t comm_rank(hr_host* h) {
  return comm(h).rank();
}

constexpr Rule kCommLocalRank = {HR_EXT_COMM " local_rank", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t comm_local_rank(hr_host* h) {
  return comm(h).ranks().local_rank;
}

constexpr Rule kCommWorldSize = {HR_EXT_COMM " world_size", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t comm_world_size(hr_host* h) {
  return comm(h).world_size();
}

constexpr Rule kCommAllReduce = {HR_EXT_COMM " all_reduce", kAnyone, When::kNotInAllocation,
                                 kNotAllowed};
static hr_status comm_all_reduce(hr_host* h, void* buf, uint64_t n, uint32_t dtype, uint32_t op,
                                 hr_comm_request** out) {
  return post_collective(
      h, out, [&](Communicator& c) { return c.all_reduce(buf, n, Dtype(dtype), reduce_op(op)); });
}

constexpr Rule kCommReduceScatter = {HR_EXT_COMM " reduce_scatter", kAnyone, When::kNotInAllocation,
                                     kNotAllowed};
static hr_status comm_reduce_scatter(hr_host* h, const void* send, void* recv, uint64_t n,
                                     uint32_t dtype, uint32_t op, hr_comm_request** out) {
  return post_collective(h, out, [&](Communicator& c) {
    return c.reduce_scatter(send, recv, n, Dtype(dtype), reduce_op(op));
  });
}

constexpr Rule kCommAllGather = {HR_EXT_COMM " all_gather", kAnyone, When::kNotInAllocation,
                                 kNotAllowed};
static hr_status comm_all_gather(hr_host* h, const void* send, void* recv, uint64_t n,
                                 uint32_t dtype, hr_comm_request** out) {
  return post_collective(
      h, out, [&](Communicator& c) { return c.all_gather(send, recv, n, Dtype(dtype)); });
}

constexpr Rule kCommBroadcast = {HR_EXT_COMM " broadcast", kAnyone, When::kNotInAllocation,
                                 kNotAllowed};
static hr_status comm_broadcast(hr_host* h, void* buf, uint64_t n, uint32_t dtype, int32_t root,
                                hr_comm_request** out) {
  return post_collective(h, out,
                         [&](Communicator& c) { return c.broadcast(buf, n, Dtype(dtype), root); });
}

constexpr Rule kCommBarrier = {HR_EXT_COMM " barrier", kAnyone, When::kNotInAllocation,
                               kNotAllowed};
static hr_status comm_barrier(hr_host* h, hr_comm_request** out) {
  return post_collective(h, out, [&](Communicator& c) { return c.barrier(); });
}

constexpr Rule kCommWait = {HR_EXT_COMM " wait", kAnyone, When::kNotInAllocation, kNotAllowed};
static hr_status comm_wait(hr_host* h, hr_comm_request* request) {
  if (!request) return HR_OK;
  std::unique_ptr<hr_comm_request> owned(request);
  try {
    owned->request.wait();
    return HR_OK;
  } catch (const std::exception& e) {
    plugin(h).error = e.what();
    return HR_ERROR;
  }
}

constexpr Rule kCommStream = {HR_EXT_COMM " stream", kAnyone, When::kAnyTime, kNotAllowed};
static void* comm_stream(hr_host* h) {
  return comm(h).stream();
}

extern const hr_ext_comm kCommExtension;
const hr_ext_comm kCommExtension = {sizeof(hr_ext_comm),
                                    0,
                                    checked<kCommRank, comm_rank>,
                                    checked<kCommLocalRank, comm_local_rank>,
                                    checked<kCommWorldSize, comm_world_size>,
                                    checked<kCommAllReduce, comm_all_reduce>,
                                    checked<kCommReduceScatter, comm_reduce_scatter>,
                                    checked<kCommAllGather, comm_all_gather>,
                                    checked<kCommBroadcast, comm_broadcast>,
                                    checked<kCommBarrier, comm_barrier>,
                                    checked<kCommWait, comm_wait>,
                                    checked<kCommStream, comm_stream>};

}  // namespace services
}  // namespace headroom
