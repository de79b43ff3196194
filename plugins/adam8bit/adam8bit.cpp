// adam8bit: AdamW with block-wise 8-bit moments (Dettmers et al. 2022, "8-bit Optimizers via
// Block-wise Quantization", as bitsandbytes' Adam8bit / AdamW8bit do it). It takes the optimizer
// role: the host's AdamW keeps 8 bytes of state per parameter (fp32 m and v), this keeps about 2.
//
//   [[plugins]]
//   name = "adam8bit"
//   beta1 = 0.9            # in [0, 1)
//   beta2 = 0.999          # in [0, 1)
//   eps = 1e-8             # > 0
//   weight_decay = 0.01    # >= 0; AdamW's decoupled decay, on tensors with hr_tensor.weight_decay
//   min_8bit_size = 4096   # tensors of fewer elements keep fp32 m and v (bitsandbytes' default)
//   block_size = 256       # fixed: only 256 is accepted (the key exists to say so)
//   seed = 0               # >= 0; the stochastic rounding of bf16 weights (below)
//
// The learning rate is the host's ([train] lr and its schedule, hr_optimizer_step_info.lr).
//
// The update, per element, is torch.optim.AdamW's in f32 (the host's adamw_element):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p - lr ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p)
// with t the host's step. Tensors of at least min_8bit_size elements keep m and v block-wise
// quantized: blocks of 256 consecutive elements (the last one shorter), each moment one byte per
// element (an index into its map) and one fp32 absmax per block; a value is map[q] * absmax. Each
// step dequantizes a block's m and v, updates the weights from the f32 moments, and requantizes
// them with the block's new absmax (nearest map entry of x / absmax, by binary search).
//
// The maps are bitsandbytes' dynamic map (create_dynamic_map, 7 exponent bits): the first moment
// signed, the second unsigned, 256 sorted entries each, 0 and 1 exact. One deviation, so that a
// block's absmax element is exact whatever its sign: the signed map's negative entry nearest zero
// (-5.5e-7) is -1 instead (bitsandbytes' most negative entry is -0.99297). kernels.h draws them.
//
// Layout and memory: at the first step, one allocation (HR_MEM_OPTIMIZER) holds the maps and
// their thresholds (4088 bytes), and one per parameter tensor its state: 8-bit tensors
// [absmax_m | absmax_v] (fp32, ceil(n / 256) each) then [q_m | q_v] (n bytes each), i.e.
// 2n + 8 ceil(n / 256) bytes; smaller tensors [m | v] in fp32, 8n bytes. headroom.estimate/1
// reports exactly that sum (hr_mechanisms.optimizer_bytes).
//
// Parameters: the data in hr_tensor.dtype — f32 (master weights) or bf16 (amp with
// master_weights = false: the weights exist only in bf16; the new weight is computed in f32 and
// stochastically rounded to bf16: the 16 random bits of element i of tensor k at step t are a
// counter-based hash of (seed, t, k, i), plugins/common/bf16.h) — and the gradient in
// hr_tensor.grad_dtype (f32 or bf16, widened to f32; data's dtype on a host whose hr_tensor has no
// grad_dtype). Sharded parameters or gradients (a zero plugin) are not supported: the step fails
// naming the tensor.
//
// Snapshots: save_state writes the version, the last step, the seed, min_8bit_size, each tensor's
// size and kind, the maps and every state buffer (device-to-host through headroom.tensors/1 read,
// 1 MiB a call), and a checksum; load_state checks all of it against this run's model and config
// (HR_ERROR_CONFIG with a message for a damaged or mismatched state) and writes the buffers back
// (headroom.tensors/1 write; memcpy on the CPU backend of a host without it). A resumed run is
// bitwise the uninterrupted one.
//
// Backends: the CPU backend only (its device memory is host memory; the kernels, kernels.h, are
// plain loops). On "cuda", create() fails: the CUDA kernels are not written yet.
//
// Threads: the training thread only (create, the optimizer step, save / load state, estimate);
// the kernels run on it, single-threaded; no locking. Only hr_plugin_entry is exported; no C++
// exception crosses the C ABI.
#include <headroom/ext/estimate.h>
#include <headroom/ext/roles.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>

#include "adam8bit/kernels.h"
#include "common/bf16.h"
#include "common/dry_run.h"
#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "common/offer_reads.h"
#include "common/optimizer_hooks.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using adam8bit::kBlock;
using adam8bit::kMapEntries;

