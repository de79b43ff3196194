// The run configuration: what a TOML file and --set overrides resolve to.
//
// Parsing is strict: an unknown key, a wrong type, an out-of-range value or a bad size string is a
// ConfigError whose message starts with "FILE:LINE:COLUMN: " (or "--set KEY=VALUE: " for an
// override) and says what would be valid.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace headroom {

// Thrown for any bad input a user can fix: config files, overrides, data files, flags.
// The host turns it into exit code 2.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where a value came from, for messages that point at it.
struct SourcePos {
  std::string file;  // the TOML path, or "--set" for a command-line override
  int line = 0;      // 1-based; 0 when unknown
  int column = 0;
  std::string str() const;  // "file:line:column", or "--set key=value"
};

struct ModelConfig {
  std::string preset;  // "" when the shape is given explicitly
  int n_layer = 0;
  int n_head = 0;
  int n_embd = 0;
  int seq_len = 0;
  int vocab_size = 0;
  // Each block's MLP hidden width (c_fc's rows, c_proj's columns; a Llama's gate and up rows,
  // down_proj's columns), block 0 first; empty when every block has the arch's width. Not a TOML
  // key: a pruned model's (headroom.resize/1), carried by snapshots and weights files (`[train]
  // init_from`), which build the model with these widths.
  std::vector<int> mlp_hidden;
  // Block b's MLP width: mlp_hidden[b], or the arch's (GPT-2's 4·n_embd, Llama's
  // intermediate_size).
  int mlp_width(int block) const {
    return block >= 0 && size_t(block) < mlp_hidden.size() ? mlp_hidden[size_t(block)]
                                                           : default_mlp_width();
  }
  int default_mlp_width() const { return llama() ? intermediate_size : 4 * n_embd; }
  // Each block's attention heads, block 0 first; empty when every block has n_head (a pruned
  // model's, as mlp_hidden). A block of h heads has attention width h·(n_embd / n_head); a
  // Llama's h is a multiple of n_head / n_kv_head (whole KV groups: kv_heads(block)).
  std::vector<int> attn_heads;
  int heads(int block) const {
    return block >= 0 && size_t(block) < attn_heads.size() ? attn_heads[size_t(block)] : n_head;
  }
  // Block b's attention width: its heads times the head size n_embd / n_head.
  int attn_width(int block) const { return n_head > 0 ? heads(block) * (n_embd / n_head) : 0; }
  // Some block's MLP width is not the arch's.
  bool pruned() const {
    for (int b = 0; b < n_layer; ++b)
      if (mlp_width(b) != default_mlp_width()) return true;
    return false;
  }
  // Some block has fewer heads than n_head.
  bool heads_pruned() const {
    for (int b = 0; b < n_layer; ++b)
      if (heads(b) != n_head) return true;
    return false;
  }
  // The attention kernels: "tiled" (FlashAttention: keeps each head's output and row log-sum-exp,
  // no (B, NH, T, T) tensor) or "naive" (keeps the (B, NH, T, T) probabilities; for comparison).
  std::string attention = "tiled";
  // The head's loss: "chunked" (the logits of chunk_tokens tokens at a time, recomputed in
  // backward: no (B, T, V) tensor) or "full" (the (B, T, V) logits kept for backward).
  std::string loss = "chunked";
  // Tokens per chunk of the chunked loss; 0: as many as fit kLossChunkBytes of logits.
  int chunk_tokens = 0;

