#include "core/model/hf_folder.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/config/hf_config.h"
#include "core/model/safetensors.h"
#include "core/os/output_file.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// An index maps a few hundred names to a few shards: a few MB at most. Anything far larger is not
// one, and is refused before it is read.
constexpr uint64_t kMaxIndexBytes = 64u << 20;

// Part of one of our parameters that is its own tensor in a Hugging Face folder: rows
// [row, row + rows) of our (out, in) matrix (all of it for most; Llama's fused projections are
// several of Hugging Face's stacked by rows).
struct Piece {
  std::string hf_name;  // without the prefix
  int64_t row = 0, rows = 0;
};

// One architecture's tensor names in a Hugging Face folder.
struct HfNames {
  std::string arch;
  // A prefix a file's names may carry (GPT2LMHeadModel's "transformer.h.0...") or not
  // (GPT2Model's "h.0..."); the folder headroom writes carries it.
  std::string prefix;
  // Our parameter `ours` of shape (rows, ..) as Hugging Face's tensors.
  std::vector<Piece> (*pieces)(const std::string& ours, int64_t rows, const ModelConfig& mc);
  // Hugging Face stores this parameter's 2-D weight (in, out); ours is (out, in).
  bool (*transposed)(const std::string& ours);
  // A tensor (name without the prefix) that is a buffer, not a parameter: skipped.
  bool (*ignored)(const std::string& name);
  // The output head's name, and the parameter it is tied to when the model ties it.
  std::string head;
  std::string head_tied_to;
};

std::vector<Piece> whole(const std::string& ours, int64_t rows, const ModelConfig&) {
  return {{ours, 0, rows}};
}

// GPT-2's names are headroom's; Hugging Face's Conv1D stores c_attn, c_proj and c_fc (in, out).
bool gpt2_transposed(const std::string& ours) {
  return ends_with(ours, ".attn.c_attn.weight") || ends_with(ours, ".attn.c_proj.weight") ||
         ends_with(ours, ".mlp.c_fc.weight") || ends_with(ours, ".mlp.c_proj.weight");
}
// h.N.attn.bias and h.N.attn.masked_bias: the causal-mask buffers older transformers saved.
bool gpt2_ignored(const std::string& name) {
  if (name.compare(0, 2, "h.") != 0) return false;
  const size_t dot = name.find('.', 2);
  if (dot == 2 || dot == std::string::npos || name.find_first_not_of("0123456789", 2) != dot)
    return false;
  const std::string rest = name.substr(dot);
  return rest == ".attn.bias" || rest == ".attn.masked_bias";
}

// Llama's names are Hugging Face's, but for the two fused projections: self_attn.qkv_proj is
// q_proj (n_embd rows), k_proj and v_proj (kv_width rows each); mlp.gate_up_proj is gate_proj
// then up_proj (rows / 2 each). nn.Linear stores (out, in), as ours.
std::vector<Piece> llama_pieces(const std::string& ours, int64_t rows, const ModelConfig& mc) {
  const auto base = [&](const char* suffix) {
    return ours.substr(0, ours.size() - std::string(suffix).size());
  };
  if (ends_with(ours, ".self_attn.qkv_proj.weight")) {
    const std::string b = base("qkv_proj.weight");
    const int64_t kv = (rows - mc.n_embd) / 2;
    return {{b + "q_proj.weight", 0, rows - 2 * kv},
            {b + "k_proj.weight", rows - 2 * kv, kv},
            {b + "v_proj.weight", rows - kv, kv}};
  }
  if (ends_with(ours, ".mlp.gate_up_proj.weight")) {
    const std::string b = base("gate_up_proj.weight");
    return {{b + "gate_proj.weight", 0, rows / 2}, {b + "up_proj.weight", rows / 2, rows / 2}};
  }
  return {{ours, 0, rows}};
}
bool never(const std::string&) {
  return false;
}
// model.layers.N.self_attn.rotary_emb.inv_freq: the rotary table older transformers saved.
bool llama_ignored(const std::string& name) {
  return ends_with(name, ".rotary_emb.inv_freq");
}

const std::vector<HfNames>& name_tables() {
  static const std::vector<HfNames> tables = {
      {"gpt2", "transformer.", whole, gpt2_transposed, gpt2_ignored, "lm_head.weight",
       "wte.weight"},
      // LlamaForCausalLM's names carry "model." (ours too); LlamaModel's do not.
      {"llama", "", llama_pieces, never, llama_ignored, "lm_head.weight",
       "model.embed_tokens.weight"},
  };
  return tables;
}

