// amp: mixed precision. The model computes in bf16 or fp16 — activations, compute copies of the
// parameters and each micro-step's gradients — while the optimizer updates fp32 master weights;
// the host casts the masters to the compute copies after every update (ABI 1.4
// set_compute_dtype). That halves activation memory. How the model state is laid out around it is
// this plugin's choice too (headroom.precision/1's appended setters), in bytes per parameter Ψ
// with AdamW:
//
//   grad_dtype = "fp32"  fp32 masters 4 + compute copies 2 + fp32 gradients 4 + moments 8 = 18Ψ.
//                        Each layer's bf16 gradients live only through its backward: made before
//                        it, added into the fp32 ones (exact accumulation) and freed at its end.
//   grad_dtype = "bf16"  DeepSpeed's layout: the backward adds into one bf16 gradient buffer over
//                        the micro-steps, no fp32 gradients: 4 + 2 + 2 + 8 = 16Ψ.
//   master_weights = false
//                        no fp32 masters: the weights exist only in bf16 and the optimizer rounds
//                        each update into them stochastically (seeded from [train] seed, the
//                        seed in snapshots, so a resume is exact): 2 + 2 + 8 = 12Ψ with bf16
//                        gradients (its default), 2 + 2 + 4 = 8Ψ with state_dtype = "bf16".
//   state_dtype = "bf16" the built-in optimizer's moments in bf16, rounded stochastically.
//
// fp16's narrow range needs dynamic loss scaling, which is this plugin's policy and state:
//
//   [[plugins]]
//   name = "amp"
//   dtype = "bf16"          # "bf16" (the default: fp32's range, no scaling) | "fp16"
//   grad_dtype = "fp32"     # "fp32" (default with masters) | "bf16" (default without; dtype bf16)
//   master_weights = true   # false: bf16 weights only, stochastic rounding (dtype bf16)
//   state_dtype = "fp32"    # "fp32" | "bf16": the built-in optimizer's state
//   # grad_dtype = "bf16" and master_weights = false run on one rank without a zero plugin.
//   # fp16 only — the loss scaler, with DeepSpeed's and torch.amp's defaults:
//   init_scale = 65536.0    # 2^16
//   growth_factor = 2.0     # after growth_interval steps without overflow
//   backoff_factor = 0.5    # on overflow, once hysteresis overflows have been absorbed
//   growth_interval = 2000
//   hysteresis = 2          # overflows tolerated before the scale backs off (DeepSpeed's
//                           # delayed_shift; it is restored when the scale grows)
//   min_scale = 1.0
//
// fp16, per step: the loss gradient is multiplied by the scale (set_loss_scale), so the fp32
// gradients at GRADS_READY are too. If any of them is not finite the step is vetoed (no NaN or
// infinity reaches the weights) and the scaler counts an overflow: hysteresis - 1 more overflows
// are tolerated at the same scale, then each overflow multiplies it by backoff_factor (never
// below min_scale). Otherwise the gradients are divided by the scale before clipping and the
// optimizer see them, and after growth_interval good steps in a row the scale grows. An overflow
// at min_scale with the hysteresis spent stops the run: the fp16 run has diverged, and skipping
// every step from then on would lose the work silently.
//
// The scale, the counters and the skipped steps are in snapshots (save_state); the host's metrics
// carry loss_scale and skipped_steps.
//
// With a zero plugin (headroom.shard/1) each rank checks and unscales only its ranges of the
// gradients, and the ranks agree on an overflow over headroom.comm/1 before vetoing.
//
// The overflow check is one fused reduction over all gradients (headroom.precision/1's
// nonfinite_many: one wait for the device a step), op_nonfinite a tensor on an older host.
//
// Training thread only (create, TRAIN_BEGIN, GRADS_READY); no locking. Device work (the checks,
// op_scale) goes on the compute stream. Only hr_plugin_entry is exported; no C++ exception crosses
// the C ABI.
#include <headroom/ext/comm.h>
#include <headroom/ext/estimate.h>
#include <headroom/ext/precision.h>
#include <headroom/ext/shard.h>
#include <headroom/ext/step.h>
#include <headroom/plugin.h>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "common/offer_reads.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct ScalerConfig {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t hysteresis = 2;
  double min_scale = 1.0;
};