struct Config {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int64_t min_8bit_size = int64_t(adam8bit::kMin8bitSize);
  int64_t seed = 0;
};

// One parameter tensor's state: where its buffer is and what it holds.
struct Tensor {
  int32_t layer = 0, index = 0;
  std::string name;
  uint64_t numel = 0;
  bool q8 = false;
  void* buf = nullptr;
  uint64_t bytes = 0;
};

constexpr uint32_t kMagic = 0x54423841u;  // "A8BT"
constexpr uint32_t kVersion = 1;

struct Header {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  int64_t step = 0;  // the last step updated
  uint64_t seed = 0;
  uint64_t min_8bit_size = 0;
  uint32_t allocated = 0;  // 0: saved before the first step (no buffers follow)
  uint32_t num_tensors = 0;
};

struct TensorHeader {
  uint64_t numel = 0;
  uint32_t q8 = 0;
  uint32_t reserved0 = 0;
  uint64_t bytes = 0;
};

// FNV-1a, 64 bits: the state's checksum.
uint64_t fnv1a(const void* data, uint64_t size, uint64_t h = 0xCBF29CE484222325ull) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (uint64_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 0x100000001B3ull;
  }
  return h;
}

class Adam8bit {
 public:
  Adam8bit(const hr_host_services* s, const Config& c) : s_(s), c_(c) {
    if (HR_HAS_FIELD(s, hr_host_services, get_extension) && s->get_extension)
      tensors_ = static_cast<const hr_ext_tensors*>(s->get_extension(s->host, HR_EXT_TENSORS));
    cpu_ = std::strcmp(s->device_kind(s->host), "cpu") == 0;
    dry_ = headroom_plugin::dry_run(s);
    const std::vector<float> mm = adam8bit::dynamic_map(true), mv = adam8bit::dynamic_map(false);
    const std::vector<float> tm = adam8bit::thresholds(mm), tv = adam8bit::thresholds(mv);
    host_maps_.insert(host_maps_.end(), mm.begin(), mm.end());
    host_maps_.insert(host_maps_.end(), mv.begin(), mv.end());
    host_maps_.insert(host_maps_.end(), tm.begin(), tm.end());
    host_maps_.insert(host_maps_.end(), tv.begin(), tv.end());
    buckets_m_ = adam8bit::buckets(tm.data());
    buckets_v_ = adam8bit::buckets(tv.data());
  }
  ~Adam8bit() {
    for (Tensor& t : tensors)
      if (t.buf) s_->free(s_->host, t.buf);
    if (maps_) s_->free(s_->host, maps_);
  }
  const hr_host_services* services() const { return s_; }
  const Config& config() const { return c_; }

  hr_status step(const hr_optimizer_step_info* info) {
    if (!info || info->struct_size < sizeof(hr_optimizer_step_info)) {
      s_->set_error(s_->host, "adam8bit: malformed hr_optimizer_step_info");
      return HR_ERROR_INVALID;
    }
    hr_status st = allocate();
    if (st != HR_OK) return st;
    if (dry_) return HR_OK;  // plan --measure: the state's bytes, no update (common/dry_run.h)
    const float* maps = static_cast<const float*>(maps_);
    for (size_t k = 0; k < tensors.size(); ++k) {
      Tensor& t = tensors[k];
      adam8bit::ParamRef p;
      uint32_t decay = 0;
      st = param(t, &p, &decay);
      if (st != HR_OK) return st;
      adam8bit::Hyper h = adam8bit::make_hyper(info->lr, c_.beta1, c_.beta2, c_.eps,
                                               decay ? c_.weight_decay : 0.0, info->step);
      h.round_key = headroom_plugin::bf16::stream_key(uint64_t(c_.seed), uint64_t(info->step), k);
      if (t.q8) {
        const uint64_t nb = adam8bit::num_blocks(t.numel);
        adam8bit::State8 q;
        q.absmax_m = static_cast<float*>(t.buf);
        q.absmax_v = q.absmax_m + nb;
        q.qm = reinterpret_cast<uint8_t*>(q.absmax_v + nb);
        q.qv = q.qm + t.numel;
        q.map_m = maps;
        q.map_v = maps + kMapEntries;
        q.buckets_m = &buckets_m_;
        q.buckets_v = &buckets_v_;
        adam8bit::step_8bit(p, q, h);
      } else {
        float* m = static_cast<float*>(t.buf);
        adam8bit::step_f32(p, m, m + t.numel, h);
      }
    }
    step_ = info->step;
    return HR_OK;
  }

