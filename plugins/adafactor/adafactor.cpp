// adafactor: the optimizer role, Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning
// Rates with Sublinear Memory Cost") with Hugging Face transformers' defaults. It replaces the
// built-in AdamW / SGD for the whole run:
//
//   [[plugins]]
//   name = "adafactor"
//   # beta1 = 0.9           # absent (the default): no first moment. Given, in [0, 1): the update
//   #                       # is the moment m = beta1 m + (1 - beta1) u (numel floats of state)
//   decay_rate = -0.8       # beta2 at the 1-based step t is 1 - t^decay_rate; < 0
//   clip_threshold = 1.0    # the update u is divided by max(1, RMS(u) / clip_threshold); > 0
//   eps1 = 1e-30            # added to g^2 before the second moments; > 0
//   eps2 = 1e-3             # the least parameter scale: max(eps2, RMS(theta)); > 0
//   relative_step = true    # the step size is min(1e-2, 1/sqrt(t)) and [train] lr is unused;
//                           # false: the host's lr ([train] lr and its schedule)
//   scale_parameter = true  # multiply the step size by max(eps2, RMS(theta)) of each tensor
//   warmup_init = false     # with relative_step: min(1e-6 t, 1/sqrt(t)) instead
//   weight_decay = 0.0      # decoupled, as Hugging Face's: theta -= weight_decay * lr * theta
//                           # before the update, on tensors with weight decay (matrices,
//                           # embeddings); >= 0
//   seed = 0                # bf16 weights only (amp master_weights = false): the stochastic
//                           # rounding's stream; in snapshots (a resume keeps the snapshot's)
//
// Per tensor and step, g its gradient (f32, or bf16 widened to f32 when amp accumulates bf16
// gradients), the state stored as f32 and the arithmetic in double:
//  - a tensor of 2 or more dimensions, seen as rows = shape[0] by cols = the rest, keeps the row
//    means R (rows floats) and the column means C (cols floats) of g^2 + eps1, each decayed by
//    beta2; the second moment is estimated as R_i C_j / mean(R), so u = g / sqrt(that);
//  - a vector keeps the full second moment V (numel floats): u = g / sqrt(V);
//  - u is clipped at RMS clip_threshold, scaled by the step size, (beta1) folded into m, and
//    subtracted from theta. With amp's master_weights = false theta is bf16: widened to compute,
//    the new value rounded stochastically into it (plugins/common/bf16.h, random bits of (seed,
//    t, tensor, element)), so that updates far below a bf16 step still move it on average.
// The update runs in passes over each tensor (the sums of g^2 + eps1 and theta^2, the sum of u^2,
// the update: kernels.h, on the host's OpenMP threads, the same bits on any number of them), so
// the only device memory it takes is its state: allocated at the first step (as
// PyTorch and the built-in AdamW do), or when a snapshot is loaded, category optimizer, one
// buffer per parameter (besides it, host vectors of partial sums, reused). The step counter t
// counts this plugin's updates (a step vetoed by amp is not one, as torch.amp skips
// optimizer.step()).
//
// Snapshots: the counter and every state tensor's bytes, named by parameter (save_state /
// load_state); a resume is bitwise. A state of another shape, another beta1 setting or damaged
// bytes is refused with a message (exit 2).
//
// Estimate (headroom.estimate/1): the state's bytes from the model's parameter tensors, into
// hr_mechanisms.optimizer_bytes; not configured, it proposes itself with its defaults. It declines
// (HR_ERROR_UNSUPPORTED) where it cannot run: CUDA, sharded state.
//
// Limits: the CPU backend only (its kernels are plain loops over host memory; on "cuda" create()
// fails saying so), whole parameters only (not with a zero plugin that shards the optimizer
// state).
//
// Training thread only (create, step, save_state, load_state, estimate); no locking; the update's
// loops run on the host's OpenMP threads (one libgomp in the process), no threads of its own. Only
// hr_plugin_entry is exported; no C++ exception crosses the C ABI.
#include <headroom/ext/estimate.h>
#include <headroom/ext/roles.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>

