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

using Key = HfModelConfig::Key;
using Kind = HfModelConfig::Key::Kind;

// One architecture's row: the names config.json gives it and where each [model] key comes from.
struct HfArch {
  std::string arch;                        // headroom's [model] arch
  std::string model_type;                  // config.json "model_type"
  std::vector<std::string> architectures;  // config.json "architectures" headroom can load
  // The [model] keys and values config.json gives; ConfigError naming the file for a missing or
  // out-of-range one, or a setting of the architecture headroom's model does not implement.
  std::vector<Key> (*read)(const json& j, const std::string& file);
  // The config.json `transformers` loads, from the shape.
  json (*write)(const std::vector<Key>& shape);
  // The [model] keys (values 0) a folder of this arch records, for a model's shape.
  std::vector<Key> (*keys)(const ModelConfig& m);
};

double value_of(const std::vector<Key>& shape, const std::string& model_key) {
  for (const auto& k : shape)
    if (k.model_key == model_key) return k.value;
  return 0;
}

// config.json's integer `hf_key` (at `j`, a nested object's name in `where`) from 1 to 2^30;
// `fallback` (when >= 0) for a missing one.
double int_key(const json& j, const std::string& hf_key, const std::string& file,
               int64_t fallback = -1, const std::string& where = "") {
  const auto v = j.find(hf_key);
  if (v == j.end() || (v->is_null() && fallback >= 0)) {
    if (fallback >= 0) return double(fallback);
    throw ConfigError(file + ": has no " + where + hf_key);
  }
  if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > (1 << 30))
    throw ConfigError(file + ": " + where + hf_key + " is " + v->dump() +
                      ", not an integer from 1 to 2^30");
  return double(v->get<int64_t>());
}

// config.json's positive number `hf_key`, `fallback` for a missing one.
double float_key(const json& j, const std::string& hf_key, const std::string& file, double fallback,
                 const std::string& where = "") {
  const auto v = j.find(hf_key);
  if (v == j.end() || v->is_null()) return fallback;
  if (!v->is_number() || !(v->get<double>() > 0) || !std::isfinite(v->get<double>()))
    throw ConfigError(file + ": " + where + hf_key + " is " + v->dump() +
                      ", not a positive number");
  return v->get<double>();
}

bool bool_key(const json& j, const std::string& hf_key, const std::string& file, bool fallback) {
  const auto v = j.find(hf_key);
  if (v == j.end() || v->is_null()) return fallback;
  if (!v->is_boolean())
    throw ConfigError(file + ": " + hf_key + " is " + v->dump() + ", not true or false");
  return v->get<bool>();
}

// The checks every architecture's shape gets: heads divide the width, the vocabulary and the
// context within headroom's limits.
void check_shape(const std::vector<Key>& shape, const std::string& file) {
  const auto hf = [&](const char* model_key) {
    for (const auto& k : shape)
      if (k.model_key == model_key) return k.hf_key;
    return std::string(model_key);
  };
  const int64_t n_embd = int64_t(value_of(shape, "n_embd"));
  const int64_t n_head = int64_t(value_of(shape, "n_head"));
  if (n_head > 0 && n_embd % n_head != 0)
    throw ConfigError(file + ": " + hf("n_embd") + " " + std::to_string(n_embd) +
                      " is not divisible by its " + hf("n_head") + " " + std::to_string(n_head));
  const int64_t vocab = int64_t(value_of(shape, "vocab_size"));
  if (vocab > (int64_t{1} << 24) || vocab < 2)
    throw ConfigError(file + ": vocab_size " + std::to_string(vocab) +
                      " is not from 2 to 16777216");
  if (value_of(shape, "seq_len") > double(int64_t{1} << 20))
    throw ConfigError(file + ": its context length (" + hf("seq_len") +
                      ") is over 2^20 tokens, headroom's limit");
}

// --- GPT-2 (GPT2LMHeadModel) -------------------------------------------------------------------

