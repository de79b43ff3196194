#include "core/run/sample.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <sstream>

#include "core/config/config.h"
#include "core/config/hf_config.h"
#include "core/data/bpe_tokenizer.h"
#include "core/device/device.h"
#include "core/model/hf_folder.h"
#include "core/model/peft_adapter.h"
#include "core/model/safetensors.h"
#include "core/run/snapshot.h"
#include "core/run/snapshot_io.h"

namespace headroom {

namespace {

namespace fs = std::filesystem;

// "n_layer=1 n_head=2 n_embd=16 seq_len=16 vocab_size=64": a snapshot's model (trainer.cpp).
ModelConfig model_of_signature(const std::string& sig, const std::string& file) {
  ModelConfig m;
  std::istringstream is(sig);
  std::string word;
  int found = 0;
  while (is >> word) {
    const size_t eq = word.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = word.substr(0, eq);
    // A pruned model's per-block widths: "mlp_hidden=64,32" "attn_heads=2,1".
    if (k == "mlp_hidden" || k == "attn_heads") {
      std::vector<int>& out = k == "mlp_hidden" ? m.mlp_hidden : m.attn_heads;
      std::istringstream list(word.substr(eq + 1));
      std::string n;
      while (std::getline(list, n, ',')) {
        try {
          out.push_back(std::stoi(n));
        } catch (const std::exception&) {
          out.clear();
          break;
        }
      }
      continue;
    }
    int v = 0;
    try {
      v = std::stoi(word.substr(eq + 1));
    } catch (const std::exception&) {
      continue;
    }
    int* slot = k == "n_layer"      ? &m.n_layer
                : k == "n_head"     ? &m.n_head
                : k == "n_embd"     ? &m.n_embd
                : k == "seq_len"    ? &m.seq_len
                : k == "vocab_size" ? &m.vocab_size
                                    : nullptr;
    if (slot) *slot = v, ++found;
  }
  try {
    read_llama_signature(sig, m);
  } catch (const std::exception& e) {
    throw ConfigError(file + ": its model \"" + sig + "\" is not a Llama headroom can build (" +
                      e.what() + "); pass --config with the model");
  }
  const auto widths_ok = [&](const std::vector<int>& w, int most) {
    return w.empty() || (int(w.size()) == m.n_layer && std::all_of(w.begin(), w.end(), [&](int x) {
                           return x >= 1 && x <= most;
                         }));
  };
  if (found != 5 || m.n_layer < 1 || m.n_head < 1 || m.n_embd < 1 || m.seq_len < 1 ||
      m.vocab_size < 1 || m.n_embd % m.n_head != 0 ||
      !widths_ok(m.mlp_hidden, m.default_mlp_width()) || !widths_ok(m.attn_heads, m.n_head) ||
      (m.llama() && (m.n_kv_head < 1 || m.n_head % m.n_kv_head != 0 || m.intermediate_size < 1)))
    throw ConfigError(file + ": its model \"" + sig +
                      "\" is not a shape headroom can build; pass --config with the model");
  return m;
}

// A pruned model's widths from its weights file (the shapes of its blocks' tensors, as
// [train] init_from reads them), into `m`.
void adopt_weights_widths(const std::string& path, ModelConfig& m) {
  m.mlp_hidden = safetensors_mlp_widths(path, m);
  m.attn_heads = safetensors_attn_heads(path, m);
}

// The model shape a GPT-2 safetensors file holds: wte (V, C), wpe (T, C), blocks h.0 .. h.L-1,
// and a pruned model's widths. n_head is not in the tensors: headroom's own files record it in
// their metadata; for another's, GPT-2's head size of 64 is assumed (and said).
ModelConfig model_of_weights(const std::string& path, std::ostream& log) {
  if (is_hf_folder(path)) return model_config_of(read_hf_config(path));
  std::map<std::string, std::string> meta;
  const std::vector<SafetensorsEntry> entries = read_safetensors_header(path, &meta);
  ModelConfig m;
  for (const SafetensorsEntry& e : entries) {
    std::string name = e.name;
    if (name.rfind("transformer.", 0) == 0) name = name.substr(12);
    if (name == "wte.weight" && e.shape.size() == 2)
      m.vocab_size = int(e.shape[0]), m.n_embd = int(e.shape[1]);
    if (name == "wpe.weight" && e.shape.size() == 2) m.seq_len = int(e.shape[0]);
    if (name.rfind("h.", 0) == 0) m.n_layer = std::max(m.n_layer, std::atoi(name.c_str() + 2) + 1);
  }
  if (m.vocab_size < 1 || m.seq_len < 1 || m.n_layer < 1)
    throw ConfigError(path + ": holds no GPT-2 (wte.weight, wpe.weight and h.N.* tensors)");
  const auto it = meta.find("n_head");
  int recorded = 0;
  if (it != meta.end()) {
    try {
      recorded = std::stoi(it->second);
    } catch (const std::exception&) {
      recorded = 0;
    }
  }
  if (recorded >= 1 && m.n_embd % recorded == 0) {
    m.n_head = recorded;
  } else {
    m.n_head = m.n_embd % 64 == 0 ? m.n_embd / 64 : 1;
    log << "headroom: " << path << " does not record n_head: assumed " << m.n_head
        << " (head size 64, GPT-2's; pass --config to say otherwise)\n";
  }
  adopt_weights_widths(path, m);
  return m;
}

// The newest snapshot in `dir`, or "" when there is none.
bool has_snapshot(const std::string& dir) {
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return false;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) == 0 && ends_with(n, ".hrsnap")) return true;
  }
  return false;
}

