// zero1 and zero2: ZeRO's first two stages (Rajbhandari et al. 2020) as policy over the host's
// headroom.shard/1 mechanism. Built twice from this file, as HEADROOM_ZERO_STAGE 1 and 2:
//
//   [[plugins]]
//   name = "zero1"                  # optimizer state sharded over the ranks
//   overlap_comm = true             # reduce each layer's gradients as soon as its backward ends
//                                   # (false: every layer's at the end of the backward)
//
//   [[plugins]]
//   name = "zero2"                  # zero1, and each rank keeps only its gradient shard
//   overlap_comm = true
//   reduce_every_micro_step = true  # DeepSpeed's way: every micro-step reduces its gradients
//                                   # into the shards, so the full gradients of a layer live only
//                                   # through its backward; false: they accumulate locally over
//                                   # the micro-steps and are reduced once, in the last
//
// The policy: take the gradient-reduction role (core's data-parallel buckets are off); at
// create(), partition. In the micro-steps that reduce (the last one for zero1; every one for
// zero2 unless reduce_every_micro_step = false), each layer's reduction starts at its
// BACKWARD_END (overlap_comm) or all of them at layer 0's, which waits for them. At STEP_END,
// every layer's updated range is gathered back and waited for. The host has the mechanism: flat,
// padded, partitioned buffers; the optimizer over this rank's ranges; the global gradient norm
// over the ranks' ranges; its checks that every layer was reduced and gathered.
//
// Training thread only; no locking. Only hr_plugin_entry is exported; no C++ exception crosses
// the C ABI.
#include <headroom/ext/shard.h>
#include <headroom/ext/step.h>
#include <headroom/plugin.h>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "zero/estimate.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#ifndef HEADROOM_ZERO_STAGE
#error "HEADROOM_ZERO_STAGE (1 or 2) must be defined"
#endif

namespace {

constexpr int kStage = HEADROOM_ZERO_STAGE;
static_assert(kStage == 1 || kStage == 2, "zero.cpp builds zero1 and zero2");

class Zero {
 public:
  Zero(const hr_host_services* s, const hr_ext_shard* shard, const hr_ext_step* step, bool overlap,
       bool every_micro_step)
      : s_(s), shard_(shard), step_(step), overlap_(overlap), every_(every_micro_step) {}

  const hr_host_services* services() const { return s_; }
  zero_plugin::Settings settings;  // the table's keys as create() read them (estimate.h)

  hr_status on_event(const hr_event_info* info) {
    if (info->event == HR_EVENT_BACKWARD_END) return backward_end(info);
    if (info->event == HR_EVENT_STEP_END) return step_end();
    return HR_OK;
  }

 private:
  // Whether this micro-step reduces: every one (zero2's default), else only the last.
  bool reduces(int32_t micro_step) const {
    if (every_) return true;
    hr_step_state st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    if (step_->state(s_->host, &st) != HR_OK) return true;
    const int32_t of = HR_HAS_FIELD(&st, hr_step_state, micro_steps) ? st.micro_steps : 1;
    return micro_step >= of;
  }

  hr_status backward_end(const hr_event_info* info) {
    if (!reduces(info->micro_step)) return HR_OK;
    if (overlap_) {
      const hr_status st = shard_->reduce_gradients(s_->host, info->layer);
      if (st != HR_OK) return st;
    } else if (info->layer == 0) {
      for (int32_t l = s_->num_layers(s_->host) - 1; l >= 0; --l) {
        const hr_status st = shard_->reduce_gradients(s_->host, l);
        if (st != HR_OK) return st;
      }
    }
    // Layer 0's backward is the last: wait for every reduction of the micro-step.
    return info->layer == 0 ? shard_->wait(s_->host) : HR_OK;
  }

  hr_status step_end() {
    for (int32_t l = 0; l < s_->num_layers(s_->host); ++l) {
      const hr_status st = shard_->gather_parameters(s_->host, l);
      if (st != HR_OK) return st;
    }
    return shard_->wait(s_->host);
  }

  const hr_host_services* s_;
  const hr_ext_shard* shard_;
  const hr_ext_step* step_;
  bool overlap_;
  bool every_;
};

hr_status create(const hr_host_services* s, void** instance) {
  const hr_ext_shard* shard = nullptr;
  const hr_ext_step* step = nullptr;
  if (HR_HAS_FIELD(s, hr_host_services, get_extension)) {
    shard = static_cast<const hr_ext_shard*>(s->get_extension(s->host, HR_EXT_SHARD));
    step = static_cast<const hr_ext_step*>(s->get_extension(s->host, HR_EXT_STEP));
  }
  if (!shard || !step) {
    s->set_error(s->host, "needs a host with headroom.shard/1 and headroom.step/1");
    return HR_ERROR_VERSION;
  }
  int32_t overlap = 1, every = 1;
  hr_status st = s->config_bool(s->host, "overlap_comm", &overlap);
  if (st != HR_OK) return st;
  if (kStage == 2) {
    st = s->config_bool(s->host, "reduce_every_micro_step", &every);
    if (st != HR_OK) return st;
  }
  // One rank: a gradient shard would be the whole gradient, and zero2's full gradients of the
  // backward would come on top of it; the optimizer state alone is partitioned (over one rank).
  const bool one_rank = s->world_size(s->host) <= 1;
  if (kStage == 2 && one_rank)
    s->log(s->host, HR_LOG_INFO, "one rank: no gradient shards (the stage is zero1's)");
  st = shard->partition(s->host, kStage == 1 || one_rank ? HR_SHARD_OPTIMIZER
                                                         : HR_SHARD_OPTIMIZER | HR_SHARD_GRADIENTS);
  if (st != HR_OK) return st;  // the host's message stands
  // Without gradient shards (zero1, or zero2 on one rank) the full gradients are reduced once, in
  // the step's last micro-step.
  const bool sharded_grads = kStage == 2 && !one_rank;
  Zero* z = new Zero(s, shard, step, overlap != 0, sharded_grads && every != 0);
  z->settings.overlap_comm = overlap != 0;
  z->settings.reduce_every_micro_step = every != 0;
  *instance = z;
  return HR_OK;
}

// headroom.estimate/1: plugins/zero/estimate.cpp, with the instance's keys (or its defaults).
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  const Zero* z = static_cast<const Zero*>(instance);
  return zero_plugin::estimate(kStage, z ? &z->settings : nullptr, q, r);
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<Zero*>(instance);
}

hr_status on_event(void* instance, const hr_event_info* info) {
  Zero* z = static_cast<Zero*>(instance);
  return headroom_plugin::guarded(z->services(), "reducing or gathering the shards",
                                  [&] { return z->on_event(info); });
}

#define HR_STR2(x) #x
#define HR_STR(x) HR_STR2(x)

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "zero" HR_STR(HEADROOM_ZERO_STAGE),
    "1.0.0",
    kStage == 1 ? "ZeRO stage 1: optimizer state sharded over the ranks"
                : "ZeRO stage 2: optimizer state and gradients sharded over the ranks",
    HR_EVENT_BIT(HR_EVENT_BACKWARD_END) | HR_EVENT_BIT(HR_EVENT_STEP_END),
    HR_ROLE_GRADIENT_REDUCTION,
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state: nothing of its own (the host snapshots the shards)
    nullptr,  // load_state
    headroom_plugin::offer_estimate<estimate>,
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
