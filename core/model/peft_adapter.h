// A LoRA run's adapters in Hugging Face PEFT's format, and the merged weights PEFT's
// merge_and_unload gives. A PEFT adapter folder holds adapter_config.json (peft_type "LORA", r,
// lora_alpha, target_modules, base_model_name_or_path) beside adapter_model.safetensors, whose
// tensors are named as the wrapped model's modules ("base_model.model.transformer.h.0.attn.c_attn.
// lora_A.weight"; A (r, in), B (out, r) for GPT-2's Conv1D and Llama's Linear alike).
//
// `--save-weights DIR/` of a LoRA run writes one; `[train] init_from = "DIR"` of one continues it:
// the base model comes from the folder its base_model_name_or_path names (empty: the base of
// train.seed's init; read_peft_adapter_config) and the adapters from the folder. Every file is
// untrusted input: a bad one is a ConfigError naming it, with the model left as it was.
#pragma once

#include <string>
#include <vector>

#include "core/config/hf_config.h"  // is_peft_adapter_folder, read_peft_adapter_config
#include "core/model/model.h"

namespace headroom {

// Writes `dir`/adapter_model.safetensors (every adapter's A and B, F32, under PEFT's names) and
// `dir`/adapter_config.json (r, lora_alpha, target_modules, fan_in_fan_out for GPT-2's Conv1D,
// base_model_name_or_path `base`), creating `dir`: PeftModel.from_pretrained(base, dir) loads it.
// `host`: the parameters' values as download_params reads them (null: read the device).
// ConfigError for a model without adapters or adapters of more than one rank and alpha;
// OutputError when it cannot be written.
void save_peft_adapter(const std::string& dir, const Gpt<float>& model,
                       const std::vector<LoraSpec>& lora, const std::string& base,
                       const std::vector<std::vector<float>>* host = nullptr);

// Loads the adapters of the folder `dir` into `model`'s (made from `lora`, the run's specs): its
// adapter_config.json must say the run's r, lora_alpha and target_modules (ConfigError naming the
// file and both values otherwise), and adapter_model.safetensors must hold exactly the model's
// adapters, each of its shape. Everything is checked before anything is uploaded, layer by layer
// inside `access` (empty: directly). The base is not loaded here (PeftAdapterConfig::base).
void load_peft_adapter(const std::string& dir, Gpt<float>& model, const std::vector<LoraSpec>& lora,
                       const MasterAccess& access = nullptr);

// `host` (every parameter's values, in model order, as download_params reads them) with each
// adapter folded into the weight it adapts, as PEFT's merge_and_unload does:
// W[row0 + i, :] += (alpha / r) · (B A)[i, :] for the rows [row0, row0 + rows) the adapter's module
// owns, B A computed in f32 (double accumulation, rounded once). The adapters' own entries are
// left as they were; the writers skip them (merged_pieces).
std::vector<std::vector<float>> merge_adapters(const Gpt<float>& model,
                                               const std::vector<LoraSpec>& lora,
                                               std::vector<std::vector<float>> host);

// `--save-weights PATH --merge`: the merged weights (merge_adapters) written as save_weights_to
// writes a model's (a Hugging Face folder or one safetensors file), without the adapters.
void save_merged_weights(const std::string& path, const Gpt<float>& model,
                         const std::vector<LoraSpec>& lora,
                         const std::vector<std::vector<float>>& host);

}  // namespace headroom