void load_snapshot_params(const SnapshotData& d, const std::string& file, Gpt<float>& model) {
  Backend& ops = model.device().backend();
  for (const auto& [name, bytes] : d.tensors)
    if (is_adapter_param(name))
      throw ConfigError("snapshot " + file + ": holds LoRA adapters (" + name +
                        "), which sampling does not apply: sample from the merged weights "
                        "(headroom train --save-weights DIR/ --merge)");
  // A run on a frozen base wrote its trainable parameters alone: the base comes from where it
  // came from then (the model was made with its seed), and must still be what it was.
  if (d.frozen_base && !d.frozen_base->init_from.empty())
    load_weights(d.frozen_base->init_from, model);
  uint64_t base = kChecksumBasis, base_tensors = 0;
  for (Param<float>* p : model.params()) {
    const auto it = d.tensors.find(p->name);
    if (it == d.tensors.end() && d.frozen_base) {
      std::vector<float> v(p->numel);
      ops.download(v.data(), p->master().value, 4 * p->numel);
      base = checksum_bytes(reinterpret_cast<const uint8_t*>(p->name.data()), p->name.size() + 1,
                            base);
      base = checksum_bytes(reinterpret_cast<const uint8_t*>(v.data()), 4 * v.size(), base);
      ++base_tensors;
      continue;
    }
    if (it == d.tensors.end())
      throw ConfigError("snapshot " + file + ": holds no parameter " + p->name);
    if (it->second.size() != p->numel * sizeof(float))
      throw ConfigError("snapshot " + file + ": " + p->name + " has " +
                        std::to_string(it->second.size()) + " bytes, expected " +
                        std::to_string(p->numel * sizeof(float)));
    ops.upload(p->master().value, it->second.data(), it->second.size());
  }
  if (d.frozen_base && (base != d.frozen_base->checksum || base_tensors != d.frozen_base->tensors))
    throw ConfigError("snapshot " + file + ": was trained on a frozen base (" +
                      (d.frozen_base->init_from.empty()
                           ? "the init of train.seed " + std::to_string(d.frozen_base->seed)
                           : d.frozen_base->init_from) +
                      ") that is no longer what it was: its " + std::to_string(base_tensors) +
                      " tensors differ from the " + std::to_string(d.frozen_base->tensors) +
                      " the snapshot's checksum was of");
  model.sync_compute_params();
}

}  // namespace