  hr_status save(const hr_state_writer* w) {
    Header h;
    h.step = step_;
    h.seed = uint64_t(c_.seed);
    h.min_8bit_size = uint64_t(c_.min_8bit_size);
    h.allocated = maps_ ? 1 : 0;
    h.num_tensors = uint32_t(tensors.size());
    uint64_t sum = fnv1a(&h, sizeof h);
    hr_status st = w->write(w->context, &h, sizeof h);
    if (st != HR_OK || !h.allocated)
      return st == HR_OK ? w->write(w->context, &sum, sizeof sum) : st;
    for (const Tensor& t : tensors) {
      TensorHeader th;
      th.numel = t.numel;
      th.q8 = t.q8 ? 1 : 0;
      th.bytes = t.bytes;
      sum = fnv1a(&th, sizeof th, sum);
      st = w->write(w->context, &th, sizeof th);
      if (st != HR_OK) return st;
    }
    std::vector<unsigned char> chunk;
    const auto copy_out = [&](const void* src, uint64_t bytes) -> hr_status {
      for (uint64_t off = 0; off < bytes;) {
        const uint64_t n = std::min<uint64_t>(HR_READ_MAX_BYTES, bytes - off);
        chunk.resize(n);
        const hr_status r = read(chunk.data(), static_cast<const unsigned char*>(src) + off, n);
        if (r != HR_OK) return r;
        sum = fnv1a(chunk.data(), n, sum);
        const hr_status wr = w->write(w->context, chunk.data(), n);
        if (wr != HR_OK) return wr;
        off += n;
      }
      return HR_OK;
    };
    st = copy_out(maps_, adam8bit::kMapBytes);
    for (size_t k = 0; st == HR_OK && k < tensors.size(); ++k)
      st = copy_out(tensors[k].buf, tensors[k].bytes);
    if (st != HR_OK) return st;
    return w->write(w->context, &sum, sizeof sum);
  }