std::vector<Key> gpt2_keys(const ModelConfig&) {
  return {{"n_layer", "n_layer"},
          {"n_head", "n_head"},
          {"n_embd", "n_embd"},
          {"seq_len", "n_positions"},
          {"vocab_size", "vocab_size"}};
}

std::vector<Key> read_gpt2(const json& j, const std::string& file) {
  std::vector<Key> shape = gpt2_keys(ModelConfig());
  for (auto& k : shape)
    k.value = int_key(j, k.hf_key, file);
  check_shape(shape, file);
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
  const int64_t n_embd = int64_t(value_of(shape, "n_embd"));
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
  return shape;
}

json write_gpt2(const std::vector<Key>& shape) {
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
    j[k.hf_key] = int64_t(k.value);
  j["n_ctx"] = int64_t(value_of(shape, "seq_len"));
  // GPT-2's <|endoftext|> is its last id (50256 of 50257); transformers' default of 50256 would
  // be out of range for a smaller vocabulary.
  j["bos_token_id"] = int64_t(value_of(shape, "vocab_size")) - 1;
  j["eos_token_id"] = int64_t(value_of(shape, "vocab_size")) - 1;
  return j;
}

// --- Llama (LlamaForCausalLM) ------------------------------------------------------------------
// transformers before 5 writes rope_theta and rope_scaling at the top level; 5 writes both inside
// rope_parameters. Both are read; headroom writes the older form, which both versions load.

std::vector<Key> llama_keys(const ModelConfig& m) {
  std::vector<Key> k = {{"n_layer", "num_hidden_layers"},
                        {"n_head", "num_attention_heads"},
                        {"n_kv_head", "num_key_value_heads"},
                        {"n_embd", "hidden_size"},
                        {"intermediate_size", "intermediate_size"},
                        {"seq_len", "max_position_embeddings", 0, Kind::kInt, true},
                        {"vocab_size", "vocab_size"},
                        {"rms_norm_eps", "rms_norm_eps", 0, Kind::kFloat},
                        {"rope_theta", "rope_theta", 0, Kind::kFloat},
                        {"tie_embeddings", "tie_word_embeddings", 0, Kind::kBool},
                        {"rope_scaling_factor", "rope_scaling.factor", 0, Kind::kFloat}};
  if (m.rope_scaling_factor > 0) {
    k.push_back({"rope_low_freq_factor", "rope_scaling.low_freq_factor", 0, Kind::kFloat});
    k.push_back({"rope_high_freq_factor", "rope_scaling.high_freq_factor", 0, Kind::kFloat});
    k.push_back({"rope_original_max_positions", "rope_scaling.original_max_position_embeddings"});
  }
  return k;
}

