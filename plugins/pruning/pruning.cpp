// pruning: gradual magnitude pruning during training (Zhu & Gupta 2017), on a cubic schedule
//
//   s_t = s_f + (s_i − s_f)·(1 − (t − t0)/(n·Δt))³,   t = t0, t0 + Δt, ..., t0 + n·Δt
//
// with s_i = initial_sparsity, s_f = final_sparsity, t0 = start_step, t0 + n·Δt = end_step and
// Δt = every. The pruning steps are those t; each prunes at STEP_END, after that step's update,
// so the losses of steps 1 .. t0 are those of a run without this plugin, bitwise.
//
//   [[plugins]]
//   name = "pruning"
//   mode = "mlp"               # "mlp" (the default) | "heads" | "unstructured"
//   initial_sparsity = 0.0     # s_i, in [0, final_sparsity]
//   final_sparsity = 0.5       # s_f, in [0, 1)
//   start_step = 100           # t0 >= 1
//   end_step = 400             # >= start_step; end_step − start_step a multiple of every
//   every = 50                 # Δt >= 1
//   importance = "magnitude"   # "magnitude" | "taylor" (modes "mlp" and "heads")
//
// mode = "mlp" — structured: it saves memory. Each block's MLP hidden units are ranked and the
// least important removed through headroom.resize/1 (core's mechanism: the rows of c_fc and its
// bias, the columns of c_proj, their gradients, the optimizer's state and, from the next forward
// on, the block's (B, T, H) activations all shrink). Every block keeps round((1 − s_t)·H0) of
// its H0 units at step t (H0: its width when the run began; at least one stays). Importance of
// unit j:
//  - magnitude: Σ|c_fc.weight[j, :]| + |c_fc.bias[j]| + Σ|c_proj.weight[:, j]|;
//  - taylor: the same sums of |w·∂L/∂w| (first-order Taylor, Molchanov et al. 2019), accumulated
//    over the Δt steps before each pruning step at OPTIMIZER_STEP (the step's final gradients,
//    clipped; a vetoed step adds nothing).
// Ties go to the lower index. Refused (by the host, with its message) on more ranks or with a
// zero plugin, and with an optimizer-role plugin that cannot resize its state.
// On a Llama (arch = "llama") a unit is a SwiGLU hidden unit: row j of gate and row j of up (the
// fused mlp.gate_up_proj, gate above up) and column j of mlp.down_proj go together; its
// importance is the sum of |w| (or |w·∂L/∂w|) over those three (no biases).
//
// mode = "unstructured" — magnitude masks on the weight matrices of the blocks (attn.c_attn,
// attn.c_proj, mlp.c_fc, mlp.c_proj; a Llama's qkv_proj, o_proj, gate_up_proj, down_proj): at each
// pruning step the round(s_t·n) smallest |w| of each matrix are masked (the masked ones stay
// masked); after every update from then on the masked weights are set to zero. This saves no
// memory: the tensors keep their size and the masks (one byte per weight, device memory of category
// parameters) add to it. The log says so. Needs f32 weights (no compute copy: amp's bf16 copies
// would keep the unmasked values).
//
// mode = "heads" — structured, the same for attention heads: every block keeps
// round((1 − s_t)·NH0) of its NH0 heads (at least one), ranked by the same sums over a head's
// q, k and v rows of attn.c_attn (weight and bias: 3·hs rows, hs = n_embd / n_head) and its hs
// columns of attn.c_proj.weight; core removes the rest (headroom.resize/1 keep_attn_heads), and
// the block's qkv (B, T, 3A), attention (B, NH, T, T) and output (B, T, A) shrink with them.
// On a Llama the heads go in whole key/value groups: a group is a KV head and the G = n_head /
// n_kv_head query heads that share it, and every block keeps round((1 − s_t)·NKV0) of its NKV0
// groups (at least one), ranked by the sums over the group's q rows, its KV head's k and v rows
// of self_attn.qkv_proj and its query heads' columns of self_attn.o_proj. So every KV head left
// keeps all its query heads and the group size stays the model's (the GQA kernels and a
// Hugging Face config need one); without GQA (n_kv_head = n_head) a group is one head, as GPT-2's.
// With n_kv_head = 1 there is nothing to prune: refused at TRAIN_BEGIN.
//
// State in snapshots: the widths H0, the Taylor sums, the masks, so a resume is bitwise.
// Training thread only; no locking. Only hr_plugin_entry is exported; no C++ exception crosses
// the C ABI.
#include <headroom/ext/precision.h>
#include <headroom/ext/resize.h>
#include <headroom/ext/state.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>

#include "common/bf16.h"
#include "common/hook_guard.h"
#include "common/offer_reads.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

enum class Mode { kMlp, kUnstructured, kHeads };