void run_sample(const SampleRequest& r, std::ostream& out, std::ostream& log) {
  if (r.tokens < 0) throw ConfigError("--tokens must be >= 0");
  const bool is_config = ends_with(r.source, ".toml");
  if (is_config && !r.config_file.empty())
    throw ConfigError("--config is for a snapshot or a weights file; " + r.source +
                      " is a config itself");
  Config config;
  const bool have_config = is_config || !r.config_file.empty();
  if (have_config) config = load_config(is_config ? r.source : r.config_file, r.sets);

  // Where the weights come from, and the model's shape.
  std::error_code ec;
  std::string snapshot_file, weights_file;
  SnapshotData snap;
  if (is_config) {
    if (has_snapshot(config.snapshot.dir)) {
      snap = read_newest_snapshot(config.snapshot.dir, &snapshot_file);
    } else if (!config.train.init_from.empty()) {
      weights_file = config.train.init_from;
      if (is_peft_adapter_folder(weights_file))
        throw ConfigError(config.train.init_from_pos.str() + ": train.init_from " + weights_file +
                          " is a PEFT adapter folder, which sampling does not apply: sample "
                          "from the merged weights (headroom train --save-weights DIR/ --merge)");
    }
  } else if (ends_with(r.source, ".hrsnap")) {
    snap = read_snapshot(r.source);
    snapshot_file = r.source;
  } else if (fs::exists(fs::path(r.source) / "config.json", ec)) {
    weights_file = r.source;  // a Hugging Face folder
  } else if (fs::is_directory(r.source, ec)) {
    snap = read_newest_snapshot(r.source, &snapshot_file);
  } else if (ends_with(r.source, ".safetensors")) {
    weights_file = r.source;
  } else {
    throw ConfigError(r.source +
                      ": not a config (.toml), a snapshot (.hrsnap, or a folder of them) or a "
                      "weights file (.safetensors)");
  }
  ModelConfig model_config = config.model;
  if (!have_config) {
    model_config = !snapshot_file.empty() ? model_of_signature(snap.model, snapshot_file)
                                          : model_of_weights(weights_file, log);
  } else if (!snapshot_file.empty() && model_config.n_layer > 0) {
    const ModelConfig s = model_of_signature(snap.model, snapshot_file);
    if (s.arch != model_config.arch || s.n_layer != model_config.n_layer ||
        s.n_head != model_config.n_head || s.n_embd != model_config.n_embd ||
        s.seq_len != model_config.seq_len || s.vocab_size != model_config.vocab_size)
      throw ConfigError("snapshot " + snapshot_file + " holds the model \"" + snap.model +
                        "\", not the config's");
    // The config's model, pruned as the snapshot's was (a resume builds it so too).
    model_config.mlp_hidden = s.mlp_hidden;
    model_config.attn_heads = s.attn_heads;
  } else if (!weights_file.empty()) {
    adopt_weights_widths(weights_file, model_config);
  }

  std::unique_ptr<Tokenizer> tokenizer;
  if (!r.tokenizer.empty())
    tokenizer = load_tokenizer(r.tokenizer);
  else if (!config.data.tokenizer.empty())
    tokenizer = load_tokenizer(config.data.tokenizer);
  else
    tokenizer = make_byte_tokenizer();
  if (tokenizer->vocab_size() > model_config.vocab_size)
    throw ConfigError("the tokenizer, " + tokenizer->describe() +
                      ", has more ids than the model's " + "vocab_size " +
                      std::to_string(model_config.vocab_size));

  std::unique_ptr<Device> device = Device::create(config.device);
  // A snapshot of a run on train.seed's frozen init: that seed's model is its base.
  const uint64_t seed = snap.frozen_base && snap.frozen_base->init_from.empty()
                            ? snap.frozen_base->seed
                            : config.train.seed;
  Gpt<float> model(model_config, *device, seed);
  if (!snapshot_file.empty()) {
    load_snapshot_params(snap, snapshot_file, model);
    log << "headroom: sampling from snapshot " << snapshot_file << " (step " << snap.step << ")\n";
  } else if (!weights_file.empty()) {
    load_weights(weights_file, model);
    log << "headroom: sampling from weights " << weights_file << "\n";
  } else {
    log << "headroom: " << r.source
        << " names no trained weights (no snapshot in [snapshot] dir, no train.init_from): "
           "sampling from its untrained initialisation (train.seed "
        << config.train.seed << ")\n";
  }
  log << "headroom: tokens: " << tokenizer->describe() << "\n";

  const std::vector<int32_t> prompt = tokenizer->encode(r.prompt);
  if (prompt.empty()) throw ConfigError("--prompt: needs at least one token of text");
  if (int(prompt.size()) > model_config.seq_len)
    log << "headroom: the prompt's " << prompt.size() << " tokens are more than seq_len "
        << model_config.seq_len << ": the model sees its last " << model_config.seq_len << "\n";
  for (int32_t t : prompt)
    if (t >= model_config.vocab_size)
      throw ConfigError("--prompt: token " + std::to_string(t) + " is outside model.vocab_size " +
                        std::to_string(model_config.vocab_size));
  if (r.ids) {
    for (size_t i = 0; i < prompt.size(); ++i)
      out << (i ? " " : "") << prompt[i];
    generate(model, prompt, r.tokens, r.params, [&](int32_t t) { out << " " << t << std::flush; });
  } else {
    // The prompt as given, then what each token adds to the decoded text (the tokenizer's
    // decoder: Llama 2's "▁" as a space, byte-fallback runs as their characters).
    out << r.prompt;
    DecodeStream text(*tokenizer, prompt);
    generate(model, prompt, r.tokens, r.params,
             [&](int32_t t) { out << text.next(t) << std::flush; });
    out << text.finish();
  }
  out << "\n";
}

}  // namespace headroom