#include "common/bf16.h"
#include "common/dry_run.h"
#include "common/hook_guard.h"
#include "common/offer_reads.h"
#include "common/optimizer_hooks.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Settings {
  bool first_moment = false;
  double beta1 = 0.0;
  double decay_rate = -0.8;
  double clip_threshold = 1.0;
  double eps1 = 1e-30;
  double eps2 = 1e-3;
  bool relative_step = true;
  bool scale_parameter = true;
  bool warmup_init = false;
  double weight_decay = 0.0;
  uint64_t seed = 0;  // bf16 weights' stochastic rounding
};

// The state of one parameter, in one device buffer: [row rows | col cols] for a factored tensor or
// [v numel], then [m numel] with beta1.
struct Slot {
  std::string name;  // the parameter's
  int32_t layer = 0, index = 0;
  uint64_t numel = 0;
  uint64_t rows = 0, cols = 0;  // factored when rows > 0
  float* buf = nullptr;
  uint64_t floats = 0;
  float* row() const { return buf; }
  float* col() const { return buf + rows; }
  float* v() const { return buf; }
  float* m() const { return buf + (rows ? rows + cols : numel); }
};

// The state's floats of one tensor (the estimate and the allocation agree through this).
uint64_t state_floats(int32_t ndim, const int64_t* shape, uint64_t numel, bool first_moment,
                      uint64_t* rows, uint64_t* cols) {
  *rows = *cols = 0;
  uint64_t n = numel;
  if (ndim >= 2 && shape[0] > 0) {
    *rows = uint64_t(shape[0]);
    *cols = numel / *rows;
    n = *rows + *cols;
  }
  return n + (first_moment ? numel : 0);
}

// What a snapshot holds: this header, then for each slot its name's length (uint32), the name,
// its byte count (uint64) and the bytes.
struct StateHeader {
  char magic[8];
  uint32_t version;
  uint32_t first_moment;
  int64_t step;
  uint32_t count;  // slots; 0 before the first step
  uint32_t seed;   // the stochastic rounding's (bf16 weights)
};
constexpr char kMagic[8] = {'A', 'D', 'F', 'A', 'C', 'T', 'O', 'R'};
constexpr uint32_t kStateVersion = 1;

class Adafactor {
 public:
  Adafactor(const hr_host_services* s, const Settings& c) : s_(s), c_(c) {
    if (HR_HAS_FIELD(s_, hr_host_services, get_extension) && s_->get_extension)
      tensors_ = static_cast<const hr_ext_tensors*>(s_->get_extension(s_->host, HR_EXT_TENSORS));
    dry_ = headroom_plugin::dry_run(s_);
  }
  ~Adafactor() {
    for (Slot& slot : slots_)
      if (slot.buf) s_->free(s_->host, slot.buf);
  }
  const hr_host_services* services() const { return s_; }
  const Settings& settings() const { return c_; }

