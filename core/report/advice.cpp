#include "core/report/advice.h"

#include "core/shard/sharding.h"

#include <toml++/toml.h>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

#include "core/comm/comm.h"
#include "core/model/model.h"
#include "core/optim/state_layout.h"
#include "headroom/ext/offload.h"
#include "headroom/ext/shard.h"

namespace headroom {

namespace {

uint64_t& at(ByCategory& b, Category c) {
  return b[static_cast<int>(c)];
}

bool fits(uint64_t bytes, uint64_t limit) {
  return !limit || bytes <= limit;
}

// The HR_SHARD_* bits (headroom/ext/shard.h). HR_SHARD_PARAMETERS is zero3's, 4 by its
// header; until that header has it, the value stands here.
constexpr uint32_t kShardOpt = HR_SHARD_OPTIMIZER, kShardGrads = HR_SHARD_GRADIENTS;
#ifdef HR_SHARD_PARAMETERS
constexpr uint32_t kShardParams = HR_SHARD_PARAMETERS;
#else
constexpr uint32_t kShardParams = 4;
#endif
static_assert(kShardParams == 4, "hr_mechanisms.shard's HR_SHARD_PARAMETERS");

// hr_mechanisms over a Mechanisms' own drop array.
struct CMechanisms {
  explicit CMechanisms(const Mechanisms& m) : drop(m.drop), lora(m.lora) {
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.compute_dtype = static_cast<uint32_t>(m.compute);
    c.micro_batch = m.micro_batch;
    c.grad_accum = m.grad_accum;
    c.num_layers = int32_t(drop.size());
    c.drop = drop.data();
    c.world_size = m.world_size;
    c.shard = m.shard;
    c.grad_reduce = m.grad_reduce;
    c.prefetch_layers = m.prefetch_layers;
    c.param_persistence_threshold = m.param_persistence_threshold;
    c.grad_dtype = m.grad_in_compute ? uint32_t(m.compute) : uint32_t(HR_DTYPE_F32);
    c.master_weights = m.masters ? 1 : 0;
    c.state_dtype = uint32_t(m.state);
    c.optimizer_bytes = m.optimizer_bytes;
    c.plugin_bytes = m.plugin_bytes;
    c.optimizer_place = m.optimizer_on_nvme   ? HR_PLACE_NVME
                        : m.optimizer_on_host ? HR_PLACE_HOST
                                              : HR_PLACE_DEVICE;
    c.activation_place = m.activations_on_host ? HR_PLACE_HOST : HR_PLACE_DEVICE;
    c.parameter_place = m.parameters_on_nvme   ? HR_PLACE_NVME
                        : m.parameters_on_host ? HR_PLACE_HOST
                                               : HR_PLACE_DEVICE;
    for (const LoraSpec& l : lora) {
      hr_lora_spec spec;
      std::memset(&spec, 0, sizeof spec);
      spec.struct_size = sizeof spec;
      spec.rank = uint32_t(l.rank);
      spec.target = l.target.c_str();
      spec.alpha = l.alpha;
      spec.dropout = l.dropout;
      specs.push_back(spec);
    }
    c.num_adapters = uint32_t(specs.size());
    c.adapters = specs.empty() ? nullptr : specs.data();
    c.base_dtype = quant_kind_name(m.base);
    c.base_double_quant = m.double_quant ? 1 : 0;
  }
  CMechanisms(const CMechanisms&) = delete;
  CMechanisms& operator=(const CMechanisms&) = delete;
  hr_mechanisms c;
  std::vector<uint8_t> drop;
  std::vector<LoraSpec> lora;  // what specs point into
  std::vector<hr_lora_spec> specs;
};

// What a plugin handed back, checked: the dtypes core computes in, a layer count it was given, a
// ZeRO stage core has (the optimizer state, + the gradients, + the parameters). The fields its
// struct_size does not cover keep `fallback`'s values (a plugin built before they were appended).
bool from_c(const hr_mechanisms& c, const ModelConfig& model, const Mechanisms& fallback,
            Mechanisms* out) {
  const size_t num_layers = size_t(std::max(0, model.n_layer)) + 2;
  if (c.compute_dtype != HR_DTYPE_F32 && c.compute_dtype != HR_DTYPE_BF16 &&
      c.compute_dtype != HR_DTYPE_F16)
    return false;
  if (!c.drop || c.num_layers < 0 || size_t(c.num_layers) != num_layers || c.micro_batch < 1 ||
      c.grad_accum < 1)
    return false;
  for (int32_t l = 0; l < c.num_layers; ++l)
    if (c.drop[l] != HR_KEEP_ACTIVATIONS && c.drop[l] != HR_DROP_ALL && c.drop[l] != HR_DROP_CHEAP)
      return false;
  Mechanisms m = fallback;
  m.compute = static_cast<Dtype>(c.compute_dtype);
  m.micro_batch = c.micro_batch;
  m.grad_accum = c.grad_accum;
  m.drop.assign(c.drop, c.drop + c.num_layers);
  if (HR_HAS_FIELD(&c, hr_mechanisms, world_size)) m.world_size = c.world_size;
  if (HR_HAS_FIELD(&c, hr_mechanisms, shard)) m.shard = c.shard;
  if (HR_HAS_FIELD(&c, hr_mechanisms, grad_reduce)) m.grad_reduce = c.grad_reduce;
  if (HR_HAS_FIELD(&c, hr_mechanisms, prefetch_layers)) m.prefetch_layers = c.prefetch_layers;
  if (HR_HAS_FIELD(&c, hr_mechanisms, param_persistence_threshold))
    m.param_persistence_threshold = c.param_persistence_threshold;
  if (HR_HAS_FIELD(&c, hr_mechanisms, optimizer_bytes)) {
    if (c.grad_dtype != HR_DTYPE_F32 && c.grad_dtype != c.compute_dtype) return false;
    if (c.master_weights > 1 || (c.state_dtype != HR_DTYPE_F32 && c.state_dtype != HR_DTYPE_BF16))
      return false;
    m.grad_in_compute = c.grad_dtype != HR_DTYPE_F32;
    m.masters = c.master_weights != 0;
    m.state = static_cast<Dtype>(c.state_dtype);
    m.optimizer_bytes = c.optimizer_bytes;
    Precision p(m.compute);
    p.grad_in_compute = m.grad_in_compute;
    p.masters = m.masters;
    p.state = m.state;
    if (!precision_problem(p).empty()) return false;
  }
  if (HR_HAS_FIELD(&c, hr_mechanisms, plugin_bytes)) m.plugin_bytes = c.plugin_bytes;
  if (HR_HAS_FIELD(&c, hr_mechanisms, optimizer_place)) {
    if (c.optimizer_place != HR_PLACE_DEVICE && c.optimizer_place != HR_PLACE_HOST &&
        c.optimizer_place != HR_PLACE_NVME)
      return false;
    m.optimizer_on_host = c.optimizer_place != HR_PLACE_DEVICE;
    m.optimizer_on_nvme = c.optimizer_place == HR_PLACE_NVME;
    if (c.activation_place != HR_PLACE_DEVICE && c.activation_place != HR_PLACE_HOST) return false;
    m.activations_on_host = c.activation_place == HR_PLACE_HOST;
    if (c.parameter_place != HR_PLACE_DEVICE && c.parameter_place != HR_PLACE_HOST &&
        c.parameter_place != HR_PLACE_NVME)
      return false;
    m.parameters_on_host = c.parameter_place != HR_PLACE_DEVICE;
    m.parameters_on_nvme = c.parameter_place == HR_PLACE_NVME;
  }
  if (HR_HAS_FIELD(&c, hr_mechanisms, base_dtype)) {
    // Adapters core would refuse to add (a target that names no module, a rank below 1) or a
    // base dtype it has no format for make the result unusable.
    if (c.num_adapters > 0 && !c.adapters) return false;
    std::vector<LoraSpec> lora;
    try {
      for (uint32_t i = 0; i < c.num_adapters; ++i) {
        // Each entry is struct_size apart: a newer plugin's longer struct is stepped over whole.
        const auto* a = reinterpret_cast<const hr_lora_spec*>(
            reinterpret_cast<const char*>(c.adapters) + uint64_t(i) * c.adapters->struct_size);
        if (!HR_HAS_FIELD(a, hr_lora_spec, key) || !a->target) return false;
        LoraSpec spec;
        spec.target = a->target;
        spec.rank = int(std::min<uint32_t>(a->rank, 1u << 20));
        spec.alpha = a->alpha;
        if (HR_HAS_FIELD(a, hr_lora_spec, dropout)) spec.dropout = a->dropout;
        check_lora(model, spec);
        lora.push_back(std::move(spec));
      }
      m.base = parse_base_dtype(c.base_dtype ? c.base_dtype : "");
    } catch (const std::invalid_argument&) {
      return false;
    }
    if (c.base_double_quant > 1 || (m.base != QuantKind::kNone && lora.empty()) ||
        (c.base_double_quant && m.base != QuantKind::kInt8 && m.base != QuantKind::kNF4))
      return false;
    m.lora = std::move(lora);
    m.double_quant = c.base_double_quant != 0;
  }
  const uint32_t stages[] = {0, kShardOpt, kShardOpt | kShardGrads,
                             kShardOpt | kShardGrads | kShardParams};
  if (m.world_size < 1 || m.world_size > (1 << 20) ||
      std::find(std::begin(stages), std::end(stages), m.shard) == std::end(stages) ||
      (m.grad_reduce & ~(HR_GRAD_REDUCE_AFTER_BACKWARD | HR_GRAD_REDUCE_LAST_MICRO_STEP)) ||
      m.prefetch_layers < 0)
    return false;
  *out = std::move(m);
  return true;
}

// The parameters the optimizer updates, layer by layer in the model's order (Layer::params): the
// ones [train] freeze leaves, or with adapters (m.lora) the adapters alone — each "<module>.
// lora_A.weight" (r, in) and "lora_B.weight" (rows, r), at the end of its layer's
// (gpt_lora_adapters, as the model adds them).
std::vector<ParamShape> trainable_param_shapes(const Config& config, const Mechanisms& m) {
  const std::vector<ParamShape> all = gpt_param_shapes(config.model);
  std::vector<ParamShape> out;
  const int layers = config.model.n_layer + 2;
  std::vector<std::vector<ParamShape>> adapters(size_t(std::max(0, layers)));
  for (const LoraAdapter& a : gpt_lora_adapters(config.model, m.lora)) {
    const AdapterSite& site = a.site;
    auto& at = adapters.at(size_t(site.layer));
    at.push_back({site.layer, site.module + ".lora_A.weight", {a.rank, site.in}, true});
    at.push_back({site.layer, site.module + ".lora_B.weight", {site.rows, a.rank}, true});
  }
  for (int l = 0; l < layers; ++l) {
    if (m.lora.empty())
      for (const ParamShape& p : all)
        if (p.layer == l && !is_frozen(config.train.freeze, p.name)) out.push_back(p);
    for (ParamShape& p : adapters[size_t(l)])
      out.push_back(std::move(p));
  }
  return out;
}

// query->peak's context: the config's shapes, and the mechanisms the query started from (for a
// plugin's struct that lacks the appended fields).
struct PeakContext {
  const Config* config;
  Mechanisms before;
};

// query->peak: the closed form for the config's shapes.
hr_status peak_of(void* context, const hr_mechanisms* m, uint64_t* out) {
  const PeakContext& ctx = *static_cast<const PeakContext*>(context);
  const Config& config = *ctx.config;
  Mechanisms mm;
  if (!m || !out || !from_c(*m, config.model, ctx.before, &mm)) return HR_ERROR_INVALID;
  const PeakEstimate e = estimate_peak(config, mm);
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
    out[i] = e.at_peak[i];
  return HR_OK;
}

// One plugin's estimate with the mechanisms `before` (which give `baseline`): its instance from
// the config, or nullptr for its proposal.
PluginEstimate ask(const Config& config, const OfferedExtension& ext, void* instance,
                   const Mechanisms& before, const PeakEstimate& baseline, const OomNumbers& oom) {
  PluginEstimate pe;
  pe.plugin = ext.plugin;
  pe.after = before;
  pe.peak = baseline;
  const auto* table = static_cast<const hr_ext_estimate*>(ext.table);
  if (!table || !HR_HAS_FIELD(table, hr_ext_estimate, estimate) || !table->estimate) return pe;
  pe.offered = true;

  hr_estimate_model model;
  std::memset(&model, 0, sizeof model);
  model.struct_size = sizeof model;
  model.n_layer = config.model.n_layer;
  model.n_head = config.model.n_head;
  model.n_embd = config.model.n_embd;
  model.seq_len = config.model.seq_len;
  model.vocab_size = config.model.vocab_size;
  model.num_params = gpt_num_params(config.model);
  model.memory_limit = config.device.memory_limit;
  model.device_kind = config.device.kind.c_str();
  // Every parameter tensor the optimizer updates, for an estimate that depends on shapes (an
  // optimizer's state): frozen ones have none.
  const std::vector<ParamShape> shapes = trainable_param_shapes(config, before);
  std::vector<hr_estimate_param> tensors(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    hr_estimate_param& t = tensors[i];
    std::memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    t.layer = shapes[i].layer;
    t.name = shapes[i].name.c_str();
    t.ndim = int32_t(shapes[i].shape.size());
    t.weight_decay = shapes[i].decay ? 1 : 0;
    t.numel = 1;
    for (size_t d = 0; d < shapes[i].shape.size(); ++d) {
      t.shape[d] = shapes[i].shape[d];
      t.numel *= uint64_t(shapes[i].shape[d]);
    }
  }
  model.num_param_tensors = int32_t(tensors.size());
  model.param_tensors = tensors.data();
  model.init_from = config.train.init_from.c_str();

  const CMechanisms in(before);
  CMechanisms out(before);
  hr_estimate_query q;
  std::memset(&q, 0, sizeof q);
  q.struct_size = sizeof q;
  q.model = &model;
  q.before = &in.c;
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
    q.baseline[i] = baseline.at_peak[i];
  PeakContext context{&config, before};
  q.context = &context;
  q.peak = peak_of;
  q.oom_requested = oom.requested;
  q.oom_free_bytes = oom.free_bytes;
  q.oom_largest_free = oom.largest_free;

  hr_estimate_result r;
  std::memset(&r, 0, sizeof r);
  r.struct_size = sizeof r;
  r.after = &out.c;
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
    r.bytes[i] = baseline.at_peak[i];
  r.step_time_factor = 1;
  pe.status = table->estimate(instance, &q, &r);
  if (pe.status != HR_OK) return pe;
  // A result core cannot use (a drop array it did not hand out, a dtype it has no kernels for, a
  // factor that is no factor) counts as an error of the plugin.
  Mechanisms after;
  if (r.after != &out.c || out.c.drop != out.drop.data() ||
      !from_c(out.c, config.model, before, &after) || !(r.step_time_factor > 0)) {
    pe.status = HR_ERROR_INVALID;
    return pe;
  }
  pe.after = std::move(after);
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
    pe.peak.at_peak[i] = r.bytes[i];
  // The plugin category is not among ABI 1.0's seven: what the plugins say they hold.
  pe.peak.at_peak[int(Category::kPlugin)] = pe.after.plugin_bytes;
  // The host ledger is core's closed form of what the mechanisms put there.
  pe.peak.host = estimate_peak(config, pe.after).host;
  pe.makes_usable = r.makes_usable;
  pe.step_time_factor = r.step_time_factor;
  pe.what.assign(r.what, strnlen(r.what, sizeof r.what));
  pe.toml.assign(r.toml, strnlen(r.toml, sizeof r.toml));
  while (!pe.toml.empty() && (pe.toml.back() == '\n' || pe.toml.back() == ' '))
    pe.toml.pop_back();
  return pe;
}

std::string plugin_table(const PluginEstimate& pe) {
  return "[[plugins]]\nname = \"" + pe.plugin + "\"" + (pe.toml.empty() ? "" : "\n" + pe.toml);
}

Remedy remedy_from(const PeakEstimate& now, const PeakEstimate& after, uint64_t limit) {
  Remedy r;
  for (int i = 0; i < kNumCategories; ++i) {
    r.saves[i] = now.at_peak[i] > after.at_peak[i] ? now.at_peak[i] - after.at_peak[i] : 0;
    r.costs[i] = after.at_peak[i] > now.at_peak[i] ? after.at_peak[i] - now.at_peak[i] : 0;
  }
  r.peak_after = after.total();
  r.fits = fits(r.peak_after, limit);
  return r;
}

// A TOML value as `--set key=VALUE` takes it, pasted into a shell: a plain word as itself (the
// config reads a bare word as a string), a string that is not one as a TOML string in single
// quotes, anything else as TOML.
std::string set_value(const toml::node& value) {
  if (const auto* s = value.as_string()) {
    const std::string& v = s->get();
    const bool word = !v.empty() && std::all_of(v.begin(), v.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
    });
    bool reads_as_other = false;  // "true", "12": TOML that is not a string
    try {
      reads_as_other = !toml::parse("v = " + v)["v"].is_string();
    } catch (const toml::parse_error&) {
    }
    if (word && !reads_as_other) return v;
    std::string quoted = "'\"";
    for (char c : v) {
      if (c == '"' || c == '\\') quoted += '\\';
      if (c == '\'') {
        quoted += "'\\''";  // close the shell's quotes, an escaped ', reopen them
        continue;
      }
      quoted += c;
    }
    return quoted + "\"'";
  }
  std::ostringstream text;
  text << toml::table{{"v", value}};
  std::string t = text.str();  // "v = ..."
  t = t.substr(t.find('=') + 2);
  while (!t.empty() && t.back() == '\n')
    t.pop_back();
  return t;
}

std::string factor_str(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "x%.2f", f);
  return buf;
}