const HfNames& names_of(const std::string& arch) {
  for (const HfNames& n : name_tables())
    if (n.arch == arch) return n;
  throw ConfigError("headroom has no Hugging Face names for arch \"" + arch + "\"");
}

// The name of a tensor in a file, as the table knows it: LlamaModel's "layers.0..." is
// LlamaForCausalLM's "model.layers.0...", GPT2LMHeadModel's "transformer.h.0..." GPT2Model's
// "h.0...".
std::string table_name(const HfNames& names, const std::string& full) {
  if (!names.prefix.empty())
    return full.compare(0, names.prefix.size(), names.prefix) == 0
               ? full.substr(names.prefix.size())
               : full;
  if (names.arch == "llama" && full != names.head && full.compare(0, 6, "model.") != 0)
    return "model." + full;
  return full;
}

std::string read_small_file(const std::string& path, uint64_t limit) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw ConfigError(path + ": is not a regular file");
  const uint64_t size = fs::file_size(path, ec);
  if (ec) throw ConfigError(path + ": cannot read its size: " + ec.message());
  if (size > limit)
    throw ConfigError(path + ": is " + std::to_string(size) + " bytes, over the limit of " +
                      std::to_string(limit));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open it");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Which file holds each tensor: every tensor of model.safetensors, or the index's weight_map.
// Each (file, entry) comes checked: the file exists and its header parses, and the index and the
// shards agree (every tensor the index names is in the shard it names, and no shard holds one the
// index does not give it).
struct Located {
  std::string file;
  SafetensorsEntry entry;
};
std::vector<Located> locate_tensors(const std::string& dir) {
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  std::error_code ec;
  std::vector<Located> out;
  // model.safetensors first, as transformers' from_pretrained looks.
  if (fs::exists(single, ec) || !fs::exists(index, ec)) {
    if (!fs::exists(single, ec))
      throw ConfigError(dir +
                        ": has neither model.safetensors nor model.safetensors.index.json "
                        "(the index of model-0000k-of-0000n.safetensors shards)");
    for (SafetensorsEntry& e : read_safetensors_header(single))
      out.push_back({single, std::move(e)});
    return out;
  }
  json j;
  try {
    j = json::parse(read_small_file(index, kMaxIndexBytes));
  } catch (const json::parse_error& e) {
    throw ConfigError(index + ": not valid JSON: " + e.what());
  }
  const auto map = j.is_object() ? j.find("weight_map") : j.end();
  if (map == j.end() || !map->is_object())
    throw ConfigError(index + ": has no \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::set<std::string>> by_file;  // shard -> the tensors it should hold
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string())
      throw ConfigError(index + ": weight_map[" + json_quoted(name) + "] is a JSON " +
                        file.type_name() + ", not a file name");
    const std::string f = file.get<std::string>();
    // A shard is a file of the folder, never a path out of it.
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      throw ConfigError(index + ": weight_map[" + json_quoted(name) + "] is " + json_quoted(f) +
                        ", not the name of a file in the folder");
    by_file[f].insert(name);
  }
  for (const auto& [f, names] : by_file) {
    const std::string path = (fs::path(dir) / f).string();
    if (!fs::exists(path, ec))
      throw ConfigError(index + ": names shard " + f + " (for " + json_quoted(*names.begin()) +
                        (names.size() > 1 ? " and " + std::to_string(names.size() - 1) + " more"
                                          : std::string()) +
                        "), but " + path + " is missing");
    std::set<std::string> held;
    for (SafetensorsEntry& e : read_safetensors_header(path)) {
      if (!names.count(e.name))
        throw ConfigError(path + ": holds tensor " + json_quoted(e.name) + ", which " + index +
                          " does not place in this shard");
      held.insert(e.name);
      out.push_back({path, std::move(e)});
    }
    for (const std::string& name : names)
      if (!held.count(name))
        throw ConfigError(index + ": places tensor " + json_quoted(name) + " in " + f + ", but " +
                          path + " has no such tensor");
  }
  return out;
}

}  // namespace

bool names_hf_folder(const std::string& path) {
  std::error_code ec;
  return !path.empty() && (path.back() == '/' || fs::is_directory(path, ec));
}