struct Settings {
  Mode mode = Mode::kMlp;
  double initial = 0.0, final_ = 0.5;
  int64_t start = 1, end = 1, every = 1;
  bool taylor = false;
};

// s_t of the cubic schedule at a pruning step t (start <= t <= end).
double sparsity_at(const Settings& c, int64_t t) {
  if (c.end == c.start) return c.final_;
  const double x = 1.0 - double(t - c.start) / double(c.end - c.start);
  return c.final_ + (c.initial - c.final_) * x * x * x;
}

bool is_pruning_step(const Settings& c, int64_t t) {
  return t >= c.start && t <= c.end && (t - c.start) % c.every == 0;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

// What a snapshot holds: this header, then per block its H0 (int32) and its Taylor sums (count
// uint32, then doubles), then per mask its byte count (uint64) and bytes.
struct StateHeader {
  char magic[8];
  uint32_t version;
  uint32_t mode;
  uint32_t blocks;
  uint32_t masks;
};
constexpr char kMagic[8] = {'P', 'R', 'U', 'N', 'I', 'N', 'G', '1'};

class Pruning {
 public:
  Pruning(const hr_host_services* s, const Settings& c, const hr_ext_tensors* tensors,
          const hr_ext_resize* resize, const hr_ext_precision* precision)
      : s_(s), c_(c), tensors_(tensors), resize_(resize), precision_(precision) {}
  ~Pruning() {
    for (Mask& m : masks_)
      if (m.bits) s_->free(s_->host, m.bits);
  }
  const hr_host_services* services() const { return s_; }

  hr_status on_event(const hr_event_info* info) {
    switch (info->event) {
      case HR_EVENT_TRAIN_BEGIN:
        return train_begin();
      case HR_EVENT_OPTIMIZER_STEP:
        // The window of Δt steps before a pruning step.
        if (c_.mode != Mode::kUnstructured && c_.taylor && in_taylor_window(info->step))
          return accumulate_taylor();
        return HR_OK;
      case HR_EVENT_STEP_END:
        if (is_pruning_step(c_, info->step)) {
          const hr_status st = c_.mode == Mode::kUnstructured ? prune_unstructured(info->step)
                                                              : prune_mlp(info->step);
          if (st != HR_OK) return st;
        }
        return c_.mode == Mode::kUnstructured ? apply_masks() : HR_OK;
      default:
        return HR_OK;
    }
  }

  hr_status save(const hr_state_writer* w) const {
    StateHeader h;
    std::memset(&h, 0, sizeof h);
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = 1;
    h.mode = uint32_t(c_.mode);
    h.blocks = uint32_t(h0_.size());
    h.masks = uint32_t(masks_.size());
    hr_status st = w->write(w->context, &h, sizeof h);
    for (size_t b = 0; st == HR_OK && b < h0_.size(); ++b) {
      const int32_t h0 = h0_[b];
      const uint32_t n = uint32_t(taylor_.empty() ? 0 : taylor_[b].size());
      st = w->write(w->context, &h0, sizeof h0);
      if (st == HR_OK) st = w->write(w->context, &n, sizeof n);
      if (st == HR_OK && n) st = w->write(w->context, taylor_[b].data(), n * sizeof(double));
    }
    std::vector<uint8_t> host;
    for (size_t k = 0; st == HR_OK && k < masks_.size(); ++k) {
      const uint64_t n = masks_[k].numel;
      host.resize(n);
      st = read(host.data(), masks_[k].bits, n);
      if (st == HR_OK) st = w->write(w->context, &n, sizeof n);
      if (st == HR_OK) st = w->write(w->context, host.data(), n);
    }
    return st;
  }

  hr_status load(const void* data, uint64_t size) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    const uint8_t* end = p + size;
    StateHeader h;
    if (size < sizeof h || std::memcmp(p, kMagic, sizeof kMagic) != 0)
      return damaged("no pruning header");
    std::memcpy(&h, p, sizeof h);
    p += sizeof h;
    if (h.version != 1 || h.mode != uint32_t(c_.mode))
      return damaged(
          "it was written in another mode or version (resume with the config the "
          "snapshot was written with)");
    auto take = [&](void* dst, uint64_t n) {
      if (uint64_t(end - p) < n) return false;
      std::memcpy(dst, p, n);
      p += n;
      return true;
    };
    std::vector<int32_t> h0(h.blocks);
    std::vector<std::vector<double>> taylor(h.blocks);
    bool any_taylor = false;
    for (uint32_t b = 0; b < h.blocks; ++b) {
      uint32_t n = 0;
      if (!take(&h0[b], sizeof h0[b]) || !take(&n, sizeof n) || n > uint32_t(h0[b]) || h0[b] < 1)
        return damaged("block " + std::to_string(b) + "'s widths");
      taylor[b].resize(n);
      if (n && !take(taylor[b].data(), n * sizeof(double)))
        return damaged("block " + std::to_string(b) + "'s Taylor sums");
      any_taylor |= n > 0;
    }
    std::vector<std::vector<uint8_t>> masks(h.masks);
    for (uint32_t k = 0; k < h.masks; ++k) {
      uint64_t n = 0;
      if (!take(&n, sizeof n) || uint64_t(end - p) < n) return damaged("mask " + std::to_string(k));
      masks[k].assign(p, p + n);
      p += n;
    }
    if (p != end) return damaged("bytes after its end");
    h0_ = h0;
    taylor_ = any_taylor ? taylor : std::vector<std::vector<double>>{};
    loaded_masks_ = std::move(masks);
    return HR_OK;
  }

 private:
  struct Mask {
    int32_t layer = 0, index = 0;
    uint64_t numel = 0;
    uint8_t* bits = nullptr;  // device memory: 1 keeps the weight, 0 masks it
  };

  hr_status fail(hr_status st, const std::string& what) const {
    s_->set_error(s_->host, ("pruning: " + what).c_str());
    return st;
  }
  hr_status damaged(const std::string& what) const {
    return fail(HR_ERROR_CONFIG, "its snapshot state is damaged or another run's: " + what);
  }
  void log(int32_t level, const std::string& m) const { s_->log(s_->host, level, m.c_str()); }

  int32_t blocks() const { return s_->num_layers(s_->host) - 2; }

  hr_status train_begin() {
    const int32_t L = blocks();
    if (c_.mode != Mode::kUnstructured) {
      if (h0_.empty())  // a fresh run: the widths it began with (a resume loaded them)
        for (int32_t b = 0; b < L; ++b)
          h0_.push_back(units(b + 1));
      if (int32_t(h0_.size()) != L) return damaged("it is of a model with other blocks");
      // A Llama's heads go in whole KV groups, and one group must stay.
      if (c_.mode == Mode::kHeads && L > 0 && is_llama(1) && h0_[0] == 1)
        return fail(HR_ERROR_UNSUPPORTED,
                    "mode = \"heads\" removes a Llama's attention heads in whole key/value "
                    "groups, and this model's blocks have one (n_kv_head = 1), which must stay: "
                    "nothing could be pruned; use mode = \"mlp\"");
      return HR_OK;
    }
    // Unstructured: f32 weights only (a compute copy would keep the unmasked values).
    if (precision_ && precision_->compute_dtype(s_->host) != HR_DTYPE_F32)
      return fail(HR_ERROR_UNSUPPORTED,
                  "mode = \"unstructured\" masks f32 weights, and this run computes in another "
                  "dtype (amp); use mode = \"mlp\", or no amp");
    if (!loaded_masks_.empty()) {
      const hr_status st = make_masks();
      if (st != HR_OK) return st;
      if (loaded_masks_.size() != masks_.size()) return damaged("its number of masks");
      for (size_t k = 0; k < masks_.size(); ++k) {
        if (loaded_masks_[k].size() != masks_[k].numel) return damaged("mask sizes");
        const hr_status w = write(masks_[k].bits, loaded_masks_[k].data(), masks_[k].numel);
        if (w != HR_OK) return w;
      }
      loaded_masks_.clear();
    }
    return HR_OK;
  }

  hr_tensor param(int32_t layer, int32_t index) const {
    hr_tensor t;
    std::memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    if (s_->layer_param(s_->host, layer, index, &t) != HR_OK)
      throw std::runtime_error("cannot read parameter " + std::to_string(index) + " of layer " +
                               std::to_string(layer));
    if (!t.data)
      throw std::runtime_error(std::string("parameter ") + (t.name ? t.name : "?") +
                               " has no whole weights here (sharded?)");
    return t;
  }

  // n elements of dtype (f32 or bf16) at device memory src, as floats on the host.
  std::vector<float> floats(const void* src, uint32_t dtype, uint64_t n) const {
    std::vector<float> out(n);
    if (dtype == HR_DTYPE_F32) {
      check(read(out.data(), src, n * sizeof(float)));
    } else if (dtype == HR_DTYPE_BF16) {
      std::vector<uint16_t> h(n);
      check(read(h.data(), src, n * sizeof(uint16_t)));
      for (uint64_t i = 0; i < n; ++i)
        out[i] = headroom_plugin::bf16::load(h[i]);
    } else {
      throw std::runtime_error("pruning reads f32 or bf16 tensors, not dtype " +
                               std::to_string(dtype));
    }
    return out;
  }
  void check(hr_status st) const {
    if (st != HR_OK) throw std::runtime_error("a device read failed");
  }
  // The host's reads and writes, a bounded chunk at a time.
  hr_status read(void* dst, const void* src, uint64_t bytes) const {
    for (uint64_t off = 0; off < bytes; off += HR_READ_MAX_BYTES) {
      const uint64_t n = std::min<uint64_t>(HR_READ_MAX_BYTES, bytes - off);
      const hr_status st = tensors_->read(s_->host, static_cast<uint8_t*>(dst) + off,
                                          static_cast<const uint8_t*>(src) + off, n);
      if (st != HR_OK) return st;
    }
    return HR_OK;
  }
  hr_status write(void* dst, const void* src, uint64_t bytes) const {
    return tensors_->write(s_->host, dst, src, bytes);
  }

  // The index of block layer `layer`'s parameter whose name ends with `tail`, or -1.
  int32_t find(int32_t layer, const char* tail) const {
    const int32_t n = s_->layer_num_params(s_->host, layer);
    for (int32_t i = 0; i < n; ++i) {
      const hr_tensor t = param(layer, i);
      if (ends_with(t.name ? t.name : "", tail)) return i;
    }
    return -1;
  }
  int32_t need(int32_t layer, const char* tail, const char* what) const {
    const int32_t i = find(layer, tail);
    if (i < 0)
      throw std::runtime_error("layer " + std::to_string(layer) + " has no " + what +
                               " to prune (no parameter *" + tail + ")");
    return i;
  }
  // A Llama block (arch = "llama": Hugging Face's Llama names, gate and up fused, q, k and v
  // fused), else GPT-2's.
  bool is_llama(int32_t layer) const { return find(layer, "mlp.gate_up_proj.weight") >= 0; }

  // A Llama block's grouped-query attention now, from its shapes: qkv_proj (A + 2·KV, C),
  // o_proj (C, A), NH heads of hs = A / NH, NKV = KV / hs groups of G = NH / NKV heads.
  struct Gqa {
    int32_t qkv = -1, o = -1;
    uint64_t A = 0, KV = 0, C = 0, NH = 0, hs = 0, NKV = 0, G = 1;
  };
  Gqa gqa_of(int32_t layer) const {
    Gqa g;
    g.qkv = need(layer, "self_attn.qkv_proj.weight", "attention");
    g.o = need(layer, "self_attn.o_proj.weight", "attention");
    const hr_tensor q = param(layer, g.qkv), o = param(layer, g.o);
    g.C = uint64_t(o.shape[0]);
    g.A = uint64_t(o.shape[1]);
    g.KV = (uint64_t(q.shape[0]) - g.A) / 2;
    g.NH = uint64_t(resize_->attn_heads(s_->host, layer));
    g.hs = g.A / g.NH;
    g.NKV = g.KV / g.hs;
    g.G = g.NH / g.NKV;
    return g;
  }

  // What the mode prunes, and how many block layer `layer` has now: MLP units, or attention
  // heads — a Llama's in whole KV groups (its units are the groups).
  int32_t units(int32_t layer) const {
    if (c_.mode != Mode::kHeads) return resize_->mlp_width(s_->host, layer);
    const int32_t heads = resize_->attn_heads(s_->host, layer);
    return is_llama(layer) ? heads / int32_t(gqa_of(layer).G) : heads;
  }
  // The heads (or MLP units) the kept units are: a Llama group's G consecutive query heads.
  int32_t heads_per_unit(int32_t layer) const {
    return c_.mode == Mode::kHeads && is_llama(layer) ? int32_t(gqa_of(layer).G) : 1;
  }
  hr_status keep(int32_t layer, const std::vector<uint32_t>& kept) const {
    if (c_.mode != Mode::kHeads)
      return resize_->keep_mlp_units(s_->host, layer, kept.data(), uint32_t(kept.size()));
    const uint32_t G = uint32_t(heads_per_unit(layer));
    std::vector<uint32_t> heads;
    for (uint32_t u : kept)
      for (uint32_t e = 0; e < G; ++e)
        heads.push_back(u * G + e);
    return resize_->keep_attn_heads(s_->host, layer, heads.data(), uint32_t(heads.size()));
  }
  const char* unit_name() const { return c_.mode == Mode::kHeads ? "heads" : "MLP units"; }

  // |w|, or |w·g| (taylor), of every element of a parameter, on the host.
  std::vector<float> values(const hr_tensor& t, bool with_grad) const {
    std::vector<float> w = floats(t.data, t.dtype, t.numel);
    if (!with_grad) return w;
    if (!t.grad) throw std::runtime_error("no gradient for the Taylor importance");
    const uint32_t gd = HR_HAS_FIELD(&t, hr_tensor, grad_dtype) ? t.grad_dtype : t.dtype;
    const std::vector<float> g = floats(t.grad, gd, t.numel);
    for (uint64_t i = 0; i < w.size(); ++i)
      w[i] *= g[i];
    return w;
  }

  // Per unit of the block (what the mode prunes): the sum over its elements.
  std::vector<double> unit_sums(int32_t layer, bool with_grad) const {
    const bool llama = is_llama(layer);
    if (c_.mode == Mode::kHeads)
      return llama ? group_sums(layer, with_grad) : head_sums(layer, with_grad);
    return llama ? swiglu_sums(layer, with_grad) : mlp_sums(layer, with_grad);
  }

  // Σ|m[row, :]| of a row-major matrix with `cols` columns.
  static double row_sum(const std::vector<float>& m, uint64_t row, uint64_t cols) {
    double s = 0.0;
    for (uint64_t k = 0; k < cols; ++k)
      s += std::fabs(double(m[row * cols + k]));
    return s;
  }
  // Σ|m[:, col]| of a row-major (rows, cols) matrix.
  static double col_sum(const std::vector<float>& m, uint64_t col, uint64_t rows, uint64_t cols) {
    double s = 0.0;
    for (uint64_t r = 0; r < rows; ++r)
      s += std::fabs(double(m[r * cols + col]));
    return s;
  }

  // Per head h: its q, k, v rows of c_attn (3A, C) and its bias, its columns of c_proj (C, A).
  std::vector<double> head_sums(int32_t layer, bool with_grad) const {
    const int32_t qkvw = need(layer, "attn.c_attn.weight", "attention"),
                  qkvb = need(layer, "attn.c_attn.bias", "attention"),
                  projw = need(layer, "attn.c_proj.weight", "attention");
    const hr_tensor w = param(layer, qkvw), b = param(layer, qkvb), p = param(layer, projw);
    const uint64_t A = uint64_t(w.shape[0]) / 3, C = uint64_t(w.shape[1]);
    const uint64_t NH = uint64_t(resize_->attn_heads(s_->host, layer)), hs = A / NH;
    const std::vector<float> a = values(w, with_grad), bb = values(b, with_grad),
                             pp = values(p, with_grad);
    std::vector<double> score(NH, 0.0);
    for (uint64_t h = 0; h < NH; ++h) {
      double s = 0.0;
      for (uint64_t part = 0; part < 3; ++part)
        for (uint64_t e = 0; e < hs; ++e) {
          const uint64_t row = part * A + h * hs + e;
          s += std::fabs(double(bb[row])) + row_sum(a, row, C);
        }
      for (uint64_t e = 0; e < hs; ++e)
        s += col_sum(pp, h * hs + e, C, A);
      score[h] = s;
    }
    return score;
  }

  // A Llama's KV group k: its G query heads' q rows of qkv_proj (A + 2·KV, C), its KV head's k
  // and v rows, and the query heads' columns of o_proj (C, A). No biases.
  std::vector<double> group_sums(int32_t layer, bool with_grad) const {
    const Gqa g = gqa_of(layer);
    const std::vector<float> q = values(param(layer, g.qkv), with_grad),
                             o = values(param(layer, g.o), with_grad);
    std::vector<double> score(g.NKV, 0.0);
    for (uint64_t k = 0; k < g.NKV; ++k) {
      double s = 0.0;
      for (uint64_t e = 0; e < g.G * g.hs; ++e) {
        const uint64_t col = k * g.G * g.hs + e;  // the group's query heads are consecutive
        s += row_sum(q, col, g.C) + col_sum(o, col, g.C, g.A);
      }
      for (uint64_t e = 0; e < g.hs; ++e)
        s += row_sum(q, g.A + k * g.hs + e, g.C) + row_sum(q, g.A + g.KV + k * g.hs + e, g.C);
      score[k] = s;
    }
    return score;
  }

  // Per MLP unit j: its row of c_fc (H, C) and its bias, its column of c_proj (C, H).
  std::vector<double> mlp_sums(int32_t layer, bool with_grad) const {
    const int32_t fcw = need(layer, "mlp.c_fc.weight", "MLP"),
                  fcb = need(layer, "mlp.c_fc.bias", "MLP"),
                  projw = need(layer, "mlp.c_proj.weight", "MLP");
    const hr_tensor w = param(layer, fcw), b = param(layer, fcb), pw = param(layer, projw);
    const uint64_t H = uint64_t(w.shape[0]), C = uint64_t(w.shape[1]);
    std::vector<double> score(H, 0.0);
    const std::vector<float> a = values(w, with_grad), bb = values(b, with_grad),
                             p = values(pw, with_grad);
    for (uint64_t j = 0; j < H; ++j)
      score[j] = std::fabs(double(bb[j])) + row_sum(a, j, C) + col_sum(p, j, C, H);
    return score;
  }

  // A Llama's SwiGLU unit j: its gate row j and up row I + j of gate_up_proj (2I, C), its
  // column j of down_proj (C, I).
  std::vector<double> swiglu_sums(int32_t layer, bool with_grad) const {
    const hr_tensor gu = param(layer, need(layer, "mlp.gate_up_proj.weight", "MLP")),
                    down = param(layer, need(layer, "mlp.down_proj.weight", "MLP"));
    const uint64_t I = uint64_t(gu.shape[0]) / 2, C = uint64_t(gu.shape[1]);
    const std::vector<float> a = values(gu, with_grad), d = values(down, with_grad);
    std::vector<double> score(I, 0.0);
    for (uint64_t j = 0; j < I; ++j)
      score[j] = row_sum(a, j, C) + row_sum(a, I + j, C) + col_sum(d, j, C, I);
    return score;
  }

  bool in_taylor_window(int64_t step) const {
    // The next pruning step at or after `step`, and whether `step` is within Δt of it.
    if (step > c_.end) return false;
    const int64_t next = step <= c_.start
                             ? c_.start
                             : c_.start + (step - c_.start + c_.every - 1) / c_.every * c_.every;
    return next - step < c_.every;
  }

  hr_status accumulate_taylor() {
    const int32_t L = blocks();
    if (taylor_.empty()) taylor_.resize(size_t(L));
    for (int32_t b = 0; b < L; ++b) {
      const std::vector<double> s = unit_sums(b + 1, true);
      std::vector<double>& acc = taylor_[size_t(b)];
      if (acc.size() != s.size()) acc.assign(s.size(), 0.0);
      for (size_t j = 0; j < s.size(); ++j)
        acc[j] += s[j];
    }
    return HR_OK;
  }

  hr_status prune_mlp(int64_t step) {
    const double target = sparsity_at(c_, step);
    const int32_t L = blocks();
    hr_memory_stats before;
    std::memset(&before, 0, sizeof before);
    before.struct_size = sizeof before;
    s_->memory_stats(s_->host, &before);
    uint64_t removed = 0;
    std::string widths;
    for (int32_t b = 0; b < L; ++b) {
      const int32_t layer = b + 1;
      const int32_t H = units(layer), per = heads_per_unit(layer);
      const int32_t H0 = h0_[size_t(b)];
      const int32_t keep_n = std::max<int32_t>(1, H0 - int32_t(std::lround(target * double(H0))));
      widths += (b ? "," : "") + std::to_string(std::min(H, keep_n) * per);
      if (keep_n >= H) continue;
      std::vector<double> score;
      if (c_.taylor && !taylor_.empty() && taylor_[size_t(b)].size() == size_t(H)) {
        score = taylor_[size_t(b)];
      } else {
        score = unit_sums(layer, false);
      }
      // The keep_n highest, ties to the lower index; kept in ascending order.
      std::vector<uint32_t> order(static_cast<size_t>(H));
      std::iota(order.begin(), order.end(), 0u);
      std::stable_sort(order.begin(), order.end(),
                       [&](uint32_t x, uint32_t y) { return score[x] > score[y]; });
      order.resize(size_t(keep_n));
      std::sort(order.begin(), order.end());
      const hr_status st = keep(layer, order);
      if (st != HR_OK) return st;  // the host's message stands
      removed += uint64_t(H - keep_n) * uint64_t(per);
    }
    taylor_.clear();  // the next window starts empty
    hr_memory_stats after = before;
    s_->memory_stats(s_->host, &after);
    auto down = [&](int c) {
      return std::to_string(before.live_by_category[c] - after.live_by_category[c]);
    };
    log(HR_LOG_INFO, "step " + std::to_string(step) + ": sparsity " + fmt("%.4f", target) + ", " +
                         std::to_string(removed) + " " + unit_name() + " removed; now " + widths +
                         "; live bytes down by: parameters " + down(HR_MEM_PARAMETERS) +
                         ", gradients " + down(HR_MEM_GRADIENTS) + ", optimizer " +
                         down(HR_MEM_OPTIMIZER) + " (activations from the next forward on)");
    return HR_OK;
  }

  // One mask per weight matrix of the blocks, all ones.
  hr_status make_masks() {
    if (!masks_.empty()) return HR_OK;
    const int32_t L = blocks();
    uint64_t bytes = 0;
    for (int32_t layer = 1; layer <= L; ++layer) {
      const int32_t n = s_->layer_num_params(s_->host, layer);
      for (int32_t i = 0; i < n; ++i) {
        const hr_tensor t = param(layer, i);
        if (t.ndim != 2) continue;
        if (t.dtype != HR_DTYPE_F32 && t.dtype != HR_DTYPE_BF16)
          return fail(HR_ERROR_UNSUPPORTED, "masks f32 or bf16 weights only");
        Mask m;
        m.layer = layer;
        m.index = i;
        m.numel = t.numel;
        m.bits =
            static_cast<uint8_t*>(s_->alloc(s_->host, t.numel, HR_MEM_PARAMETERS, "pruning mask"));
        if (!m.bits)
          return fail(HR_ERROR_OUT_OF_MEMORY,
                      "no device memory for the masks (" + std::to_string(t.numel) + " bytes)");
        masks_.push_back(m);
        const std::vector<uint8_t> ones(t.numel, 1);
        const hr_status st = write(m.bits, ones.data(), t.numel);
        if (st != HR_OK) return st;
        bytes += t.numel;
      }
    }
    log(HR_LOG_WARN,
        "mode = \"unstructured\" saves no memory: the weights keep their size and "
        "the masks add " +
            std::to_string(bytes) + " bytes (parameters); mode = \"mlp\" removes what it prunes");
    return HR_OK;
  }

  hr_status prune_unstructured(int64_t step) {
    hr_status st = make_masks();
    if (st != HR_OK) return st;
    const double target = sparsity_at(c_, step);
    uint64_t masked = 0, total = 0;
    for (Mask& m : masks_) {
      const hr_tensor t = param(m.layer, m.index);
      const std::vector<float> w = floats(t.data, t.dtype, t.numel);
      std::vector<uint8_t> bits(m.numel);
      st = read(bits.data(), m.bits, m.numel);
      if (st != HR_OK) return st;
      const uint64_t k =
          std::min<uint64_t>(m.numel, uint64_t(std::llround(target * double(m.numel))));
      // Masked ones first (they stay masked), then by |w|, ties to the lower index.
      std::vector<uint64_t> order(m.numel);
      std::iota(order.begin(), order.end(), uint64_t(0));
      std::stable_sort(order.begin(), order.end(), [&](uint64_t x, uint64_t y) {
        if (bits[x] != bits[y]) return bits[x] < bits[y];
        return std::fabs(w[x]) < std::fabs(w[y]);
      });
      for (uint64_t i = 0; i < m.numel; ++i)
        if (i < k) bits[order[i]] = 0;
      for (uint8_t b : bits)
        masked += b == 0;
      total += m.numel;
      st = write(m.bits, bits.data(), m.numel);
      if (st != HR_OK) return st;
    }
    log(HR_LOG_INFO, "step " + std::to_string(step) + ": sparsity " + fmt("%.4f", target) + ", " +
                         std::to_string(masked) + " of " + std::to_string(total) +
                         " block weights masked (no memory saved: unstructured)");
    return HR_OK;
  }

  // After every update: the masked weights to zero.
  hr_status apply_masks() {
    for (const Mask& m : masks_) {
      const hr_tensor t = param(m.layer, m.index);
      std::vector<uint8_t> bits(m.numel);
      hr_status st = read(bits.data(), m.bits, m.numel);
      if (st != HR_OK) return st;
      const uint64_t es = t.dtype == HR_DTYPE_F32 ? 4 : 2;
      std::vector<uint8_t> w(m.numel * es);
      st = read(w.data(), t.data, w.size());
      if (st != HR_OK) return st;
      for (uint64_t i = 0; i < m.numel; ++i)
        if (!bits[i]) std::memset(w.data() + i * es, 0, es);
      st = write(t.data, w.data(), w.size());
      if (st != HR_OK) return st;
    }
    return HR_OK;
  }

  const hr_host_services* s_;
  Settings c_;
  const hr_ext_tensors* tensors_;
  const hr_ext_resize* resize_;
  const hr_ext_precision* precision_;
  // mlp, heads: each block's units when the run began (MLP units, heads; a Llama's KV groups)
  std::vector<int32_t> h0_;
  std::vector<std::vector<double>> taylor_;         // mlp, taylor: per block, per unit
  std::vector<Mask> masks_;                         // unstructured
  std::vector<std::vector<uint8_t>> loaded_masks_;  // from a snapshot, until TRAIN_BEGIN
};

