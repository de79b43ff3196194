// The registry of the host's extensions: every id services->get_extension answers, and its table.
// Each table is defined in its own file, ext_<name>.cpp, with its functions and their rules.
// Adding an extension: its header (headroom/ext/<name>.h), its file, its test, and a line here
// (with the declaration of its table).
#include <cstring>

#include "core/plugin_host/services.h"
#include "headroom/ext/adapters.h"
#include "headroom/ext/batch.h"
#include "headroom/ext/comm.h"
#include "headroom/ext/config.h"
#include "headroom/ext/model.h"
#include "headroom/ext/offload.h"
#include "headroom/ext/ops.h"
#include "headroom/ext/precision.h"
#include "headroom/ext/recompute.h"
#include "headroom/ext/resize.h"
#include "headroom/ext/shard.h"
#include "headroom/ext/step.h"
#include "headroom/ext/tensors.h"
#include "headroom/ext/vm.h"

namespace headroom {
namespace services {

extern const hr_ext_vm kVmExtension;                // ext_vm.cpp
extern const hr_ext_precision kPrecisionExtension;  // ext_precision.cpp
extern const hr_ext_recompute kRecomputeExtension;  // ext_recompute.cpp
extern const hr_ext_tensors kTensorsExtension;      // ext_tensors.cpp
extern const hr_ext_step kStepExtension;            // ext_step.cpp
extern const hr_ext_comm kCommExtension;            // ext_comm.cpp
extern const hr_ext_shard kShardExtension;          // ext_shard.cpp
extern const hr_ext_batch kBatchExtension;          // ext_batch.cpp
extern const hr_ext_resize kResizeExtension;        // ext_resize.cpp
extern const hr_ext_model kModelExtension;          // ext_model.cpp
extern const hr_ext_ops kOpsExtension;              // ext_ops.cpp
extern const hr_ext_offload kOffloadExtension;      // ext_offload.cpp
extern const hr_ext_adapters kAdaptersExtension;    // ext_adapters.cpp
extern const hr_ext_config kConfigExtension;        // ext_config.cpp

namespace {

struct Extension {
  const char* id;     // "headroom.<name>/<version>"
  const void* table;  // its hr_ext_<name>
};

const Extension kExtensions[] = {
    {HR_EXT_VM, &kVmExtension},
    {HR_EXT_PRECISION, &kPrecisionExtension},
    {HR_EXT_RECOMPUTE, &kRecomputeExtension},
    {HR_EXT_TENSORS, &kTensorsExtension},
    {HR_EXT_STEP, &kStepExtension},
    {HR_EXT_COMM, &kCommExtension},
    {HR_EXT_SHARD, &kShardExtension},
    {HR_EXT_BATCH, &kBatchExtension},
    {HR_EXT_RESIZE, &kResizeExtension},
    {HR_EXT_MODEL, &kModelExtension},
    {HR_EXT_OPS, &kOpsExtension},
    {HR_EXT_OFFLOAD, &kOffloadExtension},
    {HR_EXT_ADAPTERS, &kAdaptersExtension},
    {HR_EXT_CONFIG, &kConfigExtension},
};

}  // namespace

const void* get_extension(hr_host*, const char* id) {
  if (!id) return nullptr;
  // Exact ids only: another version of one ("headroom.vm/2") is another extension.
  for (const Extension& e : kExtensions)
    if (std::strcmp(id, e.id) == 0) return e.table;
  return nullptr;
}

}  // namespace services
}  // namespace headroom