// What a block's backward GEMMs hold besides the block's own buffers (core/model/model.cpp,
// Layer::linear_backward), with LoRA adapters or a quantized base: a quantized weight's
// dequantized (OC, C) transient around its GEMM; then each adapter on it in turn: A x and d(A x)
// (N, r), the scaled B and dB (OC, r), and with dropout the dropped input and its gradient
// (N, C). Per layer, the most any one call holds; the trainable (adapter) and quantized elements
// and bytes.
struct LinearCalls {
  std::vector<uint64_t> forward;         // the most one forward GEMM call holds, per layer
  std::vector<uint64_t> backward;        // the most one GEMM call holds, per layer
  std::vector<uint64_t> adapter_numel;   // the adapters' A and B elements, per layer
  std::vector<uint64_t> adapter_params;  // each adapter's A's and B's elements
  std::vector<uint64_t> quantized_numel, quantized_bytes;
};

LinearCalls linear_calls(const ModelConfig& m, const Mechanisms& s) {
  const size_t layers = size_t(std::max(0, m.n_layer)) + 2;
  LinearCalls c;
  c.forward.assign(layers, 0);
  c.backward.assign(layers, 0);
  c.adapter_numel.assign(layers, 0);
  c.quantized_numel.assign(layers, 0);
  c.quantized_bytes.assign(layers, 0);
  if (s.lora.empty()) return c;
  const uint64_t es = dtype_size(s.compute), N = uint64_t(s.micro_batch) * uint64_t(m.seq_len);
  std::map<std::string, uint64_t> out_rows;  // each weight's rows: its GEMM's OC
  for (const ParamShape& p : gpt_param_shapes(m))
    if (p.shape.size() == 2) out_rows[p.name] = uint64_t(p.shape[0]);
  struct Weight {
    int layer = 0;
    uint64_t in = 0, oc = 0, fwd = 0, bwd = 0;
  };
  std::map<std::string, Weight> weights;
  for (const LoraAdapter& a : gpt_lora_adapters(m, s.lora)) {
    Weight& w = weights[a.site.weight];
    w.layer = a.site.layer;
    w.in = uint64_t(a.site.in);
    w.oc = out_rows[a.site.weight];
    const uint64_t r = uint64_t(a.rank);
    c.adapter_numel[size_t(a.site.layer)] += r * w.in + uint64_t(a.site.rows) * r;
    c.adapter_params.push_back(r * w.in);
    c.adapter_params.push_back(uint64_t(a.site.rows) * r);
    const uint64_t x = a.dropout > 0 ? es * N * w.in : 0;  // the dropped input
    w.bwd = std::max(w.bwd, 2 * x + 2 * es * (N * r + w.oc * r));
    // Forward: the dropped input and A x (N, r); then A x, the scaled B and B A x (N, OC).
    w.fwd = std::max(w.fwd, std::max(x + es * N * r, es * (N * r + w.oc * r + N * w.oc)));
  }
  // Quantized: every site's weight (bitsandbytes' every nn.Linear but the LM head), adapted or not.
  if (s.base != QuantKind::kNone)
    for (const AdapterSite& site : gpt_adapter_sites(m)) {
      Weight& w = weights[site.weight];
      if (w.oc == 0) {
        w.layer = site.layer;
        w.in = uint64_t(site.in);
        w.oc = out_rows[site.weight];
      }
    }
  for (const auto& [name, w] : weights) {
    const size_t l = size_t(w.layer);
    uint64_t dequantized = 0;
    if (s.base != QuantKind::kNone) {
      const uint64_t n = w.oc * w.in;
      c.quantized_numel[l] += n;
      c.quantized_bytes[l] += quant_tensor_bytes(s.base, n, s.double_quant);
      dequantized = es * n;
    }
    c.forward[l] = std::max(c.forward[l], std::max(dequantized, w.fwd));
    c.backward[l] = std::max(c.backward[l], std::max(dequantized, w.bwd));
  }
  return c;
}

}  // namespace