hr_status create(const hr_host_services* s, void** instance) {
  const auto* tensors =
      HR_HAS_FIELD(s, hr_host_services, get_extension) && s->get_extension
          ? static_cast<const hr_ext_tensors*>(s->get_extension(s->host, HR_EXT_TENSORS))
          : nullptr;
  const auto* resize =
      tensors ? static_cast<const hr_ext_resize*>(s->get_extension(s->host, HR_EXT_RESIZE))
              : nullptr;
  const auto* precision =
      tensors ? static_cast<const hr_ext_precision*>(s->get_extension(s->host, HR_EXT_PRECISION))
              : nullptr;
  if (!tensors || !HR_HAS_FIELD(tensors, hr_ext_tensors, write) || !tensors->write || !resize) {
    s->set_error(s->host, "pruning needs " HR_EXT_TENSORS " (with write) and " HR_EXT_RESIZE
                          "; this host has not both");
    return HR_ERROR_UNSUPPORTED;
  }
  Settings c;
  char mode[32] = "mlp", importance[32] = "magnitude";
  const char* modes = "must be \"mlp\", \"heads\" or \"unstructured\"";
  hr_status st = s->config_string(s->host, "mode", mode, sizeof mode);
  if (st == HR_ERROR_INVALID) return s->config_error(s->host, "mode", modes);
  if (st == HR_OK) st = s->config_string(s->host, "importance", importance, sizeof importance);
  if (st == HR_ERROR_INVALID)
    return s->config_error(s->host, "importance", "must be \"magnitude\" or \"taylor\"");
  if (st == HR_OK) st = s->config_float(s->host, "initial_sparsity", &c.initial);
  if (st == HR_OK) st = s->config_float(s->host, "final_sparsity", &c.final_);
  int64_t start = -1, end = -1;
  if (st == HR_OK) st = s->config_int(s->host, "start_step", &start);
  if (st == HR_OK) st = s->config_int(s->host, "end_step", &end);
  if (st == HR_OK) st = s->config_int(s->host, "every", &c.every);
  if (st != HR_OK) return st;

  const std::string m = mode;
  if (m == "mlp") {
    c.mode = Mode::kMlp;
  } else if (m == "unstructured") {
    c.mode = Mode::kUnstructured;
  } else if (m == "heads") {
    c.mode = Mode::kHeads;
  } else {
    return s->config_error(s->host, "mode", (std::string(modes) + "; got \"" + m + "\"").c_str());
  }
  const std::string imp = importance;
  if (imp == "taylor") {
    c.taylor = true;
  } else if (imp != "magnitude") {
    return s->config_error(s->host, "importance",
                           ("must be \"magnitude\" or \"taylor\"; got \"" + imp + "\"").c_str());
  }
  if (c.taylor && c.mode == Mode::kUnstructured)
    return s->config_error(s->host, "importance",
                           "\"taylor\" applies to modes \"mlp\" and \"heads\" only");
  if (!(c.final_ >= 0.0 && c.final_ < 1.0))
    return s->config_error(s->host, "final_sparsity",
                           ("must be in [0, 1); got " + fmt("%g", c.final_)).c_str());
  if (!(c.initial >= 0.0 && c.initial <= c.final_))
    return s->config_error(s->host, "initial_sparsity",
                           ("must be in [0, final_sparsity = " + fmt("%g", c.final_) + "]; got " +
                            fmt("%g", c.initial))
                               .c_str());
  if (start == -1) start = 1;
  if (start < 1)
    return s->config_error(
        s->host, "start_step",
        ("must be >= 1 (a step after whose update pruning starts); got " + std::to_string(start))
            .c_str());
  if (end == -1) end = start;
  if (end < start)
    return s->config_error(
        s->host, "end_step",
        ("must be >= start_step = " + std::to_string(start) + "; got " + std::to_string(end))
            .c_str());
  if (c.every < 1)
    return s->config_error(s->host, "every",
                           ("must be >= 1; got " + std::to_string(c.every)).c_str());
  if ((end - start) % c.every != 0)
    return s->config_error(s->host, "end_step",
                           ("end_step - start_step (" + std::to_string(end - start) +
                            ") must be a multiple of every = " + std::to_string(c.every) +
                            ", so that the last pruning step reaches final_sparsity")
                               .c_str());
  c.start = start;
  c.end = end;
  *instance = new Pruning(s, c, tensors, resize, precision);
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<Pruning*>(instance);
}