  hr_status load(const void* data, uint64_t size) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    Header h;
    if (!p || size < sizeof h + sizeof(uint64_t))
      return bad("is " + std::to_string(size) + " bytes, shorter than its header");
    std::memcpy(&h, p, sizeof h);
    if (h.magic != kMagic) return bad("is damaged or not adam8bit's (no adam8bit header)");
    if (h.version != kVersion)
      return bad("has version " + std::to_string(h.version) + "; this adam8bit reads version " +
                 std::to_string(kVersion));
    uint64_t stored = 0;
    std::memcpy(&stored, p + size - sizeof stored, sizeof stored);
    if (fnv1a(p, size - sizeof stored) != stored)
      return bad("is damaged: its checksum does not match its " + std::to_string(size) + " bytes");
    if (h.min_8bit_size != uint64_t(c_.min_8bit_size))
      return bad("was written with min_8bit_size = " + std::to_string(h.min_8bit_size) +
                 "; this config has " + std::to_string(c_.min_8bit_size) +
                 " (the state's layout depends on it)");
    if (h.seed != uint64_t(c_.seed)) {
      s_->log(s_->host, HR_LOG_INFO,
              ("adam8bit: the snapshot's seed " + std::to_string(h.seed) + " continues (config " +
               std::to_string(c_.seed) + ")")
                  .c_str());
      c_.seed = int64_t(h.seed);
    }
    step_ = h.step;
    if (!h.allocated) return size == sizeof h + sizeof stored ? HR_OK : bad("has trailing bytes");
    hr_status st = list_params();
    if (st != HR_OK) return st;
    if (h.num_tensors != tensors.size())
      return bad("holds " + std::to_string(h.num_tensors) + " tensors; this model has " +
                 std::to_string(tensors.size()));
    uint64_t off = sizeof h, need = sizeof h + h.num_tensors * sizeof(TensorHeader) +
                                    adam8bit::kMapBytes + sizeof stored;
    if (size < need) return bad("is truncated (" + std::to_string(size) + " bytes)");
    for (Tensor& t : tensors) {
      TensorHeader th;
      std::memcpy(&th, p + off, sizeof th);
      off += sizeof th;
      if (th.numel != t.numel || th.q8 != (t.q8 ? 1u : 0u) || th.bytes != t.bytes)
        return bad("does not match this model: " + t.name + " has " + std::to_string(t.numel) +
                   " elements, the state " + std::to_string(th.numel));
      need += th.bytes;
    }
    if (size != need)
      return bad("is " + std::to_string(size) + " bytes; its tensors need " + std::to_string(need));
    if (std::memcmp(p + off, host_maps_.data(), adam8bit::kMapBytes) != 0)
      return bad("has other quantization maps than this adam8bit's");
    off += adam8bit::kMapBytes;
    st = allocate();
    if (st != HR_OK) return st;
    for (Tensor& t : tensors) {
      st = upload(t.buf, p + off, t.bytes);
      if (st != HR_OK) return st;
      off += t.bytes;
    }
    return HR_OK;
  }

  std::vector<Tensor> tensors;

  // Pruning shrank a parameter (headroom/ext/resize.h): its moments keep the kept elements. They
  // are dequantized, gathered and quantized again block by block at the new size (each block's
  // absmax is its new elements', so a kept value may move by its quantization step: the 8-bit
  // state is approximate to begin with); fp32 moments are copied exactly.
  hr_status resize(const hr_resize_info* info) {
    if (!info || info->struct_size < sizeof(hr_resize_info) || !info->keep) {
      s_->set_error(s_->host, "adam8bit: malformed hr_resize_info");
      return HR_ERROR_INVALID;
    }
    if (!maps_) return HR_OK;  // no step yet: allocated at the new sizes
    Tensor* t = nullptr;
    for (Tensor& k : tensors)
      if (k.layer == info->layer && k.index == info->index) t = &k;
    if (!t) {
      s_->set_error(s_->host, "adam8bit: no state for the resized parameter");
      return HR_ERROR_INVALID;
    }
    std::vector<unsigned char> old(t->bytes);
    for (uint64_t off = 0; off < old.size(); off += HR_READ_MAX_BYTES) {
      const uint64_t n = std::min<uint64_t>(HR_READ_MAX_BYTES, old.size() - off);
      const hr_status r =
          read(old.data() + off, static_cast<const unsigned char*>(t->buf) + off, n);
      if (r != HR_OK) return r;
    }
    const float* map_m = host_maps_.data();
    const float* map_v = map_m + kMapEntries;
    // The moments in f32.
    std::vector<float> m(t->numel), v(t->numel);
    if (t->q8) {
      const uint64_t nb = adam8bit::num_blocks(t->numel);
      const float* am = reinterpret_cast<const float*>(old.data());
      const float* av = am + nb;
      const uint8_t* qm = old.data() + 8 * nb;
      const uint8_t* qv = qm + t->numel;
      for (uint64_t b = 0; b < nb; ++b) {
        const uint64_t lo = b * adam8bit::kBlock,
                       n = std::min<uint64_t>(adam8bit::kBlock, t->numel - lo);
        adam8bit::dequantize_block(map_m, qm + lo, am[b], n, m.data() + lo);
        adam8bit::dequantize_block(map_v, qv + lo, av[b], n, v.data() + lo);
      }
    } else {
      std::memcpy(m.data(), old.data(), t->numel * sizeof(float));
      std::memcpy(v.data(), old.data() + t->numel * sizeof(float), t->numel * sizeof(float));
    }
    // The kept elements.
    const uint64_t K = info->num_keep;
    const uint64_t cols = info->ndim == 2 ? uint64_t(info->old_shape[1]) : 1;
    const uint64_t rows = info->ndim == 2 ? uint64_t(info->old_shape[0]) : t->numel;
    std::vector<uint64_t> from;
    if (info->ndim == 1 || info->axis == 0) {
      for (uint64_t i = 0; i < K; ++i)
        for (uint64_t j = 0; j < cols; ++j)
          from.push_back(uint64_t(info->keep[i]) * cols + j);
    } else {
      for (uint64_t r = 0; r < rows; ++r)
        for (uint64_t j = 0; j < K; ++j)
          from.push_back(r * cols + info->keep[j]);
    }
    Tensor next = *t;
    next.numel = from.size();
    next.q8 = next.numel >= uint64_t(c_.min_8bit_size);
    next.bytes = adam8bit::state_bytes(next.numel, uint64_t(c_.min_8bit_size));
    std::vector<float> m2(next.numel), v2(next.numel);
    for (uint64_t i = 0; i < next.numel; ++i) {
      m2[i] = m[from[i]];
      v2[i] = v[from[i]];
    }
    std::vector<unsigned char> now(next.bytes);
    if (next.q8) {
      const uint64_t nb = adam8bit::num_blocks(next.numel);
      float* am = reinterpret_cast<float*>(now.data());
      float* av = am + nb;
      uint8_t* qm = now.data() + 8 * nb;
      uint8_t* qv = qm + next.numel;
      for (uint64_t b = 0; b < nb; ++b) {
        const uint64_t lo = b * adam8bit::kBlock,
                       n = std::min<uint64_t>(adam8bit::kBlock, next.numel - lo);
        am[b] = adam8bit::quantize_block(map_m, buckets_m_, m2.data() + lo, n, qm + lo);
        av[b] = adam8bit::quantize_block(map_v, buckets_v_, v2.data() + lo, n, qv + lo);
      }
    } else {
      std::memcpy(now.data(), m2.data(), next.numel * sizeof(float));
      std::memcpy(now.data() + next.numel * sizeof(float), v2.data(), next.numel * sizeof(float));
    }
    s_->free(s_->host, t->buf);
    t->buf = nullptr;
    next.buf = s_->alloc(s_->host, next.bytes, HR_MEM_OPTIMIZER, ("adam8bit " + next.name).c_str());
    if (!next.buf) return no_memory(next.name, next.bytes);
    *t = next;
    return upload(t->buf, now.data(), now.size());
  }

 private:
  hr_status bad(const std::string& what) {
    s_->set_error(s_->host, ("adam8bit: the snapshot's optimizer state " + what).c_str());
    return HR_ERROR_CONFIG;
  }

  hr_status read(void* dst, const void* src, uint64_t bytes) {
    if (tensors_ && tensors_->read) return tensors_->read(s_->host, dst, src, bytes);
    if (cpu_) {
      std::memcpy(dst, src, bytes);
      return HR_OK;
    }
    s_->set_error(s_->host, "adam8bit: this host offers no " HR_EXT_TENSORS " read()");
    return HR_ERROR_UNSUPPORTED;
  }

  hr_status upload(void* dst, const void* src, uint64_t bytes) {
    if (tensors_ && HR_HAS_FIELD(tensors_, hr_ext_tensors, write) && tensors_->write)
      return tensors_->write(s_->host, dst, src, bytes);
    if (cpu_) {
      std::memcpy(dst, src, bytes);
      return HR_OK;
    }
    s_->set_error(s_->host, "adam8bit: this host offers no " HR_EXT_TENSORS " write()");
    return HR_ERROR_UNSUPPORTED;
  }

  hr_status param(const Tensor& t, adam8bit::ParamRef* p, uint32_t* decay) {
    hr_tensor x;
    std::memset(&x, 0, sizeof x);
    x.struct_size = sizeof x;
    const hr_status st = s_->layer_param(s_->host, t.layer, t.index, &x);
    if (st != HR_OK) return st;
    if (!x.data || !x.grad) {
      s_->set_error(s_->host, ("adam8bit: " + std::string(x.name ? x.name : "a parameter") +
                               " has no whole " + (x.data ? "gradient" : "weights") +
                               " on this rank: sharded model state (zero) is not supported")
                                  .c_str());
      return HR_ERROR_UNSUPPORTED;
    }
    p->data = x.data;
    p->dtype = x.dtype;
    p->grad = x.grad;
    p->grad_dtype = HR_HAS_FIELD(&x, hr_tensor, grad_dtype) ? x.grad_dtype : x.dtype;
    p->numel = x.numel;
    if (!adam8bit::supported(p->dtype) || !adam8bit::supported(p->grad_dtype)) {
      s_->set_error(s_->host, ("adam8bit: " + t.name + " has weights of dtype " +
                               std::to_string(p->dtype) + " and gradients of dtype " +
                               std::to_string(p->grad_dtype) + "; it updates f32 or bf16 ones")
                                  .c_str());
      return HR_ERROR_UNSUPPORTED;
    }
    if (x.numel != t.numel) {
      s_->set_error(s_->host, ("adam8bit: " + t.name + " changed size").c_str());
      return HR_ERROR_INVALID;
    }
    *decay = x.weight_decay;
    return HR_OK;
  }

  // The model's parameter tensors, layer by layer, as layer_param lists them.
  hr_status list_params() {
    if (!tensors.empty()) return HR_OK;
    const int32_t layers = s_->num_layers(s_->host);
    for (int32_t l = 0; l < layers; ++l) {
      const int32_t n = s_->layer_num_params(s_->host, l);
      for (int32_t i = 0; i < n; ++i) {
        hr_tensor x;
        std::memset(&x, 0, sizeof x);
        x.struct_size = sizeof x;
        const hr_status st = s_->layer_param(s_->host, l, i, &x);
        if (st != HR_OK) return st;
        if (x.frozen) continue;  // never updated: no state
        Tensor t;
        t.layer = l;
        t.index = i;
        t.name = x.name ? x.name : "?";
        t.numel = x.numel;
        t.q8 = x.numel >= uint64_t(c_.min_8bit_size);
        t.bytes = adam8bit::state_bytes(x.numel, uint64_t(c_.min_8bit_size));
        tensors.push_back(t);
      }
    }
    return HR_OK;
  }

  // The maps and every tensor's state, zeroed (m = v = 0: the codes of 0, absmax 0).
  hr_status allocate() {
    if (maps_) return HR_OK;
    hr_status st = list_params();
    if (st != HR_OK) return st;
    maps_ = s_->alloc(s_->host, adam8bit::kMapBytes, HR_MEM_OPTIMIZER, "adam8bit maps");
    if (!maps_) return no_memory("the quantization maps", adam8bit::kMapBytes);
    st = upload(maps_, host_maps_.data(), adam8bit::kMapBytes);
    if (st != HR_OK) return st;
    const uint8_t zero_m = adam8bit::zero_code(host_maps_.data());
    const uint8_t zero_v = adam8bit::zero_code(host_maps_.data() + kMapEntries);
    std::vector<unsigned char> init;
    for (Tensor& t : tensors) {
      t.buf = s_->alloc(s_->host, t.bytes, HR_MEM_OPTIMIZER, ("adam8bit " + t.name).c_str());
      if (!t.buf) return no_memory(t.name, t.bytes);
      if (dry_) continue;       // values nothing reads
      init.assign(t.bytes, 0);  // fp32 zeros, absmax 0
      if (t.q8) {
        const uint64_t codes = 8 * adam8bit::num_blocks(t.numel);
        std::memset(init.data() + codes, zero_m, t.numel);
        std::memset(init.data() + codes + t.numel, zero_v, t.numel);
      }
      st = upload(t.buf, init.data(), t.bytes);
      if (st != HR_OK) return st;
    }
    return HR_OK;
  }

  hr_status no_memory(const std::string& what, uint64_t bytes) {
    s_->set_error(s_->host, ("adam8bit: no device memory for the state of " + what + " (" +
                             std::to_string(bytes) + " bytes)")
                                .c_str());
    return HR_ERROR_OUT_OF_MEMORY;
  }

  const hr_host_services* s_;
  Config c_;
  const hr_ext_tensors* tensors_ = nullptr;
  bool cpu_ = true;
  bool dry_ = false;              // a dry run (plan --measure): allocate, never compute
  std::vector<float> host_maps_;  // map_m, map_v, thresholds_m, thresholds_v: kMapBytes
  // quantize()'s buckets of each map (host memory, the plugin's own: 256 KiB each, not device
  // state).
  adam8bit::Buckets buckets_m_, buckets_v_;
  void* maps_ = nullptr;
  int64_t step_ = 0;
};

