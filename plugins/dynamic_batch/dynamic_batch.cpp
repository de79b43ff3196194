// dynamic_batch: when memory runs out (or is about to), the step runs at a smaller micro-batch
// with more accumulation — the same sequences, the same effective batch, so the same learning —
// instead of the run dying; and it grows back when memory allows. The mechanism is the host's
// (headroom.batch/1: abort and restart a step with its memory released, change the micro-batch
// between steps); the policy and its state are this plugin's:
//
//   [[plugins]]
//   name = "dynamic_batch"
//   headroom_fraction = 0.05  # proactive: a step whose peak comes within this fraction of
//                             # [device] memory_limit shrinks the next one (0 = off; also off
//                             # without a limit)
//   grow_after = 50           # good steps at a smaller micro-batch before trying the next larger
//                             # one, up to [train] micro_batch (0 = never grow)
//   min_micro_batch = 1       # never below this (a divisor of [train] micro_batch)
//
// Reactive, at OOM in a micro-step: the step restarts at the next smaller micro-batch (the largest
// divisor of [train] micro_batch at most half the current one). At min_micro_batch the OOM stands
// (exit 3), and the host's report says the micro-batch was lowered to there.
//
// Proactive, at STEP_END: with the step's peak (headroom.batch/1 attempt_peak_bytes) at or above
// (1 - headroom_fraction) · memory_limit, the next step shrinks the same way. Growing back in
// proactive mode also predicts the larger micro-batch's peak — the bytes the step added over its
// start scale with the micro-batch — and waits while that would come within the fraction.
//
// Its estimate (headroom.estimate/1), for `headroom plan` and the out-of-memory advice: as
// configured, the micro-batch the run settles on — the largest divisor that fits memory_limit by
// core's closed form (and, in proactive mode, stays under the headroom) — and that micro-batch's
// bytes. Not configured, it proposes itself with its defaults where a smaller micro-batch makes
// the run fit (the advice also spells that micro-batch as --set flags, for a run without it).
//
// A good step ran to its end without a restart and without a shrink. The current micro-batch and
// the good-step count are in snapshots (headroom.state/1): a resumed run continues at the
// micro-batch it had settled on, bitwise.
//
// Training thread only (create, TRAIN_BEGIN, STEP_END, OOM); no device work of its own.
#include <headroom/ext/batch.h>
#include <headroom/ext/estimate.h>
#include <headroom/ext/state.h>
#include <headroom/plugin.h>

#include "common/hook_guard.h"
#include "common/offer_reads.h"
#include "common/units.h"

#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace {

// What a snapshot holds.
struct State {
  uint32_t version = 1;
  int32_t micro_batch = 0;  // 0: not started (the configured one)
  int64_t good_steps = 0;
};

using headroom_units::format_bytes;

class DynamicBatch {
 public:
  DynamicBatch(const hr_host_services* s, const hr_ext_batch* batch, double fraction,
               int64_t grow_after, int32_t min_micro_batch)
      : s_(s), batch_(batch), fraction_(fraction), grow_after_(grow_after), min_(min_micro_batch) {}
  const hr_host_services* services() const { return s_; }

  hr_status on_train_begin() {
    const hr_batch_state b = state();
    // The host changes the micro-batch on one rank without a zero plugin so far: elsewhere (a
    // zero plugin on one rank) it refuses even the micro-batch it has, and this plugin stands
    // aside for the run rather than stop it later.
    if (batch_->set_micro_batch(s_->host, b.micro_batch, "unchanged") == HR_ERROR_NOT_ALLOWED) {
      off_ = true;
      s_->log(s_->host, HR_LOG_WARN,
              "the host cannot change the micro-batch in this run (one rank without a zero "
              "plugin so far): dynamic_batch does nothing");
      return HR_OK;
    }
    // A resumed run continues at the micro-batch it had settled on, if the config still allows it.
    if (st_.micro_batch == 0 || st_.micro_batch == b.micro_batch) return HR_OK;
    if (b.configured_micro_batch % st_.micro_batch != 0 || st_.micro_batch < min_) {
      s_->log(s_->host, HR_LOG_WARN,
              ("the snapshot's micro_batch " + std::to_string(st_.micro_batch) +
               " does not fit this config's (micro_batch " +
               std::to_string(b.configured_micro_batch) + ", min_micro_batch " +
               std::to_string(min_) + "): starting at " + std::to_string(b.micro_batch))
                  .c_str());
      st_ = State{};
      return HR_OK;
    }
    return batch_->set_micro_batch(s_->host, st_.micro_batch,
                                   ("resumed at the micro-batch the run had settled on, " +
                                    std::to_string(st_.good_steps) + " good steps there")
                                       .c_str());
  }

