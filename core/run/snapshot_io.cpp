#include "core/run/snapshot_io.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "core/model/hf_folder.h"
#include "core/model/peft_adapter.h"
#include "core/model/safetensors.h"
#include "core/run/host_optimizer.h"
#include "core/run/snapshot.h"

namespace headroom {

namespace {

// A double as it prints and parses back to itself.
std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// A Llama's shape beyond GPT-2's keys (read back by read_llama_signature): a snapshot of one
// resumes into that model only, and `headroom sample` builds it from the snapshot alone.
std::string llama_signature(const ModelConfig& m) {
  std::string s = " arch=llama n_kv_head=" + std::to_string(m.kv_heads()) +
                  " intermediate_size=" + std::to_string(m.intermediate_size) +
                  " tie_embeddings=" + (m.tie_embeddings ? "true" : "false") +
                  " rms_norm_eps=" + exact(m.rms_norm_eps) + " rope_theta=" + exact(m.rope_theta);
  if (m.rope_scaling_factor > 0.0)
    s += " rope_scaling=" + exact(m.rope_scaling_factor) + "," + exact(m.rope_low_freq_factor) +
         "," + exact(m.rope_high_freq_factor) + "," + std::to_string(m.rope_original_max_positions);
  return s;
}

// A pruned model's adds its blocks' MLP widths and heads (an unpruned one's reads as it always
// did).
std::string model_signature(const ModelConfig& m) {
  return "n_layer=" + std::to_string(m.n_layer) + " n_head=" + std::to_string(m.n_head) +
         " n_embd=" + std::to_string(m.n_embd) + " seq_len=" + std::to_string(m.seq_len) +
         " vocab_size=" + std::to_string(m.vocab_size) +
         (m.pruned() ? " mlp_hidden=" + mlp_hidden_str(m) : "") +
         (m.heads_pruned() ? " attn_heads=" + attn_heads_str(m) : "") +
         (m.llama() ? llama_signature(m) : "");
}

// The widths a signature records ("... mlp_hidden=3072,1536"); empty when it records none or
// they do not parse as `n` positive integers.
std::vector<int> signature_widths(const std::string& sig, int n,
                                  const std::string& key = " mlp_hidden=") {
  const size_t at = sig.find(key);
  if (at == std::string::npos) return {};
  std::vector<int> out;
  std::string rest = sig.substr(at + key.size());
  rest = rest.substr(0, rest.find(' '));
  size_t pos = 0;
  while (pos <= rest.size()) {
    const size_t comma = std::min(rest.find(',', pos), rest.size());
    const std::string num = rest.substr(pos, comma - pos);
    if (num.empty() || num.size() > 9 || num.find_first_not_of("0123456789") != std::string::npos)
      return {};
    out.push_back(std::stoi(num));
    if (out.back() < 1) return {};
    pos = comma + 1;
  }
  return int(out.size()) == n ? out : std::vector<int>{};
}

std::vector<uint8_t> bytes_of(Backend& ops, const void* data, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  ops.download(host.data(), data, host.size());
  return host;
}

}  // namespace

bool read_llama_signature(const std::string& sig, ModelConfig& m) {
  std::istringstream is(sig);
  std::map<std::string, std::string> kv;
  std::string word;
  while (is >> word) {
    const size_t eq = word.find('=');
    if (eq != std::string::npos) kv[word.substr(0, eq)] = word.substr(eq + 1);
  }
  if (kv["arch"] != "llama") return false;
  auto number = [&](const std::string& key, bool required) {
    const auto it = kv.find(key);
    if (it == kv.end()) {
      if (required) throw std::invalid_argument("it records no " + key);
      return std::nan("");
    }
    size_t used = 0;
    const double v = std::stod(it->second, &used);
    if (used != it->second.size()) throw std::invalid_argument(key + " " + it->second);
    return v;
  };
  m.arch = "llama";
  m.n_kv_head = int(number("n_kv_head", true));
  m.intermediate_size = int(number("intermediate_size", true));
  m.tie_embeddings = kv["tie_embeddings"] == "true";
  m.rms_norm_eps = number("rms_norm_eps", true);
  m.rope_theta = number("rope_theta", true);
  const auto scaling = kv.find("rope_scaling");
  if (scaling != kv.end()) {
    std::istringstream list(scaling->second);
    std::string f[4];
    for (std::string& x : f)
      if (!std::getline(list, x, ','))
        throw std::invalid_argument("rope_scaling " + scaling->second);
    m.rope_scaling_factor = std::stod(f[0]);
    m.rope_low_freq_factor = std::stod(f[1]);
    m.rope_high_freq_factor = std::stod(f[2]);
    m.rope_original_max_positions = std::stoi(f[3]);
  }
  return true;
}

void adopt_pruned_widths(Config& config, const std::string& resume_dir,
                         std::unique_ptr<SnapshotData>* snapshot, std::string* path) {
  if (!resume_dir.empty()) {
    // Read once, here; resume() loads it. A folder without a readable snapshot is resume()'s to
    // refuse, where it always was.
    try {
      *snapshot = std::make_unique<SnapshotData>(read_newest_snapshot(resume_dir, path));
    } catch (const ConfigError&) {
      snapshot->reset();
      return;
    }
    const SnapshotData& d = **snapshot;
    ModelConfig pruned = config.model;
    pruned.mlp_hidden = signature_widths(d.model, config.model.n_layer);
    pruned.attn_heads = signature_widths(d.model, config.model.n_layer, " attn_heads=");
    // Only the widths are taken: a snapshot of another model is refused by resume().
    if (model_signature(pruned) == d.model) {
      config.model.mlp_hidden = pruned.mlp_hidden;
      config.model.attn_heads = pruned.attn_heads;
    }
    return;
  }
  if (!config.train.init_from.empty()) {
    try {
      config.model.mlp_hidden = safetensors_mlp_widths(config.train.init_from, config.model);
      config.model.attn_heads = safetensors_attn_heads(config.train.init_from, config.model);
    } catch (const ConfigError& e) {
      throw ConfigError(config.train.init_from_pos.str() + ": train.init_from: " + e.what());
    }
  }
}

SnapshotIO::SnapshotIO(Parts parts, std::string resume_dir, std::unique_ptr<SnapshotData> resumed,
                       std::string resumed_path)
    : p_(parts),
      resume_dir_(std::move(resume_dir)),
      resumed_(std::move(resumed)),
      resumed_path_(std::move(resumed_path)) {}

SnapshotIO::~SnapshotIO() = default;

void SnapshotIO::load_init_from(const std::vector<LoraSpec>& lora) {
  const TrainConfig& t = p_.config.train;
  if (t.init_from.empty()) return;
  // A PEFT adapter folder continues a LoRA run: its base (a folder, or train.seed's init), then
  // its adapters.
  const bool adapter = is_peft_adapter_folder(t.init_from);
  std::string base = t.init_from;
  try {
    if (adapter) base = read_peft_adapter_config(t.init_from).base;
    if (!base.empty())
      load_weights(base, p_.model, masters(false, true),
                   p_.sharding ? p_.sharding->frozen_access() : nullptr);
    if (adapter) load_peft_adapter(t.init_from, p_.model, lora, masters(false, true));
  } catch (const ConfigError& e) {
    throw ConfigError(t.init_from_pos.str() + ": train.init_from: " + e.what());
  }
  if (!p_.log) return;
  if (adapter)
    *p_.log << "init_from: a PEFT adapter from " << t.init_from << " on the base "
            << (base.empty() ? "of train.seed's init" : base) << "\n";
  else
    *p_.log << "init_from: loaded " << p_.model.params().size() << " tensors ("
            << p_.model.num_params() << " parameters) from " << t.init_from << "\n";
}

SnapshotData::FrozenBase SnapshotIO::frozen_base(const std::vector<std::vector<float>>& host) {
  SnapshotData::FrozenBase b;
  const TrainConfig& t = p_.config.train;
  b.init_from = is_peft_adapter_folder(t.init_from) ? read_peft_adapter_config(t.init_from).base
                                                    : t.init_from;
  b.seed = t.seed;
  // Over each frozen parameter's name and values, in model order: computed once, the base never
  // changes.
  if (!base_checksum_) {
    const std::vector<Param<float>*> params = p_.model.params();
    uint64_t h = kChecksumBasis, n = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i]->frozen) continue;
      const std::string& name = params[i]->name;
      h = checksum_bytes(reinterpret_cast<const uint8_t*>(name.data()), name.size() + 1, h);
      h = checksum_bytes(reinterpret_cast<const uint8_t*>(host.at(i).data()),
                         host[i].size() * sizeof(float), h);
      ++n;
    }
    base_checksum_ = std::make_pair(h, n);
  }
  b.checksum = base_checksum_->first;
  b.tensors = base_checksum_->second;
  return b;
}