  hr_status step(const hr_optimizer_step_info* info) {
    if (!info || info->struct_size < sizeof(hr_optimizer_step_info)) {
      s_->set_error(s_->host, "adafactor: malformed hr_optimizer_step_info");
      return HR_ERROR_INVALID;
    }
    if (!allocated_) {
      const hr_status st = allocate();
      if (st != HR_OK) return st;
    }
    ++t_;
    if (dry_) return HR_OK;  // plan --measure: the state's bytes, no update (common/dry_run.h)
    const double t = double(t_);
    const double beta2 = 1.0 - std::pow(t, c_.decay_rate);
    double rel = info->lr;
    if (c_.relative_step) rel = std::min(c_.warmup_init ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
    for (size_t k = 0; k < slots_.size(); ++k) {
      hr_tensor p;
      const hr_status st = param(slots_[k], &p);
      if (st != HR_OK) return st;
      update(slots_[k], p, beta2, rel, headroom_plugin::bf16::stream_key(c_.seed, uint64_t(t_), k));
    }
    return HR_OK;
  }

  hr_status save(const hr_state_writer* w) const {
    StateHeader h;
    std::memset(&h, 0, sizeof h);
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = kStateVersion;
    h.first_moment = c_.first_moment ? 1 : 0;
    h.step = t_;
    h.count = allocated_ ? uint32_t(slots_.size()) : 0;
    h.seed = uint32_t(c_.seed);
    hr_status st = w->write(w->context, &h, sizeof h);
    std::vector<uint8_t> chunk;
    for (uint32_t k = 0; st == HR_OK && k < h.count; ++k) {
      const Slot& slot = slots_[k];
      const uint32_t len = uint32_t(slot.name.size());
      const uint64_t bytes = slot.floats * sizeof(float);
      st = w->write(w->context, &len, sizeof len);
      if (st == HR_OK) st = w->write(w->context, slot.name.data(), len);
      if (st == HR_OK) st = w->write(w->context, &bytes, sizeof bytes);
      // Device to host, at most HR_READ_MAX_BYTES a call.
      const uint8_t* src = reinterpret_cast<const uint8_t*>(slot.buf);
      for (uint64_t off = 0; st == HR_OK && off < bytes; off += HR_READ_MAX_BYTES) {
        const uint64_t n = std::min<uint64_t>(HR_READ_MAX_BYTES, bytes - off);
        chunk.resize(n);
        st = read(chunk.data(), src + off, n);
        if (st == HR_OK) st = w->write(w->context, chunk.data(), n);
      }
    }
    return st;
  }

  // Pruning shrank a parameter (headroom/ext/resize.h): its state keeps the kept rows or columns.
  // A matrix's factored second moments: the kept rows' row statistics (rows kept) or the kept
  // columns' column statistics (columns kept), the other vector as it was (its entries average
  // over the removed elements too: an approximation, as the paper's factoring itself is); a
  // vector's v and any m keep the kept elements. New memory first is not needed: the old buffer
  // is read to the host and freed before the new one is made.
  hr_status resize(const hr_resize_info* info) {
    if (!info || info->struct_size < sizeof(hr_resize_info) || !info->keep) {
      s_->set_error(s_->host, "adafactor: malformed hr_resize_info");
      return HR_ERROR_INVALID;
    }
    if (!allocated_) return HR_OK;  // allocated at the new sizes by the first step
    Slot* slot = nullptr;
    for (Slot& k : slots_)
      if (k.layer == info->layer && k.index == info->index) slot = &k;
    if (!slot) {
      s_->set_error(s_->host, "adafactor: no state for the resized parameter");
      return HR_ERROR_INVALID;
    }
    std::vector<float> old(slot->floats);
    hr_status st = read(old.data(), slot->buf, old.size() * sizeof(float));
    if (st != HR_OK) return st;
    const uint64_t K = info->num_keep;
    const uint64_t old_rows = info->ndim == 2 ? uint64_t(info->old_shape[0]) : 0;
    const uint64_t old_cols = info->ndim == 2 ? uint64_t(info->old_shape[1]) : 0;
    // The kept elements of a (rows, cols) tensor (a vector: rows = 0) at src, into dst.
    auto gather = [&](const float* src, float* dst) {
      if (info->ndim == 1) {
        for (uint64_t i = 0; i < K; ++i)
          dst[i] = src[info->keep[i]];
      } else if (info->axis == 0) {
        for (uint64_t i = 0; i < K; ++i)
          std::memcpy(dst + i * old_cols, src + uint64_t(info->keep[i]) * old_cols,
                      old_cols * sizeof(float));
      } else {
        for (uint64_t r = 0; r < old_rows; ++r)
          for (uint64_t j = 0; j < K; ++j)
            dst[r * K + j] = src[r * old_cols + info->keep[j]];
      }
    };
    Slot next = *slot;
    next.numel = 1;
    for (int32_t d = 0; d < info->ndim; ++d)
      next.numel *= uint64_t(info->new_shape[d]);
    next.floats = state_floats(info->ndim, info->new_shape, next.numel, c_.first_moment, &next.rows,
                               &next.cols);
    std::vector<float> now(next.floats, 0.0f);
    if (slot->rows) {
      if (info->axis == 0) {  // rows kept: their statistics; the columns' as they were
        for (uint64_t i = 0; i < K; ++i)
          now[i] = old[info->keep[i]];
        std::memcpy(now.data() + next.rows, old.data() + slot->rows, slot->cols * sizeof(float));
      } else {  // columns kept
        std::memcpy(now.data(), old.data(), slot->rows * sizeof(float));
        for (uint64_t j = 0; j < K; ++j)
          now[next.rows + j] = old[slot->rows + info->keep[j]];
      }
    } else {
      gather(old.data(), now.data());
    }
    if (c_.first_moment)
      gather(old.data() + (slot->rows ? slot->rows + slot->cols : slot->numel),
             now.data() + (next.rows ? next.rows + next.cols : next.numel));
    s_->free(s_->host, slot->buf);
    slot->buf = nullptr;
    next.buf = static_cast<float*>(s_->alloc(s_->host, next.floats * sizeof(float),
                                             HR_MEM_OPTIMIZER, ("adafactor " + next.name).c_str()));
    if (!next.buf) {
      s_->set_error(
          s_->host,
          ("no device memory for the resized adafactor state of '" + next.name + "'").c_str());
      return HR_ERROR_OUT_OF_MEMORY;
    }
    st = write(next.buf, now.data(), now.size() * sizeof(float));
    *slot = next;
    return st;
  }

  hr_status load(const void* data, uint64_t size) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    const uint8_t* end = p + size;
    StateHeader h;
    if (size < sizeof h)
      return damaged("it holds " + std::to_string(size) + " bytes, less than its " +
                     std::to_string(sizeof h) + "-byte header");
    std::memcpy(&h, p, sizeof h);
    p += sizeof h;
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) return damaged("no adafactor header");
    if (h.version != kStateVersion)
      return damaged("state version " + std::to_string(h.version) + "; this plugin reads " +
                     std::to_string(kStateVersion));
    if (h.step < 0 || h.first_moment > 1) return damaged("a bad step counter or flag");
    if (h.count == 0) {  // saved before the first update
      if (h.step != 0 || p != end) return damaged("a step counter without state tensors");
      return HR_OK;
    }
    if (bool(h.first_moment) != c_.first_moment)
      return mismatch(h.first_moment ? "it has a first moment (beta1 was set), and this config "
                                       "sets no beta1"
                                     : "it has no first moment, and this config sets beta1");
    hr_status st = allocate();
    if (st != HR_OK) return st;
    if (h.count != slots_.size())
      return mismatch("it holds " + std::to_string(h.count) + " state tensors; this model needs " +
                      std::to_string(slots_.size()));
    // Check everything before writing anything.
    std::vector<const uint8_t*> bytes_at(slots_.size());
    for (size_t k = 0; k < slots_.size(); ++k) {
      uint32_t len = 0;
      uint64_t bytes = 0;
      if (end - p < ptrdiff_t(sizeof len)) return damaged("it ends inside tensor " + num(k));
      std::memcpy(&len, p, sizeof len);
      p += sizeof len;
      if (uint64_t(end - p) < uint64_t(len) + sizeof bytes)
        return damaged("it ends inside tensor " + num(k));
      const std::string name(reinterpret_cast<const char*>(p), len);
      p += len;
      std::memcpy(&bytes, p, sizeof bytes);
      p += sizeof bytes;
      const Slot& slot = slots_[k];
      if (name != slot.name)
        return mismatch("state tensor " + num(k) + " is '" + name + "'; this model's is '" +
                        slot.name + "'");
      if (bytes != slot.floats * sizeof(float))
        return mismatch("'" + name + "' holds " + std::to_string(bytes) + " bytes; this model's " +
                        std::to_string(slot.floats * sizeof(float)));
      if (uint64_t(end - p) < bytes) return damaged("it ends inside '" + name + "'");
      bytes_at[k] = p;
      p += bytes;
    }
    if (p != end) return damaged(std::to_string(end - p) + " bytes after the last tensor");
    for (size_t k = 0; k < slots_.size(); ++k) {
      st = write(slots_[k].buf, bytes_at[k], slots_[k].floats * sizeof(float));
      if (st != HR_OK) return st;
    }
    t_ = h.step;
    c_.seed = h.seed;  // the rounding continues the snapshot's stream
    return HR_OK;
  }

 private:
  static std::string num(size_t k) { return std::to_string(k); }
  hr_status damaged(const std::string& what) {
    s_->set_error(s_->host, ("the adafactor state is damaged: " + what).c_str());
    return HR_ERROR_CONFIG;
  }
  hr_status mismatch(const std::string& what) {
    s_->set_error(s_->host, ("the adafactor state does not fit this run: " + what +
                             " (resume with the config the snapshot was written with)")
                                .c_str());
    return HR_ERROR_CONFIG;
  }

  hr_status param(const Slot& slot, hr_tensor* p) const {
    std::memset(p, 0, sizeof *p);
    p->struct_size = sizeof *p;
    const hr_status st = s_->layer_param(s_->host, slot.layer, slot.index, p);
    if (st != HR_OK) return st;
    if (p->numel != slot.numel) {
      s_->set_error(s_->host,
                    ("adafactor: parameter '" + slot.name + "' changed its size").c_str());
      return HR_ERROR_INVALID;
    }
    if (p->dtype != HR_DTYPE_F32 && p->dtype != HR_DTYPE_BF16) {
      s_->set_error(s_->host, ("adafactor updates f32 or bf16 weights; '" + slot.name +
                               "' has weights of dtype " + std::to_string(p->dtype))
                                  .c_str());
      return HR_ERROR_UNSUPPORTED;
    }
    if (!p->data || !p->grad) {
      s_->set_error(s_->host, ("adafactor updates whole parameters, and '" + slot.name +
                               "' has no whole weights or gradient here (sharded by a zero "
                               "plugin?); use the built-in optimizer with sharding")
                                  .c_str());
      return HR_ERROR_UNSUPPORTED;
    }
    const uint32_t gd = HR_HAS_FIELD(p, hr_tensor, grad_dtype) ? p->grad_dtype : p->dtype;
    if (gd != HR_DTYPE_F32 && gd != HR_DTYPE_BF16) {
      s_->set_error(s_->host, ("adafactor reads f32 or bf16 gradients; '" + slot.name +
                               "' has gradients of dtype " + std::to_string(gd))
                                  .c_str());
      return HR_ERROR_UNSUPPORTED;
    }
    p->grad_dtype = gd;
    return HR_OK;
  }

  // One state buffer per parameter, zeroed, for every trainable parameter of every layer.
  hr_status allocate() {
    if (allocated_) return HR_OK;
    std::vector<Slot> slots;
    const int32_t layers = s_->num_layers(s_->host);
    for (int32_t l = 0; l < layers; ++l) {
      const int32_t n = s_->layer_num_params(s_->host, l);
      for (int32_t i = 0; i < n; ++i) {
        hr_tensor p;
        std::memset(&p, 0, sizeof p);
        p.struct_size = sizeof p;
        const hr_status st = s_->layer_param(s_->host, l, i, &p);
        if (st != HR_OK) return st;
        if (p.frozen) continue;  // never updated: no state
        Slot slot;
        slot.name = p.name ? p.name : "";
        slot.layer = l;
        slot.index = i;
        slot.numel = p.numel;
        slot.floats =
            state_floats(p.ndim, p.shape, p.numel, c_.first_moment, &slot.rows, &slot.cols);
        slots.push_back(slot);
      }
    }
    for (Slot& slot : slots) {
      const uint64_t bytes = slot.floats * sizeof(float);
      slot.buf = static_cast<float*>(
          s_->alloc(s_->host, bytes, HR_MEM_OPTIMIZER, ("adafactor " + slot.name).c_str()));
      if (!slot.buf) {
        for (Slot& done : slots)
          if (done.buf) s_->free(s_->host, done.buf);
        s_->set_error(s_->host, ("no device memory for the adafactor state of '" + slot.name +
                                 "' (" + std::to_string(bytes) + " bytes)")
                                    .c_str());
        return HR_ERROR_OUT_OF_MEMORY;
      }
      if (!dry_) std::fill(slot.buf, slot.buf + slot.floats, 0.0f);
    }
    slots_ = std::move(slots);
    allocated_ = true;
    return HR_OK;
  }

  // The CPU backend's kernel (kernels.h): device memory is host memory. theta f32 (masters) or
  // bf16 (amp master_weights = false: rounded stochastically from `key`).
  void update(const Slot& slot, const hr_tensor& p, double beta2, double rel, uint64_t key) {
    adafactor::Tensor t;
    t.theta = p.data;
    t.grad = p.grad;
    t.numel = slot.numel;
    t.rows = slot.rows;
    t.cols = slot.cols;
    if (slot.rows) {
      t.row = slot.row();
      t.col = slot.col();
    } else {
      t.v = slot.v();
    }
    t.m = c_.first_moment ? slot.m() : nullptr;
    adafactor::Hyper h;
    h.beta2 = beta2;
    h.rel = rel;
    h.eps1 = c_.eps1;
    h.eps2 = c_.eps2;
    h.clip_threshold = c_.clip_threshold;
    h.scale_parameter = c_.scale_parameter;
    h.weight_decay = p.weight_decay ? c_.weight_decay : 0.0;
    h.beta1 = c_.beta1;
    h.round_key = key;
    adafactor::update(t, h, p.dtype == HR_DTYPE_BF16, p.grad_dtype == HR_DTYPE_BF16, scratch_);
  }

  hr_status read(void* dst, const void* src, uint64_t bytes) const {
    if (tensors_ && tensors_->read) return tensors_->read(s_->host, dst, src, bytes);
    std::memcpy(dst, src, bytes);  // CPU backend (create() refuses any other)
    return HR_OK;
  }
  hr_status write(void* dst, const void* src, uint64_t bytes) const {
    if (tensors_ && HR_HAS_FIELD(tensors_, hr_ext_tensors, write) && tensors_->write)
      return tensors_->write(s_->host, dst, src, bytes);
    std::memcpy(dst, src, bytes);  // CPU backend: device memory is host memory
    return HR_OK;
  }

  const hr_host_services* s_;
  Settings c_;
  const hr_ext_tensors* tensors_ = nullptr;
  std::vector<Slot> slots_;
  bool allocated_ = false;
  bool dry_ = false;            // a dry run (plan --measure): allocate, never compute
  int64_t t_ = 0;               // updates done
  adafactor::Scratch scratch_;  // the passes' partial sums and column factors (host memory)
};

