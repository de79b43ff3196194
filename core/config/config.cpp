#include "core/config/config.h"

#include "core/config/config_keys.h"
#include "core/config/hf_config.h"

#include <toml++/toml.h>

#include "core/config/toml_type_name.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <string_view>
#include <utility>

#include "plugins/common/units.h"

namespace headroom {

namespace {

constexpr int64_t kIntMax = INT_MAX;
constexpr int64_t kInt64Max = INT64_MAX;

// Every section of the file and its keys (config_keys.cpp), in the order messages list them. All
// are tables but plugins, which is an array of tables ([[plugins]]).
using Section = ConfigSection;
const std::vector<Section>& sections() {
  return config_sections();
}
const Section* find_section(const std::string& name) {
  return find_config_section(name);
}
// "[train]", or "[[plugins]]" for the array of tables.
std::string section_header(const Section& s) {
  return s.array_of_tables ? "[[" + std::string(s.name) + "]]" : "[" + std::string(s.name) + "]";
}

struct Preset {
  const char* name;
  ModelConfig shape;
};

// A GPT-2 shape.
ModelConfig gpt2_shape(const char* name, int n_layer, int n_head, int n_embd, int seq_len,
                       int vocab_size) {
  ModelConfig m;
  m.preset = name;
  m.n_layer = n_layer;
  m.n_head = n_head;
  m.n_embd = n_embd;
  m.seq_len = seq_len;
  m.vocab_size = vocab_size;
  return m;
}

// A Llama shape, as its Hugging Face config.json has it (seq_len: the context it was pretrained
// at, not max_position_embeddings; rope scaling for Llama 3.1 and 3.2).
struct LlamaShape {
  int n_layer, n_head, n_kv_head, n_embd, intermediate_size, seq_len, vocab_size;
  bool tied;
  double rope_theta, rms_norm_eps, rope_scaling_factor;
};
ModelConfig llama_shape(const char* name, const LlamaShape& s) {
  ModelConfig m = gpt2_shape(name, s.n_layer, s.n_head, s.n_embd, s.seq_len, s.vocab_size);
  m.arch = "llama";
  m.n_kv_head = s.n_kv_head;
  m.intermediate_size = s.intermediate_size;
  m.tie_embeddings = s.tied;
  m.rope_theta = s.rope_theta;
  m.rms_norm_eps = s.rms_norm_eps;
  m.rope_scaling_factor = s.rope_scaling_factor;  // low 1, high 4, original 8192: the defaults
  return m;
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"tiny", gpt2_shape("tiny", 2, 4, 64, 64, 256)},
      {"gpt2-124m", gpt2_shape("gpt2-124m", 12, 12, 768, 1024, 50257)},
      {"gpt2-350m", gpt2_shape("gpt2-350m", 24, 16, 1024, 1024, 50257)},
      {"gpt2-774m", gpt2_shape("gpt2-774m", 36, 20, 1280, 1024, 50257)},
      {"gpt2-1558m", gpt2_shape("gpt2-1558m", 48, 25, 1600, 1024, 50257)},
      // HuggingFaceTB/SmolLM2-135M, TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T,
      // meta-llama/Llama-3.2-1B and Llama-3.1-8B: 134,515,008, 1,100,048,384, 1,235,814,400 and
      // 8,030,261,248 parameters (tests/llama_model_test.cpp checks them).
      {"smollm2-135m",
       llama_shape("smollm2-135m", {30, 9, 3, 576, 1536, 2048, 49152, true, 1e5, 1e-5, 0})},
      {"tinyllama-1.1b",
       llama_shape("tinyllama-1.1b", {22, 32, 4, 2048, 5632, 2048, 32000, false, 1e4, 1e-5, 0})},
      {"llama-3.2-1b",
       llama_shape("llama-3.2-1b", {16, 32, 8, 2048, 8192, 8192, 128256, true, 5e5, 1e-5, 32})},
      {"llama-3.1-8b",
       llama_shape("llama-3.1-8b", {32, 32, 8, 4096, 14336, 8192, 128256, false, 5e5, 1e-5, 8})},
  };
  return p;
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) s += sep;
    s += items[i];
  }
  return s;
}

std::string quoted_list(const std::vector<std::string>& items) {
  std::vector<std::string> q;
  for (const auto& i : items)
    q.push_back("\"" + i + "\"");
  return join(q, ", ");
}

// "[model], [train], ..., [[plugins]] (an array of tables, one [[plugins]] entry per plugin)".
std::string sections_list() {
  std::vector<std::string> names;
  for (const Section& s : sections()) {
    names.push_back(section_header(s) + (s.array_of_tables
                                             ? " (an array of tables, one [[" +
                                                   std::string(s.name) + "]] entry per plugin)"
                                             : ""));
  }
  return join(names, ", ");
}

}  // namespace

std::string type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::string:
      return "string";
    case toml::node_type::boolean:
      return "boolean";
    case toml::node_type::table:
      return "table";
    case toml::node_type::array:
      return "array";
    case toml::node_type::date:
      return "date";
    case toml::node_type::time:
      return "time";
    case toml::node_type::date_time:
      return "date-time";
    default:
      return "nothing";
  }
}

std::string type_name_with_article(const toml::node& node) {
  const std::string name = type_name(node);
  return (name.find_first_of("aeiou") == 0 ? "an " : "a ") + name;
}

namespace {

std::string pos_str(const std::string& file, const toml::source_region& src) {
  SourcePos p;
  p.file = file;
  p.line = static_cast<int>(src.begin.line);
  p.column = static_cast<int>(src.begin.column);
  return p.str();
}

// Shortest "%.Ng" that reads back as the same double.
std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

// A relative path is taken relative to `base_dir`; the result is absolute, so that the resolved
// config means the same wherever it is re-read.
std::string resolve_path(const std::string& path, const std::string& base_dir) {
  std::filesystem::path p(path);
  if (p.is_relative()) p = std::filesystem::path(base_dir) / p;
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(p, ec);
  return ec ? p.string() : abs.string();
}

// A number as TOML writes one (decimal, hex, octal, binary; a fraction, an exponent), whether or
// not it is in range: "1e400", "99999999999999999999". A scanner rather than std::regex: GCC 12
// warns (maybe-uninitialized, an error here) inside <regex> itself at -O1.
bool looks_like_number(const std::string& v) {
  size_t i = 0;
  const size_t n = v.size();
  if (i < n && (v[i] == '+' || v[i] == '-')) ++i;
  // Digits (and TOML's '_' separators) accepted by `is_digit`, at least one; returns whether any.
  auto run = [&](auto is_digit) {
    const size_t start = i;
    while (i < n && (is_digit(v[i]) || v[i] == '_'))
      ++i;
    return i > start;
  };
  auto dec = [](char c) { return c >= '0' && c <= '9'; };
  if (n - i > 2 && v[i] == '0' && (v[i + 1] == 'x' || v[i + 1] == 'o' || v[i + 1] == 'b')) {
    const char base = v[i + 1];
    i += 2;
    bool any = false;
    if (base == 'x')
      any = run([](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; });
    if (base == 'o') any = run([](char c) { return c >= '0' && c <= '7'; });
    if (base == 'b') any = run([](char c) { return c == '0' || c == '1'; });
    return any && i == n;
  }
  if (i >= n || !dec(v[i])) return false;
  run(dec);
  if (i < n && v[i] == '.') {
    ++i;
    if (!run(dec)) return false;
  }
  if (i < n && (v[i] == 'e' || v[i] == 'E')) {
    ++i;
    if (i < n && (v[i] == '+' || v[i] == '-')) ++i;
    if (!run(dec)) return false;
  }
  return i == n;
}

// Validates the parsed (and overridden) document and fills a Config.
class Validator {
 public:
  Validator(std::string file, std::map<std::string, std::string> overrides, bool model_in_file)
      : file_(std::move(file)), overrides_(std::move(overrides)), model_in_file_(model_in_file) {
    base_dir_ = std::filesystem::path(file_).parent_path().string();
  }