std::string SnapshotIO::base_str(const SnapshotData::FrozenBase& b) {
  char sum[17];
  std::snprintf(sum, sizeof sum, "%016llx", static_cast<unsigned long long>(b.checksum));
  return (b.init_from.empty() ? "the init of train.seed " + std::to_string(b.seed)
                              : "train.init_from " + b.init_from) +
         ", " + std::to_string(b.tensors) + " tensors of checksum " + sum;
}

int64_t SnapshotIO::resume_or_start() {
  return resume_dir_.empty() ? 1 : resume() + 1;
}

void SnapshotIO::save_weights(const std::string& path) {
  const bool writes = !path.empty() && root();
  const auto host = download_params(p_.model, masters(true, false), writes);
  if (writes) save_weights_to(path, p_.model, &host);
}

void SnapshotIO::mark_step_start() {
  if (p_.config.snapshot.every <= 0) return;
  step_start_data_ = p_.loader.state();
  step_start_plugins_ = p_.plugins.save_states();
}

std::string SnapshotIO::write(int64_t step) {
  return write(step, p_.loader.state(), p_.plugins.save_states());
}

std::string SnapshotIO::write_at_stop(int64_t completed, bool mid_step) {
  if (p_.config.snapshot.every > 0 && completed >= 1 && completed != newest_step_) {
    if (mid_step) {
      write(completed, step_start_data_, step_start_plugins_);
    } else {
      write(completed);
    }
    return "snapshot " + newest_path_ + " written";
  }
  if (newest_step_ >= 1) return "the newest snapshot is " + newest_path_;
  return "";
}