  // Reactive: the step runs again, smaller.
  hr_status on_oom(const hr_event_info* info) {
    if (off_) return HR_OK;
    const hr_batch_state b = state();
    const int32_t smaller = next_smaller(b.configured_micro_batch, b.micro_batch);
    if (smaller == 0) {
      const std::string m =
          "out of memory at micro_batch " + std::to_string(b.micro_batch) +
          (b.micro_batch == 1
               ? ", the smallest there is"
               : ", the smallest min_micro_batch = " + std::to_string(min_) + " allows") +
          ": the out-of-memory stands";
      s_->log(s_->host, HR_LOG_WARN, m.c_str());
      return HR_OK;
    }
    const std::string why = "out of memory (" + format_bytes(info->bytes) +
                            " requested) at micro_batch " + std::to_string(b.micro_batch);
    if (batch_->restart_step(s_->host, smaller, why.c_str()) != HR_OK) {
      // Outside a micro-step, or a run that cannot restart steps: the out-of-memory stands.
      s_->log(s_->host, HR_LOG_WARN,
              ("cannot restart this step at a smaller micro-batch here (step " +
               std::to_string(info->step) + ", micro-step " + std::to_string(info->micro_step) +
               "): the out-of-memory stands")
                  .c_str());
      return HR_OK;
    }
    st_.micro_batch = smaller;
    st_.good_steps = 0;
    return HR_OK;
  }

  hr_status on_step_end(const hr_event_info* info) {
    if (off_) return HR_OK;
    const hr_batch_state b = state();
    const int32_t cur = b.micro_batch;
    st_.micro_batch = cur;
    const uint64_t limit = b.memory_limit;
    const bool proactive = fraction_ > 0 && limit > 0;
    const double threshold = (1.0 - fraction_) * double(limit);
    if (proactive && double(b.attempt_peak_bytes) >= threshold) {
      const int32_t smaller = next_smaller(b.configured_micro_batch, cur);
      st_.good_steps = 0;
      if (smaller == 0) return HR_OK;  // nothing smaller: the wall will tell
      char why[256];
      std::snprintf(why, sizeof why,
                    "proactive: step %" PRId64
                    "'s peak %s is within headroom_fraction %g of memory_limit %s; shrinking "
                    "before anything fails",
                    info->step, format_bytes(b.attempt_peak_bytes).c_str(), fraction_,
                    format_bytes(limit).c_str());
      st_.micro_batch = smaller;
      return batch_->set_micro_batch(s_->host, smaller, why);
    }
    st_.good_steps = b.restarts > 0 ? 0 : st_.good_steps + 1;
    if (grow_after_ <= 0 || cur >= b.configured_micro_batch || st_.good_steps < grow_after_)
      return HR_OK;
    const int32_t larger = next_larger(b.configured_micro_batch, cur);
    std::string why = std::to_string(st_.good_steps) + " good steps at micro_batch " +
                      std::to_string(cur) + ": trying " + std::to_string(larger) + " again";
    st_.good_steps = 0;
    if (proactive) {
      // The bytes the step added over its start grow with the micro-batch.
      const double added = double(b.attempt_peak_bytes - b.attempt_start_bytes);
      const double predicted = double(b.attempt_start_bytes) + added * larger / cur;
      if (predicted >= threshold) return HR_OK;  // it would only shrink again: wait more
      why += " (predicted peak " + format_bytes(uint64_t(predicted)) + ")";
    }
    st_.micro_batch = larger;
    return batch_->set_micro_batch(s_->host, larger, why.c_str());
  }

  double fraction() const { return fraction_; }
  int32_t min_micro_batch() const { return min_; }

  hr_status save(const hr_state_writer* w) const { return w->write(w->context, &st_, sizeof st_); }
  hr_status load(const void* data, uint64_t size) {
    State loaded;
    if (size != sizeof loaded) {
      s_->set_error(s_->host, ("dynamic_batch state of " + std::to_string(size) +
                               " bytes; expected " + std::to_string(sizeof loaded))
                                  .c_str());
      return HR_ERROR_CONFIG;
    }
    std::memcpy(&loaded, data, sizeof loaded);
    if (loaded.version != 1 || loaded.micro_batch < 0 || loaded.good_steps < 0) {
      s_->set_error(s_->host, "dynamic_batch state is damaged (unknown version or bad values)");
      return HR_ERROR_CONFIG;
    }
    st_ = loaded;
    return HR_OK;
  }

