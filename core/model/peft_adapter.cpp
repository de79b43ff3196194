#include "core/model/peft_adapter.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/config/config.h"
#include "core/model/hf_folder.h"
#include "core/model/safetensors.h"
#include "core/os/output_file.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// PEFT's names are the wrapped model's: GPT-2's modules under transformer., below
// base_model.model.
std::string peft_prefix(const ModelConfig& m) {
  return std::string("base_model.model.") + (m.llama() ? "" : "transformer.");
}

// A number of adapter_config.json as it would be written there: 4, 8.5.
std::string num_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string targets_str(const std::vector<std::string>& s) {
  std::string out;
  for (const std::string& t : s)
    out += (out.empty() ? "" : ", ") + t;
  return "[" + out + "]";
}

// What a writer of the model's weights leaves out of a merged model: the adapters.
std::vector<TensorPiece> base_only(const std::string& ours, int64_t rows) {
  return is_adapter_param(ours) ? std::vector<TensorPiece>{}
                                : std::vector<TensorPiece>{{ours, 0, rows}};
}

}  // namespace

void save_peft_adapter(const std::string& dir, const Gpt<float>& model,
                       const std::vector<LoraSpec>& lora, const std::string& base,
                       const std::vector<std::vector<float>>* host) {
  if (lora.empty()) throw ConfigError("--save-weights " + dir + ": this model has no adapters");
  for (const LoraSpec& s : lora)
    if (s.rank != lora.front().rank || s.alpha != lora.front().alpha)
      throw ConfigError("--save-weights " + dir +
                        ": PEFT's adapter_config.json takes one r and lora_alpha for all "
                        "targets; these adapters have several");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw OutputError("--save-weights " + dir + ": cannot create the folder: " + ec.message());
  const std::string prefix = peft_prefix(model.config());
  save_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), model, host,
                   [&](const std::string& ours, int64_t rows) {
                     return is_adapter_param(ours)
                                ? std::vector<TensorPiece>{{prefix + ours, 0, rows}}
                                : std::vector<TensorPiece>{};
                   });
  json c = json::object();
  c["peft_type"] = "LORA";
  c["task_type"] = "CAUSAL_LM";
  // Absolute, so that the folder names its base wherever it is read from (init_from's path is).
  c["base_model_name_or_path"] = base.empty() ? base : fs::absolute(base, ec).string();
  c["r"] = lora.front().rank;
  c["lora_alpha"] = lora.front().alpha;
  c["lora_dropout"] = lora.front().dropout;
  std::vector<std::string> targets;
  for (const LoraSpec& s : lora)
    targets.push_back(s.target);
  // PEFT writes its "all-linear" as the string, not a module name in a list.
  if (targets.size() == 1 && targets[0] == kAllLinear) {
    c["target_modules"] = targets[0];
  } else {
    c["target_modules"] = targets;
  }
  c["fan_in_fan_out"] = !model.config().llama();  // GPT-2's Conv1D stores (in, out)
  c["bias"] = "none";
  c["inference_mode"] = true;
  AtomicFile config((fs::path(dir) / "adapter_config.json").string(),
                    "--save-weights adapter_config.json");
  config.write(c.dump(2) + "\n");
  config.commit();
}