hr_status on_event(void* instance, const hr_event_info* info) {
  Pruning* p = static_cast<Pruning*>(instance);
  return headroom_plugin::guarded(p->services(), "pruning", [&] { return p->on_event(info); });
}

hr_status save_state(void* instance, const hr_state_writer* w) {
  Pruning* p = static_cast<Pruning*>(instance);
  return headroom_plugin::guarded(p->services(), "saving its state", [&] { return p->save(w); });
}

hr_status load_state(void* instance, const void* data, uint64_t size) {
  Pruning* p = static_cast<Pruning*>(instance);
  return headroom_plugin::guarded(p->services(), "loading its state",
                                  [&] { return p->load(data, size); });
}

const hr_ext_state kState = {sizeof(hr_ext_state), 0, save_state, load_state};

const void* get_extension(const char* id) {
  if (id && std::strcmp(id, HR_EXT_STATE) == 0) return &kState;
  // The Taylor importance reads the step's final gradients at OPTIMIZER_STEP. STEP_END prunes
  // and masks weights: a resize shrinks the gradients with them, their values unread.
  return headroom_plugin::offer_reads<HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP)>(id);
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "pruning",
    "1.0.0",
    "gradual magnitude pruning on Zhu & Gupta's cubic schedule: MLP units or attention heads "
    "removed (saves memory) "
    "or unstructured masks (saves none)",
    HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP) |
        HR_EVENT_BIT(HR_EVENT_STEP_END),
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
