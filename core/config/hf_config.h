// A Hugging Face model folder's config.json, read as far as a run needs it: which of headroom's
// architectures it is and the [model] shape it gives ([train] init_from = "DIR" takes the shape
// from there when [model] gives none; a [model] that says otherwise is an error naming both).
//
// Each architecture is one row of a table (hf_config.cpp): its model_type and architectures
// names, and which config.json key gives each [model] key. GPT-2's is filled in; another
// architecture adds its row.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace headroom {

struct HfModelConfig {
  std::string file;  // DIR/config.json, for messages
  std::string arch;  // headroom's name: "gpt2"
  // The [model] keys it gives, in [model]'s order: {"n_layer", "n_layer", 12}: headroom's key,
  // config.json's key, the value.
  struct Key {
    std::string model_key;
    std::string hf_key;
    int64_t value = 0;
  };
  std::vector<Key> shape;
};

// True when `path` is a folder (an init_from that names a Hugging Face folder, not a file).
bool is_hf_folder(const std::string& path);

// Reads DIR/config.json. ConfigError naming the file for a missing or unreadable file, JSON that
// does not parse (with its line and column), an architecture headroom does not have (saying which
// it has), a shape key that is missing or out of range, or a setting of the architecture that
// headroom's model does not implement (GPT-2: layer_norm_epsilon other than 1e-5, an
// activation_function other than gelu_new, an n_inner other than 4·n_embd, an untied head).
HfModelConfig read_hf_config(const std::string& dir);

// The config.json a folder of `arch` with this shape gets (`--save-weights DIR/`), the keys
// `transformers` reads; `shape` as HfModelConfig::shape gives it (model keys and values).
std::string hf_config_json(const std::string& arch, const std::vector<HfModelConfig::Key>& shape);

// The value of the [model] shape key `key` ("n_layer", .., "vocab_size") in `m`.
int64_t model_shape_value(const ModelConfig& m, const std::string& key);

// The ModelConfig of the shape `hf` gives (everything else default).
ModelConfig model_config_of(const HfModelConfig& hf);

// The [model] keys of `arch`'s row, with their config.json names (values 0).
std::vector<HfModelConfig::Key> hf_shape_keys(const std::string& arch);

}  // namespace headroom