void load_peft_adapter(const std::string& dir, Gpt<float>& model, const std::vector<LoraSpec>& lora,
                       const MasterAccess& access) {
  if (lora.empty())
    throw ConfigError(dir +
                      ": is a PEFT adapter folder (it has adapter_config.json), but this run adds "
                      "no adapters: list the lora plugin in [[plugins]] with the adapter's r, "
                      "alpha and target_modules, or name its base folder instead");
  const PeftAdapterConfig c = read_peft_adapter_config(dir);
  // The run's adapters must be the folder's: the same rank, scale and modules.
  for (const LoraSpec& s : lora) {
    if (double(s.rank) != c.r)
      throw ConfigError(c.file + ": r is " + num_str(c.r) +
                        ", but this run's lora plugin has r = " + std::to_string(s.rank));
    if (s.alpha != c.alpha)
      throw ConfigError(c.file + ": lora_alpha is " + num_str(c.alpha) +
                        ", but this run's lora plugin has alpha = " + num_str(s.alpha));
  }
  std::vector<std::string> ours;
  for (const LoraSpec& s : lora)
    ours.push_back(s.target);
  std::sort(ours.begin(), ours.end());
  if (c.targets != ours)
    throw ConfigError(c.file + ": target_modules is " + targets_str(c.targets) +
                      ", but this run's lora plugin has target_modules = " + targets_str(ours));

  // Every tensor of the file matched to an adapter, by name and shape, before any is read.
  const std::string weights = (fs::path(dir) / "adapter_model.safetensors").string();
  const std::vector<SafetensorsEntry> entries = read_safetensors_header(weights);
  const std::string prefix = peft_prefix(model.config());
  std::map<std::string, const Param<float>*> adapters;
  for (const Param<float>* p : model.params())
    if (is_adapter_param(p->name)) adapters[p->name] = p;
  std::map<const Param<float>*, const SafetensorsEntry*> found;
  for (const SafetensorsEntry& e : entries) {
    std::string name = e.name;
    if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
    // PEFT's in-memory names carry the adapter's name; saved ones do not.
    const size_t d = name.find(".default.");
    if (d != std::string::npos) name.erase(d, 8);
    const auto it = adapters.find(name);
    if (it == adapters.end())
      throw ConfigError(weights + ": tensor \"" + e.name + "\" is not an adapter of this run (" +
                        std::to_string(adapters.size()) + " adapters, as " + prefix +
                        adapters.begin()->first + ")");
    if (e.shape != it->second->shape)
      throw ConfigError(weights + ": tensor \"" + e.name + "\" has shape " + json(e.shape).dump() +
                        ", expected " + json(it->second->shape).dump());
    if (!found.emplace(it->second, &e).second)
      throw ConfigError(weights + ": tensor \"" + e.name + "\" is there twice");
  }
  for (const auto& [name, p] : adapters)
    if (!found.count(p))
      throw ConfigError(weights + ": holds no tensor " + prefix + name + " (" +
                        std::to_string(adapters.size() - found.size()) +
                        " of this run's adapters are missing)");

  std::map<const Param<float>*, std::vector<float>> host;
  for (const auto& [p, e] : found) {
    std::vector<float>& v = host[p];
    v.resize(p->numel);
    read_safetensors_tensor(weights, *e, v.data(), false);
  }
  upload_params(model, host, access);
}

std::vector<std::vector<float>> merge_adapters(const Gpt<float>& model,
                                               const std::vector<LoraSpec>& lora,
                                               std::vector<std::vector<float>> host) {
  const std::vector<Param<float>*> params = model.params();
  if (host.size() != params.size())
    throw std::logic_error("merge_adapters: " + std::to_string(host.size()) + " tensors for " +
                           std::to_string(params.size()) + " parameters");
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i)
    index[params[i]->name] = i;
  std::set<std::string> merged;  // a module two targets name has one adapter (Gpt's rule)
  for (const LoraSpec& spec : lora) {
    const float scale = float(spec.alpha / spec.rank);
    for (const AdapterSite& site : gpt_adapter_sites(model.config())) {
      if (!lora_target_matches(spec.target, site.module) || !merged.insert(site.module).second)
        continue;
      const std::vector<float>& A = host.at(index.at(site.module + ".lora_A.weight"));  // (r, in)
      const std::vector<float>& B = host.at(index.at(site.module + ".lora_B.weight"));  // (rows, r)
      std::vector<float>& W = host.at(index.at(site.weight));                           // (OC, in)
      const int64_t r = spec.rank, in = site.in;
      for (int64_t i = 0; i < site.rows; ++i) {
        float* w = W.data() + (site.row0 + i) * in;
        for (int64_t j = 0; j < in; ++j) {
          double d = 0;
          for (int64_t k = 0; k < r; ++k)
            d += double(B[size_t(i * r + k)]) * double(A[size_t(k * in + j)]);
          // PEFT: delta = (B @ A) * scaling in f32, then W += delta.
          w[j] += float(d) * scale;
        }
      }
    }
  }
  return host;
}

void save_merged_weights(const std::string& path, const Gpt<float>& model,
                         const std::vector<LoraSpec>& lora,
                         const std::vector<std::vector<float>>& host) {
  const std::vector<std::vector<float>> merged = merge_adapters(model, lora, host);
  if (names_hf_folder(path)) {
    save_hf_folder(path, model, &merged);  // a Hugging Face folder holds no adapters
  } else {
    save_safetensors(path, model, &merged, base_only);
  }
}

}  // namespace headroom