// What the scaler carries from step to step, and what a snapshot holds.
struct ScalerState {
  uint32_t version = 1;
  uint32_t hysteresis_left = 0;  // overflows still tolerated at this scale
  double scale = 1.0;
  int64_t good_steps = 0;  // since the last overflow or growth
  int64_t skipped_steps = 0;
};

std::string scale_str(double s) {
  char buf[64];
  const double e = std::log2(s);
  if (s >= 1 && e == std::floor(e)) {
    std::snprintf(buf, sizeof buf, "2^%d", int(e));
  } else {
    std::snprintf(buf, sizeof buf, "%g", s);
  }
  return buf;
}

class Amp {
 public:
  Amp(const hr_host_services* s, bool fp16, const ScalerConfig& c) : s_(s), fp16_(fp16), c_(c) {
    st_.scale = fp16 ? c.init_scale : 1.0;
    st_.hysteresis_left = uint32_t(c.hysteresis);
  }
  const hr_host_services* services() const { return s_; }
  bool fp16() const { return fp16_; }
  // The state layout it chose (its estimate's).
  bool grad_bf16 = false, masters = true, state_bf16 = false;
  double scale() const { return st_.scale; }

  hr_status on_grads_ready() {
    if (!fp16_) return HR_OK;  // bf16 has fp32's exponent range: nothing to scale
    std::vector<hr_tensor> grads = gradients();
    bool overflow = false;
    const hr_status checked = any_nonfinite(grads, &overflow);
    if (checked != HR_OK) return checked;
    // Sharded gradients (a zero plugin): each rank sees only its ranges, so the ranks agree: any
    // rank's overflow skips the step everywhere.
    if (sharded_) {
      const hr_status st = agree(&overflow);
      if (st != HR_OK) return st;
    }
    if (overflow) return on_overflow();
    for (const hr_tensor& g : grads) {
      const hr_status st = s_->op_scale(s_->host, g.grad, g.grad_dtype, g.numel, 1.0 / st_.scale);
      if (st != HR_OK) return st;
    }
    if (++st_.good_steps >= c_.growth_interval) {
      st_.good_steps = 0;
      st_.hysteresis_left = uint32_t(c_.hysteresis);
      return set_scale(st_.scale * c_.growth_factor);
    }
    return HR_OK;
  }

  // The scale for the first step (and after a resume).
  hr_status start() { return fp16_ ? s_->set_loss_scale(s_->host, st_.scale) : HR_OK; }

  hr_status save(const hr_state_writer* w) const { return w->write(w->context, &st_, sizeof st_); }
  hr_status load(const void* data, uint64_t size) {
    ScalerState loaded;
    if (size != sizeof loaded) {
      s_->set_error(s_->host, ("amp state of " + std::to_string(size) + " bytes; expected " +
                               std::to_string(sizeof loaded))
                                  .c_str());
      return HR_ERROR;
    }
    std::memcpy(&loaded, data, sizeof loaded);
    if (loaded.version != 1 || !(loaded.scale > 0) || !std::isfinite(loaded.scale)) {
      s_->set_error(s_->host, "amp state is damaged (unknown version or a bad loss scale)");
      return HR_ERROR;
    }
    st_ = loaded;
    return start();
  }