uint64_t PeakEstimate::host_total() const {
  uint64_t t = 0;
  for (uint64_t b : host)
    t += b;
  return t;
}

uint64_t PeakEstimate::total() const {
  uint64_t t = 0;
  for (uint64_t b : at_peak)
    t += b;
  return t;
}

Mechanisms mechanisms_of(const Config& config, int world_size) {
  Mechanisms m;
  m.micro_batch = config.train.micro_batch;
  m.grad_accum = config.train.grad_accum;
  m.drop.assign(size_t(std::max(0, config.model.n_layer)) + 2, HR_KEEP_ACTIVATIONS);
  m.world_size = world_size > 0 ? world_size : rank_info().world_size;
  return m;
}

PeakEstimate estimate_peak(const Config& config, int micro_batch) {
  Mechanisms m = mechanisms_of(config);
  m.micro_batch = micro_batch;
  return estimate_peak(config, m);
}

PeakEstimate estimate_peak(const Config& config, const Mechanisms& s) {
  const RankInfo& ri = rank_info();
  return estimate_peak(config, s, s.world_size == ri.world_size ? ri.rank : 0);
}

// One rank's peak. Its moments are the backward of each layer, from the head down to the
// embedding (a forward holds less: fewer activations, no full gradients, no more layers gathered
// than the backward after it, and a block's forward one (B, T, max(Hd, C)) transient, less than
// the scratch of its backward); the first of the highest is the tracker's peak, so each moment's
// bytes by category are what it records there.
PeakEstimate estimate_peak(const Config& config, const Mechanisms& s, int rank) {
  const ModelConfig& m = config.model;
  // What the host shards of what the plugin asked (on one rank, less: the trainer's rule).
  const uint32_t shard_what = effective_partition(s.shard, s.world_size, s.parameters_on_host);
  const uint64_t B = uint64_t(s.micro_batch), T = uint64_t(m.seq_len), C = uint64_t(m.n_embd);
  const uint64_t V = uint64_t(m.vocab_size), L = uint64_t(std::max(0, m.n_layer)), N = B * T;
  // es: the compute dtype's element size (activations, compute copies); statistics and masters
  // are fp32.
  const uint64_t es = dtype_size(s.compute), kF32 = 4;
  const bool copies = s.compute != Dtype::kF32;
  const uint64_t per_param = kF32 + (copies ? es : 0);  // a master and its compute copy
  // At rest, whole (model.h Precision): the weights (f32 masters and compute copies, or the
  // compute dtype alone) and the step's gradients (f32, or in the compute dtype). Accumulating
  // in f32 with compute copies, a layer's compute-dtype gradients live only through its
  // backward (and layer 0's, the tied wte, from the head's on).
  // The built-in optimizer on the host with amp's masters holds them there (ZeRO-Offload's
  // layout, core/run/host_optimizer.h): the device keeps the compute copies alone.
  // Sharded, the masters are the rank's range of the optimizer state on the device
  // (core/shard/sharding.h), and the host optimizer keeps an f32 copy of that range as of any
  // weights it updates.
  const bool host_masters = s.optimizer_on_host &&
                            s.optimizer_bytes == Mechanisms::kBuiltinOptimizer && copies &&
                            s.masters && (shard_what & kShardOpt) == 0;
  const uint64_t weights_el = copies ? (s.masters && !host_masters ? kF32 : 0) + es : kF32;
  const uint64_t grads_el = copies && s.grad_in_compute ? es : kF32;
  const bool micro_grads = copies && !s.grad_in_compute;

  // The layers' parameter elements (model.cpp): the embedding (wte, wpe), the blocks (each at
  // its MLP width: a pruned model's differ), the head (ln_f; its LM head is the tied wte).
  // Sharded, each layer's flat buffers are padded to a multiple of the W ranks, and rank r owns
  // [r·S, (r+1)·S) of them, S = padded / W.
  const size_t H = size_t(L) + 1;  // the head's index
  std::vector<uint64_t> numel(H + 1, 0);
  // A Llama's embedding has no wpe, its head an RMSNorm (C) and, untied, its lm_head (V, C).
  numel[0] = V * C + (m.llama() ? 0 : T * C);
  for (size_t l = 1; l < H; ++l)
    numel[l] = gpt_block_params(m, int(l) - 1);
  numel[H] = m.llama() ? C + (m.tied() ? 0 : V * C) : 2 * C;
  // Frozen parameters ([train] freeze) are out of the layers' flat buffers: their weights alone
  // (f32, or with compute copies the compute dtype alone), no gradients, no optimizer state.
  std::vector<uint64_t> frozen(H + 1, 0);
  if (!config.train.freeze.empty())
    for (const ParamShape& p : gpt_param_shapes(m)) {
      if (!is_frozen(config.train.freeze, p.name)) continue;
      uint64_t n = 1;
      for (int64_t d : p.shape)
        n *= uint64_t(d);
      frozen[size_t(p.layer)] += n;
      numel[size_t(p.layer)] -= n;
    }
  // LoRA (s.lora): the adapters are their layers' trainable parameters and every other one is
  // frozen; a quantized base stores the frozen block weights as their quant_tensor_bytes.
  const LinearCalls calls = linear_calls(m, s);
  if (!s.lora.empty()) {
    for (size_t l = 0; l <= H; ++l) {
      frozen[l] = frozen[l] + numel[l] - calls.quantized_numel[l];  // the layer's base, whole
      numel[l] = calls.adapter_numel[l];
    }
  }
  const uint64_t W = uint64_t(std::max(1, s.world_size)), r = uint64_t(std::max(0, rank));
  const bool sh_opt = (shard_what & kShardOpt) != 0;
  const bool sh_grad = sh_opt && (shard_what & kShardGrads);
  const bool sh_param = sh_grad && (shard_what & kShardParams);
  std::vector<uint64_t> padded(H + 1), shard(H + 1), mine(H + 1), frozen_bytes(H + 1);
  std::vector<bool> gathers(H + 1, false);  // zero3: sharded, gathered around its use
  uint64_t params_rest = 0, grads_rest = 0, mine_total = 0;
  // Offloaded parameters (core/shard/sharding.h): a sharded layer's parameter, frozen and gradient
  // shards rest in the host ledger instead, with one staging buffer of the largest gradient shard;
  // the host optimizer updates those shards in place, keeping copies only of the whole layers'
  // ranges (host_mine of mine_total).
  const bool offloaded = sh_param && s.parameters_on_host;
  // Their NVMe tier (core/shard/shard_file.h): the compute, frozen and quantized shards in the
  // file instead, and the file's staging (the largest layer's slot) in the host ledger.
  const bool in_file = offloaded && s.parameters_on_nvme;
  uint64_t host_params_rest = 0, host_grads_rest = 0, staging = 0, host_mine = 0;
  uint64_t file_staging = 0;
  const uint64_t frozen_el = copies ? es : kF32;  // frozen weights: in the compute dtype alone
  for (size_t l = 0; l <= H; ++l) {
    const uint64_t n = numel[l];
    padded[l] = sh_opt ? (n + W - 1) / W * W : n;
    shard[l] = padded[l] / W;
    // The rank's real elements (the padding is nobody's parameter): what the optimizer updates.
    mine[l] = sh_opt ? std::min(n, (r + 1) * shard[l]) - std::min(n, r * shard[l]) : n;
    mine_total += mine[l];
    // The frozen weights and a quantized base's bytes, padded like the flat buffers when sharded
    // (the bytes in 4-byte words: Layer::allocate_params).
    const uint64_t word = 4 * W;
    const uint64_t frozen_w = frozen_el * (sh_opt ? (frozen[l] + W - 1) / W * W : frozen[l]);
    const uint64_t quant_b = sh_opt && W > 1 ? (calls.quantized_bytes[l] + word - 1) / word * word
                                             : calls.quantized_bytes[l];
    frozen_bytes[l] = frozen_w + quant_b;
    // The threshold counts every parameter of the layer, the frozen ones too (Sharding::place).
    const uint64_t all = n + frozen[l] + calls.quantized_numel[l];
    gathers[l] = sh_param && all >= s.param_persistence_threshold && all > 0;
    // At rest: the masters and compute copies, whole or (zero3) the rank's shard of each; with
    // compute copies and anything sharded the fp32 masters are optimizer state, the rank's range
    // of them only (core/shard/sharding.h). The gradients whole (fp32 and the compute dtype's) or
    // the rank's fp32 gradient shard. The frozen storage whole, or (zero3) the rank's range of it.
    const uint64_t p_rest = gathers[l]         ? per_param * shard[l]
                            : copies && sh_opt ? es * padded[l] + kF32 * shard[l]
                                               : weights_el * padded[l];
    const uint64_t g_rest = sh_grad ? kF32 * shard[l] : grads_el * padded[l];
    const uint64_t z_rest = gathers[l] ? frozen_bytes[l] / W : frozen_bytes[l];
    if (in_file && gathers[l]) {
      // The master shard stays; the slot's parts are the compute, frozen and quantized shards.
      const uint64_t compute = copies ? es * shard[l] : 0;
      host_params_rest += p_rest - compute;
      file_staging =
          std::max(file_staging, shard_file_staging_bytes({compute, frozen_w / W, quant_b / W}));
      host_grads_rest += g_rest;
      staging = std::max(staging, kF32 * shard[l]);
    } else if (offloaded && gathers[l]) {
      host_params_rest += p_rest + z_rest;
      host_grads_rest += g_rest;
      staging = std::max(staging, kF32 * shard[l]);
    } else {
      params_rest += p_rest + z_rest;
      grads_rest += g_rest;
      host_mine += mine[l];
    }
  }
  uint64_t trainable = 0;
  for (uint64_t n : numel)
    trainable += n;

  PeakEstimate base;
  const TrainConfig& t = config.train;
  const uint64_t states = t.optimizer == "adamw" ? 2 : (t.momentum > 0 ? 1 : 0);
  const uint64_t state_bytes = s.optimizer_bytes != Mechanisms::kBuiltinOptimizer
                                   ? s.optimizer_bytes
                                   : dtype_size(s.state) * states * mine_total;
  if (s.optimizer_on_host && s.optimizer_bytes == Mechanisms::kBuiltinOptimizer) {
    // The built-in optimizer on the host place (core/run/host_optimizer.h): the device holds
    // none of its state; the host holds the state, an f32 copy of what it updates (the masters,
    // or the weights) and a copy of every gradient, whole (nothing is sharded with it).
    at(base.host, Category::kOptimizer) = state_bytes;
    if (s.optimizer_on_nvme) {
      // The NVMe tier: the state is in its file; the host holds its two staging buffers, of
      // the largest trainable parameter's (a piece's) state.
      std::vector<uint64_t> numels = calls.adapter_params;
      if (s.lora.empty())
        for (const ParamShape& p : gpt_param_shapes(m)) {
          if (is_frozen(config.train.freeze, p.name)) continue;
          uint64_t n = 1;
          for (int64_t d : p.shape)
            n *= uint64_t(d);
          numels.push_back(n);
        }
      // In pieces where nothing rounds stochastically (f32 state and weights: not amp without
      // masters), else whole parameters (core/run/host_optimizer.h streams_in_pieces).
      const bool pieces = s.state == Dtype::kF32 && !(copies && !s.masters);
      at(base.host, Category::kOptimizer) =
          state_file_host_bytes(numels, int(states), s.state, pieces);
    }
    // The f32 copy of what it updates; with the masters on the host, the masters and the
    // compute-dtype copy each update uploads.
    at(base.host, Category::kParameters) = (host_masters           ? kF32 + es
                                            : copies && !s.masters ? es
                                                                   : kF32) *
                                           host_mine;
    at(base.host, Category::kGradients) = grads_el * host_mine;
    at(base.host, Category::kParameters) += host_params_rest + file_staging;
    at(base.host, Category::kGradients) += host_grads_rest + staging;
  } else {
    at(base.at_peak, Category::kOptimizer) = state_bytes;
  }
  at(base.at_peak, Category::kData) = 2 * sizeof(int32_t) * N;  // inputs and targets
  // The plugins' own memory, held the whole run (hr_mechanisms.plugin_bytes).
  at(base.at_peak, Category::kPlugin) = s.plugin_bytes;
  // Data parallelism (more than one rank, nothing sharded: the sharding plugin reduces the
  // gradients itself): the gradient buckets partition the parameters, one fp32 copy of every
  // gradient, allocated once (core/run/trainer.cpp, build_buckets).
  if (W > 1 && !sh_opt) at(base.at_peak, Category::kCommunication) = kF32 * trainable;

  // What the layers save in forward (model.cpp): the embedding's output, each block's tensors,
  // the head's ln_f, its statistics and the per-token losses, and with [model] loss = "full"
  // the (B, T, V) logits (the chunked loss keeps none: backward computes them again).
  // Block l's (layer l's) at its MLP width.
  std::vector<uint64_t> full(H + 1, 0), cheap(H + 1, 0), block_ws(H + 1, 0);
  for (size_t l = 1; l < H; ++l) {
    full[l] = gpt_block_activation_bytes(m, s.micro_batch, m.seq_len, s.compute, int(l) - 1);
    cheap[l] = gpt_block_cheap_activation_bytes(m, s.micro_batch, m.seq_len, s.compute, int(l) - 1);
  }
  const uint64_t out = es * N * C;  // a block's output; the embedding's
  const uint64_t head = gpt_head_activation_bytes(m, s.micro_batch, m.seq_len, s.compute);
  // Backward holds two (B, T, C) gradient buffers throughout, and each layer its own scratch:
  // the head dln_f (B, T, C) and, chunked, one chunk's logits (chunk, V); a block of MLP width
  // Hd (4C unpruned) dgelu (B, T, max(Hd, 3C): it holds dqkv later), dfc (B, T, max(Hd, C): it
  // holds GELU's and ln_1's outputs computed again), two (B, T, C) and, with the naive attention,
  // its scratch — (T, T) on the CPU, (NH, T, T) on CUDA (Backend::attention_scratch_numel; the
  // tiled attention needs none); the embedding none.
  // A block with fewer heads (a pruned model's: attention width Ad = its heads · C / NH) holds
  // dqkv (B, T, 3·Ad) in dgelu's buffer and its own heads' attention scratch.
  const uint64_t dres = 2 * es * N * C;
  const uint64_t head_ws = dres + gpt_head_workspace_bytes(m, s.micro_batch, m.seq_len, s.compute);
  const bool tiled = m.attention != "naive";
  // A Llama block (model.h gpt_block_workspace_bytes): d(gate|up) (B, T, max(2I, C + 2KV)),
  // dswiglu (B, T, max(I, C)), two (B, T, C).
  for (size_t l = 1; l < H; ++l) {
    const uint64_t heads = uint64_t(m.heads(int(l) - 1));
    const uint64_t scratch =
        tiled ? 0 : attention_scratch_numel(config.device.kind, s.micro_batch, int(T), int(heads));
    block_ws[l] =
        dres + gpt_block_workspace_bytes(m, s.micro_batch, int(T), s.compute, int(l) - 1, scratch);
  }
  // Between its forward and its backward a block that drops everything (HR_DROP_ALL) holds only
  // its output; one that drops its cheap tensors (HR_DROP_CHEAP, selective) all but those; a kept
  // one its full activations. In its own backward a block holds them all (recomputed when
  // dropped), but for a selective drop its output: Layer::recompute frees that before it makes the
  // cheap tensors again (backward does not read it).
  auto drop_of = [&](size_t l) { return l < s.drop.size() ? s.drop[l] : HR_KEEP_ACTIVATIONS; };
  auto held = [&](size_t l) {
    return drop_of(l) == HR_DROP_ALL     ? out
           : drop_of(l) == HR_DROP_CHEAP ? full[l] - cheap[l]
                                         : full[l];
  };
  auto in_backward = [&](size_t l) {
    return drop_of(l) == HR_DROP_CHEAP ? full[l] - out : full[l];
  };

  // Sharded gradients (zero2, zero3): a layer's full gradients (fp32 and the compute dtype's)
  // exist from just before its backward until its reduction is finished. Layer 0's are made
  // before the head's backward (the head adds into the tied wte). Reduced at each BACKWARD_END,
  // the reduction started before is finished (freed) first: layer l's backward holds layers 0, l
  // and l + 1's. Reduced after the backward: layers 0 and l .. H. Only in the last micro-step
  // (grad_accum > 1): every layer's from the second micro-step on.
  // zero3 without prefetching gathers layer l only after l + 1's reduction started, and waiting
  // for the gather finishes what was started before it: l + 1's are freed by then.
  // With the optimizer on the host, the tied embedding's (fp32 and compute-dtype) wait in host
  // memory from the end of the head's backward to the start of the embedding's
  // (Gpt::set_gradient_park): the blocks' backward holds none of them.
  // With amp's f32 accumulation (micro_grads) the head writes the embedding's compute-dtype
  // gradients, and its f32 ones are made in its own backward (or, reduced in the last micro-step
  // only, kept from the first micro-step on).
  const bool park = sh_grad && s.optimizer_on_host && m.tied() && H >= 2;
  auto parked = [&](size_t l) { return park && l >= 1 && l < H; };
  auto full_grads = [&](size_t l) {
    uint64_t b = 0;
    const bool above_done = sh_param && s.prefetch_layers == 0 && gathers[l];
    for (size_t k = 0; k <= H; ++k) {
      const bool live =
          (k == 0 && (l == 0 || !micro_grads)) || k == l ||
          ((s.grad_reduce & HR_GRAD_REDUCE_LAST_MICRO_STEP) && s.grad_accum > 1) ||
          ((s.grad_reduce & HR_GRAD_REDUCE_AFTER_BACKWARD) ? k > l : k == l + 1 && !above_done);
      if (live && !(k == 0 && parked(l)))
        b += kF32 * padded[k];  // the compute-dtype ones are micro_grads'
    }
    return b;
  };
  // The compute-dtype gradients of one micro-step (micro_grads) in layer l's backward: its own
  // and the embedding's (the head adds into the tied wte).
  auto micro = [&](size_t l) {
    return micro_grads ? es * (padded[l] + (l > 0 && !parked(l) ? padded[0] : 0)) : 0;
  };
  // Sharded parameters (zero3, prefetch p; plugins/zero/zero.cpp's window): a layer is gathered
  // whole — its fp32 values, or with compute copies only its compute copy, and its frozen
  // storage — while it or one of the next p computations reads it. The computations in order:
  // the forward of layers 0 .. H, then the backward of H .. 0; the head reads the tied wte, so
  // the embedding too (an untied head, a Llama's lm_head, reads its own). Layer l's backward so
  // holds layers max(l - p, 0) .. l gathered, and the tied embedding when the head's backward is
  // among them; block l's forward layers l .. l + p, and past the head the backward's.
  const bool tied = m.tied();
  auto gathered_at = [&](size_t position) {  // 0 .. H forward, H + 1 .. 2H + 1 backward
    std::vector<bool> read(H + 1, false);
    for (size_t q = position; q <= position + size_t(s.prefetch_layers) && q <= 2 * H + 1; ++q) {
      const size_t l = q <= H ? q : 2 * H + 1 - q;
      read[l] = true;
      if (l == H && tied) read[0] = true;
    }
    uint64_t b = 0;
    for (size_t k = 0; k <= H; ++k)
      if (gathers[k] && read[k]) b += (copies ? es : kF32) * padded[k] + frozen_bytes[k];
    return b;
  };
  auto gathered = [&](size_t l) { return gathered_at(2 * H + 1 - l); };  // in l's backward

  // The moments in the order they happen: the tracker's peak is the first of the highest.
  PeakEstimate e;
  uint64_t best = 0;
  auto moment = [&](uint64_t act, uint64_t ws, uint64_t params, uint64_t grads) {
    PeakEstimate at_l = base;
    at(at_l.at_peak, Category::kActivations) = act;
    at(at_l.at_peak, Category::kWorkspace) = ws;
    at(at_l.at_peak, Category::kParameters) = params;
    at(at_l.at_peak, Category::kGradients) = grads;
    if (at_l.total() > best) {
      best = at_l.total();
      e = at_l;
    }
  };
  // A block's forward (and a dropped block's recomputation) holds no more than its backward
  // with the same layers gathered: every activation it saves, as its backward, but one (B, T,
  // max(Hd, C)) transient instead of the backward's scratch, which is larger by more than what a
  // forward GEMM call holds beyond a backward one (its B A x (N, OC), OC <= Hd or 2I for a
  // Llama's gate|up). With sharded parameters the forward's window is another: the embedding's
  // forward holds the next p layers, block l's l .. l + p — the head's last blocks' (a large
  // frozen LM head or embedding gathered while a block computes). Those moments come first, in
  // their order: the embedding holds its output, block l the held bytes of the blocks below, its
  // own saved ones and the transient beside its largest GEMM call; the head's forward holds no
  // more than its backward, with the same layers gathered. Full gradients are there in a forward
  // only from the second micro-step on when they are reduced in the last one.
  uint64_t below = 0;  // the held bytes of the blocks below layer l
  // Activation offload (s.activations_on_host, Gpt::set_activation_place): of the outputs of
  // layers 0 .. l - 1, which `out + below` count, the device holds in layer l's forward only its
  // input, l - 1's (the others moved to the host as each next forward ended), and in its
  // backward l - 1's and l - 2's (back one layer ahead). The host holds the rest; at most, once
  // the forward is done, every output but the head's input: layers 0 .. H - 2.
  auto on_host_fwd = [&](size_t l) { return s.activations_on_host ? (l - 1) * out : 0; };
  auto on_host_bwd = [&](size_t l) { return s.activations_on_host && l > 2 ? (l - 2) * out : 0; };
  if (s.activations_on_host) at(base.host, Category::kActivations) = (H - 1) * out;
  if (sh_param) {
    uint64_t fwd_grads = grads_rest;
    if ((s.grad_reduce & HR_GRAD_REDUCE_LAST_MICRO_STEP) && s.grad_accum > 1)
      for (size_t k = 0; k <= H; ++k)
        fwd_grads += kF32 * padded[k];
    moment(out, 0, params_rest + gathered_at(0), fwd_grads);
    for (size_t l = 1; l < H; ++l) {
      const uint64_t transient = es * N * std::max<uint64_t>(uint64_t(m.mlp_width(int(l) - 1)), C);
      moment(out + below - on_host_fwd(l) + full[l], transient + calls.forward[l],
             params_rest + gathered_at(l), fwd_grads);
      below += held(l);
    }
  } else {
    for (size_t l = 1; l < H; ++l)
      below += held(l);
  }
  for (size_t l = H + 1; l-- > 0;) {
    if (l >= 1 && l < H) below -= held(l);  // now the blocks below l
    const uint64_t params = params_rest + (sh_param ? gathered(l) : 0);
    const uint64_t grads = grads_rest + (sh_grad ? full_grads(l) : 0) + micro(l);
    if (l == H) {  // every block's held bytes, the head's own
      moment(out + below - on_host_bwd(l) + head, head_ws, params, grads);
    } else if (l >= 1) {  // the blocks below, its own full activations
      moment(out + below - on_host_bwd(l) + in_backward(l), block_ws[l] + calls.backward[l], params,
             grads);
    } else {  // the embedding holds its output
      moment(out, dres, params, grads);
    }
  }
  // The host ledger: what it holds the whole run (base.host, with every offloaded activation:
  // the forward's end), and when the embedding's gradient is parked, the moment it arrives, the
  // head's backward done: the outputs of layers 0 .. H - 3 still on the host. The first of the
  // highest is its peak.
  if (park) {
    PeakEstimate at_park = base;
    at(at_park.host, Category::kActivations) = s.activations_on_host ? (H - 2) * out : 0;
    const bool f32_there =
        !micro_grads || ((s.grad_reduce & HR_GRAD_REDUCE_LAST_MICRO_STEP) && s.grad_accum > 1);
    at(at_park.host, Category::kGradients) +=
        ((f32_there ? kF32 : 0) + (micro_grads ? es : 0)) * padded[0];
    if (at_park.host_total() > base.host_total()) e.host = at_park.host;
  }
  return e;
}

