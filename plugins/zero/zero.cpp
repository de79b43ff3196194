// zero1, zero2 and zero3: ZeRO's three stages (Rajbhandari et al. 2020) as policy over the host's
// headroom.shard/1 mechanism. Built three times from this file, as HEADROOM_ZERO_STAGE 1, 2, 3:
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
//   [[plugins]]
//   name = "zero3"                  # zero2, and each rank keeps only its parameter shard
//   overlap_comm = true
//   reduce_every_micro_step = true
//   prefetch_layers = 1             # layers gathered ahead of the one computing
//   param_persistence_threshold = 100000  # layers of fewer parameter elements stay whole
//                                   # (DeepSpeed's default; per layer, a layer being one flat
//                                   # buffer: the head's LayerNorm, tiny layers)
//
// The policy: take the gradient-reduction role (core's data-parallel buckets are off); at
// create(), partition. In the micro-steps that reduce (the last one for zero1; every one for
// zero2 and zero3 unless reduce_every_micro_step = false), each layer's reduction starts at its
// BACKWARD_END (overlap_comm) or all of them at layer 0's, which waits for them. At STEP_END,
// every whole layer's updated range is gathered back and waited for.
//
// zero3's parameters follow the micro-step's computations in order — the forward of layers
// 0..L-1, then their backward, L-1..0; the head (L-1) reads the embedding's tied wte too — through
// a window: at each computation's BEGIN the layers it and the next prefetch_layers computations
// read are gathered (the host waits for the ones it needs now); at its END the layers no
// computation in the window reads any more are released. So at most 1 + prefetch_layers
// computations' layers are gathered at once, and none outlives the micro-step.
//
// The host has the mechanism: flat, padded, partitioned buffers; the optimizer over this rank's
// ranges; the global gradient norm over the ranks' ranges; its checks that every layer was
// reduced and gathered, and that no gathered parameters outlive a step.
//
// Training thread only; no locking. Only hr_plugin_entry is exported; no C++ exception crosses
// the C ABI.
#include <headroom/ext/shard.h>
#include <headroom/ext/step.h>
#include <headroom/plugin.h>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "common/offer_reads.h"
#include "zero/estimate.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#ifndef HEADROOM_ZERO_STAGE
#error "HEADROOM_ZERO_STAGE (1, 2 or 3) must be defined"
#endif

namespace {

constexpr int kStage = HEADROOM_ZERO_STAGE;
static_assert(kStage >= 1 && kStage <= 3, "zero.cpp builds zero1, zero2 and zero3");

class Zero {
 public:
  Zero(const hr_host_services* s, const hr_ext_shard* shard, const hr_ext_step* step, bool overlap,
       bool every_micro_step, int32_t prefetch)
      : s_(s),
        shard_(shard),
        step_(step),
        overlap_(overlap),
        every_(every_micro_step),
        prefetch_(prefetch) {}

  const hr_host_services* services() const { return s_; }
  zero_plugin::Settings settings;  // the table's keys as create() read them (estimate.h)

  hr_status on_event(const hr_event_info* info) {
    switch (info->event) {
      case HR_EVENT_TRAIN_BEGIN:
        return train_begin();
      case HR_EVENT_FORWARD_BEGIN:
        return window_begin(info->layer);
      case HR_EVENT_FORWARD_END:
        return window_end(info->layer);
      case HR_EVENT_BACKWARD_BEGIN:
        return window_begin(position_of_backward(info->layer));
      case HR_EVENT_BACKWARD_END: {
        const hr_status st = backward_end(info);
        return st != HR_OK ? st : window_end(position_of_backward(info->layer));
      }
      case HR_EVENT_STEP_END:
        return step_end();
      default:
        return HR_OK;
    }
  }

 private:
  // The model's partition, once it exists: which layers keep their parameters whole, and the
  // tied one each reads too.
  hr_status train_begin() {
    const int32_t n = s_->num_layers(s_->host);
    whole_.assign(size_t(n), true);
    tied_.assign(size_t(n), -1);
    gathered_.assign(size_t(n), false);
    for (int32_t l = 0; l < n; ++l) {
      hr_shard_layout lay;
      std::memset(&lay, 0, sizeof lay);
      lay.struct_size = sizeof lay;
      const hr_status st = shard_->layout(s_->host, l, &lay);
      if (st != HR_OK) return st;
      // Without gradient shards (zero1, or more on one rank) the full gradients are reduced
      // once, in the step's last micro-step.
      if (!(lay.what & HR_SHARD_GRADIENTS)) every_ = false;
      if (!HR_HAS_FIELD(&lay, hr_shard_layout, tied)) continue;  // no parameter shards
      whole_[size_t(l)] = lay.whole != 0;
      tied_[size_t(l)] = lay.tied;
    }
    return HR_OK;
  }