  // The block: "gpt2" (LayerNorm with biases, learned positions wpe, GELU MLP of 4·n_embd, tied
  // head) or "llama" (RMSNorm, rotary positions, SwiGLU MLP of intermediate_size, grouped-query
  // attention, no biases, tied or untied head). The keys below are Llama's only.
  std::string arch = "gpt2";
  bool llama() const { return arch == "llama"; }
  int n_kv_head = 0;          // key/value heads, dividing n_head; 0: n_head (no grouping)
  int intermediate_size = 0;  // the SwiGLU MLP's hidden width (gate, up: its rows)
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_embeddings = false;  // the head's weight is embed_tokens (GPT-2 always ties)
  // Llama 3's rope scaling (Hugging Face's rope_type "llama3"); factor 0: none.
  double rope_scaling_factor = 0.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int rope_original_max_positions = 8192;
  // Key/value heads (n_kv_head, or n_head when 0) and their width: n_kv_head · head size.
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int kv_width() const { return n_head > 0 ? kv_heads() * (n_embd / n_head) : 0; }
  // Block b's key/value heads and their width. Heads are pruned in whole key/value groups (a KV
  // head with the n_head / n_kv_head query heads sharing it), so a block of heads(b) query heads
  // has heads(b) / (n_head / n_kv_head) KV heads; unpruned, kv_heads().
  int kv_heads(int block) const {
    const int group = kv_heads() > 0 ? n_head / kv_heads() : 1;
    return group > 0 ? heads(block) / group : 0;
  }
  int kv_width(int block) const { return n_head > 0 ? kv_heads(block) * (n_embd / n_head) : 0; }
  // The head reads the token embedding: always for GPT-2.
  bool tied() const { return !llama() || tie_embeddings; }
};

struct TrainConfig {
  int64_t steps = 200;
  int micro_batch = 4;
  int grad_accum = 1;
  std::string optimizer = "adamw";  // "adamw" | "sgd"
  double lr = 3e-4;
  double min_lr = 0.0;  // floor of the cosine / linear decay
  double weight_decay = 0.1;
  double beta1 = 0.9;  // AdamW
  double beta2 = 0.95;
  double eps = 1e-8;
  double momentum = 0.0;  // SGD; 0 keeps no state
  int64_t warmup_steps = 10;
  std::string lr_schedule = "cosine";  // "cosine" | "linear" | "constant"
  double grad_clip = 1.0;              // 0 turns clipping off
  uint64_t seed = 1;                   // parameter init
  int64_t log_every = 1;               // progress / metrics cadence in optimizer steps
  std::string init_from;               // a safetensors file to start from; "" = fresh init
  SourcePos init_from_pos;
  // Validation: every eval_every optimizer steps (and after the last), the mean loss over the
  // first eval_batches micro-batches of the validation data, forward only; 0 = never.
  int64_t eval_every = 0;
  int eval_batches = 8;
  SourcePos eval_every_pos;
  // Hugging Face name globs of the parameters that do not train (core/model/model.h
  // freeze_matches), each with where it was written.
  std::vector<std::string> freeze;
  std::vector<SourcePos> freeze_pos;
};

struct DataConfig {
  std::string kind = "synthetic";  // "synthetic" | "text" | "shards"
  std::string path;                // text: the file, resolved relative to the config file
  std::string pattern;             // shards: a glob ("data/*.bin"), relative to the config file
  bool shuffle = false;            // shards: seeded shuffling of shard order and positions
  int workers = 0;                 // threads filling the prefetch queue; 0 = load inline
  int prefetch = 2;                // batches the queue holds (with workers > 0)
  uint64_t seed = 1;               // synthetic: the Markov chain and the sampling
  int branching = 4;               // synthetic: successors per token (entropy <= ln(branching))
  // Validation data (train.eval_every), at most one of: a text file (kind "text"), a glob of
  // shards (kind "shards"), or the tail of the training data held out (text and shards: that
  // fraction of its bytes or tokens is not trained on). Synthetic data validates on a stream of
  // its own from the same chain.
  std::string val_path;
  std::string val_pattern;
  double val_fraction = 0.0;
  SourcePos val_pos;  // where the one that is set was set
  // shards: the tokenizer that wrote them (a tokenizer.json, or a vocab.json with merges.txt
  // beside it), resolved relative to the config file; `headroom sample` decodes with it. "" =
  // bytes.
  std::string tokenizer;
  SourcePos tokenizer_pos;
  SourcePos path_pos;  // where path was set, for errors about the file itself
};