  Config run(toml::table& root) {
    Config c;
    c.file = file_;
    for (auto&& [key, node] : root) {
      const std::string k(key.str());
      const Section* section = find_section(k);
      if (!section && !node.is_table() && !node.is_array_of_tables()) {
        throw ConfigError(pos_str(file_, key.source()) + ": '" + k +
                          "' is a key outside any section; " + suggest_section(k));
      }
      if (!section) {
        throw ConfigError(pos_str(file_, key.source()) + ": unknown section '" + k +
                          "'; valid sections: " + sections_list());
      }
      if (!section->array_of_tables && !node.is_table()) {
        throw ConfigError(pos_str(file_, node.source()) + ": '" + k + "' must be a table ([" + k +
                          "]), got " + type_name(node));
      }
    }
    const HfModelConfig hf = hf_folder_shape(root);
    model(root["model"].as_table(), c.model);
    if (!hf.file.empty()) model_matches_hf(root, c.model, hf);
    if (auto* t = root["train"].as_table()) train(*t, c.train);
    if (auto* t = root["data"].as_table()) data(*t, c.data);
    if (auto* t = root["device"].as_table()) device(*t, c.device);
    if (auto* t = root["host"].as_table()) host(*t, c.device);
    if (auto* t = root["snapshot"].as_table()) snapshot(*t, c.snapshot);
    if (auto* t = root["distributed"].as_table()) distributed(*t, c.distributed);
    if (auto* n = root.get("plugins")) plugins(*n, c.plugins);
    data_fits_model(root, c);
    evaluation_has_data(root, c);
    return c;
  }

 private:
  // For a key written before any section header: the sections that have a key of that name.
  static std::string suggest_section(const std::string& key) {
    std::vector<std::string> owners;
    for (const Section& s : sections()) {
      if (s.find(key)) {
        owners.push_back(section_header(s));
      }
    }
    if (owners.empty()) {
      return "no section has a key '" + key +
             "'; every key goes under a section header: " + sections_list();
    }
    std::string list = owners[0];
    for (size_t i = 1; i < owners.size(); ++i)
      list += (i + 1 == owners.size() ? " and " : ", ") + owners[i];
    if (owners.size() > 1) return key + " is a key of " + list + ": put it under one of them";
    if (owners[0] == "[[plugins]]") {
      return key + " is a key of [[plugins]]: put it under a [[plugins]] entry";
    }
    return key + " is a key of " + list + ": put it under " + list;
  }

  // Where a value is: "--set section.key=value" when an override put it there, else FILE:L:C.
  std::string where(const std::string& section, const std::string& key,
                    const toml::source_region& src) const {
    auto it = overrides_.find(section + "." + key);
    if (it != overrides_.end()) return "--set " + it->second;
    return pos_str(file_, src);
  }
  std::string where(const std::string& section, const std::string& key,
                    const toml::node& node) const {
    return where(section, key, node.source());
  }
  // The table's own position, or the first override into it when it came from overrides only.
  std::string table_where(const std::string& section, const toml::table& t) const {
    if (t.source().begin.line != 0) return pos_str(file_, t.source());
    for (const auto& [k, v] : overrides_) {
      if (k.compare(0, section.size() + 1, section + ".") == 0) return "--set " + v;
    }
    return file_;
  }

  // Every key of `t` is one of its section's (config_keys.cpp).
  void check_keys(const std::string& section, const toml::table& t) const {
    const Section& keys = *find_section(section);
    for (auto&& [key, node] : t) {
      const std::string k(key.str());
      if (!keys.find(k)) {
        throw ConfigError(where(section, k, key.source()) + ": unknown key '" + k + "' in [" +
                          section + "]; valid keys: " + join(keys.key_names(), ", "));
      }
    }
  }

  [[noreturn]] void type_error(const std::string& section, const std::string& key,
                               const toml::node& node, const std::string& expected) const {
    // A --set number TOML could not hold arrives as a bare word (a size key reads it so:
    // "9511862599518519294"): a number key says it is out of range, not "got string".
    if (node.is_string() && overrides_.count(section + "." + key) &&
        looks_like_number(node.as_string()->get()) && expected != "a string")
      throw ConfigError(where(section, key, node) + ": " + section + "." + key + ": " +
                        node.as_string()->get() + " is out of range: expected " + expected +
                        ", and a float must be finite and within +-1.8e308, an integer within "
                        "+-9223372036854775807");
    throw ConfigError(where(section, key, node) + ": " + section + "." + key + ": expected " +
                      expected + ", got " + type_name(node));
  }

  // Reads an integer in [lo, hi] if present. `why`, when given, is appended to a range error to
  // say where the bound comes from.
  bool get_int(const toml::table& t, const std::string& section, const std::string& key, int64_t lo,
               int64_t hi, int64_t& out, const std::string& why = "") const {
    const toml::node* n = t.get(key);
    if (!n) return false;
    if (!n->is_integer()) type_error(section, key, *n, "an integer");
    const int64_t v = n->as_integer()->get();
    const std::string reason = why.empty() ? "" : " (" + why + ")";
    if (v < lo) {
      throw ConfigError(where(section, key, *n) + ": " + section + "." + key + " must be >= " +
                        std::to_string(lo) + reason + ", got " + std::to_string(v));
    }
    if (v > hi) {
      throw ConfigError(where(section, key, *n) + ": " + section + "." + key + " must be <= " +
                        std::to_string(hi) + reason + ", got " + std::to_string(v));
    }
    out = v;
    return true;
  }
  template <typename T>
  bool get_int_as(const toml::table& t, const std::string& section, const std::string& key,
                  int64_t lo, int64_t hi, T& out, const std::string& why = "") const {
    int64_t v = 0;
    if (!get_int(t, section, key, lo, hi, v, why)) return false;
    out = static_cast<T>(v);
    return true;
  }

  enum class Bound { kNone, kInclusive, kExclusive };

  // Reads a finite number (float or integer) within the given bounds if present.
  bool get_float(const toml::table& t, const std::string& section, const std::string& key,
                 Bound lo_kind, double lo, Bound hi_kind, double hi, double& out) const {
    const toml::node* n = t.get(key);
    if (!n) return false;
    double v = 0;
    if (n->is_floating_point()) {
      v = n->as_floating_point()->get();
    } else if (n->is_integer()) {
      v = static_cast<double>(n->as_integer()->get());
    } else {
      type_error(section, key, *n, "a number");
    }
    const std::string name = section + "." + key;
    std::string range;
    if (lo_kind != Bound::kNone) {
      range += (lo_kind == Bound::kInclusive ? ">= " : "> ") + format_double(lo);
    }
    if (hi_kind != Bound::kNone) {
      if (!range.empty()) range += " and ";
      range += (hi_kind == Bound::kInclusive ? "<= " : "< ") + format_double(hi);
    }
    const bool bad = !std::isfinite(v) || (lo_kind == Bound::kInclusive && v < lo) ||
                     (lo_kind == Bound::kExclusive && v <= lo) ||
                     (hi_kind == Bound::kInclusive && v > hi) ||
                     (hi_kind == Bound::kExclusive && v >= hi);
    if (bad) {
      throw ConfigError(where(section, key, *n) + ": " + name + " must be a finite number " +
                        range + ", got " + format_double(v));
    }
    out = v;
    return true;
  }

  bool get_string(const toml::table& t, const std::string& section, const std::string& key,
                  std::string& out) const {
    const toml::node* n = t.get(key);
    if (!n) return false;
    if (!n->is_string()) type_error(section, key, *n, "a string");
    out = n->as_string()->get();
    return true;
  }