std::vector<Key> read_llama(const json& j, const std::string& file) {
  const std::string where = file + ": ";
  const double n_head = int_key(j, "num_attention_heads", file);
  const json none = json::object();
  const auto params = j.find("rope_parameters");
  if (params != j.end() && !params->is_null() && !params->is_object())
    throw ConfigError(where + "rope_parameters is " + params->dump() + ", not an object");
  const json& rp = params != j.end() && params->is_object() ? *params : none;
  const auto scaling_it = j.find("rope_scaling");
  if (scaling_it != j.end() && !scaling_it->is_null() && !scaling_it->is_object())
    throw ConfigError(where + "rope_scaling is " + scaling_it->dump() + ", not an object or null");
  // The scaling: rope_scaling (before transformers 5) or rope_parameters (5), by its rope_type.
  const bool old_form = scaling_it != j.end() && scaling_it->is_object();
  const json& scaling = old_form ? *scaling_it : rp;
  const std::string sname = old_form ? "rope_scaling." : "rope_parameters.";
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (const auto t = scaling.find(key); t != scaling.end()) {
      if (!t->is_string())
        throw ConfigError(where + sname + key + " is " + t->dump() + ", not a string");
      type = t->get<std::string>();
      break;
    }
  if (type != "default" && type != "llama3")
    throw ConfigError(where + sname + "rope_type is \"" + type +
                      "\", which headroom's rotary embeddings do not implement; they do "
                      "\"default\" (none) and \"llama3\"");
  const double theta = float_key(j, "rope_theta", file,
                                 float_key(rp, "rope_theta", file, 10000.0, "rope_parameters."));
  std::vector<Key> shape = {
      {"n_layer", "num_hidden_layers", int_key(j, "num_hidden_layers", file)},
      {"n_head", "num_attention_heads", n_head},
      {"n_kv_head", "num_key_value_heads",
       int_key(j, "num_key_value_heads", file, int64_t(n_head))},
      {"n_embd", "hidden_size", int_key(j, "hidden_size", file)},
      {"intermediate_size", "intermediate_size", int_key(j, "intermediate_size", file)},
      {"seq_len", "max_position_embeddings", int_key(j, "max_position_embeddings", file),
       Kind::kInt, true},
      {"vocab_size", "vocab_size", int_key(j, "vocab_size", file)},
      // LlamaConfig's defaults where the file leaves a key out.
      {"rms_norm_eps", "rms_norm_eps", float_key(j, "rms_norm_eps", file, 1e-6), Kind::kFloat},
      {"rope_theta", "rope_theta", theta, Kind::kFloat},
      {"tie_embeddings", "tie_word_embeddings",
       bool_key(j, "tie_word_embeddings", file, false) ? 1.0 : 0.0, Kind::kBool},
      {"rope_scaling_factor", "rope_scaling.factor",
       type == "llama3" ? float_key(scaling, "factor", file, 0, sname) : 0.0, Kind::kFloat}};
  if (type == "llama3") {
    if (value_of(shape, "rope_scaling_factor") <= 0)
      throw ConfigError(where + sname + "factor is missing; rope_type \"llama3\" needs it");
    shape.push_back({"rope_low_freq_factor", "rope_scaling.low_freq_factor",
                     float_key(scaling, "low_freq_factor", file, 1.0, sname), Kind::kFloat});
    shape.push_back({"rope_high_freq_factor", "rope_scaling.high_freq_factor",
                     float_key(scaling, "high_freq_factor", file, 4.0, sname), Kind::kFloat});
    shape.push_back({"rope_original_max_positions", "rope_scaling.original_max_position_embeddings",
                     int_key(scaling, "original_max_position_embeddings", file, 8192, sname)});
  }
  check_shape(shape, file);
  const int64_t kv = int64_t(value_of(shape, "n_kv_head"));
  if (int64_t(n_head) % kv != 0)
    throw ConfigError(where + "num_key_value_heads " + std::to_string(kv) +
                      " does not divide num_attention_heads " + std::to_string(int64_t(n_head)));
  const int64_t head_size = int64_t(value_of(shape, "n_embd")) / int64_t(n_head);
  if (const auto h = j.find("head_dim"); h != j.end() && !h->is_null() && *h != json(head_size))
    throw ConfigError(where + "head_dim is " + h->dump() +
                      ", but headroom's Llama attention heads are hidden_size / "
                      "num_attention_heads = " +
                      std::to_string(head_size) + " wide");
  if (const auto a = j.find("hidden_act"); a != j.end() && *a != json("silu"))
    throw ConfigError(where + "hidden_act is " + a->dump() +
                      ", but headroom's Llama MLP is SwiGLU (\"silu\")");
  for (const char* flag : {"attention_bias", "mlp_bias"})
    if (const auto f = j.find(flag); f != j.end() && *f == json(true))
      throw ConfigError(where + flag + " is true, but headroom's Llama has no biases");
  if (const auto tp = j.find("pretraining_tp"); tp != j.end() && !tp->is_null() && *tp != json(1))
    throw ConfigError(where + "pretraining_tp is " + tp->dump() +
                      ", which headroom does not implement (1: the plain GEMMs)");
  return shape;
}