hr_status read_settings(const hr_host_services* s, Settings* c) {
  const double kAbsent = std::nan("");
  double beta1 = kAbsent;
  int32_t relative = 1, scale = 1, warmup = 0;
  hr_status st = s->config_float(s->host, "beta1", &beta1);
  if (st == HR_OK) st = s->config_float(s->host, "decay_rate", &c->decay_rate);
  if (st == HR_OK) st = s->config_float(s->host, "clip_threshold", &c->clip_threshold);
  if (st == HR_OK) st = s->config_float(s->host, "eps1", &c->eps1);
  if (st == HR_OK) st = s->config_float(s->host, "eps2", &c->eps2);
  if (st == HR_OK) st = s->config_bool(s->host, "relative_step", &relative);
  if (st == HR_OK) st = s->config_bool(s->host, "scale_parameter", &scale);
  if (st == HR_OK) st = s->config_bool(s->host, "warmup_init", &warmup);
  if (st == HR_OK) st = s->config_float(s->host, "weight_decay", &c->weight_decay);
  int64_t seed = 0;
  if (st == HR_OK) st = s->config_int(s->host, "seed", &seed);
  if (st != HR_OK) return st;
  if (seed < 0 || seed > int64_t(UINT32_MAX))
    return s->config_error(s->host, "seed", "must be an integer in [0, 4294967295] (default 0)");
  c->seed = uint64_t(seed);
  c->relative_step = relative != 0;
  c->scale_parameter = scale != 0;
  c->warmup_init = warmup != 0;
  if (!std::isnan(beta1)) {
    if (!(beta1 >= 0 && beta1 < 1))
      return s->config_error(s->host, "beta1",
                             "must be in [0, 1) (e.g. 0.9), or absent for no first moment");
    c->first_moment = true;
    c->beta1 = beta1;
  }
  if (!(c->decay_rate < 0) || !std::isfinite(c->decay_rate))
    return s->config_error(s->host, "decay_rate",
                           "must be a finite number < 0 (default -0.8: beta2 at step t is "
                           "1 - t^-0.8)");
  if (!(c->clip_threshold > 0) || !std::isfinite(c->clip_threshold))
    return s->config_error(s->host, "clip_threshold", "must be a finite number > 0 (default 1.0)");
  if (!(c->eps1 > 0) || !std::isfinite(c->eps1))
    return s->config_error(s->host, "eps1", "must be a finite number > 0 (default 1e-30)");
  if (!(c->eps2 > 0) || !std::isfinite(c->eps2))
    return s->config_error(s->host, "eps2", "must be a finite number > 0 (default 1e-3)");
  if (!(c->weight_decay >= 0) || !std::isfinite(c->weight_decay))
    return s->config_error(s->host, "weight_decay", "must be a finite number >= 0 (default 0.0)");
  if (c->warmup_init && !c->relative_step)
    return s->config_error(s->host, "warmup_init",
                           "= true needs relative_step = true (it warms up the relative step "
                           "size; with relative_step = false use [train] warmup_steps)");
  return HR_OK;
}