  bool get_bool(const toml::table& t, const std::string& section, const std::string& key,
                bool& out) const {
    const toml::node* n = t.get(key);
    if (!n) return false;
    if (!n->is_boolean()) type_error(section, key, *n, "a boolean (true or false)");
    out = n->as_boolean()->get();
    return true;
  }

  // A file or folder name: resolved relative to the config file's folder, or to the current
  // directory when it came from --set. `pos` records where it was written.
  bool get_path(const toml::table& t, const std::string& section, const std::string& key,
                std::string& out, SourcePos* pos) const {
    std::string v;
    if (!get_string(t, section, key, v)) return false;
    const toml::node* n = t.get(key);
    if (v.empty()) {
      throw ConfigError(where(section, key, *n) + ": " + section + "." + key +
                        " must name a file or folder, got an empty string");
    }
    const auto ov = overrides_.find(section + "." + key);
    out = resolve_path(v, ov != overrides_.end() ? std::string() : base_dir_);
    if (pos) *pos = pos_of(section, key, *n);
    return true;
  }

  // Where section.key was written: the file's line and column, or its --set.
  SourcePos pos_of(const std::string& section, const std::string& key, const toml::node& n) const {
    SourcePos pos;
    const auto ov = overrides_.find(section + "." + key);
    if (ov != overrides_.end()) {
      pos.file = "--set " + ov->second;
    } else {
      pos.file = file_;
      pos.line = static_cast<int>(n.source().begin.line);
      pos.column = static_cast<int>(n.source().begin.column);
    }
    return pos;
  }

  void snapshot(const toml::table& t, SnapshotConfig& c) {
    const std::string s = "snapshot";
    check_keys(s, t);
    get_int(t, s, "every", 0, kInt64Max, c.every);
    get_path(t, s, "dir", c.dir, nullptr);
    get_int_as(t, s, "keep", 1, 1000000, c.keep);
    get_bool(t, s, "save_weights", c.save_weights);
    if (c.every > 0 && c.dir.empty()) {
      throw ConfigError(where(s, "every", *t.get("every")) +
                        ": snapshot.every > 0 needs snapshot.dir, the folder snapshots go to " +
                        "(e.g. dir = \"snapshots\")");
    }
  }

  bool get_choice(const toml::table& t, const std::string& section, const std::string& key,
                  const std::vector<std::string>& choices, std::string& out) const {
    std::string v;
    if (!get_string(t, section, key, v)) return false;
    if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
      throw ConfigError(where(section, key, *t.get(key)) + ": " + section + "." + key +
                        " must be one of " + quoted_list(choices) + ", got \"" + v + "\"");
    }
    out = v;
    return true;
  }

  void model(const toml::table* t, ModelConfig& m) {
    const std::vector<std::string> names = model_presets();
    std::string preset;
    if (t) {
      check_keys("model", *t);
      get_choice(*t, "model", "preset", names, preset);
    }
    // No [model] in the file: the tiny preset, which overrides may then adjust.
    if (preset.empty() && !model_in_file_) preset = "tiny";
    if (!preset.empty()) {
      for (const auto& p : presets()) {
        if (preset == p.name) m = p.shape;
      }
    }
    m.preset = preset;
    if (!t) return;

    struct Shape {
      const char* key;
      int* field;
      int64_t lo, hi;
      const char* why;
    };
    const Shape shape[] = {{"n_layer", &m.n_layer, 1, kIntMax, ""},
                           {"n_head", &m.n_head, 1, kIntMax, ""},
                           {"n_embd", &m.n_embd, 1, kIntMax, ""},
                           {"seq_len", &m.seq_len, 1, int64_t{1} << 20, ""},
                           {"vocab_size", &m.vocab_size, 2, int64_t{1} << 24,
                            "the number of tokens, from 2 to 16777216"}};
    std::vector<std::string> missing;
    for (const auto& s : shape) {
      if (!get_int_as(*t, "model", s.key, s.lo, s.hi, *s.field, s.why)) missing.push_back(s.key);
    }
    if (preset.empty() && !missing.empty()) {
      throw ConfigError(table_where("model", *t) + ": [model] has no preset, so n_layer, n_head, " +
                        "n_embd, seq_len and vocab_size are all required; missing: " +
                        join(missing, ", ") + "; or set preset = one of " + quoted_list(names));
    }
    arch(*t, m);
    get_choice(*t, "model", "attention", {"tiled", "naive"}, m.attention);
    get_choice(*t, "model", "loss", {"chunked", "full"}, m.loss);
    get_int_as(*t, "model", "chunk_tokens", 0, kIntMax, m.chunk_tokens,
               "tokens per chunk of the chunked loss, or 0 for as many as fit 64 MiB of logits");
    if (m.n_embd % m.n_head != 0) {
      const int64_t lower = int64_t{m.n_embd} / m.n_head * m.n_head;
      const int64_t upper = lower + m.n_head;
      std::string suggest = lower > 0 ? std::to_string(lower) + " or n_embd = " : "";
      suggest += std::to_string(upper);
      const toml::node* at = t->get("n_embd") ? t->get("n_embd") : t->get("n_head");
      const std::string w = at ? where("model", t->get("n_embd") ? "n_embd" : "n_head", *at)
                               : table_where("model", *t);
      throw ConfigError(w + ": model.n_embd (" + std::to_string(m.n_embd) +
                        ") must be divisible by model.n_head (" + std::to_string(m.n_head) +
                        "); e.g. n_embd = " + suggest);
    }
  }

