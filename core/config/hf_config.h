// A Hugging Face model folder's config.json, read as far as a run needs it: which of headroom's
// architectures it is and the [model] shape it gives ([train] init_from = "DIR" takes the shape
// from there when [model] gives none; a [model] that says otherwise is an error naming both).
//
// Each architecture is one row of a table (hf_config.cpp): its model_type and architectures
// names, which config.json key gives each [model] key, the settings its model fixes, and the
// config.json `transformers` loads. Rows: GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM:
// Llama 2 and 3, TinyLlama, SmolLM2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace headroom {

struct HfModelConfig {
  std::string file;  // DIR/config.json, for messages
  std::string arch;  // headroom's [model] arch: "gpt2" or "llama"
  // The [model] keys it gives, in [model]'s order: {"n_layer", "n_layer", 12}: headroom's key,
  // config.json's key (a nested one as "rope_scaling.factor"), the value.
  struct Key {
    enum class Kind { kInt, kFloat, kBool };
    std::string model_key;
    std::string hf_key;
    double value = 0;  // an integer (up to 2^30), a float, or 0/1
    Kind kind = Kind::kInt;
    // The model's value may be below the folder's: a Llama's seq_len (max_position_embeddings
    // is the longest context it was made for; rotary positions have no table to match).
    bool at_most = false;
  };
  std::vector<Key> shape;
};

// True when `path` is a folder (an init_from that names a Hugging Face folder, not a file).
bool is_hf_folder(const std::string& path);

// Reads DIR/config.json. ConfigError naming the file for a missing or unreadable file, JSON that
// does not parse (with its line and column), an architecture headroom does not have (saying which
// it has), a shape key that is missing or out of range, or a setting of the architecture that
// headroom's model does not implement (GPT-2: layer_norm_epsilon other than 1e-5, an
// activation_function other than gelu_new, an n_inner other than 4·n_embd, an untied head; Llama:
// a hidden_act other than silu, biases, a head_dim other than hidden_size / num_attention_heads,
// a rope type other than the default and "llama3").
HfModelConfig read_hf_config(const std::string& dir);

// The config.json a folder of `arch` with this shape gets (`--save-weights DIR/`), the keys
// `transformers` reads; `shape` as HfModelConfig::shape gives it (model keys and values).
std::string hf_config_json(const std::string& arch, const std::vector<HfModelConfig::Key>& shape);

// The value of the [model] shape key `key` ("n_layer", .., "vocab_size", "rope_theta", ..) in `m`.
double model_shape_value(const ModelConfig& m, const std::string& key);

// `k`'s value as [model] writes it ("12", "1e-05", "true"), for messages.
std::string shape_value_str(const HfModelConfig::Key& k, double value);

// A Hugging Face PEFT adapter folder's adapter_config.json (a LoRA adapter beside its
// adapter_model.safetensors), as far as continuing it needs.
struct PeftAdapterConfig {
  std::string file;  // DIR/adapter_config.json, for messages
  // The base model folder it was trained on: base_model_name_or_path, absolute as written or
  // relative to DIR; "" when it names none (headroom's own runs from train.seed's init).
  std::string base;
  double r = 0, alpha = 0;
  std::vector<std::string> targets;  // target_modules, sorted
};

// True when `dir` is a folder with an adapter_config.json: a PEFT adapter, not a base model.
bool is_peft_adapter_folder(const std::string& dir);

// Reads DIR/adapter_config.json. ConfigError naming the file for one missing, unreadable or far
// too large, JSON that does not parse, a peft_type other than "LORA", r, lora_alpha or
// target_modules missing or of another type, or a base_model_name_or_path that is not a folder
// here (a Hub id: headroom reads local folders).
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);

// The ModelConfig of the shape `hf` gives (everything else default).
ModelConfig model_config_of(const HfModelConfig& hf);

// The [model] keys a folder of `m`'s arch records, with their config.json names and m's values.
std::vector<HfModelConfig::Key> hf_shape_of(const ModelConfig& m);

}  // namespace headroom