 private:
  hr_status on_overflow() {
    ++st_.skipped_steps;
    st_.good_steps = 0;
    const double before = st_.scale;
    if (st_.hysteresis_left > 1) {
      --st_.hysteresis_left;
    } else if (st_.scale > c_.min_scale) {
      st_.scale = std::fmax(st_.scale * c_.backoff_factor, c_.min_scale);
    } else {
      s_->set_error(s_->host,
                    ("gradient overflow at the minimum loss scale " + scale_str(c_.min_scale) +
                     ": the fp16 run has diverged (try dtype = \"bf16\", a lower lr, "
                     "or a smaller min_scale)")
                        .c_str());
      return HR_ERROR;
    }
    const std::string reason =
        "gradient overflow (inf/NaN) at loss scale " + scale_str(before) +
        (st_.scale != before ? "; scale now " + scale_str(st_.scale) : "; scale kept (hysteresis)");
    s_->veto_step(s_->host, reason.c_str());
    return set_scale(st_.scale);
  }

  hr_status set_scale(double scale) {
    st_.scale = scale;
    return s_->set_loss_scale(s_->host, scale);
  }

  // Whether any rank overflowed: the flags summed over the ranks (headroom.comm/1, f32 on the
  // device: a host-side value must travel in a device buffer).
  hr_status agree(bool* overflow) {
    if (!comm_ || comm_->world_size(s_->host) <= 1) return HR_OK;
    void* flag = s_->alloc(s_->host, sizeof(float), HR_MEM_WORKSPACE, "amp: overflow flag");
    if (!flag) {
      s_->set_error(s_->host, "no memory for the overflow flag");
      return HR_ERROR_OUT_OF_MEMORY;
    }
    hr_status st = s_->op_fill(s_->host, flag, HR_DTYPE_F32, 1, *overflow ? 1.0 : 0.0);
    hr_comm_request* req = nullptr;
    if (st == HR_OK) st = comm_->all_reduce(s_->host, flag, 1, HR_DTYPE_F32, HR_COMM_SUM, &req);
    if (st == HR_OK) st = comm_->wait(s_->host, req);
    double sum = 0.0;
    if (st == HR_OK) st = s_->op_sum_squares(s_->host, flag, HR_DTYPE_F32, 1, &sum);
    s_->free(s_->host, flag);
    if (st == HR_OK) *overflow = sum > 0;
    return st;
  }

  // Every fp32 gradient the optimizer reads: each parameter's, or with sharded gradients each
  // layer's range on this rank (headroom.shard/1).
  std::vector<hr_tensor> gradients() const {
    std::vector<hr_tensor> out;
    const int32_t layers = s_->num_layers(s_->host);
    if (sharded_) {
      for (int32_t l = 0; l < layers; ++l) {
        hr_tensor t;
        std::memset(&t, 0, sizeof t);
        t.struct_size = sizeof t;
        if (shard_->gradient_range(s_->host, l, &t) == HR_OK) {
          t.grad_dtype = t.dtype;  // sharded gradients are fp32
          out.push_back(t);
        }
      }
      return out;
    }
    for (int32_t l = 0; l < layers; ++l) {
      const int32_t n = s_->layer_num_params(s_->host, l);
      for (int32_t i = 0; i < n; ++i) {
        hr_tensor t;
        std::memset(&t, 0, sizeof t);
        t.struct_size = sizeof t;
        if (s_->layer_param(s_->host, l, i, &t) == HR_OK && t.grad) out.push_back(t);
      }
    }
    return out;
  }

  const hr_host_services* s_;
  bool fp16_;
  ScalerConfig c_;
  ScalerState st_;

 public:
  // From TRAIN_BEGIN on (a zero plugin partitions in its create(), which may come after amp's).
  void find_extensions() {
    if (!HR_HAS_FIELD(s_, hr_host_services, get_extension)) return;
    const auto* prec =
        static_cast<const hr_ext_precision*>(s_->get_extension(s_->host, HR_EXT_PRECISION));
    if (prec && HR_HAS_FIELD(prec, hr_ext_precision, nonfinite_many)) nonfinite_many_ = prec;
    shard_ = static_cast<const hr_ext_shard*>(s_->get_extension(s_->host, HR_EXT_SHARD));
    comm_ = static_cast<const hr_ext_comm*>(s_->get_extension(s_->host, HR_EXT_COMM));
    if (!shard_ || !comm_) return;
    hr_shard_layout l;
    std::memset(&l, 0, sizeof l);
    l.struct_size = sizeof l;
    sharded_ = shard_->layout(s_->host, 0, &l) == HR_OK && l.what != 0;
  }