  // [model] arch and the keys only Llama has. A preset gives its arch: arch may repeat it, not
  // contradict it. A Llama key under arch = "gpt2" is an error naming both.
  void arch(const toml::table& t, ModelConfig& m) {
    const std::string preset_arch = m.arch;
    if (get_choice(t, "model", "arch", {"gpt2", "llama"}, m.arch) && !m.preset.empty() &&
        m.arch != preset_arch)
      throw ConfigError(where("model", "arch", *t.get("arch")) + ": model.arch = \"" + m.arch +
                        "\" contradicts preset \"" + m.preset + "\", whose arch is \"" +
                        preset_arch + "\" (remove arch, or the preset)");
    static const char* const kLlamaKeys[] = {"n_kv_head",
                                             "intermediate_size",
                                             "rms_norm_eps",
                                             "rope_theta",
                                             "tie_embeddings",
                                             "rope_scaling_factor",
                                             "rope_low_freq_factor",
                                             "rope_high_freq_factor",
                                             "rope_original_max_positions"};
    // Each value is read (its type and range checked) before the arch is: a wrong value says
    // so under either arch.
    const std::string s = "model";
    get_int_as(t, s, "n_kv_head", 1, kIntMax, m.n_kv_head,
               "key/value heads of grouped-query attention, dividing n_head");
    get_int_as(t, s, "intermediate_size", 1, kIntMax, m.intermediate_size,
               "the SwiGLU MLP's hidden width");
    get_float(t, s, "rms_norm_eps", Bound::kExclusive, 0, Bound::kNone, 0, m.rms_norm_eps);
    get_float(t, s, "rope_theta", Bound::kExclusive, 0, Bound::kNone, 0, m.rope_theta);
    get_bool(t, s, "tie_embeddings", m.tie_embeddings);
    get_float(t, s, "rope_scaling_factor", Bound::kInclusive, 0, Bound::kNone, 0,
              m.rope_scaling_factor);
    get_float(t, s, "rope_low_freq_factor", Bound::kExclusive, 0, Bound::kNone, 0,
              m.rope_low_freq_factor);
    get_float(t, s, "rope_high_freq_factor", Bound::kExclusive, 0, Bound::kNone, 0,
              m.rope_high_freq_factor);
    get_int_as(t, s, "rope_original_max_positions", 1, kIntMax, m.rope_original_max_positions,
               "the context the rope scaling stretches");
    if (!m.llama()) {
      for (const char* k : kLlamaKeys)
        if (const toml::node* n = t.get(k))
          throw ConfigError(where("model", k, *n) + ": model." + k +
                            " is a key of arch = \"llama\", and this model's arch is \"" + m.arch +
                            "\" (set arch = \"llama\", or remove " + k + ")");
      return;
    }
    if (m.intermediate_size == 0)
      throw ConfigError(table_where(s, t) +
                        ": [model] arch = \"llama\" without a preset needs intermediate_size, the "
                        "SwiGLU MLP's hidden width (e.g. " +
                        std::to_string(8 * int64_t(m.n_embd) / 3) + ", 8/3 of n_embd)");
    if (m.rope_scaling_factor > 0 && m.rope_scaling_factor < 1)
      throw ConfigError(where(s, "rope_scaling_factor", *t.get("rope_scaling_factor")) +
                        ": model.rope_scaling_factor must be 0 (no scaling) or >= 1, got " +
                        format_double(m.rope_scaling_factor));
    if (m.rope_high_freq_factor <= m.rope_low_freq_factor) {
      const char* k =
          t.get("rope_high_freq_factor") ? "rope_high_freq_factor" : "rope_low_freq_factor";
      const std::string w = t.get(k) ? where(s, k, *t.get(k)) : table_where(s, t);
      throw ConfigError(w + ": model.rope_high_freq_factor (" +
                        format_double(m.rope_high_freq_factor) +
                        ") must be greater than model.rope_low_freq_factor (" +
                        format_double(m.rope_low_freq_factor) + ")");
    }
    // Whichever of the two was written is where the fix goes.
    auto at = [&](const char* a, const char* b) {
      const char* k = t.get(a) ? a : t.get(b) ? b : nullptr;
      return k ? where(s, k, *t.get(k)) : table_where(s, t);
    };
    if (m.n_head > 0 && m.n_head % m.kv_heads() != 0)
      throw ConfigError(at("n_kv_head", "n_head") + ": model.n_kv_head (" +
                        std::to_string(m.n_kv_head) + ") must divide model.n_head (" +
                        std::to_string(m.n_head) + ")");
    if (m.n_head > 0 && m.n_embd % m.n_head == 0 && (m.n_embd / m.n_head) % 2 != 0)
      throw ConfigError(at("n_embd", "n_head") +
                        ": arch = \"llama\" rotates pairs of a head's elements, so the head size " +
                        "n_embd / n_head must be even, got " + std::to_string(m.n_embd / m.n_head));
    if (const toml::node* n = t.get("attention"))
      if (n->is_string() && n->as_string()->get() == "naive")
        throw ConfigError(where(s, "attention", *n) +
                          ": model.attention = \"naive\" has no grouped-query attention or rotary "
                          "positions: arch = \"llama\" takes \"tiled\"");
  }

  // [train] init_from = "DIR", a Hugging Face folder: the [model] shape keys that neither the file
  // nor a preset gives come from DIR/config.json (put into [model] as if written there); what
  // [model] does give is checked against it by model_matches_hf.
  HfModelConfig hf_folder_shape(toml::table& root) {
    const toml::table* train = root["train"].as_table();
    const toml::node* n = train ? train->get("init_from") : nullptr;
    const std::string v = n ? n->value<std::string>().value_or("") : "";
    if (v.empty()) return {};
    const auto ov = overrides_.find("train.init_from");
    std::string dir = resolve_path(v, ov != overrides_.end() ? std::string() : base_dir_);
    if (!is_hf_folder(dir)) return {};
    HfModelConfig hf;
    try {
      // A PEFT adapter folder: the shape is its base's (none for a base of train.seed's init).
      if (is_peft_adapter_folder(dir)) dir = read_peft_adapter_config(dir).base;
      if (dir.empty()) return {};
      hf = read_hf_config(dir);
    } catch (const ConfigError& e) {
      throw ConfigError(where("train", "init_from", *n) + ": train.init_from: " + e.what());
    }
    if (!root["model"].as_table()) root.insert("model", toml::table{});
    toml::table& model = *root["model"].as_table();
    model_in_file_ = true;  // the folder gives the shape: not the tiny preset
    // The folder's arch (a Llama's keys are read under it); a [model] arch that says otherwise
    // is model_matches_hf's error.
    if (const toml::node* a = model.get("arch"); a && a->value<std::string>() != hf.arch)
      throw ConfigError(where("model", "arch", *a) + ": model.arch = \"" +
                        a->value<std::string>().value_or("?") + "\" contradicts " + hf.file +
                        ", a " + hf.arch + " model (train.init_from's folder); leave arch out to " +
                        "take the folder's");
    if (!model.get("arch") && !model.get("preset")) model.insert("arch", hf.arch);
    using Kind = HfModelConfig::Key::Kind;
    if (!model.get("preset"))
      for (const auto& k : hf.shape) {
        if (model.get(k.model_key)) continue;
        if (k.kind == Kind::kInt) model.insert(k.model_key, int64_t(k.value));
        if (k.kind == Kind::kFloat) model.insert(k.model_key, k.value);
        if (k.kind == Kind::kBool) model.insert(k.model_key, k.value != 0);
      }
    return hf;
  }

  // A [model] (its keys or its preset) that says other than the init_from folder's config.json.
  void model_matches_hf(const toml::table& root, const ModelConfig& m,
                        const HfModelConfig& hf) const {
    const toml::table& t = *root["model"].as_table();
    if (m.arch != hf.arch) {
      const std::string theirs = hf.file + " is a " + hf.arch + " model (train.init_from's folder)";
      if (const toml::node* n = t.get("arch"))
        throw ConfigError(where("model", "arch", *n) + ": model.arch = \"" + m.arch +
                          "\" contradicts it: " + theirs + "; leave arch out to take the folder's");
      throw ConfigError(table_where("model", t) + ": model.preset \"" + m.preset + "\" is arch \"" +
                        m.arch + "\", but " + theirs);
    }
    for (const auto& k : hf.shape) {
      const double ours = model_shape_value(m, k.model_key);
      if (ours == k.value || (k.at_most && ours < k.value)) continue;
      const std::string theirs = hf.file + "'s " + k.hf_key + " = " + shape_value_str(k, k.value) +
                                 " (train.init_from's folder)";
      const std::string bound = k.at_most ? " (it may be at most the folder's)" : "";
      if (const toml::node* n = t.get(k.model_key))
        throw ConfigError(where("model", k.model_key, *n) + ": model." + k.model_key + " = " +
                          shape_value_str(k, ours) + " contradicts " + theirs + bound +
                          "; leave it out of [model] to take the folder's");
      throw ConfigError(table_where("model", t) + ": model.preset \"" + m.preset + "\" has " +
                        k.model_key + " = " + shape_value_str(k, ours) + ", which contradicts " +
                        theirs + bound + "; leave the preset out to take the folder's shape");
    }
  }