std::string SnapshotIO::write(int64_t step, const std::string& data_state,
                              const std::map<std::string, std::vector<uint8_t>>& plugin_states) {
  const int world = p_.comm.world_size();
  // The parameters on the host, read on every rank (sharded masters are gathered layer by layer,
  // a collective), kept by the rank that writes them.
  const auto host = download_params(p_.model, masters(true, false), world == 1 || root());
  // Sharded optimizer state (zero plugins) is each rank's own: it goes in the rank's part.
  std::map<std::string, std::vector<uint8_t>> own;
  if (sharded_state())
    for (const Optimizer::StateTensor& s : p_.optimizer.state(p_.segments))
      own[s.name] = bytes_of(p_.device.backend_for(s.data), s.data, s.bytes());
  if (world > 1) {
    // Each rank's own part (its data position, its shards) first, then, once every rank's is
    // written, rank 0 writes the replicated state: a step_<N>.hrsnap in the folder means every
    // part is there.
    write_rank_part(p_.config.snapshot.dir, step, p_.comm.rank(), world, data_state, own);
    p_.comm.barrier().wait();
    if (!root()) {
      newest_path_ = snapshot_file(p_.config.snapshot.dir, step);
      newest_step_ = step;
      return newest_path_;
    }
  }
  SnapshotData d;
  d.step = step;
  d.skipped_steps = p_.counters.skipped_steps;
  d.best_val_loss = p_.counters.best_val_loss;
  d.best_val_step = p_.counters.best_val_step;
  // With ranks the data positions are in the rank parts; the replicated file says how many.
  d.data_state = world > 1 ? ranks_data_state(world) : data_state;
  d.model = model_signature(p_.config.model);
  d.optimizer = optimizer_signature();
  const std::vector<Param<float>*> params = p_.model.params();
  // A frozen base is named, not copied: its weights never change, and a LoRA run's base is most
  // of the model.
  if (p_.model.has_frozen()) d.frozen_base = frozen_base(host);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i]->frozen) continue;
    const auto* b = reinterpret_cast<const uint8_t*>(host[i].data());
    d.tensors[params[i]->name].assign(b, b + host[i].size() * sizeof(float));
  }
  if (!sharded_state())
    for (const Optimizer::StateTensor& s : p_.optimizer.state(p_.segments))
      d.tensors[s.name] = bytes_of(p_.device.backend_for(s.data), s.data, s.bytes());
  d.plugins = plugin_states;
  const std::string path =
      headroom::write_snapshot(p_.config.snapshot.dir, d, p_.config.snapshot.keep);
  newest_path_ = path;
  newest_step_ = step;
  // The weights beside it, for other tools; pruned with the snapshot. Rank 0's alone.
  if (p_.config.snapshot.save_weights)
    save_safetensors(path.substr(0, path.size() - std::strlen(".hrsnap")) + ".safetensors",
                     p_.model, &host);
  if (p_.log && !p_.live_progress) *p_.log << "snapshot: " << path << "\n";
  return path;
}