namespace {

// Where each parameter's tensors are in a folder, every name, shape and the config.json checked.
struct FolderMatch {
  HfModelConfig hf;
  std::vector<Located> tensors;
  // Our parameter name -> its pieces, each with its tensor in `tensors`.
  std::map<std::string, std::vector<std::pair<Piece, size_t>>> found;
  int64_t head = -1;  // the tied head's tensor, when the folder has one
};

// The shape of piece `pc` of parameter `p` in the folder: its rows of ours, (in, out) when the
// table says Hugging Face transposes it.
std::vector<int64_t> piece_shape(const HfNames& names, const ParamShape& p, const Piece& pc) {
  std::vector<int64_t> shape = p.shape;
  shape[0] = pc.rows;
  if (names.transposed(p.name)) std::swap(shape[0], shape[1]);
  return shape;
}

// Matches the folder `dir` to a model of shape `mc` whose parameters are `params` (names and
// shapes, ours), reading headers only.
FolderMatch match_folder(const std::string& dir, const ModelConfig& mc,
                         const std::vector<ParamShape>& params) {
  FolderMatch m;
  m.hf = read_hf_config(dir);
  const HfModelConfig& hf = m.hf;
  if (hf.arch != mc.arch)
    throw ConfigError(hf.file + ": is a " + hf.arch + " model, but this model is " + mc.arch);
  for (const auto& k : hf.shape) {
    const double ours = model_shape_value(mc, k.model_key);
    if (ours != k.value && !(k.at_most && ours < k.value))
      throw ConfigError(hf.file + ": " + k.hf_key + " is " + shape_value_str(k, k.value) +
                        ", but the model's " + k.model_key + " is " + shape_value_str(k, ours));
  }
  if (mc.pruned() || mc.heads_pruned())
    throw ConfigError(dir +
                      ": a Hugging Face folder holds a model of one MLP width and head count; "
                      "this model is pruned (load its weights from a .safetensors file)");
  const HfNames& names = names_of(hf.arch);
  const bool tied = mc.tied();
  m.tensors = locate_tensors(dir);

  // Each Hugging Face tensor name -> the parameter and the piece of it the tensor holds.
  std::map<std::string, std::pair<const ParamShape*, Piece>> by_hf_name;
  for (const ParamShape& p : params)
    for (const Piece& pc : names.pieces(p.name, p.shape[0], mc))
      by_hf_name[pc.hf_name] = {&p, pc};
  std::map<std::string, size_t> seen;  // Hugging Face name -> its tensor
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const Located& t = m.tensors[i];
    const std::string& full = t.entry.name;
    const std::string name = table_name(names, full);
    if (names.ignored(name)) continue;
    if (name == names.head && tied) {
      m.head = int64_t(i);
      continue;
    }
    const auto it = by_hf_name.find(name);
    if (it == by_hf_name.end())
      throw ConfigError(t.file + ": tensor " + json_quoted(full) +
                        " is not a parameter of this model (" + hf.arch + ", n_layer " +
                        std::to_string(mc.n_layer) + ")");
    const auto [at, fresh] = seen.emplace(name, i);
    if (!fresh)
      throw ConfigError(t.file + ": tensor " + json_quoted(full) +
                        " is there twice: " + m.tensors[at->second].file + " holds " +
                        json_quoted(m.tensors[at->second].entry.name) + " too");
    const auto& [p, pc] = it->second;
    const std::vector<int64_t> expected = piece_shape(names, *p, pc);
    if (t.entry.shape != expected)
      throw ConfigError(t.file + ": tensor " + json_quoted(full) + " has shape " +
                        shape_str(t.entry.shape) + ", expected " + shape_str(expected) + " (" +
                        hf.file + "'s shape, Hugging Face layout)");
    m.found[p->name].push_back({pc, i});
  }
  for (const auto& [name, target] : by_hf_name)
    if (!seen.count(name))
      throw ConfigError(dir + ": no file of the folder holds tensor " + names.prefix + name + " (" +
                        std::to_string(by_hf_name.size() - seen.size()) +
                        " of the model's tensors are missing)");
  if (m.head >= 0) {
    const SafetensorsEntry& head = m.tensors[size_t(m.head)].entry;
    const SafetensorsEntry& tied_to = m.tensors[seen.at(names.head_tied_to)].entry;
    if (head.shape != tied_to.shape)
      throw ConfigError(m.tensors[size_t(m.head)].file + ": tensor " + json_quoted(head.name) +
                        " has shape " + shape_str(head.shape) + ", expected " +
                        shape_str(tied_to.shape) + " (tied to " + names.head_tied_to + ")");
  }
  return m;
}

}  // namespace

