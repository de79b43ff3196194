// lora: LoRA fine-tuning (Hu et al. 2021) as Hugging Face PEFT configures it. The base model is
// frozen — no gradients, optimizer state or master copies for it — and each targeted linear module
// gets a trainable low-rank update beside its GEMM, y = W x + (alpha / r) · B (A x), with A (r, in)
// Kaiming-uniform (a = sqrt(5)) and B (out, r) zero, so training starts from the base model
// exactly. The adapters are parameters named as PEFT's ("h.0.attn.c_attn.lora_A.weight"); the
// optimizer, clipping, snapshots and --save-weights see them as any other.
//
//   [[plugins]]
//   name = "lora"
//   r = 8                                    # the rank, >= 1
//   alpha = 16.0                             # the update's scale is alpha / r; default r
//   dropout = 0.05                           # PEFT's lora_dropout on the adapters' input
//   target_modules = ["c_attn"]              # PEFT's: module names or suffixes of them
//   base_dtype = "nf4"                       # the frozen linear weights: f32 (as the model),
//                                            # bf16, int8 or nf4 (QLoRA, bitsandbytes' formats)
//   double_quant = true                      # int8/nf4: the absmaxes 8-bit too (QLoRA's)
//
// GPT-2's modules are attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj ("c_proj" is both
// projections); Llama's self_attn.q_proj, k_proj, v_proj, o_proj and mlp.gate_proj, up_proj,
// down_proj. A target that names none is a config error at its file:line:column, listing them.
//
// Policy only: core's headroom.adapters/1 is the mechanism (core/model/model.h, LoraSpec), and
// headroom.config/1 reads the list. Training thread, create() and headroom.estimate/1 only; no
// state of its own beyond its keys (the adapters are parameters, in the snapshots). Only
// hr_plugin_entry is exported; no C++ exception crosses the C ABI.
#include <headroom/ext/adapters.h>
#include <headroom/ext/config.h>
#include <headroom/ext/estimate.h>
#include <headroom/plugin.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "common/offer_reads.h"