  void train(const toml::table& t, TrainConfig& c) {
    const std::string s = "train";
    check_keys(s, t);
    get_int(t, s, "steps", 1, kInt64Max, c.steps);
    get_int_as(t, s, "micro_batch", 1, kIntMax, c.micro_batch);
    get_int_as(t, s, "grad_accum", 1, kIntMax, c.grad_accum);
    get_choice(t, s, "optimizer", {"adamw", "sgd"}, c.optimizer);
    get_float(t, s, "lr", Bound::kExclusive, 0, Bound::kNone, 0, c.lr);
    get_float(t, s, "min_lr", Bound::kInclusive, 0, Bound::kNone, 0, c.min_lr);
    get_float(t, s, "weight_decay", Bound::kInclusive, 0, Bound::kNone, 0, c.weight_decay);
    get_float(t, s, "beta1", Bound::kInclusive, 0, Bound::kExclusive, 1, c.beta1);
    get_float(t, s, "beta2", Bound::kInclusive, 0, Bound::kExclusive, 1, c.beta2);
    get_float(t, s, "eps", Bound::kExclusive, 0, Bound::kNone, 0, c.eps);
    get_float(t, s, "momentum", Bound::kInclusive, 0, Bound::kExclusive, 1, c.momentum);
    get_int(t, s, "warmup_steps", 0, kInt64Max, c.warmup_steps);
    get_choice(t, s, "lr_schedule", {"cosine", "linear", "constant"}, c.lr_schedule);
    get_float(t, s, "grad_clip", Bound::kInclusive, 0, Bound::kNone, 0, c.grad_clip);
    get_int_as(t, s, "seed", 0, kInt64Max, c.seed);
    get_int(t, s, "log_every", 1, kInt64Max, c.log_every);
    get_path(t, s, "init_from", c.init_from, &c.init_from_pos);
    get_int(t, s, "eval_every", 0, kInt64Max, c.eval_every);
    if (const toml::node* n = t.get("eval_every")) c.eval_every_pos = pos_of(s, "eval_every", *n);
    get_int_as(t, s, "eval_batches", 1, 1 << 20, c.eval_batches);
    if (const toml::node* n = t.get("freeze")) {
      const toml::array* arr = n->as_array();
      if (!arr) type_error(s, "freeze", *n, "an array of strings ([\"h.*.mlp.*\", ...])");
      c.freeze.clear();
      c.freeze_pos.clear();
      for (const toml::node& e : *arr) {
        if (!e.is_string() || e.as_string()->get().empty())
          throw ConfigError(
              where(s, "freeze", e) +
              ": train.freeze: each entry must be a non-empty string, a glob over "
              "Hugging Face parameter names (\"h.*.mlp.*\"), got " +
              (e.is_string() ? std::string("an empty string") : type_name_with_article(e)));
        c.freeze.push_back(e.as_string()->get());
        SourcePos pos = pos_of(s, "freeze", e);
        c.freeze_pos.push_back(pos);
      }
    }
    if (c.min_lr > c.lr) {
      const toml::node* n = t.get("min_lr");
      const std::string w = n ? where(s, "min_lr", *n) : where(s, "lr", *t.get("lr"));
      throw ConfigError(w + ": train.min_lr (" + format_double(c.min_lr) +
                        ") must be <= train.lr (" + format_double(c.lr) + ")");
    }
  }

  void data(const toml::table& t, DataConfig& c) {
    const std::string s = "data";
    check_keys(s, t);
    get_choice(t, s, "kind", {"synthetic", "text", "shards"}, c.kind);
    const bool has_path = get_path(t, s, "path", c.path, &c.path_pos);
    const bool has_pattern = get_path(t, s, "pattern", c.pattern, &c.path_pos);
    const toml::node* kind = t.get("kind");
    if (c.kind == "text" && !has_path) {
      throw ConfigError(where(s, "kind", *kind) + ": data.kind = \"text\" needs data.path, " +
                        "the text file to train on (e.g. path = \"corpus.txt\")");
    }
    if (c.kind == "shards" && !has_pattern) {
      throw ConfigError(
          where(s, "kind", *kind) + ": data.kind = \"shards\" needs " +
          "data.pattern, a glob of llm.c token shards (e.g. pattern = " + "\"data/train_*.bin\")");
    }
    if (has_path && c.kind != "text") {
      throw ConfigError(where(s, "path", *t.get("path")) +
                        ": data.path is only used with data.kind = \"text\"; remove it or set " +
                        "kind = \"text\" (valid kinds: \"synthetic\", \"text\", \"shards\")");
    }
    if (has_pattern && c.kind != "shards") {
      throw ConfigError(where(s, "pattern", *t.get("pattern")) +
                        ": data.pattern is only used with data.kind = \"shards\"");
    }
    get_int_as(t, s, "seed", 0, kInt64Max, c.seed);
    get_int_as(t, s, "branching", 1, 64, c.branching);
    get_bool(t, s, "shuffle", c.shuffle);
    get_int_as(t, s, "workers", 0, 64, c.workers);
    get_int_as(t, s, "prefetch", 1, 1024, c.prefetch);
    if (get_path(t, s, "tokenizer", c.tokenizer, &c.tokenizer_pos) && c.kind != "shards")
      throw ConfigError(where(s, "tokenizer", *t.get("tokenizer")) +
                        ": data.tokenizer names the tokenizer that wrote llm.c shards (data.kind = "
                        "\"shards\"); for text, write shards with `headroom shard TEXT OUTDIR "
                        "--tokenizer FILE` and train on those");
    validation_data(t, c);
  }

  // [data] val_path, val_pattern, val_fraction: at most one, the one the kind reads.
  void validation_data(const toml::table& t, DataConfig& c) {
    const std::string s = "data";
    SourcePos pos;
    const bool has_path = get_path(t, s, "val_path", c.val_path, &pos);
    const bool has_pattern = get_path(t, s, "val_pattern", c.val_pattern, &pos);
    get_float(t, s, "val_fraction", Bound::kExclusive, 0, Bound::kExclusive, 1, c.val_fraction);
    const bool has_fraction = t.get("val_fraction") != nullptr;
    if (has_fraction) c.val_pos = pos_of(s, "val_fraction", *t.get("val_fraction"));
    if (has_path || has_pattern) c.val_pos = pos;
    const char* key = has_path ? "val_path" : has_pattern ? "val_pattern" : "val_fraction";
    if (int(has_path) + int(has_pattern) + int(has_fraction) > 1)
      throw ConfigError(where(s, key, *t.get(key)) +
                        ": set one of data.val_path, data.val_pattern and data.val_fraction, "
                        "not several: each names the whole validation data");
    if (c.kind == "synthetic" && (has_path || has_pattern || has_fraction))
      throw ConfigError(where(s, key, *t.get(key)) + ": data." + key +
                        " is not used with data.kind = \"synthetic\", which validates on a "
                        "stream of its own from the same chain; remove it");
    if (has_path && c.kind != "text")
      throw ConfigError(where(s, "val_path", *t.get("val_path")) +
                        ": data.val_path is a text file, for data.kind = \"text\"; with "
                        "shards use data.val_pattern or data.val_fraction");
    if (has_pattern && c.kind != "shards")
      throw ConfigError(where(s, "val_pattern", *t.get("val_pattern")) +
                        ": data.val_pattern is a glob of shards, for data.kind = \"shards\"; "
                        "with text use data.val_path or data.val_fraction");
  }

  // Text data is bytes: every token 0..255 must be in the vocabulary. (Shards hold token ids of
  // whatever tokenizer wrote them; a token >= vocab_size is found when its batch is read.)
  void data_fits_model(toml::table& root, const Config& c) const {
    if (c.data.kind != "text" || c.model.vocab_size >= 256) return;
    const toml::table* model = root["model"].as_table();
    const toml::node* vocab = model ? model->get("vocab_size") : nullptr;
    const toml::table& data = *root["data"].as_table();  // kind = "text" was written there
    const std::string kind_at = where("data", "kind", *data.get("kind"));
    const std::string w = vocab ? where("model", "vocab_size", *vocab) : kind_at;
    throw ConfigError(w + ": model.vocab_size is " + std::to_string(c.model.vocab_size) +
                      ", but data.kind = \"text\"" + (vocab ? " (" + kind_at + ")" : "") +
                      " trains on bytes, tokens 0..255: model.vocab_size must be >= 256");
  }

  // train.eval_every on text or shards needs validation data that is not the training data.
  void evaluation_has_data(toml::table& root, const Config& c) const {
    const DataConfig& d = c.data;
    if (c.train.eval_every == 0 || d.kind == "synthetic") return;
    if (!d.val_path.empty() || !d.val_pattern.empty() || d.val_fraction > 0) return;
    const toml::node* n = root["train"].as_table()->get("eval_every");
    throw ConfigError(where("train", "eval_every", *n) + ": train.eval_every needs validation " +
                      "data: set data." + (d.kind == "text" ? "val_path" : "val_pattern") +
                      " or data.val_fraction (e.g. val_fraction = 0.1 holds out the last " +
                      "tenth of the " + (d.kind == "text" ? "text" : "tokens") + ")");
  }