static ConfigEstimate estimate_chain(const Config& config, CreatedPlugins& created,
                                     const Mechanisms& start, const OomNumbers& oom);

ConfigEstimate estimate_config(const Config& config, const OomNumbers& oom, int world_size) {
  ConfigEstimate ce;
  ce.mechanisms = mechanisms_of(config, world_size);
  ce.peak = estimate_peak(config, ce.mechanisms);
  if (config.plugins.empty()) return ce;
  CreatedPlugins created(config);
  ce = estimate_chain(config, created, ce.mechanisms, oom);
  // The adapters a plugin adds are the run's whatever its place in the TOML: a plugin before it
  // (an optimizer's state over the trainable parameters) is asked again knowing them.
  if (!ce.mechanisms.lora.empty()) {
    Mechanisms with = mechanisms_of(config, world_size);
    with.lora = ce.mechanisms.lora;
    with.base = ce.mechanisms.base;
    with.double_quant = ce.mechanisms.double_quant;
    ce = estimate_chain(config, created, with, oom);
  }
  // What the trainer refuses of the plugins' choices together (core/run/trainer.cpp): amp's
  // layouts other than its default across ranks or sharded; the parameter shards in host memory
  // without a plugin that shards the parameters; their NVMe tier with nothing for the file.
  const Mechanisms& m = ce.mechanisms;
  if ((m.grad_in_compute || !m.masters) &&
      (m.world_size > 1 || effective_partition(m.shard, m.world_size, m.parameters_on_host)))
    throw ConfigError(config.file + ": amp's " +
                      (m.masters ? "grad_dtype = \"bf16\"" : "master_weights = false") +
                      " runs on one rank without a zero plugin so far");
  if (m.parameters_on_host && !(effective_partition(m.shard, m.world_size, true) & kShardParams))
    throw ConfigError(config.file +
                      ": the offload plugin puts the parameter shards in host memory, but no "
                      "plugin shards the parameters: list zero3 in [[plugins]]");
  if (m.parameters_on_nvme && m.compute == Dtype::kF32 && config.train.freeze.empty() &&
      m.lora.empty())
    throw ConfigError(config.file +
                      ": the offload plugin puts the parameter shards in files, but the layers "
                      "read fp32 parameters, the optimizer's masters: nothing would go to the "
                      "file; turn amp on, or use parameters = \"host\"");
  return ce;
}