 private:
  hr_batch_state state() const {
    hr_batch_state b;
    std::memset(&b, 0, sizeof b);
    b.struct_size = sizeof b;
    batch_->state(s_->host, &b);
    return b;
  }
  // The largest divisor of B at most half of `cur` and at least min_micro_batch, else the
  // largest below `cur` and at least min_micro_batch; 0 when there is none.
  int32_t next_smaller(int32_t B, int32_t cur) const {
    for (int32_t d = cur / 2; d >= min_ && d >= 1; --d)
      if (B % d == 0) return d;
    for (int32_t d = cur - 1; d >= min_ && d >= 1; --d)
      if (B % d == 0) return d;
    return 0;
  }
  // The smallest divisor of B at least twice `cur`, else B.
  static int32_t next_larger(int32_t B, int32_t cur) {
    for (int32_t d = 2 * cur; d < B; ++d)
      if (B % d == 0) return d;
    return B;
  }

  const hr_host_services* s_;
  const hr_ext_batch* batch_;
  double fraction_;
  int64_t grow_after_;
  int32_t min_;
  State st_;
  bool off_ = false;  // the host cannot change the micro-batch in this run
};

hr_status create(const hr_host_services* s, void** instance) {
  const auto* batch =
      HR_HAS_FIELD(s, hr_host_services, get_extension)
          ? static_cast<const hr_ext_batch*>(s->get_extension(s->host, HR_EXT_BATCH))
          : nullptr;
  if (!batch) {
    s->set_error(s->host, "dynamic_batch needs a host with headroom.batch/1; this one is older");
    return HR_ERROR_UNSUPPORTED;
  }
  double fraction = 0.05;
  int64_t grow_after = 50, min_micro_batch = 1;
  hr_status st = s->config_float(s->host, "headroom_fraction", &fraction);
  if (st == HR_OK) st = s->config_int(s->host, "grow_after", &grow_after);
  if (st == HR_OK) st = s->config_int(s->host, "min_micro_batch", &min_micro_batch);
  if (st != HR_OK) return st;
  if (!(fraction >= 0 && fraction < 0.5))
    return s->config_error(s->host, "headroom_fraction",
                           "must be in [0, 0.5): the share of memory_limit kept free (0.05; 0 "
                           "turns the proactive mode off)");
  if (grow_after < 0)
    return s->config_error(s->host, "grow_after",
                           "must be >= 0 good steps before growing back (0 = never)");
  // Every rank would have to agree on every restart: one rank so far.
  if (s->world_size(s->host) > 1) {
    s->set_error(s->host,
                 ("dynamic_batch runs on one rank so far; this run has " +
                  std::to_string(s->world_size(s->host)) + " (remove it from the [[plugins]] list)")
                     .c_str());
    return HR_ERROR_CONFIG;
  }
  hr_batch_state b;
  std::memset(&b, 0, sizeof b);
  b.struct_size = sizeof b;
  st = batch->state(s->host, &b);
  if (st != HR_OK) return st;
  if (min_micro_batch < 1 || min_micro_batch > b.configured_micro_batch ||
      b.configured_micro_batch % min_micro_batch != 0)
    return s->config_error(s->host, "min_micro_batch",
                           ("must divide [train] micro_batch " +
                            std::to_string(b.configured_micro_batch) + " (1 = no floor)")
                               .c_str());
  *instance = new DynamicBatch(s, batch, fraction, grow_after, int32_t(min_micro_batch));
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<DynamicBatch*>(instance);
}

hr_status on_event(void* instance, const hr_event_info* info) {
  DynamicBatch* d = static_cast<DynamicBatch*>(instance);
  return headroom_plugin::guarded(d->services(), "choosing the micro-batch", [&] {
    switch (info->event) {
      case HR_EVENT_TRAIN_BEGIN:
        return d->on_train_begin();
      case HR_EVENT_OOM:
        return d->on_oom(info);
      case HR_EVENT_STEP_END:
        return d->on_step_end(info);
      default:
        return HR_OK;
    }
  });
}

hr_status save_state(void* instance, const hr_state_writer* writer) {
  const DynamicBatch* d = static_cast<const DynamicBatch*>(instance);
  return headroom_plugin::guarded(d->services(), "saving its state",
                                  [&] { return d->save(writer); });
}

