#include "core/config/hf_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace headroom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A config.json is a few kB; anything over this is not one, and is not read into memory.
constexpr uint64_t kMaxConfigBytes = 16u << 20;

// One architecture's row: the names config.json gives it and where each [model] key comes from.
struct HfArch {
  std::string arch;                        // headroom's [model] arch
  std::string model_type;                  // config.json "model_type"
  std::vector<std::string> architectures;  // config.json "architectures" headroom can load
  std::vector<HfModelConfig::Key> shape;   // [model] key <- config.json key
  // The settings of the architecture headroom's model fixes: refuse a config.json that differs.
  void (*check)(const json& j, const std::vector<HfModelConfig::Key>& shape,
                const std::string& file);
  // The config.json `transformers` loads, from the shape.
  json (*write)(const std::vector<HfModelConfig::Key>& shape);
};

int64_t value_of(const std::vector<HfModelConfig::Key>& shape, const std::string& model_key) {
  for (const auto& k : shape)
    if (k.model_key == model_key) return k.value;
  return 0;
}

void check_gpt2(const json& j, const std::vector<HfModelConfig::Key>& shape,
                const std::string& file) {
  const std::string where = file + ": ";
  if (const auto e = j.find("layer_norm_epsilon"); e != j.end()) {
    if (!e->is_number() || std::fabs(e->get<double>() - 1e-5) > 1e-12)
      throw ConfigError(where + "layer_norm_epsilon is " + e->dump() +
                        ", but headroom's GPT-2 LayerNorm uses 1e-5");
  }
  if (const auto a = j.find("activation_function"); a != j.end()) {
    if (!a->is_string() || (*a != "gelu_new" && *a != "gelu_pytorch_tanh"))
      throw ConfigError(where + "activation_function is " + a->dump() +
                        ", but headroom's GPT-2 MLP uses the tanh GELU (\"gelu_new\")");
  }
  const int64_t n_embd = value_of(shape, "n_embd");
  if (const auto n = j.find("n_inner"); n != j.end() && !n->is_null()) {
    if (!n->is_number_integer() || n->get<int64_t>() != 4 * n_embd)
      throw ConfigError(where + "n_inner is " + n->dump() + ", but headroom's GPT-2 MLP is " +
                        std::to_string(4 * n_embd) + " wide (4·n_embd; null means that too)");
  }
  if (const auto t = j.find("tie_word_embeddings"); t != j.end() && *t != json(true))
    throw ConfigError(where + "tie_word_embeddings is " + t->dump() +
                      ", but headroom's GPT-2 ties the output head to wte");
  for (const char* flag : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    if (const auto f = j.find(flag); f != j.end() && *f == json(true))
      throw ConfigError(where + flag + " is true, which headroom's GPT-2 attention does not do");
  if (const auto f = j.find("scale_attn_weights"); f != j.end() && *f == json(false))
    throw ConfigError(where +
                      "scale_attn_weights is false, but headroom's GPT-2 attention scales "
                      "by 1/sqrt(head size)");
}

json write_gpt2(const std::vector<HfModelConfig::Key>& shape) {
  json j = {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", 1e-5},
            {"n_inner", nullptr},
            {"tie_word_embeddings", true},
            {"scale_attn_weights", true},
            // Dropout is off: headroom trains without it, so the model reads the same in eval
            // and train mode.
            {"attn_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"resid_pdrop", 0.0},
            {"torch_dtype", "float32"}};
  for (const auto& k : shape)
    j[k.hf_key] = k.value;
  j["n_ctx"] = value_of(shape, "seq_len");
  // GPT-2's <|endoftext|> is its last id (50256 of 50257); transformers' default of 50256 would
  // be out of range for a smaller vocabulary.
  j["bos_token_id"] = value_of(shape, "vocab_size") - 1;
  j["eos_token_id"] = value_of(shape, "vocab_size") - 1;
  return j;
}

const std::vector<HfArch>& archs() {
  static const std::vector<HfArch> table = {
      {"gpt2",
       "gpt2",
       {"GPT2LMHeadModel", "GPT2Model"},
       {{"n_layer", "n_layer", 0},
        {"n_head", "n_head", 0},
        {"n_embd", "n_embd", 0},
        {"seq_len", "n_positions", 0},
        {"vocab_size", "vocab_size", 0}},
       check_gpt2,
       write_gpt2},
  };
  return table;
}

std::string known_archs() {
  std::string s;
  for (const HfArch& a : archs()) {
    s += (s.empty() ? "" : "; ") + std::string("model_type \"") + a.model_type + "\" (";
    for (size_t i = 0; i < a.architectures.size(); ++i)
      s += (i ? ", " : "") + a.architectures[i];
    s += ")";
  }
  return s;
}

const HfArch& arch_row(const std::string& arch) {
  for (const HfArch& a : archs())
    if (a.arch == arch) return a;
  throw ConfigError("a Hugging Face folder of arch \"" + arch +
                    "\" cannot be written: headroom knows " + known_archs());
}

// The row config.json names, by model_type (or, without one, by architectures).
const HfArch& find_arch(const json& j, const std::string& file) {
  const auto mt = j.find("model_type");
  const auto ar = j.find("architectures");
  if (mt != j.end() && !mt->is_string())
    throw ConfigError(file + ": model_type is a JSON " + std::string(mt->type_name()) +
                      ", not a string");
  if (ar != j.end() && !(ar->is_array() || ar->is_null()))
    throw ConfigError(file + ": architectures is a JSON " + std::string(ar->type_name()) +
                      ", not an array of strings");
  if (mt == j.end() && (ar == j.end() || ar->is_null() || ar->empty()))
    throw ConfigError(file + ": has neither model_type nor architectures; headroom loads " +
                      known_archs());
  for (const HfArch& a : archs()) {
    if (mt != j.end() && *mt != a.model_type) continue;
    if (ar != j.end() && ar->is_array()) {
      for (const auto& name : *ar) {
        if (!name.is_string() || std::find(a.architectures.begin(), a.architectures.end(),
                                           name.get<std::string>()) == a.architectures.end())
          throw ConfigError(file + ": architectures names " + name.dump() +
                            ", which headroom does not have; it loads " + known_archs());
      }
    }
    return a;
  }
  throw ConfigError(file + ": model_type " + mt->dump() +
                    " is not an architecture headroom has; it loads " + known_archs());
}

}  // namespace

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  return !path.empty() && fs::is_directory(path, ec);
}