// The config's plugins' estimates chained in TOML order from `start`.
static ConfigEstimate estimate_chain(const Config& config, CreatedPlugins& created,
                                     const Mechanisms& start, const OomNumbers& oom) {
  ConfigEstimate ce;
  ce.mechanisms = start;
  ce.peak = estimate_peak(config, ce.mechanisms);
  ce.roles = created.host().roles();
  const std::vector<OfferedExtension> offered = created.host().offered(HR_EXT_ESTIMATE);
  size_t k = 0;  // offered is in TOML order, the plugins that offer one
  for (const PluginEntry& entry : config.plugins) {
    PluginEstimate pe;
    if (k < offered.size() && offered[k].plugin == entry.name) {
      pe = ask(config, offered[k], offered[k].instance, ce.mechanisms, ce.peak, oom);
      ++k;
    } else {
      pe.plugin = entry.name;
      pe.after = ce.mechanisms;
      pe.peak = ce.peak;
    }
    if (pe.ok()) {
      ce.mechanisms = pe.after;
      ce.peak = pe.peak;
      ce.step_time_factor *= pe.step_time_factor;
    }
    ce.plugins.push_back(std::move(pe));
  }
  return ce;
}

Advice advise(const Config& config, const std::vector<OfferedExtension>& installed,
              const OomNumbers& oom) {
  Advice a;
  a.config = estimate_config(config, oom);
  a.file = config.file;
  a.world_size = mechanisms_of(config).world_size;
  a.limit = config.device.memory_limit;
  const uint64_t now_total = a.config.peak.total();
  a.fits = fits(now_total, a.limit);
  // `plan` of a config that fits needs nothing; an out-of-memory failure of one the estimate says
  // fits still asks the plugins (an allocator may explain it).
  if (a.fits && !oom.requested) return a;
  auto file = [&](Remedy r) { (r.fits ? a.remedies : a.not_enough).push_back(std::move(r)); };

  // Each installed plugin the config does not list, as it proposes itself.
  auto listed = [&](const std::string& name) {
    return std::any_of(config.plugins.begin(), config.plugins.end(),
                       [&](const PluginEntry& p) { return p.name == name; });
  };
  std::vector<const OfferedExtension*> helping;  // its proposal lowers the peak
  std::vector<uint64_t> helping_peak;
  bool one_fits = false;
  for (const OfferedExtension& ext : installed) {
    if (listed(ext.plugin)) continue;
    if (ext.roles & a.config.roles) continue;  // a role one of the config's plugins already takes
    const PluginEstimate pe = ask(config, ext, nullptr, a.config.mechanisms, a.config.peak, oom);
    if (!pe.ok()) continue;
    Remedy r = remedy_from(a.config.peak, pe.peak, a.limit);
    r.what = pe.plugin + ": " + pe.what;
    r.toml = plugin_table(pe);
    r.plugins = {pe.plugin};
    r.unstranded = pe.makes_usable;
    r.step_time_factor = pe.step_time_factor;
    if (pe.after.world_size != a.world_size) r.ranks = pe.after.world_size;
    if (r.peak_after < now_total) {
      helping.push_back(&ext);
      helping_peak.push_back(r.peak_after);
    }
    // A proposal that runs the step at another micro-batch (dynamic_batch's) can also be written
    // into the config: the same split as --set flags, estimated without the plugin. The plugin's
    // policy chose it; core only spells it.
    Remedy split;
    const int b = pe.after.micro_batch, accum = pe.after.grad_accum;
    const bool splits = b != config.train.micro_batch && b >= 1 &&
                        b * accum == config.train.micro_batch * config.train.grad_accum &&
                        pe.after.world_size == a.world_size && pe.after.shard == 0;
    if (splits) {
      Config smaller = config;
      smaller.train.micro_batch = b;
      smaller.train.grad_accum = accum;
      split = remedy_from(a.config.peak, estimate_config(smaller, oom).peak, a.limit);
      split.what = "micro_batch " + std::to_string(b) + " x grad_accum " + std::to_string(accum) +
                   " (the same " + std::to_string(b * accum) + " sequences per step, as " +
                   pe.plugin + " would run it)";
      split.sets = {"train.micro_batch=" + std::to_string(b),
                    "train.grad_accum=" + std::to_string(accum)};
      split.step_time_factor = pe.step_time_factor;
    }
    if (r.peak_after < now_total || r.unstranded) {
      one_fits = one_fits || r.fits;
      file(std::move(r));
    }
    if (splits && split.peak_after < now_total) {
      one_fits = one_fits || split.fits;
      file(std::move(split));
    }
  }

  // Each listed plugin that would propose another table of its own (checkpoint's policy sqrt ->
  // every): its proposal on top of the config without it, merged into the table it has, as
  // --set flags; when the merged table is refused (a key of the old setting the new one rejects),
  // its proposal alone, to put in place of the listed table.
  for (size_t i = 0; i < config.plugins.size(); ++i) {
    const PluginEntry& entry = config.plugins[i];
    const auto ext =
        std::find_if(installed.begin(), installed.end(),
                     [&](const OfferedExtension& e) { return e.plugin == entry.name; });
    if (ext == installed.end()) continue;
    Config without = config;
    without.plugins.erase(without.plugins.begin() + long(i));
    toml::table proposal, merged;
    std::string proposal_text;  // as the plugin wrote it
    int ranks = a.world_size;   // the ranks it proposes (a zero plugin: more)
    try {
      const ConfigEstimate base = estimate_config(without, oom);
      const PluginEstimate pe = ask(config, *ext, nullptr, base.mechanisms, base.peak, oom);
      if (!pe.ok()) continue;
      proposal_text = pe.toml;
      ranks = pe.after.world_size;
      proposal = toml::parse(pe.toml);
      merged = toml::parse(entry.toml);
    } catch (const std::exception&) {
      continue;  // the plugin's proposal is not a table it could read: no remedy from it
    }
    const toml::table had = merged;
    for (auto&& [key, value] : proposal)
      merged.insert_or_assign(key, value);
    // It proposes what it already has, on the ranks it has.
    if (merged == had && ranks == a.world_size) continue;
    Config variant = config;
    ConfigEstimate e;
    bool as_flags = true;
    auto estimate_with = [&](const toml::table& t) {
      std::ostringstream text;
      text << t;
      variant.plugins[i].toml = text.str();
      e = estimate_config(variant, oom, ranks);
    };
    try {
      estimate_with(merged);
    } catch (const ConfigError&) {
      as_flags = false;
      try {
        estimate_with(proposal);
      } catch (const ConfigError&) {
        continue;
      }
    }
    if (e.peak.total() >= now_total) continue;
    Remedy r = remedy_from(a.config.peak, e.peak, a.limit);
    r.plugins = {entry.name};
    r.step_time_factor = e.step_time_factor / a.config.step_time_factor;
    if (ranks != a.world_size) r.ranks = ranks;
    for (const PluginEstimate& pe : e.plugins)
      if (pe.plugin == entry.name) r.what = entry.name + ": " + pe.what;
    for (const PluginEstimate& pe : a.config.plugins)
      if (pe.plugin == entry.name && pe.ok()) r.what += " (now: " + pe.what + ")";
    if (as_flags) {
      for (auto&& [key, value] : proposal)
        r.sets.push_back("plugins." + entry.name + "." + std::string(key.str()) + "=" +
                         set_value(value));
    } else {
      r.toml = "[[plugins]]\nname = \"" + entry.name + "\"" +
               (entry.path.empty() ? "" : "\npath = \"" + entry.path + "\"") +
               (proposal_text.empty() ? "" : "\n" + proposal_text);
      r.replaces = entry.pos.str();
    }
    file(std::move(r));
  }

  // None fits alone: the ones that lower the peak, the largest saving first, each proposing
  // itself on top of the ones before, until the estimate fits.
  if (!one_fits && helping.size() >= 2) {
    std::vector<size_t> order(helping.size());
    for (size_t i = 0; i < order.size(); ++i)
      order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return helping_peak[x] < helping_peak[y]; });
    Mechanisms m = a.config.mechanisms;
    PeakEstimate peak = a.config.peak;
    Remedy combined;
    std::vector<std::string> whats, tables;
    double factor = 1;
    uint32_t roles = a.config.roles;  // two plugins of one role (zero2, zero3) cannot be combined
    for (size_t i : order) {
      if (helping[i]->roles & roles) continue;
      const PluginEstimate pe = ask(config, *helping[i], nullptr, m, peak, oom);
      if (!pe.ok() || pe.peak.total() >= peak.total()) continue;
      roles |= helping[i]->roles;
      m = pe.after;
      peak = pe.peak;
      factor *= pe.step_time_factor;
      combined.plugins.push_back(pe.plugin);
      whats.push_back(pe.plugin + " (" + pe.what + ")");
      tables.push_back(plugin_table(pe));
      if (combined.plugins.size() >= 2 && fits(peak.total(), a.limit)) break;
    }
    if (combined.plugins.size() >= 2 && fits(peak.total(), a.limit)) {
      Remedy r = remedy_from(a.config.peak, peak, a.limit);
      r.plugins = combined.plugins;
      for (size_t i = 0; i < whats.size(); ++i) {
        r.what += (i ? " + " : "") + whats[i];
        r.toml += (i ? "\n\n" : "") + tables[i];
      }
      r.step_time_factor = factor;
      if (m.world_size != a.world_size) r.ranks = m.world_size;
      a.remedies.push_back(std::move(r));
    }
  }
  return a;
}

