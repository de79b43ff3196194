// What the communicator's implementations share inside core/comm/: their factories and the checks
// every collective makes of its arguments. Not for other rooms: they use comm.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/comm/comm.h"

namespace headroom {
namespace comm_detail {

// Throws std::invalid_argument unless dtype is f32, bf16 or f16 (what collectives carry), or for
// a collective that moves bytes without arithmetic (all_gather, broadcast: `moves`) also i32.
void check_dtype(Dtype dtype, const char* collective, bool moves = false);
// Throws std::invalid_argument unless 0 <= root < world_size.
void check_root(int root, int world_size);
// "all_reduce (4096 bf16, sum)": what a message names while waiting.
std::string describe(const char* collective, uint64_t n, Dtype dtype, const char* op = nullptr);
const char* op_name(ReduceOp op);

std::unique_ptr<Communicator> make_self_communicator(Device& device);

// A collective timed out or was stopped with a peer missing: the peer may be dead, and
// MPI_Finalize's fence over every process would wait for it forever. After this, the exit gives
// MPI_Finalize a few seconds, then ends the process with exit code 6 (ranks.cpp).
void mark_mpi_unusable();
bool mpi_unusable();
#if HEADROOM_HAVE_MPI
class MpiCommunicator;
std::unique_ptr<MpiCommunicator> make_mpi_communicator(Device& device,
                                                       const DistributedConfig& config);
#endif
#if HEADROOM_HAVE_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(Device& device,
                                                     const DistributedConfig& config);
#endif

}  // namespace comm_detail
}  // namespace headroom