 private:
  // Any NaN or infinity in the gradients: one fused check (one wait for the device) where the
  // host has headroom.precision/1's nonfinite_many, else one op_nonfinite a tensor.
  hr_status any_nonfinite(const std::vector<hr_tensor>& grads, bool* overflow) const {
    *overflow = false;
    if (nonfinite_many_) {
      std::vector<const void*> data;
      std::vector<uint32_t> dtypes;
      std::vector<uint64_t> numels;
      for (const hr_tensor& g : grads) {
        data.push_back(g.grad);
        dtypes.push_back(g.grad_dtype);
        numels.push_back(g.numel);
      }
      int32_t bad = 0;
      const hr_status st = nonfinite_many_->nonfinite_many(s_->host, grads.size(), data.data(),
                                                           dtypes.data(), numels.data(), &bad);
      *overflow = bad != 0;
      return st;
    }
    for (const hr_tensor& g : grads) {
      int32_t bad = 0;
      const hr_status st = s_->op_nonfinite(s_->host, g.grad, g.grad_dtype, g.numel, &bad);
      if (st != HR_OK) return st;
      if (bad) {
        *overflow = true;
        break;
      }
    }
    return HR_OK;
  }

  const hr_ext_precision* nonfinite_many_ = nullptr;
  const hr_ext_shard* shard_ = nullptr;
  const hr_ext_comm* comm_ = nullptr;
  bool sharded_ = false;
};