// Training snapshots (weights, optimizer state, step, data position, plugin state) for resuming.
struct SnapshotConfig {
  int64_t every = 0;          // optimizer steps between snapshots; 0 = none
  std::string dir;            // where they go, resolved relative to the config file
  int keep = 3;               // the newest this many are kept
  bool save_weights = false;  // also write model.safetensors beside each snapshot
};

// More memory than any device holds (2^48 bytes, 256 TiB): the largest memory_limit, and the
// largest allocation an allocation trace may record.
constexpr uint64_t kMaxDeviceBytes = uint64_t(1) << 48;

// The most token ids a model has (model.vocab_size's upper bound), and so the bound on every id a
// tokenizer file may give.
constexpr int64_t kMaxVocabSize = int64_t(1) << 24;

struct DeviceConfig {
  std::string kind = "cpu";  // "cpu" or "cuda"
  SourcePos kind_pos;        // where kind was set, for the device's own errors (no CUDA device)
  int index = 0;
  // index was written ([device] index or --set device.index): a GPU rank then uses it instead of
  // its local rank.
  bool index_set = false;
  uint64_t memory_limit = 0;  // bytes; 0 = no limit
  // [host] memory_limit: the wall of the host place beside the device (host memory the run keeps
  // in its host ledger: offloaded optimizer state); bytes, 0 = no limit.
  uint64_t host_memory_limit = 0;
  // The CPU backend's threads (element-wise kernels and GEMMs); 0 = OpenMP's default, which is
  // OMP_NUM_THREADS when set, else the cores available.
  int threads = 0;
};

// [distributed]: data parallelism across ranks (mpirun / srun). Read at every world size; used
// only above 1.
struct DistributedConfig {
  uint64_t bucket_size =
      25ull << 20;        // gradient bytes per all-reduce bucket (PyTorch DDP's 25 MiB)
  double timeout_s = 60;  // a collective not done after this long: the run stops, naming the rank
  // Launch a bucket's all-reduce as soon as its layers end their backward (true), or every bucket
  // after the whole backward (false: nothing overlaps; for measuring what overlap hides).
  bool overlap = true;
};

// One [[plugins]] entry. Only name and path are the host's; every other key is the plugin's own and
// is validated by the plugin when it is loaded.
struct PluginEntry {
  std::string name;
  std::string path;    // "" = search the plugin path; else resolved relative to the config file
  SourcePos pos;       // the table's position, for messages
  SourcePos path_pos;  // where path was set ("--set plugins.NAME.path=..." for an override); pos
                       // when path is not set
  std::string toml;    // the plugin's own keys, re-serialised as a TOML table (no name/path)
  std::map<std::string, SourcePos> key_pos;  // where each of the plugin's own keys was written
};

struct Config {
  std::string file;  // the config file as given
  ModelConfig model;
  TrainConfig train;
  DataConfig data;
  DeviceConfig device;
  SnapshotConfig snapshot;
  DistributedConfig distributed;
  std::vector<PluginEntry> plugins;
};

// Reads FILE, applies each "section.key=value" override (value in TOML syntax; a bare word is taken
// as a string), validates everything, fills every default and resolves the model preset.
Config load_config(const std::string& file, const std::vector<std::string>& overrides = {});

// The same from TOML text (tests); `file` only names the source in messages and anchors relative
// paths.
Config parse_config(const std::string& toml_text, const std::string& file,
                    const std::vector<std::string>& overrides = {});

// The resolved config as TOML with every default filled in: what `headroom check` prints.
// Re-parsing the output gives the same Config.
std::string format_config(const Config& config);

// "64MiB" -> 67108864. Accepts an integer with an optional unit B, KiB, MiB, GiB (also a decimal
// number with a unit, "1.5GiB"); throws ConfigError naming `where` otherwise.
uint64_t parse_size(const std::string& text, const std::string& where);

// 67108864 -> "64 MiB"; used in reports.
std::string format_bytes(uint64_t bytes);

// The preset names, for messages and docs.
const std::vector<std::string>& model_presets();

}  // namespace headroom