int64_t SnapshotIO::resume() {
  std::string path = resumed_path_;
  SnapshotData d = resumed_ ? std::move(*resumed_) : read_newest_snapshot(resume_dir_, &path);
  resumed_.reset();
  auto refuse = [&](const std::string& why) {
    return ConfigError("--resume: snapshot " + path + " " + why);
  };
  // What every rank reads alike (the replicated file, the config) is checked first.
  if (d.model != model_signature(p_.config.model))
    throw refuse("is of another model (" + d.model + "); this config has " +
                 model_signature(p_.config.model));
  // The optimizer must be this run's; how its state is sharded need not be (resharding).
  const std::string optimizer = optimizer_signature();
  const OptimizerLayout theirs = optimizer_layout(d.optimizer);
  if (!same_optimizer(d.optimizer, optimizer)) {
    std::vector<std::string> loaded;
    for (const PluginEntry& p : p_.config.plugins)
      loaded.push_back(p.name);
    throw refuse(optimizer_mismatch(d, optimizer, p_.plugins.optimizer_plugin(), loaded));
  }
  if (d.step >= p_.config.train.steps)
    throw refuse("is at step " + std::to_string(d.step) +
                 ", already at train.steps = " + std::to_string(p_.config.train.steps));
  // A frozen base is this run's own (train.init_from's, or the seed's init): a snapshot trained on
  // other frozen weights is refused, naming both, rather than resumed on a base the config does
  // not name.
  if (d.frozen_base || p_.model.has_frozen()) {
    if (!p_.model.has_frozen())
      throw refuse("was trained on a frozen base (" + base_str(*d.frozen_base) +
                   "), but this run freezes nothing ([train] freeze, the lora plugin)");
    const SnapshotData::FrozenBase ours =
        frozen_base(download_params(p_.model, masters(true, false)));
    if (!d.frozen_base)
      throw refuse("holds every parameter, but this run freezes " + std::to_string(ours.tensors) +
                   " of them: it was written by a run without frozen parameters (or by a "
                   "headroom of before 2026-12-06, which copied the base into each snapshot)");
    if (d.frozen_base->checksum != ours.checksum || d.frozen_base->tensors != ours.tensors)
      throw refuse("was trained on another frozen base: " + base_str(*d.frozen_base) +
                   ", but this run's is " + base_str(ours));
  }
  const int world = p_.comm.world_size();
  const int written_by = snapshot_world_size(d.data_state);
  if (theirs.sharded_over != 0 && theirs.sharded_over != written_by)
    throw refuse("says its optimizer state is sharded over " + std::to_string(theirs.sharded_over) +
                 " ranks, but it was written by " + std::to_string(written_by));
  // The same world size and the same sharding: each rank reads its own part (its data position
  // and shards), and everything loads as it was saved, bitwise. Otherwise the state is resharded.
  // (An optimizer plugin's state is never sharded: an old snapshot's unnamed "plugin" is ours.)
  const bool same_signature = d.optimizer == optimizer || (is_plugin_optimizer(d.optimizer) &&
                                                           same_optimizer(d.optimizer, optimizer));
  const bool same_layout = written_by == world && same_signature;
  std::string data_state = d.data_state;
  RankPart part;
  std::unique_ptr<StateResharder> resharded;
  std::string why;
  try {
    if (!same_layout) {
      resharded = reshard_optimizer_state(d, path, written_by, &data_state);
    } else if (world > 1) {
      part = read_rank_part(resume_dir_, d.step, p_.comm.rank(), world);
      data_state = part.data_state;
    }
  } catch (const ConfigError& e) {
    why = std::string(same_layout ? "is incomplete: " : "cannot be resharded: ") + e.what();
  }
  // Every rank learns whether any rank refused, so all stop alike.
  if (world > 1) {
    uint64_t failed = why.empty() ? 0 : 1;
    p_.comm.all_max_host(&failed, 1);
    if (failed && why.empty()) why = "cannot be resumed: another rank refused its part";
  }
  if (!why.empty()) throw refuse(why);
  // Every tensor the run has must be in the snapshot, with the same size; nothing else may be.
  // Sharded optimizer state is in this rank's part instead; resharded state was assembled above.
  // A target: a parameter (its masters made whole layer by layer inside masters(), sharded or
  // not) or an optimizer state tensor (this rank's, on the device or the host place).
  struct Target {
    std::string name;
    Param<float>* param = nullptr;
    void* data = nullptr;
    uint64_t bytes = 0;  // f32 parameters; optimizer state in its dtype
  };
  auto check = [&](const std::map<std::string, std::vector<uint8_t>>& tensors,
                   const std::vector<Target>& targets, const std::string& where) {
    if (targets.size() != tensors.size())
      throw refuse(where + "holds " + std::to_string(tensors.size()) + " tensors; this run has " +
                   std::to_string(targets.size()));
    for (const Target& t : targets) {
      const auto it = tensors.find(t.name);
      if (it == tensors.end()) throw refuse(where + "has no tensor '" + t.name + "'");
      if (it->second.size() != t.bytes)
        throw refuse(where + "has tensor '" + t.name + "' of " + std::to_string(it->second.size()) +
                     " bytes; expected " + std::to_string(t.bytes));
    }
  };
  Backend& ops = p_.device.backend();
  auto upload_state = [&](const std::map<std::string, std::vector<uint8_t>>& tensors,
                          const std::vector<Target>& targets) {
    for (const Target& t : targets)
      if (!t.param)
        p_.device.backend_for(t.data).upload(t.data, tensors.at(t.name).data(), t.bytes);
  };
  std::vector<Target> replicated, own;
  for (Param<float>* p : p_.model.params())
    if (!p->frozen) replicated.push_back({p->name, p, nullptr, p->numel * sizeof(float)});
  if (resharded) {
    // The replicated file's optimizer state (an unsharded snapshot's) went into the resharder.
    std::set<std::string> names;
    for (const Target& t : replicated)
      names.insert(t.name);
    for (auto it = d.tensors.begin(); it != d.tensors.end();)
      it = names.count(it->first) ? std::next(it) : d.tensors.erase(it);
    for (const Optimizer::StateTensor& s : p_.optimizer.state(p_.segments)) {
      const std::vector<uint8_t>& bytes = resharded->bytes(s.name);
      p_.device.backend_for(s.data).upload(s.data, bytes.data(), bytes.size());
    }
  } else {
    for (const Optimizer::StateTensor& s : p_.optimizer.state(p_.segments))
      (sharded_state() ? own : replicated).push_back({s.name, nullptr, s.data, s.bytes()});
  }
  const std::string own_where = "(rank " + std::to_string(p_.comm.rank()) + "'s part) ";
  check(d.tensors, replicated, "");
  if (world > 1 && !resharded) check(part.tensors, own, own_where);
  upload_state(d.tensors, replicated);
  if (world > 1 && !resharded) upload_state(part.tensors, own);
  // The parameters, layer by layer: every rank loads the full masters and keeps its shard of
  // them where they are sharded (zero3, amp).
  const MasterAccess access = masters(false, true);
  for (size_t l = 0; l < p_.model.layers().size(); ++l) {
    const auto write = [&] {
      for (const auto& p : p_.model.layers()[l]->params())
        if (!p->frozen)  // the base is this run's already (checked above)
          ops.upload(p->master().value, d.tensors.at(p->name).data(), p->numel * sizeof(float));
      ops.synchronize();  // `d` holds the bytes until here
    };
    if (access) {
      access(int(l), write);
    } else {
      write();
    }
  }
  ops.synchronize();  // `d`, the part and the resharder hold the bytes until here
  p_.model.sync_compute_params();
  try {
    p_.loader.restore(data_state);
  } catch (const ConfigError& e) {
    throw refuse(std::string("has a data position this run cannot use: ") + e.what());
  }
  p_.plugins.load_states(d.plugins, path);
  p_.counters.skipped_steps = d.skipped_steps;
  p_.counters.best_val_loss = d.best_val_loss;
  p_.counters.best_val_step = d.best_val_step;
  newest_path_ = path;
  newest_step_ = d.step;
  if (p_.log) {
    *p_.log << "resumed from " << path << " (step " << d.step << ")";
    if (!same_layout)
      *p_.log << ", resharded from " << written_by << " rank" << (written_by == 1 ? "" : "s")
              << " to " << world;
    *p_.log << "\n";
  }
  return d.step;
}