hr_status create(const hr_host_services* s, void** instance) {
  if (!HR_HAS_FIELD(s, hr_host_services, set_loss_scale) || !s->set_compute_dtype) {
    s->set_error(s->host,
                 "amp needs plugin ABI 1.4 (set_compute_dtype, set_loss_scale); this host is "
                 "older");
    return HR_ERROR_UNSUPPORTED;
  }
  char dtype[16] = "bf16";
  hr_status st = s->config_string(s->host, "dtype", dtype, sizeof dtype);
  const std::string d = dtype;
  if (st == HR_ERROR_INVALID || (st == HR_OK && d != "bf16" && d != "fp16"))
    return s->config_error(s->host, "dtype",
                           ("must be \"bf16\" or \"fp16\"; got \"" + d + "\"").c_str());
  if (st != HR_OK) return st;
  const bool fp16 = d == "fp16";

  int32_t master = 1;
  st = s->config_bool(s->host, "master_weights", &master);
  if (st != HR_OK) return st;
  if (!master && fp16)
    return s->config_error(s->host, "master_weights",
                           "= false needs dtype = \"bf16\" (the weights are kept in bf16 and "
                           "rounded stochastically); fp16 keeps fp32 masters");
  // The gradients: fp32 beside the masters, bf16 without them, unless given.
  char grad[16] = "";
  st = s->config_string(s->host, "grad_dtype", grad, sizeof grad);
  std::string g = grad;
  if (st == HR_ERROR_INVALID || (st == HR_OK && !g.empty() && g != "fp32" && g != "bf16"))
    return s->config_error(s->host, "grad_dtype",
                           ("must be \"fp32\" or \"bf16\"; got \"" + g + "\"").c_str());
  if (st != HR_OK) return st;
  if (g.empty()) g = master ? "fp32" : "bf16";
  if (g == "bf16" && fp16)
    return s->config_error(s->host, "grad_dtype",
                           "= \"bf16\" needs dtype = \"bf16\" (fp16 accumulates in fp32)");
  char state[16] = "fp32";
  st = s->config_string(s->host, "state_dtype", state, sizeof state);
  const std::string sd = state;
  if (st == HR_ERROR_INVALID || (st == HR_OK && sd != "fp32" && sd != "bf16"))
    return s->config_error(s->host, "state_dtype",
                           ("must be \"fp32\" or \"bf16\"; got \"" + sd + "\"").c_str());
  if (st != HR_OK) return st;

  // The scaler's keys: every one is read (so none is an unknown key), then checked.
  ScalerConfig c;
  // Sentinels no TOML value can be, to tell "absent" from "given the default".
  const double kAbsent = std::nan("");
  const int64_t kAbsentInt = INT64_MIN;
  double init = kAbsent, growth = kAbsent, backoff = kAbsent, min_scale = kAbsent;
  int64_t interval = kAbsentInt, hysteresis = kAbsentInt;
  st = s->config_float(s->host, "init_scale", &init);
  if (st == HR_OK) st = s->config_float(s->host, "growth_factor", &growth);
  if (st == HR_OK) st = s->config_float(s->host, "backoff_factor", &backoff);
  if (st == HR_OK) st = s->config_int(s->host, "growth_interval", &interval);
  if (st == HR_OK) st = s->config_int(s->host, "hysteresis", &hysteresis);
  if (st == HR_OK) st = s->config_float(s->host, "min_scale", &min_scale);
  if (st != HR_OK) return st;
  const char* given = !std::isnan(init)          ? "init_scale"
                      : !std::isnan(growth)      ? "growth_factor"
                      : !std::isnan(backoff)     ? "backoff_factor"
                      : interval != kAbsentInt   ? "growth_interval"
                      : hysteresis != kAbsentInt ? "hysteresis"
                      : !std::isnan(min_scale)   ? "min_scale"
                                                 : nullptr;
  if (given && !fp16)
    return s->config_error(s->host, given,
                           "is a loss-scaler key: it applies to dtype = \"fp16\" only (bf16 "
                           "needs no loss scaling)");
  if (!std::isnan(init)) c.init_scale = init;
  if (!std::isnan(growth)) c.growth_factor = growth;
  if (!std::isnan(backoff)) c.backoff_factor = backoff;
  if (interval != kAbsentInt) c.growth_interval = interval;
  if (hysteresis != kAbsentInt) c.hysteresis = hysteresis;
  if (!std::isnan(min_scale)) c.min_scale = min_scale;
  if (!(c.init_scale > 0) || !std::isfinite(c.init_scale))
    return s->config_error(s->host, "init_scale", "must be a finite number > 0 (65536 = 2^16)");
  if (!(c.growth_factor > 1) || !std::isfinite(c.growth_factor))
    return s->config_error(s->host, "growth_factor", "must be > 1 (default 2)");
  if (!(c.backoff_factor > 0 && c.backoff_factor < 1))
    return s->config_error(s->host, "backoff_factor", "must be in (0, 1) (default 0.5)");
  if (c.growth_interval < 1)
    return s->config_error(s->host, "growth_interval", "must be >= 1 step (default 2000)");
  if (c.hysteresis < 1 || c.hysteresis > 1000000)
    return s->config_error(s->host, "hysteresis", "must be >= 1 (default 2; 1 backs off at once)");
  if (!(c.min_scale > 0) || c.min_scale > c.init_scale)
    return s->config_error(s->host, "min_scale", "must be > 0 and <= init_scale (default 1)");

  st = s->set_compute_dtype(s->host, fp16 ? HR_DTYPE_F16 : HR_DTYPE_BF16);
  if (st != HR_OK) return st;  // the host's message stands
  const bool layout = g == "bf16" || !master || sd == "bf16";
  if (layout) {
    const auto* prec =
        HR_HAS_FIELD(s, hr_host_services, get_extension)
            ? static_cast<const hr_ext_precision*>(s->get_extension(s->host, HR_EXT_PRECISION))
            : nullptr;
    if (!prec || !HR_HAS_FIELD(prec, hr_ext_precision, state_dtype)) {
      s->set_error(s->host,
                   "grad_dtype = \"bf16\", master_weights = false and state_dtype = \"bf16\" "
                   "need a host whose headroom.precision/1 lays out the model state; this one "
                   "is older");
      return HR_ERROR_UNSUPPORTED;
    }
    if (g == "bf16") st = prec->set_grad_dtype(s->host, HR_DTYPE_BF16);
    if (st == HR_OK && !master) st = prec->set_master_weights(s->host, 0);
    if (st == HR_OK && sd == "bf16") st = prec->set_state_dtype(s->host, HR_DTYPE_BF16);
    if (st != HR_OK) return st;
  }
  Amp* amp = new Amp(s, fp16, c);
  amp->grad_bf16 = g == "bf16";
  amp->masters = master != 0;
  amp->state_bf16 = sd == "bf16";
  st = amp->start();
  // bf16 has no loss scale: its GRADS_READY hook has nothing to do, so it does not take that
  // event, and holds back nothing that waits for the event's hooks (the offload plugin's update
  // overlapped with the backward). A host before headroom.step/1's set_events sends it anyway.
  if (st == HR_OK && !fp16 && HR_HAS_FIELD(s, hr_host_services, get_extension)) {
    const auto* step = static_cast<const hr_ext_step*>(s->get_extension(s->host, HR_EXT_STEP));
    if (step && HR_HAS_FIELD(step, hr_ext_step, set_events))
      st = step->set_events(s->host, HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN));
  }
  if (st != HR_OK) {
    delete amp;
    return st;
  }
  *instance = amp;
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<Amp*>(instance);
}