  void device(const toml::table& t, DeviceConfig& c) {
    const std::string s = "device";
    check_keys(s, t);
    std::string kind;
    if (get_string(t, s, "kind", kind)) {
      const std::string w = where(s, "kind", *t.get("kind"));
      if (kind != "cpu" && kind != "cuda") {
        throw ConfigError(w + ": device.kind must be \"cpu\" or \"cuda\", got \"" + kind + "\"");
      }
      const toml::node* n = t.get("kind");
      const auto ov = overrides_.find(s + ".kind");
      c.kind_pos.file = ov != overrides_.end() ? "--set " + ov->second : file_;
      if (ov == overrides_.end()) {
        c.kind_pos.line = static_cast<int>(n->source().begin.line);
        c.kind_pos.column = static_cast<int>(n->source().begin.column);
      }
      c.kind = kind;
    }
    c.index_set = get_int_as(t, s, "index", 0, kIntMax, c.index);
    get_int_as(t, s, "threads", 0, 4096, c.threads);
    if (const toml::node* n = t.get("memory_limit")) c.memory_limit = memory_limit(s, *n);
  }

  // [host]: the host place's wall.
  void host(const toml::table& t, DeviceConfig& c) {
    const std::string s = "host";
    check_keys(s, t);
    if (const toml::node* n = t.get("memory_limit")) c.host_memory_limit = memory_limit(s, *n);
  }

  // `section`.memory_limit: a size string, a number of bytes, or "none" (0).
  uint64_t memory_limit(const std::string& s, const toml::node& node) {
    const toml::node* n = &node;
    const std::string key = s + ".memory_limit";
    uint64_t limit = 0;
    {
      const std::string w = where(s, "memory_limit", *n);
      if (n->is_integer()) {
        const int64_t v = n->as_integer()->get();
        if (v < 0) {
          throw ConfigError(w + ": " + key + " must be >= 0 bytes (0 or \"none\" for no " +
                            "limit) or a size string like \"64MiB\", got " + std::to_string(v));
        }
        limit = static_cast<uint64_t>(v);
      } else if (n->is_string()) {
        const std::string v = n->as_string()->get();
        if (v != "none") {
          try {
            limit = parse_size(v, w + ": " + key);
          } catch (const ConfigError& e) {
            throw ConfigError(std::string(e.what()) +
                              "; also valid: an integer number of bytes, or \"none\" for no limit");
          }
        }
      } else {
        type_error(s, "memory_limit", *n,
                   "a size string like \"64MiB\", an integer number of bytes, or \"none\"");
      }
      if (limit > kMaxDeviceBytes)
        throw ConfigError(w + ": " + key + " must be at most " + std::to_string(kMaxDeviceBytes) +
                          " bytes (256 TiB, more than any machine holds), got " +
                          std::to_string(limit));
    }
    return limit;
  }

  void distributed(const toml::table& t, DistributedConfig& c) {
    const std::string s = "distributed";
    check_keys(s, t);
    if (const toml::node* n = t.get("bucket_size")) {
      const std::string w = where(s, "bucket_size", *n);
      if (!n->is_string()) type_error(s, "bucket_size", *n, "a size string like \"25MiB\"");
      c.bucket_size = parse_size(n->as_string()->get(), w + ": distributed.bucket_size");
      if (c.bucket_size == 0)
        throw ConfigError(w + ": distributed.bucket_size must be > 0 bytes, got \"" +
                          n->as_string()->get() + "\"");
      if (c.bucket_size > kMaxDeviceBytes)
        throw ConfigError(w + ": distributed.bucket_size must be at most " +
                          std::to_string(kMaxDeviceBytes) + " bytes, got " +
                          std::to_string(c.bucket_size));
    }
    get_float(t, s, "timeout_s", Bound::kExclusive, 0, Bound::kNone, 0, c.timeout_s);
    get_bool(t, s, "overlap", c.overlap);
  }

  void plugins(const toml::node& node, std::vector<PluginEntry>& out) {
    const toml::array* arr = node.as_array();
    if (!arr || !arr->is_array_of_tables()) {
      if (!(arr && arr->empty())) {
        throw ConfigError(pos_str(file_, node.source()) +
                          ": 'plugins' must be an array of tables, written as [[plugins]] " +
                          "entries with name = \"...\", got " + type_name(node));
      }
    }
    std::map<std::string, std::string> seen;  // name -> position
    for (const toml::node& e : *arr) {
      const toml::table& t = *e.as_table();
      PluginEntry p;
      p.pos.file = file_;
      p.pos.line = static_cast<int>(t.source().begin.line);
      p.pos.column = static_cast<int>(t.source().begin.column);
      const std::string here = p.pos.str();
      const toml::node* name = t.get("name");
      if (!name) {
        throw ConfigError(here + ": [[plugins]] entry has no name; every entry needs " +
                          "name = \"...\" (lowercase letters, digits and _)");
      }
      if (!name->is_string()) {
        throw ConfigError(pos_str(file_, name->source()) +
                          ": plugins.name: expected a string, got " + type_name(*name));
      }
      p.name = name->as_string()->get();
      bool ok = !p.name.empty();
      for (char ch : p.name) {
        ok = ok && ((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_');
      }
      if (!ok) {
        throw ConfigError(pos_str(file_, name->source()) + ": plugin name '" + p.name +
                          "' must be non-empty and use only lowercase letters, digits and _ " +
                          "([a-z0-9_]+)");
      }
      auto [it, inserted] = seen.emplace(p.name, here);
      if (!inserted) {
        throw ConfigError(here + ": plugin '" + p.name + "' is listed twice (first at " +
                          it->second + "); each plugin may appear once in [[plugins]]");
      }
      // An override (--set plugins.NAME.key=value) is where its value came from.
      const std::string section = "plugins." + p.name;
      p.path_pos = p.pos;
      if (const toml::node* path = t.get("path")) {
        const std::string w = where(section, "path", *path);
        if (!path->is_string()) {
          throw ConfigError(w + ": plugins.path: expected a string, got " + type_name(*path));
        }
        const std::string v = path->as_string()->get();
        if (v.empty()) {
          throw ConfigError(w + ": plugins.path must name a file, got an empty string; leave it " +
                            "out to search the plugin path");
        }
        // As every path from --set: relative to the current directory, not the config file's.
        const auto ov = overrides_.find(section + ".path");
        p.path = resolve_path(v, ov != overrides_.end() ? std::string() : base_dir_);
        p.path_pos = SourcePos{};
        if (ov != overrides_.end()) {
          p.path_pos.file = "--set " + ov->second;
        } else {
          p.path_pos.file = file_;
          p.path_pos.line = static_cast<int>(path->source().begin.line);
          p.path_pos.column = static_cast<int>(path->source().begin.column);
        }
      }
      toml::table own = t;
      own.erase("name");
      own.erase("path");
      // From the parsed table, not the copy: copies do not keep their source positions.
      for (auto&& [key, value] : t) {
        if (key.str() == "name" || key.str() == "path") continue;
        SourcePos kp;
        const auto ov = overrides_.find(section + "." + std::string(key.str()));
        if (ov != overrides_.end()) {
          kp.file = "--set " + ov->second;
        } else {
          kp.file = file_;
          kp.line = static_cast<int>(value.source().begin.line);
          kp.column = static_cast<int>(value.source().begin.column);
        }
        p.key_pos[std::string(key.str())] = kp;
      }
      std::ostringstream os;
      os << own;
      p.toml = os.str();
      out.push_back(std::move(p));
    }
  }

  std::string file_;
  std::string base_dir_;
  std::map<std::string, std::string> overrides_;
  bool model_in_file_;
};

// The value of an override in TOML syntax; anything that does not parse as one value is a plain
// string.
// Whether `s` is UTF-8 without control characters (tab aside): what a TOML string may hold.
bool is_toml_text(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if ((c < 0x20 && c != '\t') || c == 0x7f) return false;
      ++i;
      continue;
    }
    const int n = c >= 0xf0 && c <= 0xf4 ? 3 : c >= 0xe0 ? 2 : c >= 0xc2 && c < 0xe0 ? 1 : -1;
    if (n < 0 || i + size_t(n) >= s.size()) return false;  // a bad lead byte, or cut short
    uint32_t cp = c & (0x3f >> n);
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3f);
    }
    const uint32_t min = n == 1 ? 0x80 : n == 2 ? 0x800 : 0x10000;
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += size_t(n) + 1;
  }
  return true;
}

