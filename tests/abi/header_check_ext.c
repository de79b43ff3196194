/* Every extension header compiles on its own, warning-free, as C99, C11 and C++17. */
#include <headroom/ext/batch.h>
#include <headroom/ext/comm.h>
#include <headroom/ext/estimate.h>
#include <headroom/ext/precision.h>
#include <headroom/ext/recompute.h>
#include <headroom/ext/roles.h>
#include <headroom/ext/shard.h>
#include <headroom/ext/state.h>
#include <headroom/ext/step.h>
#include <headroom/ext/tensors.h>
#include <headroom/ext/vm.h>

int main(void) {
  return (int)(sizeof(hr_ext_vm) + sizeof(hr_ext_precision) + sizeof(hr_ext_recompute) +
               sizeof(hr_ext_tensors) + sizeof(hr_ext_step) + sizeof(hr_ext_state) +
               sizeof(hr_ext_estimate) + sizeof(hr_ext_comm) + sizeof(hr_ext_shard) +
               sizeof(hr_ext_batch)) == 0;
}