HfModelConfig read_hf_config(const std::string& dir) {
  HfModelConfig c;
  c.file = (fs::path(dir) / "config.json").string();
  std::error_code ec;
  if (!fs::exists(c.file, ec))
    throw ConfigError(c.file +
                      ": missing; a Hugging Face model folder has config.json beside its "
                      "model.safetensors");
  if (!fs::is_regular_file(c.file, ec)) throw ConfigError(c.file + ": is not a regular file");
  const uint64_t size = fs::file_size(c.file, ec);
  if (ec) throw ConfigError(c.file + ": cannot read its size: " + ec.message());
  if (size > kMaxConfigBytes)
    throw ConfigError(c.file + ": is " + std::to_string(size) + " bytes, over the " +
                      std::to_string(kMaxConfigBytes) + " a config.json may have");
  std::ifstream in(c.file, std::ios::binary);
  if (!in) throw ConfigError(c.file + ": cannot open it");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw ConfigError(c.file + ": not valid JSON: " + e.what());
  }
  if (!j.is_object())
    throw ConfigError(c.file + ": is a JSON " + std::string(j.type_name()) + ", not an object");
  const HfArch& a = find_arch(j, c.file);
  c.arch = a.arch;
  c.shape = a.shape;
  for (auto& k : c.shape) {
    const auto v = j.find(k.hf_key);
    if (v == j.end())
      throw ConfigError(c.file + ": has no " + k.hf_key + " (headroom's model." + k.model_key +
                        ")");
    if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > (1 << 30))
      throw ConfigError(c.file + ": " + k.hf_key + " is " + v->dump() +
                        ", not an integer from 1 to 2^30");
    k.value = v->get<int64_t>();
  }
  const int64_t n_embd = value_of(c.shape, "n_embd"), n_head = value_of(c.shape, "n_head");
  if (n_head > 0 && n_embd % n_head != 0)
    throw ConfigError(c.file + ": n_embd " + std::to_string(n_embd) + " is not divisible by its " +
                      "n_head " + std::to_string(n_head));
  if (value_of(c.shape, "vocab_size") > (int64_t{1} << 24) || value_of(c.shape, "vocab_size") < 2)
    throw ConfigError(c.file + ": vocab_size " + std::to_string(value_of(c.shape, "vocab_size")) +
                      " is not from 2 to 16777216");
  if (value_of(c.shape, "seq_len") > (int64_t{1} << 20))
    throw ConfigError(c.file + ": its context length is over 2^20 tokens, headroom's limit");
  a.check(j, c.shape, c.file);
  return c;
}

int64_t model_shape_value(const ModelConfig& m, const std::string& key) {
  if (key == "n_layer") return m.n_layer;
  if (key == "n_head") return m.n_head;
  if (key == "n_embd") return m.n_embd;
  if (key == "seq_len") return m.seq_len;
  if (key == "vocab_size") return m.vocab_size;
  throw std::logic_error("model_shape_value: no [model] shape key " + key);
}

ModelConfig model_config_of(const HfModelConfig& hf) {
  ModelConfig m;
  for (const auto& k : hf.shape) {
    int* field = k.model_key == "n_layer"   ? &m.n_layer
                 : k.model_key == "n_head"  ? &m.n_head
                 : k.model_key == "n_embd"  ? &m.n_embd
                 : k.model_key == "seq_len" ? &m.seq_len
                                            : &m.vocab_size;
    *field = int(k.value);
  }
  return m;
}

std::vector<HfModelConfig::Key> hf_shape_keys(const std::string& arch) {
  return arch_row(arch).shape;
}

std::string hf_config_json(const std::string& arch, const std::vector<HfModelConfig::Key>& shape) {
  return arch_row(arch).write(shape).dump(2) + "\n";
}

}  // namespace headroom
