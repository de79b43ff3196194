// The dry backend: the op table of a run that allocates, frees and moves memory exactly as the
// real one does but computes nothing. `headroom plan --measure` runs its variants on it: the bytes
// a run holds depend on the shapes and on the order of the ops, never on the values, so the
// tracker and the allocator see the run they would see with arithmetic, at the cost of the
// memory traffic alone (a gpt2-1558m variant's GEMMs would take minutes on a CPU).
//
// Every op that places memory or waits (host_alloc, download, synchronize, the uploads' marks) is
// the wrapped backend's. Every op that computes returns without touching memory, with three
// exceptions that keep the run on its normal path: the per-token losses are written as zeros (the
// loss stays finite), the reductions return 0 and any_nonfinite false (no overflow, no clipping).
// The ops that only write values (fill, cast, copy, upload) are skipped too: no allocation depends
// on a value, and a buffer nothing writes costs no host memory on the CPU device, whose dry buffers
// are mapped without backing (core/device/device.cpp), so an 8B model's dry run fits a small host.
// The host-sync count is the wrapped backend's accounting, so waits are counted alike.
#pragma once

#include <memory>

#include "core/device/backend.h"

namespace headroom {

std::unique_ptr<Backend> make_dry_backend(Backend& real);

}  // namespace headroom