std::vector<PluginMode> plugin_modes() {
  std::vector<PluginMode> modes;
  const PluginCatalog catalog;
  for (const OfferedExtension& ext : catalog.offered(HR_EXT_ESTIMATE)) {
    const auto* table = static_cast<const hr_ext_estimate*>(ext.table);
    if (!table || !HR_HAS_FIELD(table, hr_ext_estimate, modes) || !table->modes) continue;
    for (uint32_t i = 0; i < table->num_modes; ++i) {
      // Each entry is struct_size apart: a newer plugin's longer struct is stepped over whole.
      const uint32_t stride = table->modes[0].struct_size;
      const auto* m = reinterpret_cast<const hr_estimate_mode*>(
          reinterpret_cast<const char*>(table->modes) + uint64_t(i) * stride);
      if (stride < sizeof(hr_estimate_mode) || !m->what || !m->toml) break;  // not a mode table
      PluginMode pm;
      pm.plugin = ext.plugin;
      pm.what = ext.plugin + " (" + std::string(m->what) + ")";
      pm.toml = "[[plugins]]\nname = \"" + ext.plugin + "\"" + (*m->toml ? "\n" : "") + m->toml;
      pm.roles = ext.roles;
      modes.push_back(std::move(pm));
    }
  }
  return modes;
}