void check_hf_folder(const std::string& dir, const ModelConfig& m) {
  match_folder(dir, m, gpt_param_shapes(m));
}

void load_hf_folder(const std::string& dir, Gpt<float>& model, const MasterAccess& access,
                    const MasterAccess& frozen_access) {
  // Every tensor matched to a parameter before any is read, so a bad folder leaves the model as
  // it was.
  std::vector<ParamShape> shapes;
  std::map<std::string, const Param<float>*> params;
  for (const Param<float>* p : model.params()) {
    // A Hugging Face folder is a base model: LoRA adapters keep their init.
    if (is_adapter_param(p->name)) continue;
    shapes.push_back({0, p->name, p->shape, false});
    params[p->name] = p;
  }
  const FolderMatch m = match_folder(dir, model.config(), shapes);
  const HfNames& names = names_of(m.hf.arch);

  std::map<const Param<float>*, std::vector<float>> host;
  for (const auto& [name, pieces] : m.found) {
    const Param<float>* p = params.at(name);
    std::vector<float>& v = host[p];
    v.resize(p->numel);
    const uint64_t cols = p->numel / uint64_t(p->shape[0]);  // a row of ours
    for (const auto& [pc, i] : pieces)
      read_safetensors_tensor(m.tensors[i].file, m.tensors[i].entry,
                              v.data() + uint64_t(pc.row) * cols, names.transposed(name));
  }
  // The head is tied: a checkpoint whose head differs would load as another model, so it is
  // refused rather than dropped.
  if (m.head >= 0) {
    const Located& head = m.tensors[size_t(m.head)];
    const std::vector<float>& tied = host.at(params.at(names.head_tied_to));
    std::vector<float> v(tied.size());
    read_safetensors_tensor(head.file, head.entry, v.data(), false);
    if (std::memcmp(v.data(), tied.data(), 4 * v.size()) != 0)
      throw ConfigError(head.file + ": tensor " + json_quoted(head.entry.name) + " differs from " +
                        names.head_tied_to +
                        ", but this model ties the output head to it: an untied checkpoint cannot "
                        "be loaded into it" +
                        (model.config().llama() ? " (set model.tie_embeddings = false)" : ""));
  }

  upload_params(model, host, access, frozen_access);
}

void save_hf_folder(const std::string& dir, const Gpt<float>& model,
                    const std::vector<std::vector<float>>* host) {
  const ModelConfig& mc = model.config();
  // A Llama has no .safetensors file of its own (core/run/trainer.cpp): its snapshots keep it.
  if (mc.pruned() || mc.heads_pruned())
    throw ConfigError("--save-weights " + dir +
                      ": this model is pruned (its blocks differ in MLP "
                      "width or heads), which a Hugging Face config.json cannot describe; " +
                      (mc.llama() ? std::string("an arch = \"llama\" model is saved only as a "
                                                "Hugging Face folder, so a pruned one's weights "
                                                "stay in its snapshots ([snapshot] every)")
                                  : std::string("save to a .safetensors file instead")));
  const HfNames& names = names_of(mc.arch);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw OutputError("--save-weights " + dir + ": cannot create the folder: " + ec.message());
  // Each file appears whole or not at all (AtomicFile); the weights go first, so a folder with a
  // new config.json always has the weights it was written with.
  save_safetensors((fs::path(dir) / "model.safetensors").string(), model, host,
                   [&](const std::string& ours, int64_t rows) {
                     std::vector<TensorPiece> out;
                     if (is_adapter_param(ours)) return out;  // a base model's folder
                     for (const Piece& pc : names.pieces(ours, rows, mc))
                       out.push_back({names.prefix + pc.hf_name, pc.row, pc.rows});
                     return out;
                   });
  AtomicFile config((fs::path(dir) / "config.json").string(), "--save-weights config.json");
  config.write(hf_config_json(mc.arch, hf_shape_of(mc)));
  config.commit();
}

void load_weights(const std::string& path, Gpt<float>& model, const MasterAccess& access,
                  const MasterAccess& frozen_access) {
  if (is_hf_folder(path)) {
    load_hf_folder(path, model, access, frozen_access);
  } else {
    load_safetensors(path, model, access, frozen_access);
  }
}

void save_weights_to(const std::string& path, const Gpt<float>& model,
                     const std::vector<std::vector<float>>* host) {
  if (names_hf_folder(path)) {
    save_hf_folder(path, model, host);
  } else {
    save_safetensors(path, model, host);
  }
}

}  // namespace headroom