std::unique_ptr<StateResharder> SnapshotIO::reshard_optimizer_state(const SnapshotData& d,
                                                                    const std::string& path,
                                                                    int written_by,
                                                                    std::string* data_state) {
  std::map<std::string, uint64_t> numel;
  for (const Param<float>* p : p_.model.params())
    numel[p->name] = p->numel;
  auto r = std::make_unique<StateResharder>(numel);
  // What this run's segments need (whole parameters, or this rank's ranges when sharded).
  for (const Optimizer::StateTensor& s : p_.optimizer.state(p_.segments))
    r->want(s.name, s.numel);
  // An unsharded snapshot's optimizer state is in the replicated file, beside the parameters.
  for (const auto& [name, bytes] : d.tensors)
    if (!numel.count(name)) r->take(name, bytes, path);
  // Every rank part, one at a time: each gives its ranges (sharded state), and its data position.
  // That position is global (the same on every rank, data.h), so it moves to another world size
  // as it is; a part whose position differs from rank 0's cannot.
  const bool same_world = written_by == p_.comm.world_size();
  for (int q = 0; q < (written_by > 1 ? written_by : 0); ++q) {
    const RankPart part = read_rank_part(resume_dir_, d.step, q, written_by);
    const std::string file = rank_part_file(resume_dir_, d.step, q);
    if (same_world) {
      if (q == p_.comm.rank()) *data_state = part.data_state;
    } else if (q == 0) {
      *data_state = part.data_state;
    } else if (part.data_state != *data_state) {
      throw ConfigError(file + " holds another data position than rank 0's part, so the " +
                        "positions cannot be moved to another world size");
    }
    for (const auto& [name, bytes] : part.tensors)
      r->take(name, bytes, file);
  }
  r->check("what " + std::to_string(written_by) + " rank" + (written_by == 1 ? "" : "s") +
           " wrote");
  return r;
}