Advice advise(const Config& config, const OomNumbers& oom) {
  const PluginCatalog catalog;
  return advise(config, catalog.offered(HR_EXT_ESTIMATE), oom);
}

std::string format_estimate(const ConfigEstimate& e) {
  std::string s;
  for (const PluginEstimate& pe : e.plugins) {
    if (!pe.offered) {
      s += "  " + pe.plugin +
           ": offers no estimate (headroom.estimate/1); counted as changing nothing\n";
    } else if (pe.status != HR_OK) {
      s += "  " + pe.plugin + ": its estimate failed (status " + std::to_string(pe.status) +
           "); counted as changing nothing\n";
    } else {
      s += "  " + pe.plugin + ": " + pe.what + "; step time about " +
           factor_str(pe.step_time_factor) + "\n";
    }
  }
  if (!e.plugins.empty()) s = "with the config's [[plugins]], in order:\n" + s;
  char line[128];
  const int W = e.mechanisms.world_size;
  const int rank = W == rank_info().world_size ? rank_info().rank : 0;
  if (W > 1)
    std::snprintf(line, sizeof line,
                  "estimated peak of rank %d of %d, micro_batch %d x grad_accum %d a rank:\n", rank,
                  W, e.mechanisms.micro_batch, e.mechanisms.grad_accum);
  else
    std::snprintf(line, sizeof line, "estimated peak, micro_batch %d x grad_accum %d:\n",
                  e.mechanisms.micro_batch, e.mechanisms.grad_accum);
  s += line;
  for (int i = 0; i < kNumCategories; ++i) {
    std::snprintf(line, sizeof line, "  %-16s %14s\n", category_name(category_at(i)),
                  format_bytes(e.peak.at_peak[i]).c_str());
    s += line;
  }
  std::snprintf(line, sizeof line, "  %-16s %14s\n", "total", format_bytes(e.peak.total()).c_str());
  s += line;
  if (e.peak.host_total() == 0) return s;
  s += "estimated host memory (the host ledger):\n";
  for (int i = 0; i < kNumCategories; ++i) {
    if (!e.peak.host[i]) continue;
    std::snprintf(line, sizeof line, "  %-16s %14s\n", category_name(category_at(i)),
                  format_bytes(e.peak.host[i]).c_str());
    s += line;
  }
  std::snprintf(line, sizeof line, "  %-16s %14s\n", "total",
                format_bytes(e.peak.host_total()).c_str());
  return s + line;
}

