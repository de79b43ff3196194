// The events of the training loop (docs/design.md, "The loop and its events"). The trainer fires
// them; listeners — the plugin host, once plugins load — receive them in registration order.
#pragma once

#include <cstdint>

#include "core/device/memory.h"

namespace headroom {

enum class Event : int {
  kTrainBegin = 0,
  kTrainEnd,
  kStepBegin,
  kStepEnd,
  kForwardBegin,   // per layer
  kForwardEnd,     // per layer
  kBackwardBegin,  // per layer
  kBackwardEnd,    // per layer
  kGradsReady,     // every micro-step's gradient accumulated (and reduced across ranks)
  kOptimizerStep,  // just before the optimizer updates the parameters
  kAlloc,
  kFree,
  kOom,
  // World size > 1, data parallelism: a gradient bucket's all-reduce launched (in the step's last
  // micro-step, once the lowest layer feeding it finished its backward), and waited for (before
  // GRADS_READY). `bytes`: the bucket's; `layer`: its lowest layer.
  kBucketLaunch,
  kBucketDone,
  // An evaluation of the validation loss (train.eval_every) finished, after its step's STEP_END:
  // `loss` the validation loss (the mean over ranks), `tokens` this rank's token count.
  kEvalEnd,
};
constexpr int kNumEvents = 16;
const char* event_name(Event e);  // "TRAIN_BEGIN", ...

struct EventInfo {
  Event event = Event::kTrainBegin;
  int64_t step = 0;    // 1-based optimizer step; 0 outside steps
  int micro_step = 0;  // 1-based within the step; 0 outside micro-steps
  int layer = -1;      // FORWARD_* / BACKWARD_*; BUCKET_*: the bucket's lowest layer
  // ALLOC / FREE / OOM; BUCKET_*: bytes is the bucket's size
  const void* ptr = nullptr;
  uint64_t bytes = 0;
  Category category = Category::kWorkspace;
  // BACKWARD_END: the micro-step's mean loss over its tokens, and its token count; GRADS_READY and
  // STEP_END: the step's, over all its micro-steps' tokens; EVAL_END: the validation loss and
  // its tokens. 0 for other events. Read on the host
  // where the head computes the loss (once a micro-step): no device sync of its own.
  double loss = 0.0;
  uint64_t tokens = 0;
};

class EventListener {
 public:
  virtual ~EventListener() = default;
  // Called on the training thread, in loop order.
  virtual void on_event(const EventInfo& info) = 0;
};

}  // namespace headroom
