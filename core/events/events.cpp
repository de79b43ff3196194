#include "core/events/events.h"

#include "headroom/plugin.h"

// The C ABI and core number events and categories alike: a plugin's event id is core's.
static_assert(static_cast<int>(headroom::Event::kOom) == HR_EVENT_OOM, "event ids drifted");
static_assert(static_cast<int>(headroom::Event::kBucketDone) == HR_EVENT_BUCKET_DONE,
              "event ids drifted");
static_assert(static_cast<int>(headroom::Event::kEvalEnd) == HR_EVENT_EVAL_END,
              "event ids drifted");
static_assert(headroom::kNumEvents == HR_EVENT_EVAL_END + 1, "event count drifted");
static_assert(static_cast<int>(headroom::Category::kCommunication) == HR_MEM_COMMUNICATION,
              "category ids drifted");
static_assert(static_cast<int>(headroom::Category::kPlugin) == HR_MEM_PLUGIN,
              "category ids drifted");
static_assert(headroom::kNumCategories == HR_MEM_CATEGORY_COUNT, "category count drifted");

namespace headroom {

const char* event_name(Event e) {
  switch (e) {
    case Event::kTrainBegin:
      return "TRAIN_BEGIN";
    case Event::kTrainEnd:
      return "TRAIN_END";
    case Event::kStepBegin:
      return "STEP_BEGIN";
    case Event::kStepEnd:
      return "STEP_END";
    case Event::kForwardBegin:
      return "FORWARD_BEGIN";
    case Event::kForwardEnd:
      return "FORWARD_END";
    case Event::kBackwardBegin:
      return "BACKWARD_BEGIN";
    case Event::kBackwardEnd:
      return "BACKWARD_END";
    case Event::kGradsReady:
      return "GRADS_READY";
    case Event::kOptimizerStep:
      return "OPTIMIZER_STEP";
    case Event::kAlloc:
      return "ALLOC";
    case Event::kFree:
      return "FREE";
    case Event::kOom:
      return "OOM";
    case Event::kBucketLaunch:
      return "BUCKET_LAUNCH";
    case Event::kBucketDone:
      return "BUCKET_DONE";
    case Event::kEvalEnd:
      return "EVAL_END";
  }
  return "UNKNOWN";
}

}  // namespace headroom