hr_status create(const hr_host_services* s, void** instance) {
  Settings c;
  const hr_status st = read_settings(s, &c);
  if (st != HR_OK) return st;
  const char* kind = s->device_kind(s->host);
  if (kind && std::strcmp(kind, "cpu") != 0) {
    s->set_error(s->host, (std::string("adafactor runs on the CPU backend only: its CUDA kernels "
                                       "are not written yet (device kind \"") +
                           kind + "\"); use the built-in optimizer on this device")
                              .c_str());
    return HR_ERROR_UNSUPPORTED;
  }
  *instance = new Adafactor(s, c);
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

using Hooks = headroom_plugin::OptimizerHooks<Adafactor>;

// headroom.estimate/1: the optimizer state is this plugin's (rows + cols floats a matrix, numel a
// vector, numel more each with beta1); core's closed form has the rest.
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!q || !r || !r->after || !q->peak || !q->model) return HR_ERROR_INVALID;
  const Settings defaults;
  const Settings& c = instance ? static_cast<const Adafactor*>(instance)->settings() : defaults;
  const hr_estimate_model& m = *q->model;
  // What it cannot run with: another device than the CPU, optimizer state sharded by a zero
  // plugin.
  const hr_mechanisms& before = *r->after;
  if (m.device_kind && std::strcmp(m.device_kind, "cpu") != 0) return HR_ERROR_UNSUPPORTED;
  if (HR_HAS_FIELD(&before, hr_mechanisms, shard) && before.shard != 0) return HR_ERROR_UNSUPPORTED;
  uint64_t floats = 0;
  if (HR_HAS_FIELD(&m, hr_estimate_model, param_tensors) && m.param_tensors &&
      m.num_param_tensors > 0) {
    for (int32_t k = 0; k < m.num_param_tensors; ++k) {
      const hr_estimate_param& p = m.param_tensors[k];
      uint64_t rows, cols;
      floats += state_floats(p.ndim, p.shape, p.numel, c.first_moment, &rows, &cols);
    }
  } else {
    return HR_ERROR_UNSUPPORTED;  // a host that does not list the tensors: no shapes to count
  }
  if (!HR_HAS_FIELD(r->after, hr_mechanisms, optimizer_bytes))
    return HR_ERROR_UNSUPPORTED;  // a host whose closed form cannot take another optimizer's bytes
  r->after->optimizer_bytes = floats * sizeof(float);
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  // Step time over the built-in AdamW, CPU backend, gpt2-124m: 1.095 (docs/results/
  // model-state.md, section 1). Not measured on a GPU (it has no CUDA kernels).
  r->step_time_factor = 1.095;
  std::snprintf(r->what, sizeof r->what,
                "Adafactor optimizer: factored second moments (rows + cols floats a matrix)%s",
                c.first_moment ? " and a first moment" : ", no first moment");
  if (instance) {
    r->toml[0] = '\0';
  } else {
    std::snprintf(r->toml, sizeof r->toml, "relative_step = true");
  }
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

const hr_ext_estimate kEstimate = {sizeof(hr_ext_estimate), 0, estimate_noexcept, 0, 0, nullptr};

const void* get_extension(const char* id) {
  if (!id) return nullptr;
  if (std::strcmp(id, HR_EXT_ESTIMATE) == 0) return &kEstimate;
  if (std::strcmp(id, HR_EXT_OPTIMIZER) == 0) return &Hooks::kHooks;
  // It subscribes to no event: its optimizer role's step reads the gradients.
  return headroom_plugin::offer_reads<0>(id);
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "adafactor",
    "1.0.0",
    "Adafactor optimizer (factored second moments, update clipping, relative step size): "
    "optimizer state of rows + cols floats per matrix",
    0,  // events
    HR_ROLE_OPTIMIZER,
    0,  // reserved0
    create_hook,
    Hooks::destroy,
    Hooks::on_event,
    nullptr,  // allocator
    &Hooks::kHooks,
    Hooks::save_state,
    Hooks::load_state,
    get_extension,
};

}  // namespace

// hr_negotiate refuses another major version; the host's message names both versions.
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