// The value of an override: TOML, else a bare word taken as a string.
toml::table override_value(const std::string& text, const std::string& value) {
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
    if (parsed.size() == 1 && parsed.get("v") != nullptr) return parsed;
  } catch (const toml::parse_error&) {
  }
  if (!is_toml_text(value))
    throw ConfigError("--set " + text +
                      ": the value is neither TOML nor plain text (it holds invalid UTF-8 or a "
                      "control character); quote a string as TOML: key=\"...\"");
  parsed = toml::table{};
  parsed.insert("v", value);
  return parsed;
}

// "plugins.NAME.key=value" -> key of the [[plugins]] entry named NAME = value.
void apply_plugin_override(toml::table& root, const std::string& text, const std::string& name,
                           const std::string& key, const std::string& value) {
  const std::string at = "--set " + text + ": ";
  if (key == "name") {
    throw ConfigError(at + "a [[plugins]] entry's name cannot be changed with --set (the name " +
                      "picks the entry); edit the config file, or load another file with " +
                      "--set plugins." + name + ".path=FILE");
  }
  toml::node* plugins = root.get("plugins");
  toml::array* arr = plugins ? plugins->as_array() : nullptr;
  if (plugins && !(arr && (arr->empty() || arr->is_array_of_tables()))) {
    throw ConfigError(at + "'plugins' in the config file is not an array of [[plugins]] tables");
  }
  std::vector<std::string> names;
  toml::table* entry = nullptr;
  bool unnamed = false;  // an entry without a string name, which validation refuses at its line
  if (arr) {
    for (toml::node& e : *arr) {
      toml::table& t = *e.as_table();
      const toml::node* n = t.get("name");
      if (!n || !n->is_string()) {
        unnamed = true;
        continue;
      }
      const std::string& entry_name = n->as_string()->get();
      names.push_back(entry_name);
      if (entry_name == name && !entry) entry = &t;
    }
  }
  if (!entry && unnamed) return;  // the file's own error comes first
  if (!entry) {
    throw ConfigError(at + "no [[plugins]] entry is named '" + name + "'; " +
                      (names.empty() ? std::string("the config lists no plugins")
                                     : "the config lists: " + join(names, ", ")) +
                      " (--set can change the keys of a listed plugin, not add one)");
  }
  entry->insert_or_assign(key, *override_value(text, value).get("v"));
}

// "section.key=value" -> root[section][key] = value; "plugins.NAME.key=value" -> the key of the
// [[plugins]] entry named NAME.
void apply_override(toml::table& root, const std::string& text,
                    std::map<std::string, std::string>& where) {
  const std::string form =
      "expected --set section.key=value, e.g. --set train.steps=100, or "
      "--set plugins.NAME.key=value for a [[plugins]] entry";
  const size_t eq = text.find('=');
  if (eq == std::string::npos) {
    throw ConfigError("--set " + text + ": no '=' in the override; " + form);
  }
  const std::string key = trim(text.substr(0, eq));
  const std::string value = trim(text.substr(eq + 1));
  std::vector<std::string> parts;
  for (size_t b = 0;;) {
    const size_t dot = key.find('.', b);
    parts.push_back(key.substr(b, dot == std::string::npos ? std::string::npos : dot - b));
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  const bool empty_part =
      std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); });
  if (key.empty() || parts.size() < 2 || empty_part) {
    throw ConfigError("--set " + text + ": the key must be section.key; " + form);
  }
  // Bare TOML keys only: anything else could not be written back by `headroom check`.
  for (const std::string& p : parts) {
    if (!std::all_of(p.begin(), p.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
        }))
      throw ConfigError("--set " + text + ": '" + p +
                        "' is not a key: keys are made of letters, digits, '_' and '-'; " + form);
  }
  const std::string& section = parts[0];
  const Section* known = find_section(section);
  if (!known) {
    throw ConfigError("--set " + text + ": unknown section '" + section + "'; valid sections: " +
                      sections_list() + "; a [[plugins]] entry is set as plugins.NAME.key");
  }
  if (known->array_of_tables) {
    if (parts.size() != 3) {
      throw ConfigError(
          "--set " + text + ": a [[plugins]] override names the entry and one of " +
          "its keys: --set plugins.NAME.key=value (NAME: the entry's name = \"...\")");
    }
    apply_plugin_override(root, text, parts[1], parts[2], value);
    where[key] = text;
    return;
  }
  if (parts.size() != 2) {
    throw ConfigError("--set " + text + ": the key must be section.key; " + form);
  }
  const std::string& name = parts[1];

  toml::node* sec = root.get(section);
  if (sec && !sec->is_table()) {
    throw ConfigError("--set " + text + ": '" + section + "' is not a table in the config file");
  }
  if (!sec) {
    root.insert(section, toml::table{});
    sec = root.get(section);
  }
  sec->as_table()->insert_or_assign(name, *override_value(text, value).get("v"));
  where[key] = text;
}

}  // namespace

std::string SourcePos::str() const {
  if (line <= 0) return file;
  return file + ":" + std::to_string(line) + ":" + std::to_string(column);
}

const std::vector<std::string>& model_presets() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& p : presets())
      n.push_back(p.name);
    return n;
  }();
  return names;
}

Config load_config(const std::string& file, const std::vector<std::string>& overrides) {
  std::FILE* f = std::fopen(file.c_str(), "rb");
  if (!f) {
    throw ConfigError("cannot read config file '" + file + "': " + std::strerror(errno));
  }
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0)
    text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    throw ConfigError("cannot read config file '" + file + "': " + std::strerror(err));
  }
  return parse_config(text, file, overrides);
}

Config parse_config(const std::string& toml_text, const std::string& file,
                    const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(toml_text, std::string_view(file));
  } catch (const toml::parse_error& e) {
    SourcePos p;
    p.file = file;
    p.line = static_cast<int>(e.source().begin.line);
    p.column = static_cast<int>(e.source().begin.column);
    if (p.line == 0) p.line = 1, p.column = 1;
    throw ConfigError(p.str() + ": TOML syntax error: " + std::string(e.description()));
  }
  const bool model_in_file = root.get("model") != nullptr;
  std::map<std::string, std::string> where;
  for (const auto& o : overrides)
    apply_override(root, o, where);
  Validator v(file, std::move(where), model_in_file);
  return v.run(root);
}