hr_status load_state(void* instance, const void* data, uint64_t size) {
  DynamicBatch* d = static_cast<DynamicBatch*>(instance);
  return headroom_plugin::guarded(d->services(), "loading its state",
                                  [&] { return d->load(data, size); });
}

uint64_t total(const uint64_t* bytes) {
  uint64_t t = 0;
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
    t += bytes[i];
  return t;
}

// headroom.estimate/1 (above). Step time: the same work in smaller GEMMs (docs/results/plugins.md,
// "Smaller micro-batches": examples/demo.toml's 32 x 1 against 4 x 8 and 8 x 4 on the CPU, 0.84
// to 1.02, within the noise; other shapes are not measured), plus the abandoned attempt of the
// step that found the wall, once.
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!q || !r || !r->after || !q->before || !q->peak) return HR_ERROR_INVALID;
  const DynamicBatch* configured = static_cast<const DynamicBatch*>(instance);
  // Not configured: what its defaults would do.
  const DynamicBatch defaults(nullptr, nullptr, 0.05, 50, 1);
  const DynamicBatch* d = configured ? configured : &defaults;
  const uint64_t limit = q->model ? q->model->memory_limit : 0;
  const bool one_rank = !HR_HAS_FIELD(q->before, hr_mechanisms, shard) ||
                        (q->before->world_size <= 1 && q->before->shard == 0);
  const int32_t B = q->before->micro_batch, A = q->before->grad_accum;
  // It changes nothing there; not configured, it has nothing to propose.
  if (!limit || !one_rank || B < 1) return configured ? HR_OK : HR_ERROR_UNSUPPORTED;
  const double threshold = (1.0 - d->fraction()) * double(limit);
  int32_t chosen = 0;
  uint64_t bytes[HR_MEM_CATEGORY_COUNT_V1] = {0};
  uint64_t data = 0;  // the host keeps the configured micro-batch's input buffers
  for (int32_t b = B; b >= d->min_micro_batch() && b >= 1; --b) {
    if (B % b != 0) continue;
    r->after->micro_batch = b;
    r->after->grad_accum = A * (B / b);
    const hr_status st = q->peak(q->context, r->after, bytes);
    if (st != HR_OK) return st;
    if (b == B) data = bytes[HR_MEM_DATA];
    bytes[HR_MEM_DATA] = data;
    chosen = b;
    const uint64_t t = total(bytes);
    if (t <= limit && (d->fraction() == 0 || double(t) < threshold)) break;
  }
  if (chosen == 0 || (!configured && (chosen == B || total(bytes) > limit)))
    return configured ? HR_OK : HR_ERROR_UNSUPPORTED;
  std::memcpy(r->bytes, bytes, sizeof bytes);
  r->step_time_factor = 1.0;
  std::snprintf(r->what, sizeof r->what,
                chosen == B ? "the micro-batch as configured (%d x %d)"
                            : "the micro-batch shrinks to %d x %d on out-of-memory",
                int(chosen), int(A * (B / chosen)));
  if (configured) std::snprintf(r->toml, sizeof r->toml, "headroom_fraction = %g", d->fraction());
  return HR_OK;
}

hr_status estimate_noexcept(void* instance, const hr_estimate_query* q,
                            hr_estimate_result* r) noexcept {
  try {
    return estimate(instance, q, r);
  } catch (...) {
    return HR_ERROR;
  }
}

const hr_ext_state kState = {sizeof(hr_ext_state), 0, save_state, load_state};
const hr_ext_estimate kEstimate = {sizeof(hr_ext_estimate), 0, estimate_noexcept, 0, 0, nullptr};

const void* get_extension(const char* id) {
  if (!id) return nullptr;
  if (std::strcmp(id, HR_EXT_STATE) == 0) return &kState;
  if (std::strcmp(id, HR_EXT_ESTIMATE) == 0) return &kEstimate;
  // TRAIN_BEGIN, STEP_END and OOM read the memory and the batch: no hook touches the gradients.
  return headroom_plugin::offer_reads<0>(id);
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "dynamic_batch",
    "1.0.0",
    "shrinks the micro-batch (more accumulation, same effective batch) when a step runs out of "
    "memory or comes close to it, and grows it back",
    HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
        HR_EVENT_BIT(HR_EVENT_OOM),
    0,  // roles
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state: headroom.state/1
    nullptr,  // load_state
    get_extension,
};

}  // namespace

// hr_negotiate refuses another major version; the host's message names both versions.
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