std::string format_remedies(const Advice& advice) {
  std::string s;
  if (advice.remedies.empty()) {
    s = "nothing found that fits by the estimate: raise device.memory_limit, or shrink the model "
        "or seq_len\n";
  } else {
    s = "what would make it fit (each by the estimate; step time against the run as "
        "configured):\n";
  }
  auto by_category = [](const ByCategory& bytes) {
    std::string list;
    for (int i = 0; i < kNumCategories; ++i) {
      if (!bytes[i]) continue;
      list += std::string(list.empty() ? "" : ", ") + category_name(category_at(i)) + " " +
              format_bytes(bytes[i]);
    }
    return list;
  };
  for (const Remedy& r : advice.remedies) {
    s += "  - " + r.what + "\n";
    s += "    peak about " + format_bytes(r.peak_after) + "; step time " +
         (r.step_time_measured ? "about " + factor_str(r.step_time_factor) : "not measured") +
         (r.step_time_note.empty() ? "" : " (" + r.step_time_note + ")") + "\n";
    const std::string saved = by_category(r.saves), cost = by_category(r.costs);
    if (!saved.empty()) s += "    saves about " + saved + " at the peak\n";
    if (!cost.empty()) s += "    costs about " + cost + " more\n";
    if (r.unstranded)
      s += "    makes usable " + format_bytes(r.unstranded) +
           " of free memory now in holes too small for the request\n";
    if (!r.sets.empty()) {
      s += "    on the command line:\n     ";
      for (const std::string& f : r.sets)
        s += " --set " + f;
      s += "\n";
    }
    if (!r.toml.empty()) {
      s += r.replaces.empty()
               ? "    append to the config:\n"
               : "    in the config, in place of the [[plugins]] table at " + r.replaces + ":\n";
      size_t start = 0;
      while (start <= r.toml.size()) {
        const size_t end = r.toml.find('\n', start);
        const std::string line = r.toml.substr(start, end - start);
        s += line.empty() ? "\n" : "      " + line + "\n";
        if (end == std::string::npos) break;
        start = end + 1;
      }
    }
    if (r.ranks > 0) {
      // Each rank reads micro_batch x grad_accum sequences of its own a step (docs/design.md,
      // "Ranks"): the step's batch grows with the ranks.
      s += "    launch on " + std::to_string(r.ranks) +
           " ranks (each reads micro_batch x grad_accum sequences of its own a step):\n" +
           "      mpirun -np " + std::to_string(r.ranks) + " headroom train " +
           (advice.file.empty() ? std::string("CONFIG") : advice.file);
      for (const std::string& f : r.sets)
        s += " --set " + f;
      s += "\n";
    }
  }
  if (!advice.not_enough.empty()) {
    s += "not enough alone:";
    for (size_t i = 0; i < advice.not_enough.size(); ++i) {
      const Remedy& r = advice.not_enough[i];
      const std::string name = (r.plugins.empty() ? r.what : r.plugins[0]) +
                               (r.ranks > 0 ? " on " + std::to_string(r.ranks) + " ranks" : "");
      s += std::string(i ? ";" : "") + " " + name + " (peak about " + format_bytes(r.peak_after) +
           (r.unstranded ? ", makes usable " + format_bytes(r.unstranded) : "") + ")";
    }
    s += "\n";
  }
  return s;
}

}  // namespace headroom