hr_status on_event(void* instance, const hr_event_info* info) {
  Amp* a = static_cast<Amp*>(instance);
  if (info->event == HR_EVENT_TRAIN_BEGIN) {
    a->find_extensions();
    return HR_OK;
  }
  if (info->event != HR_EVENT_GRADS_READY) return HR_OK;
  return headroom_plugin::guarded(a->services(), "checking and unscaling the gradients",
                                  [&] { return a->on_grads_ready(); });
}

hr_status save_state(void* instance, const hr_state_writer* writer) {
  const Amp* a = static_cast<const Amp*>(instance);
  return headroom_plugin::guarded(a->services(), "saving the loss scaler",
                                  [&] { return a->save(writer); });
}

hr_status load_state(void* instance, const void* data, uint64_t size) {
  Amp* a = static_cast<Amp*>(instance);
  return headroom_plugin::guarded(a->services(), "loading the loss scaler",
                                  [&] { return a->load(data, size); });
}

// headroom.estimate/1: amp sets the compute dtype, core's closed form has the bytes (the compute
// copies of the parameters and gradients beside the fp32 masters, the halved activations).
// Configured: the dtype it was given; not configured: it proposes bf16 (no loss scaling needed).
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!q || !r || !r->after || !q->peak) return HR_ERROR_INVALID;
  const Amp* amp = static_cast<const Amp*>(instance);
  const bool fp16 = amp && amp->fp16();
  r->after->compute_dtype = fp16 ? HR_DTYPE_F16 : HR_DTYPE_BF16;
  // As configured: its layout. Proposed (not configured), on one unsharded rank where the host
  // has the layouts: the first of DeepSpeed's 16-byte layout (bf16 gradients), no masters
  // (12 bytes a parameter) and no masters with bf16 state (8) that fits memory_limit, else the
  // first; fp32 gradients (18) elsewhere.
  const bool layouts = HR_HAS_FIELD(q->before, hr_mechanisms, optimizer_bytes) &&
                       HR_HAS_FIELD(r->after, hr_mechanisms, optimizer_bytes);
  const bool one_rank = layouts && q->before->world_size <= 1 && q->before->shard == 0;
  struct Layout {
    bool grad_bf16, masters, state_bf16;
  };
  Layout tries[3] = {{false, true, false}, {}, {}};
  size_t n_tries = 1;
  if (amp) {
    tries[0] = {amp->grad_bf16, amp->masters, amp->state_bf16};
  } else if (one_rank) {
    tries[0] = {true, true, false};
    tries[1] = {true, false, false};
    tries[2] = {true, false, true};
    n_tries = 3;
  }
  const uint64_t limit = q->model ? q->model->memory_limit : 0;
  Layout chosen = tries[0];
  for (size_t k = 0; k < n_tries; ++k) {
    const Layout& l = tries[k];
    if (layouts) {
      r->after->grad_dtype = l.grad_bf16 ? HR_DTYPE_BF16 : HR_DTYPE_F32;
      r->after->master_weights = l.masters ? 1 : 0;
      r->after->state_dtype = l.state_bf16 ? HR_DTYPE_BF16 : HR_DTYPE_F32;
    }
    const hr_status st = q->peak(q->context, r->after, r->bytes);
    if (st != HR_OK) return st;
    uint64_t total = 0;
    for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
      total += r->bytes[i];
    if (!limit || total <= limit) {
      chosen = l;
      break;
    }
  }
  if (layouts) {
    r->after->grad_dtype = chosen.grad_bf16 ? HR_DTYPE_BF16 : HR_DTYPE_F32;
    r->after->master_weights = chosen.masters ? 1 : 0;
    r->after->state_dtype = chosen.state_bf16 ? HR_DTYPE_BF16 : HR_DTYPE_F32;
  }
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  const bool grad_bf16 = chosen.grad_bf16, masters = chosen.masters, state_bf16 = chosen.state_bf16;
  // Step time over no plugins, CPU backend, gpt2-124m: fp16 docs/results/plugins.md (1.350, the
  // loss scaler's checks); bf16 docs/results/model-state.md, section 1: grad_dtype fp32 1.138,
  // bf16 1.147, master_weights = false 1.292, with state_dtype bf16 1.421 (stochastic rounding
  // of every weight and moment). Not measured on a GPU yet.
  r->step_time_factor = fp16        ? 1.35
                        : !masters  ? (state_bf16 ? 1.42 : 1.29)
                        : grad_bf16 ? 1.15
                                    : 1.14;
  std::snprintf(
      r->what, sizeof r->what, "mixed precision, %s activations and weights, %s, %s%s",
      fp16 ? "fp16" : "bf16", masters ? "fp32 master weights" : "no masters (stochastic rounding)",
      grad_bf16 ? "bf16 gradients" : "fp32 gradients", state_bf16 ? ", bf16 optimizer state" : "");
  std::snprintf(r->toml, sizeof r->toml, "dtype = \"%s\"%s%s%s", fp16 ? "fp16" : "bf16",
                grad_bf16 && masters ? "\ngrad_dtype = \"bf16\"" : "",
                masters ? "" : "\nmaster_weights = false",
                state_bf16 ? "\nstate_dtype = \"bf16\"" : "");
  return HR_OK;
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
// The precisions `plan --measure --search` tries.
constexpr hr_estimate_mode kModes[] = {
    headroom_plugin::mode("bf16, fp32 masters", "dtype = \"bf16\""),
    headroom_plugin::mode("fp16, fp32 masters", "dtype = \"fp16\""),
    headroom_plugin::mode("bf16 weights, no masters", "dtype = \"bf16\"\nmaster_weights = false"),
    headroom_plugin::mode("bf16 weights and state, no masters",
                          "dtype = \"bf16\"\nmaster_weights = false\nstate_dtype = \"bf16\""),
};

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "amp",
    "1.0.0",
    "mixed precision: bf16 or fp16 activations and compute weights, fp32 master weights, dynamic "
    "loss scaling for fp16",
    HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_GRADS_READY),
    0,  // roles
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    save_state,
    load_state,
    // It checks and unscales the gradients at GRADS_READY (TRAIN_BEGIN only finds extensions).
    headroom_plugin::offer_all<headroom_plugin::offer_estimate_modes<estimate, kModes>,
                               headroom_plugin::offer_reads<HR_EVENT_BIT(HR_EVENT_GRADS_READY)>>,
};

}  // namespace

// hr_negotiate refuses another major version; the host's message names both versions.
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
