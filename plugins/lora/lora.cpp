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
// headroom.config/1 reads the list. Training thread, create() only; no state of its own (the
// adapters are parameters, in the snapshots). Only hr_plugin_entry is exported; no C++ exception
// crosses the C ABI.
#include <headroom/ext/adapters.h>
#include <headroom/ext/config.h>
#include <headroom/plugin.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/hook_guard.h"
#include "common/offer_reads.h"

namespace {

struct Lora {
  int64_t r = 8;
  double alpha = 0;  // 0: r's value
  double dropout = 0;
  std::vector<std::string> targets;
  char base_dtype[16] = "f32";
  int32_t double_quant = 0;
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
  for (const std::string& t : c.targets) {
    // A target that names no module is the host's config error, at the key's position.
    const hr_lora_spec spec = {sizeof(hr_lora_spec), uint32_t(c.r), t.c_str(), c.alpha,
                               "target_modules",     c.dropout};
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
  *instance = nullptr;
  return HR_OK;
}

void destroy(void*) {}

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
    headroom_plugin::offer_reads<0>,
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