  // zero3's window over the micro-step's computations: position p < L is layer p's forward,
  // L + i is the backward of layer L-1-i.
  int32_t num_layers() const { return int32_t(whole_.size()); }
  int32_t position_of_backward(int32_t layer) const { return 2 * num_layers() - 1 - layer; }
  int32_t layer_at(int32_t position) const {
    return position < num_layers() ? position : 2 * num_layers() - 1 - position;
  }
  // The sharded layers computation `position` reads (itself, and the one it is tied to).
  template <class F>
  void for_each_read(int32_t position, F&& f) const {
    const int32_t l = layer_at(position);
    for (const int32_t r : {l, tied_[size_t(l)]})
      if (r >= 0 && !whole_[size_t(r)]) f(r);
  }
  bool read_in(int32_t layer, int32_t from, int32_t to) const {
    bool found = false;
    for (int32_t p = from; p <= to && p < 2 * num_layers(); ++p)
      for_each_read(p, [&](int32_t r) { found = found || r == layer; });
    return found;
  }
  hr_status window_begin(int32_t position) {
    hr_status st = HR_OK;
    for (int32_t p = position; p <= position + prefetch_ && p < 2 * num_layers(); ++p)
      for_each_read(p, [&](int32_t r) {
        if (st != HR_OK || gathered_[size_t(r)]) return;
        st = shard_->gather_parameters(s_->host, r);
        gathered_[size_t(r)] = st == HR_OK;
      });
    return st;
  }
  hr_status window_end(int32_t position) {
    for (int32_t l = 0; l < num_layers(); ++l) {
      if (!gathered_[size_t(l)] || read_in(l, position + 1, position + prefetch_)) continue;
      const hr_status st = shard_->release_parameters(s_->host, l);
      if (st != HR_OK) return st;
      gathered_[size_t(l)] = false;
    }
    return HR_OK;
  }

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
    // The whole layers' updated ranges (zero3's sharded layers are gathered when next read).
    for (int32_t l = 0; l < s_->num_layers(s_->host); ++l) {
      if (!whole_.empty() && !whole_[size_t(l)]) continue;
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
  int32_t prefetch_;
  std::vector<bool> whole_;     // per layer: its parameters are not sharded
  std::vector<int32_t> tied_;   // per layer: the other layer it reads, or -1
  std::vector<bool> gathered_;  // per layer: this plugin gathered it and has not released it
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
  int64_t prefetch = 1, persist = 100000;
  if (kStage >= 2) {
    st = s->config_bool(s->host, "reduce_every_micro_step", &every);
    if (st != HR_OK) return st;
  }
  if (kStage == 3) {
    st = s->config_int(s->host, "prefetch_layers", &prefetch);
    if (st != HR_OK) return st;
    if (prefetch < 0 || prefetch > 64)
      return s->config_error(s->host, "prefetch_layers",
                             "must be 0 to 64 (the layers gathered ahead of the one computing)");
    st = s->config_int(s->host, "param_persistence_threshold", &persist);
    if (st != HR_OK) return st;
    if (persist < 0)
      return s->config_error(s->host, "param_persistence_threshold",
                             "must be >= 0 (parameter elements; 0: every layer sharded)");
  }
  // The stage's partition. What the host shards may be less (on one rank only the optimizer
  // state, unless the parameters' shards rest in host memory: headroom.offload/1): the layout's
  // `what` says, at TRAIN_BEGIN.
  const uint32_t what = kStage == 1 ? HR_SHARD_OPTIMIZER
                        : kStage == 2
                            ? HR_SHARD_OPTIMIZER | HR_SHARD_GRADIENTS
                            : HR_SHARD_OPTIMIZER | HR_SHARD_GRADIENTS | HR_SHARD_PARAMETERS;
  st = shard->partition(s->host, what);
  if (st != HR_OK) return st;  // the host's message stands
  if (what & HR_SHARD_PARAMETERS) {
    if (!HR_HAS_FIELD(shard, hr_ext_shard, persist_below)) {
      s->set_error(s->host, "needs a host whose headroom.shard/1 shards parameters (ABI 1.5)");
      return HR_ERROR_VERSION;
    }
    st = shard->persist_below(s->host, uint64_t(persist));
    if (st != HR_OK) return st;
  }
  Zero* z = new Zero(s, shard, step, overlap != 0, kStage >= 2 && every != 0, int32_t(prefetch));
  z->settings.overlap_comm = overlap != 0;
  z->settings.reduce_every_micro_step = every != 0;
  z->settings.prefetch_layers = int32_t(prefetch);
  z->settings.param_persistence_threshold = uint64_t(persist);
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

// What `plan --measure --search` tries of zero3 (hr_ext_estimate.modes): its defaults, on the
// run's ranks. On one rank that shards only the optimizer state, unless the offload plugin puts
// the shards in host memory: the search pairs the two modes where neither fits alone.
constexpr hr_estimate_mode kModes[] = {headroom_plugin::mode("at its defaults", "")};
constexpr headroom_plugin::OfferFn kOfferEstimate =
    kStage == 3 ? &headroom_plugin::offer_estimate_modes<estimate, kModes>
                : &headroom_plugin::offer_estimate<estimate>;

#define HR_STR2(x) #x
#define HR_STR(x) HR_STR2(x)

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "zero" HR_STR(HEADROOM_ZERO_STAGE),
    "1.0.0",
    kStage == 1 ? "ZeRO stage 1: optimizer state sharded over the ranks"
    : kStage == 2
        ? "ZeRO stage 2: optimizer state and gradients sharded over the ranks"
        : "ZeRO stage 3: optimizer state, gradients and parameters sharded over the ranks",
    // TRAIN_BEGIN from zero2 on: what the host partitioned (layout's `what`).
    HR_EVENT_BIT(HR_EVENT_BACKWARD_END) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
        (kStage >= 2 ? HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) : 0) |
        (kStage == 3 ? HR_EVENT_BIT(HR_EVENT_FORWARD_BEGIN) | HR_EVENT_BIT(HR_EVENT_FORWARD_END) |
                           HR_EVENT_BIT(HR_EVENT_BACKWARD_BEGIN)
                     : 0),
    HR_ROLE_GRADIENT_REDUCTION,
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state: nothing of its own (the host snapshots the shards)
    nullptr,  // load_state
    // BACKWARD_END reduces the layer's gradients into the shards; the rest gathers and releases
    // parameters.
    headroom_plugin::offer_all<kOfferEstimate,
                               headroom_plugin::offer_reads<HR_EVENT_BIT(HR_EVENT_BACKWARD_END)>>,
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