hr_status create(const hr_host_services* s, void** instance) {
  Config c;
  hr_status st = s->config_float(s->host, "beta1", &c.beta1);
  if (st == HR_OK) st = s->config_float(s->host, "beta2", &c.beta2);
  if (st == HR_OK) st = s->config_float(s->host, "eps", &c.eps);
  if (st == HR_OK) st = s->config_float(s->host, "weight_decay", &c.weight_decay);
  if (st == HR_OK) st = s->config_int(s->host, "min_8bit_size", &c.min_8bit_size);
  if (st == HR_OK) st = s->config_int(s->host, "seed", &c.seed);
  int64_t block_size = int64_t(kBlock);
  if (st == HR_OK) st = s->config_int(s->host, "block_size", &block_size);
  if (st != HR_OK) return st;
  if (!(c.beta1 >= 0 && c.beta1 < 1))
    return s->config_error(s->host, "beta1", "must be in [0, 1) (default 0.9)");
  if (!(c.beta2 >= 0 && c.beta2 < 1))
    return s->config_error(s->host, "beta2", "must be in [0, 1) (default 0.999)");
  if (!(c.eps > 0) || !std::isfinite(c.eps))
    return s->config_error(s->host, "eps", "must be a finite number > 0 (default 1e-8)");
  if (!(c.weight_decay >= 0) || !std::isfinite(c.weight_decay))
    return s->config_error(s->host, "weight_decay", "must be a finite number >= 0 (default 0.01)");
  if (c.min_8bit_size < 0 || c.min_8bit_size > (int64_t(1) << 40))
    return s->config_error(s->host, "min_8bit_size",
                           "must be an element count in [0, 2^40] (default 4096; tensors of "
                           "fewer elements keep fp32 moments)");
  if (c.seed < 0) return s->config_error(s->host, "seed", "must be an integer >= 0 (default 0)");
  if (block_size != int64_t(kBlock))
    return s->config_error(
        s->host, "block_size",
        ("must be 256, the only block size adam8bit has; got " + std::to_string(block_size))
            .c_str());
  const char* kind = s->device_kind(s->host);
  if (std::strcmp(kind, "cpu") != 0) {
    s->set_error(s->host,
                 ("adam8bit runs on the CPU backend only: its kernels for \"" + std::string(kind) +
                  "\" are not written yet (use [device] kind = \"cpu\", or the built-in "
                  "AdamW)")
                     .c_str());
    return HR_ERROR_UNSUPPORTED;
  }
  *instance = new Adam8bit(s, c);
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

using Hooks = headroom_plugin::OptimizerHooks<Adam8bit>;

// headroom.estimate/1: the optimizer state's bytes from the model's parameter tensors (the
// layout above), then core's closed form for the peak. Configured: its min_8bit_size; proposed:
// the defaults. Needs the host's parameter list (hr_estimate_model.param_tensors) and
// hr_mechanisms.optimizer_bytes; without them, or with sharded state, nothing to offer.
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!q || !r || !r->after || !q->peak || !q->model) return HR_ERROR_INVALID;
  const hr_estimate_model* m = q->model;
  if (!HR_HAS_FIELD(m, hr_estimate_model, param_tensors) || !m->param_tensors ||
      m->num_param_tensors <= 0 || !HR_HAS_FIELD(r->after, hr_mechanisms, optimizer_bytes))
    return HR_ERROR_UNSUPPORTED;
  if (HR_HAS_FIELD(r->after, hr_mechanisms, shard) && r->after->shard != 0)
    return HR_ERROR_UNSUPPORTED;
  if (m->device_kind && std::strcmp(m->device_kind, "cpu") != 0) return HR_ERROR_UNSUPPORTED;
  const uint64_t min8 =
      instance ? uint64_t(static_cast<const Adam8bit*>(instance)->config().min_8bit_size)
               : adam8bit::kMin8bitSize;
  uint64_t bytes = adam8bit::kMapBytes;
  for (int32_t i = 0; i < m->num_param_tensors; ++i)
    bytes += adam8bit::state_bytes(m->param_tensors[i].numel, min8);
  r->after->optimizer_bytes = bytes;
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  // Step time over the built-in AdamW, CPU backend, gpt2-124m: 2.83 (docs/results/
  // model-state.md, section 1: its scalar quantize / dequantize loop, one thread, over 124M
  // elements costs ~9.5 s a step). Not measured on a GPU (it has no CUDA kernels).
  r->step_time_factor = 2.83;
  std::snprintf(r->what, sizeof r->what,
                "8-bit AdamW: block-wise quantized moments, about 2 bytes of state per parameter");
  std::snprintf(r->toml, sizeof r->toml, "min_8bit_size = %llu", (unsigned long long)min8);
  return HR_OK;
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "adam8bit",
    "1.0.0",
    "AdamW with block-wise 8-bit moments (bitsandbytes' dynamic map, blocks of 256): about 2 "
    "bytes of optimizer state per parameter instead of 8",
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
    // It subscribes to no event: its optimizer role's step reads the gradients.
    headroom_plugin::offer_all<headroom_plugin::offer_estimate<estimate>,
                               headroom_plugin::offer_reads<0>>,
};

}  // namespace

// hr_negotiate refuses another major version; the host's message names both versions.
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