// ---------------------------------------------------------------------------------------------
// Output

bool SnapshotIO::sharded_state() const {
  return p_.sharding && p_.comm.world_size() > 1;
}

std::string SnapshotIO::optimizer_signature() const {
  if (p_.plugins.provides_optimizer())
    return plugin_optimizer_signature(p_.plugins.optimizer_plugin());
  // Its state's dtype and, for bf16 weights or state, where its stochastic rounding starts: a
  // resume must continue the same stream (optim.h rounding_seed).
  std::string layout;
  if (p_.model.precision().state != Dtype::kF32) layout += " with bf16 state";
  if (p_.model.precision().state != Dtype::kF32 || !p_.model.precision().masters)
    layout += std::string(p_.model.precision().masters ? "" : " updating bf16 weights") +
              ", stochastic rounding seed " + std::to_string(p_.optimizer.rounding_seed());
  if (!layout.empty()) return p_.config.train.optimizer + layout;
  // Where the state is: sharded, in the rank parts (a resume elsewhere reshards it).
  return sharded_state() ? p_.config.train.optimizer + " sharded over " +
                               std::to_string(p_.comm.world_size()) + " ranks"
                         : p_.config.train.optimizer;
}

MasterAccess SnapshotIO::masters(bool gather, bool scatter) {
  // Sharded masters are gathered; a model without masters makes them from its bf16 weights, and
  // frozen weights beside compute copies from those (never sharded: inside the gather).
  // One access inside another: `outer` around `inner`, either possibly empty.
  auto nest = [](MasterAccess outer, MasterAccess inner) -> MasterAccess {
    if (!outer || !inner) return outer ? outer : inner;
    return
        [outer, inner](int l, const std::function<void()>& f) { outer(l, [&] { inner(l, f); }); };
  };
  MasterAccess model = p_.model.master_access(gather, scatter);
  // Offload with amp's masters: the trainable ones are the host optimizer's
  // (core/run/host_optimizer.h); the model's access still makes the frozen ones around it.
  if (auto* host = dynamic_cast<HostOptimizer*>(&p_.optimizer); host && host->masters_on_host())
    model = nest(model, host->master_access(p_.model, scatter));
  return nest(p_.sharding ? p_.sharding->master_access(gather, scatter) : nullptr, model);
}
}  // namespace headroom