namespace {

struct Lora {
  int64_t r = 8;
  double alpha = 0;  // 0: r's value
  double dropout = 0;
  std::vector<std::string> targets;
  char base_dtype[16] = "f32";
  int32_t double_quant = 0;
  // The specs handed to the host: add_lora's, and hr_mechanisms.adapters' in an estimate.
  std::vector<hr_lora_spec> specs;
  void make_specs() {
    specs.clear();
    for (const std::string& t : targets)
      specs.push_back(
          {sizeof(hr_lora_spec), uint32_t(r), t.c_str(), alpha, "target_modules", dropout});
  }
};

const void* extension(const hr_host_services* s, const char* id) {
  return HR_HAS_FIELD(s, hr_host_services, get_extension) ? s->get_extension(s->host, id) : nullptr;
}

hr_status create(const hr_host_services* s, void** instance) {
  Lora c;
  hr_status st = s->config_int(s->host, "r", &c.r);
  if (st == HR_OK) st = s->config_float(s->host, "alpha", &c.alpha);
  if (st == HR_OK) st = s->config_float(s->host, "dropout", &c.dropout);
  if (st == HR_OK) st = s->config_string(s->host, "base_dtype", c.base_dtype, sizeof c.base_dtype);
  if (st == HR_ERROR_INVALID)
    return s->config_error(s->host, "base_dtype",
                           "must be one of \"f32\", \"bf16\", \"int8\", \"nf4\"");
  if (st == HR_OK) st = s->config_bool(s->host, "double_quant", &c.double_quant);
  if (st != HR_OK) return st;
  const std::string base = c.base_dtype;
  if (c.double_quant && (base == "f32" || base == "bf16"))
    return s->config_error(s->host, "double_quant",
                           "quantizes the absmaxes of an int8 or nf4 base (base_dtype); this "
                           "base has none");
  if (c.r < 1 || c.r > (int64_t(1) << 20))
    return s->config_error(s->host, "r", "the rank must be between 1 and 2^20");
  if (c.alpha == 0) c.alpha = double(c.r);
  if (!(c.alpha > 0) || !std::isfinite(c.alpha))
    return s->config_error(s->host, "alpha", "must be a finite number > 0 (default: r)");
  if (!(c.dropout >= 0 && c.dropout < 1))
    return s->config_error(s->host, "dropout",
                           "must be in [0, 1): the probability an adapter's input element is "
                           "dropped in training (PEFT's lora_dropout)");
  const auto* config = static_cast<const hr_ext_config*>(extension(s, HR_EXT_CONFIG));
  const auto* adapters = static_cast<const hr_ext_adapters*>(extension(s, HR_EXT_ADAPTERS));
  if (!config || !adapters) {
    s->set_error(s->host, "the host offers no " HR_EXT_ADAPTERS " and " HR_EXT_CONFIG
                          " (a headroom older than this plugin)");
    return HR_ERROR;
  }
  uint32_t n = 0;
  st = config->string_count(s->host, "target_modules", &n);
  if (st != HR_OK) return st;
  if (n == 0)
    return s->config_error(s->host, "target_modules",
                           "is required: the modules to adapt, as PEFT's target_modules "
                           "([\"c_attn\"] for GPT-2, [\"q_proj\", \"v_proj\"] for Llama)");
  for (uint32_t i = 0; i < n; ++i) {
    char name[256];
    st = config->string_at(s->host, "target_modules", i, name, sizeof name);
    if (st != HR_OK) return st;
    c.targets.emplace_back(name);
  }
  c.make_specs();
  for (const hr_lora_spec& spec : c.specs) {
    // A target that names no module is the host's config error, at the key's position.
    st = adapters->add_lora(s->host, &spec);
    if (st != HR_OK) return st;
  }
  if (base != "f32") {
    if (!HR_HAS_FIELD(adapters, hr_ext_adapters, set_base)) {
      s->set_error(s->host, "base_dtype needs " HR_EXT_ADAPTERS
                            "'s set_base (a headroom older "
                            "than this plugin)");
      return HR_ERROR;
    }
    // A dtype that is none of the valid ones is the host's config error, at the key's position.
    const hr_base_spec spec = {sizeof(hr_base_spec), uint32_t(c.double_quant != 0), c.base_dtype,
                               "base_dtype"};
    st = adapters->set_base(s->host, &spec);
    if (st != HR_OK) return st;
  }
  *instance = new Lora(std::move(c));
  static_cast<Lora*>(*instance)->make_specs();  // the moved strings' pointers
  return HR_OK;
}

void destroy(void* instance) {
  delete static_cast<Lora*>(instance);
}

// A step with adapters on a frozen base runs no weight-gradient GEMM of the base and no optimizer
// update of it; a quantized base adds its dequantization before each GEMM. Measured on the CPU at
// gpt2-350m's shapes, 128 tokens a step, against full training's step (docs/results/lora.md, the
// idle column): 0.48 on an f32 base, 0.55 on bf16 and int8, 0.61 on nf4. With more tokens a step
// the optimizer weighs less and the factor rises toward the FLOPs' 2/3.
double step_time_factor(const std::string& base) {
  if (base == "f32") return 0.48;
  if (base == "nf4") return 0.61;
  return 0.55;
}

// A TOML float: "16.0", "0.05".
std::string toml_float(double v) {
  char text[32];
  std::snprintf(text, sizeof text, v == std::floor(v) ? "%.1f" : "%.17g", v);
  return text;
}

// The adapters and base as `c` sets them in `after`, and the peak they leave.
hr_status estimate_with(const Lora& c, const hr_estimate_query* q, hr_estimate_result* r) {
  r->after->num_adapters = uint32_t(c.specs.size());
  r->after->adapters = c.specs.data();
  r->after->base_dtype = c.base_dtype;
  r->after->base_double_quant = uint32_t(c.double_quant != 0);
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  r->step_time_factor = step_time_factor(c.base_dtype);
  std::string targets;
  for (const std::string& t : c.targets)
    targets += (targets.empty() ? "" : ", ") + t;
  const std::string base = c.base_dtype;
  std::snprintf(r->what, sizeof r->what,
                "adapters of rank %lld on %s, the base frozen in %s%s: trains the adapters alone",
                static_cast<long long>(c.r), targets.c_str(), base.c_str(),
                c.double_quant ? " with double quantization" : "");
  std::string toml =
      "r = " + std::to_string(c.r) + "\nalpha = " + toml_float(c.alpha) + "\ntarget_modules = [";
  for (size_t i = 0; i < c.targets.size(); ++i)
    toml += (i ? ", \"" : "\"") + c.targets[i] + "\"";
  toml += "]\n";
  if (c.dropout > 0) toml += "dropout = " + toml_float(c.dropout) + "\n";
  if (base != "f32") toml += "base_dtype = \"" + base + "\"\n";
  if (c.double_quant) toml += "double_quant = true\n";
  std::snprintf(r->toml, sizeof r->toml, "%s", toml.c_str());
  return HR_OK;
}

// headroom.estimate/1. As configured: the adapters and the base it sets. Not in the config: a
// run that starts from weights (init_from) can be fine-tuned instead of trained whole; where it
// does not fit, the proposal is adapters of rank 16 (alpha 32) on every linear module (PEFT's
// "all-linear", as QLoRA adapts) on the least quantized base that fits — f32, bf16, int8, nf4,
// nf4 with double quantization — or the last where none does. A run from a fresh init has no base
// worth freezing: nothing to propose.
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!HR_HAS_FIELD(r->after, hr_mechanisms, base_dtype))
    return HR_ERROR_UNSUPPORTED;  // older host
  if (instance) return estimate_with(*static_cast<const Lora*>(instance), q, r);
  const hr_estimate_model* m = q->model;
  if (!HR_HAS_FIELD(m, hr_estimate_model, init_from) || !m->init_from || !*m->init_from)
    return HR_ERROR_UNSUPPORTED;
  if (q->before->num_adapters > 0) return HR_ERROR_UNSUPPORTED;  // another plugin's adapters
  // The proposal's storage lives until the next call (hr_mechanisms' rule).
  static Lora proposal;
  proposal = Lora{};
  proposal.r = 16;
  proposal.alpha = 32;
  proposal.targets = {"all-linear"};
  proposal.make_specs();
  const struct {
    const char* dtype;
    int32_t double_quant;
  } bases[] = {{"f32", 0}, {"bf16", 0}, {"int8", 0}, {"nf4", 0}, {"nf4", 1}};
  for (const auto& b : bases) {
    std::snprintf(proposal.base_dtype, sizeof proposal.base_dtype, "%s", b.dtype);
    proposal.double_quant = b.double_quant;
    const hr_status st = estimate_with(proposal, q, r);
    if (st != HR_OK) return st;
    uint64_t total = 0;
    for (uint64_t bytes : r->bytes)
      total += bytes;
    if (m->memory_limit && total + r->after->plugin_bytes <= m->memory_limit) break;
  }
  return HR_OK;
}

hr_status on_event(void*, const hr_event_info*) {
  return HR_OK;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "lora",
    "1.0.0",
    "LoRA fine-tuning: a frozen base and trainable low-rank adapters on the modules named, as "
    "PEFT's LoraConfig",
    0,  // events: none
    0,  // roles
    0,  // reserved0
    create,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state: the adapters are parameters, in the snapshot
    nullptr,  // load_state
    // It reads no gradient at any event.
    headroom_plugin::offer_all<headroom_plugin::offer_estimate<estimate>,
                               headroom_plugin::offer_reads<0>>,
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