std::string format_config(const Config& c) {
  std::ostringstream os;
  auto kv = [&](const char* key, const std::string& value) { os << key << " = " << value << "\n"; };
  auto num = [](auto v) { return std::to_string(v); };

  os << "# headroom resolved config";
  if (!c.file.empty()) {
    std::string from = c.file;  // a comment ends at a newline
    for (char& ch : from) {
      if (ch == '\n' || ch == '\r') ch = ' ';
    }
    os << " (from " << from << ")";
  }
  os << "\n\n[model]\n";
  if (!c.model.preset.empty()) kv("preset", toml_string(c.model.preset));
  kv("n_layer", num(c.model.n_layer));
  kv("n_head", num(c.model.n_head));
  kv("n_embd", num(c.model.n_embd));
  kv("seq_len", num(c.model.seq_len));
  kv("vocab_size", num(c.model.vocab_size));
  kv("attention", toml_string(c.model.attention));
  kv("loss", toml_string(c.model.loss));
  kv("chunk_tokens", num(c.model.chunk_tokens));
  kv("arch", toml_string(c.model.arch));
  if (c.model.llama()) {
    kv("n_kv_head", num(c.model.kv_heads()));
    kv("intermediate_size", num(c.model.intermediate_size));
    kv("rms_norm_eps", format_double(c.model.rms_norm_eps));
    kv("rope_theta", format_double(c.model.rope_theta));
    kv("tie_embeddings", c.model.tie_embeddings ? "true" : "false");
    kv("rope_scaling_factor", format_double(c.model.rope_scaling_factor));
    kv("rope_low_freq_factor", format_double(c.model.rope_low_freq_factor));
    kv("rope_high_freq_factor", format_double(c.model.rope_high_freq_factor));
    kv("rope_original_max_positions", num(c.model.rope_original_max_positions));
  }

  const TrainConfig& t = c.train;
  os << "\n[train]\n";
  kv("steps", num(t.steps));
  kv("micro_batch", num(t.micro_batch));
  kv("grad_accum", num(t.grad_accum));
  kv("optimizer", toml_string(t.optimizer));
  kv("lr", format_double(t.lr));
  kv("min_lr", format_double(t.min_lr));
  kv("weight_decay", format_double(t.weight_decay));
  kv("beta1", format_double(t.beta1));
  kv("beta2", format_double(t.beta2));
  kv("eps", format_double(t.eps));
  kv("momentum", format_double(t.momentum));
  kv("warmup_steps", num(t.warmup_steps));
  kv("lr_schedule", toml_string(t.lr_schedule));
  kv("grad_clip", format_double(t.grad_clip));
  kv("seed", num(t.seed));
  kv("log_every", num(t.log_every));
  if (!t.init_from.empty()) kv("init_from", toml_string(t.init_from));
  kv("eval_every", num(t.eval_every));
  kv("eval_batches", num(t.eval_batches));
  if (!t.freeze.empty()) {
    std::string list = "[";
    for (size_t i = 0; i < t.freeze.size(); ++i)
      list += (i ? ", " : "") + toml_string(t.freeze[i]);
    kv("freeze", list + "]");
  }

  os << "\n[data]\n";
  kv("kind", toml_string(c.data.kind));
  if (!c.data.path.empty()) kv("path", toml_string(c.data.path));
  if (!c.data.pattern.empty()) kv("pattern", toml_string(c.data.pattern));
  kv("seed", num(c.data.seed));
  kv("branching", num(c.data.branching));
  kv("shuffle", c.data.shuffle ? "true" : "false");
  kv("workers", num(c.data.workers));
  kv("prefetch", num(c.data.prefetch));
  if (!c.data.val_path.empty()) kv("val_path", toml_string(c.data.val_path));
  if (!c.data.val_pattern.empty()) kv("val_pattern", toml_string(c.data.val_pattern));
  if (c.data.val_fraction > 0) kv("val_fraction", format_double(c.data.val_fraction));
  if (!c.data.tokenizer.empty()) kv("tokenizer", toml_string(c.data.tokenizer));

  os << "\n[device]\n";
  kv("kind", toml_string(c.device.kind));
  kv("index", num(c.device.index));
  // A size in the largest unit that divides it ("64MiB"), else a number of bytes.
  const auto size_value = [](uint64_t bytes) {
    const std::pair<uint64_t, const char*> units[] = {
        {uint64_t{1} << 30, "GiB"}, {uint64_t{1} << 20, "MiB"}, {uint64_t{1} << 10, "KiB"}};
    for (const auto& [size, unit] : units) {
      if (bytes % size == 0) return "\"" + std::to_string(bytes / size) + unit + "\"";
    }
    return std::to_string(bytes);
  };
  const uint64_t ml = c.device.memory_limit;
  kv("memory_limit", ml == 0 ? std::string("\"none\"") : size_value(ml));
  if (c.device.threads != 0) kv("threads", num(c.device.threads));
  if (c.device.host_memory_limit != 0) {
    os << "\n[host]\n";
    kv("memory_limit", size_value(c.device.host_memory_limit));
  }

  os << "\n[snapshot]\n";
  kv("every", num(c.snapshot.every));
  if (!c.snapshot.dir.empty()) kv("dir", toml_string(c.snapshot.dir));
  kv("keep", num(c.snapshot.keep));
  kv("save_weights", c.snapshot.save_weights ? "true" : "false");

  os << "\n[distributed]\n";
  // A number of bytes is a size too: "100B" when no unit divides it.
  const uint64_t bs = c.distributed.bucket_size;
  const std::string bucket = size_value(bs);
  kv("bucket_size", bucket[0] == '"' ? bucket : "\"" + bucket + "B\"");
  kv("timeout_s", format_double(c.distributed.timeout_s));
  kv("overlap", c.distributed.overlap ? "true" : "false");

  if (!c.plugins.empty()) {
    toml::array entries;
    for (const auto& p : c.plugins) {
      toml::table e;
      try {
        e = toml::parse(p.toml, std::string_view(p.pos.file));
      } catch (const toml::parse_error& err) {
        throw ConfigError(p.pos.str() + ": plugin '" + p.name +
                          "': its settings are not valid TOML: " + std::string(err.description()));
      }
      e.insert_or_assign("name", p.name);
      if (!p.path.empty()) e.insert_or_assign("path", p.path);
      entries.push_back(std::move(e));
    }
    toml::table root;
    root.insert("plugins", std::move(entries));
    os << "\n" << root << "\n";
  }
  return os.str();
}

uint64_t parse_size(const std::string& text, const std::string& where) {
  const auto bad = [&]() {
    return ConfigError(where + ": bad size '" + text +
                       "': expected a number followed by B, KiB, MiB or GiB, e.g. \"64MiB\"");
  };
  const std::string s = trim(text);
  size_t i = 0;
  uint64_t whole = 0;
  const size_t int_begin = i;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    const uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (whole > (UINT64_MAX - d) / 10) throw bad();
    whole = whole * 10 + d;
    ++i;
  }
  if (i == int_begin) throw bad();
  std::string frac;
  bool has_dot = false;
  if (i < s.size() && s[i] == '.') {
    has_dot = true;
    ++i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9')
      frac += s[i++];
    if (frac.empty()) throw bad();
  }
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t'))
    ++i;
  const std::string unit = s.substr(i);
  uint64_t mult = 0;
  if (unit.empty()) {
    if (has_dot) throw bad();  // a plain number of bytes must be whole
    mult = 1;
  } else if (unit == "B") {
    mult = 1;
  } else if (unit == "KiB") {
    mult = uint64_t{1} << 10;
  } else if (unit == "MiB") {
    mult = uint64_t{1} << 20;
  } else if (unit == "GiB") {
    mult = uint64_t{1} << 30;
  } else {
    throw bad();
  }
  if (whole > UINT64_MAX / mult) throw bad();
  uint64_t bytes = whole * mult;
  // floor(mult * 0.frac), exactly: fold the digits in from the last one.
  uint64_t part = 0;
  for (size_t k = frac.size(); k-- > 0;) {
    part = (static_cast<uint64_t>(frac[k] - '0') * mult + part) / 10;
  }
  if (bytes > UINT64_MAX - part) throw bad();
  bytes += part;
  return bytes;
}

std::string format_bytes(uint64_t bytes) {
  return headroom_units::format_bytes(bytes);
}

}  // namespace headroom