json write_llama(const std::vector<Key>& shape) {
  const auto i = [&](const char* k) { return int64_t(value_of(shape, k)); };
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"mlp_bias", false},
            {"attention_dropout", 0.0},
            {"pretraining_tp", 1},
            {"head_dim", i("n_embd") / i("n_head")},
            {"torch_dtype", "float32"},
            {"rope_scaling", nullptr}};
  for (const auto& k : shape) {
    if (k.hf_key.compare(0, 13, "rope_scaling.") == 0) continue;
    if (k.kind == Kind::kInt) j[k.hf_key] = int64_t(k.value);
    if (k.kind == Kind::kFloat) j[k.hf_key] = k.value;
    if (k.kind == Kind::kBool) j[k.hf_key] = k.value != 0;
  }
  if (value_of(shape, "rope_scaling_factor") > 0)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", value_of(shape, "rope_scaling_factor")},
                         {"low_freq_factor", value_of(shape, "rope_low_freq_factor")},
                         {"high_freq_factor", value_of(shape, "rope_high_freq_factor")},
                         {"original_max_position_embeddings", i("rope_original_max_positions")}};
  return j;
}

const std::vector<HfArch>& archs() {
  static const std::vector<HfArch> table = {
      {"gpt2", "gpt2", {"GPT2LMHeadModel", "GPT2Model"}, read_gpt2, write_gpt2, gpt2_keys},
      {"llama", "llama", {"LlamaForCausalLM", "LlamaModel"}, read_llama, write_llama, llama_keys},
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
  c.shape = a.read(j, c.file);
  return c;
}

double model_shape_value(const ModelConfig& m, const std::string& key) {
  if (key == "n_layer") return m.n_layer;
  if (key == "n_head") return m.n_head;
  if (key == "n_embd") return m.n_embd;
  if (key == "seq_len") return m.seq_len;
  if (key == "vocab_size") return m.vocab_size;
  if (key == "n_kv_head") return m.kv_heads();
  if (key == "intermediate_size") return m.intermediate_size;
  if (key == "rms_norm_eps") return m.rms_norm_eps;
  if (key == "rope_theta") return m.rope_theta;
  if (key == "tie_embeddings") return m.tie_embeddings ? 1 : 0;
  if (key == "rope_scaling_factor") return m.rope_scaling_factor;
  if (key == "rope_low_freq_factor") return m.rope_low_freq_factor;
  if (key == "rope_high_freq_factor") return m.rope_high_freq_factor;
  if (key == "rope_original_max_positions") return m.rope_original_max_positions;
  throw std::logic_error("model_shape_value: no [model] shape key " + key);
}

std::string shape_value_str(const HfModelConfig::Key& k, double value) {
  if (k.kind == Kind::kBool) return value != 0 ? "true" : "false";
  if (k.kind == Kind::kInt) return std::to_string(int64_t(value));
  return json(value).dump();  // the shortest text that reads back as the same double
}

ModelConfig model_config_of(const HfModelConfig& hf) {
  ModelConfig m;
  m.arch = hf.arch;
  for (const auto& k : hf.shape) {
    const auto set_int = [&](int& f) { f = int(k.value); };
    if (k.model_key == "n_layer") set_int(m.n_layer);
    if (k.model_key == "n_head") set_int(m.n_head);
    if (k.model_key == "n_embd") set_int(m.n_embd);
    if (k.model_key == "seq_len") set_int(m.seq_len);
    if (k.model_key == "vocab_size") set_int(m.vocab_size);
    if (k.model_key == "n_kv_head") set_int(m.n_kv_head);
    if (k.model_key == "intermediate_size") set_int(m.intermediate_size);
    if (k.model_key == "rope_original_max_positions") set_int(m.rope_original_max_positions);
    if (k.model_key == "rms_norm_eps") m.rms_norm_eps = k.value;
    if (k.model_key == "rope_theta") m.rope_theta = k.value;
    if (k.model_key == "tie_embeddings") m.tie_embeddings = k.value != 0;
    if (k.model_key == "rope_scaling_factor") m.rope_scaling_factor = k.value;
    if (k.model_key == "rope_low_freq_factor") m.rope_low_freq_factor = k.value;
    if (k.model_key == "rope_high_freq_factor") m.rope_high_freq_factor = k.value;
  }
  return m;
}

std::vector<HfModelConfig::Key> hf_shape_of(const ModelConfig& m) {
  std::vector<HfModelConfig::Key> shape = arch_row(m.arch).keys(m);
  for (auto& k : shape)
    k.value = model_shape_value(m, k.model_key);
  return shape;
}

std::string hf_config_json(const std::string& arch, const std::vector<HfModelConfig::Key>& shape) {
  return arch_row(arch).write(shape).dump(2) + "\n";
}

bool is_peft_adapter_folder(const std::string& dir) {
  std::error_code ec;
  return !dir.empty() && fs::is_directory(dir, ec) &&
         fs::exists(fs::path(dir) / "adapter_config.json", ec);
}

PeftAdapterConfig read_peft_adapter_config(const std::string& dir) {
  PeftAdapterConfig a;
  a.file = (fs::path(dir) / "adapter_config.json").string();
  const std::string& file = a.file;
  // adapter_config.json is a few hundred bytes; anything far larger is not one.
  constexpr uintmax_t kMaxBytes = 1u << 20;
  std::error_code ec;
  const uintmax_t size = fs::file_size(file, ec);
  if (ec) throw ConfigError(file + ": cannot be read: " + ec.message());
  if (size > kMaxBytes)
    throw ConfigError(file + ": is " + std::to_string(size) +
                      " bytes, far more than an adapter_config.json holds");
  std::ifstream in(file, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw ConfigError(file + ": cannot be read");
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(file + ": is not JSON: " + e.what());
  }
  if (!c.is_object()) throw ConfigError(file + ": is not a JSON object");
  const auto what = [&](const char* key) {
    const auto it = c.find(key);
    return it == c.end() ? std::string("missing") : it->dump();
  };
  const auto type = c.find("peft_type");
  if (type == c.end() || !type->is_string() || type->get<std::string>() != "LORA")
    throw ConfigError(file + ": peft_type is " + what("peft_type") +
                      "; headroom continues LoRA adapters only (\"LORA\")");
  for (const char* key : {"r", "lora_alpha"})
    if (!c.contains(key) || !c[key].is_number())
      throw ConfigError(file + ": " + key + " is " + what(key) + ", expected a number");
  a.r = c["r"].get<double>();
  a.alpha = c["lora_alpha"].get<double>();
  const auto t = c.find("target_modules");
  if (t != c.end() && t->is_string()) {
    a.targets.push_back(t->get<std::string>());
  } else if (t != c.end() && t->is_array() &&
             std::all_of(t->begin(), t->end(),
                         [](const nlohmann::json& v) { return v.is_string(); })) {
    for (const nlohmann::json& v : *t)
      a.targets.push_back(v.get<std::string>());
  } else {
    throw ConfigError(file + ": target_modules is " + what("target_modules") +
                      ", expected a list of module names");
  }
  std::sort(a.targets.begin(), a.targets.end());
  const auto b = c.find("base_model_name_or_path");
  if (b != c.end() && !b->is_null() && !b->is_string())
    throw ConfigError(file + ": base_model_name_or_path is " + b->dump() + ", expected a string");
  const std::string v = b != c.end() && b->is_string() ? b->get<std::string>() : "";
  if (!v.empty()) {
    fs::path p(v);
    if (p.is_relative()) p = fs::path(dir) / p;
    if (!fs::is_directory(p, ec))
      throw ConfigError(file + ": base_model_name_or_path \"" + v + "\" is not a folder here (" +
                        p.string() +
                        "); headroom reads a base model from a local Hugging Face folder: "
                        "download it and set base_model_name_or_path to its path");
    a.base = fs::absolute(p, ec).string();
  }
  return a;
}

}  // namespace headroom
