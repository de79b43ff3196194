#include "core/config/config_keys.h"

#include "core/config/config.h"

namespace headroom {

namespace {

using T = KeyType;

// One table per section, in the order the parser's messages list the keys. A key added here is
// accepted by the parser's key check; it still needs its getter in config.cpp (the reference test
// sets each key to a value of the wrong type and expects the parser to refuse it).
std::vector<ConfigSection> make_sections() {
  return {
      {"model",
       false,
       "The model's shape: a preset, or all five shape keys (keys given with a preset override "
       "it), and for arch = \"llama\" intermediate_size. Without a [model] table, the tiny "
       "preset: the defaults below are its. The keys from n_kv_head on are Llama's: under arch = "
       "\"gpt2\" each is an error.",
       {
           {"preset", T::kChoice, "a named shape; without one, all five shape keys are required",
            model_presets()},
           {"n_layer", T::kInteger, "transformer blocks, >= 1", {}},
           {"n_head", T::kInteger, "attention heads, >= 1; n_embd must be divisible by n_head", {}},
           {"n_embd", T::kInteger, "model width C, >= 1", {}},
           {"seq_len",
            T::kInteger,
            "context length T (also the position-embedding size), 1 to 2^20",
            {}},
           {"vocab_size",
            T::kInteger,
            "tokens, 2 to 2^24; >= 256 for text data (bytes), >= the tokenizer's for shards",
            {}},
           {"attention",
            T::kChoice,
            "tiled keeps each head's output and row log-sum-exp (no (B, NH, T, T) tensor); naive "
            "keeps the probabilities, for comparison",
            {"tiled", "naive"}},
           {"loss",
            T::kChoice,
            "chunked computes the head's logits a chunk of tokens at a time and again in "
            "backward (no (B, T, V) tensor); full keeps the logits",
            {"chunked", "full"}},
           {"chunk_tokens",
            T::kInteger,
            "tokens per chunk of the chunked loss; 0: the fewest chunks of at most 64 MiB of "
            "logits, split evenly",
            {}},
           {"arch",
            T::kChoice,
            "gpt2: LayerNorm, learned positions, GELU MLP of 4 n_embd, tied head; llama: RMSNorm, "
            "rotary positions, SwiGLU MLP, grouped-query attention, no biases; a preset gives its "
            "own",
            {"gpt2", "llama"}},
           {"n_kv_head",
            T::kInteger,
            "llama: key/value heads (grouped-query attention), dividing n_head; default n_head",
            {}},
           {"intermediate_size",
            T::kInteger,
            "llama: the SwiGLU MLP's hidden width (gate and up rows), >= 1; required without a "
            "preset",
            {}},
           {"rms_norm_eps", T::kFloat, "llama: RMSNorm's epsilon, > 0; default 1e-5", {}},
           {"rope_theta", T::kFloat, "llama: the rotary embeddings' base, > 0; default 10000", {}},
           {"tie_embeddings",
            T::kBoolean,
            "llama: the head's weight is the token embedding (no lm_head); default false",
            {}},
           {"rope_scaling_factor",
            T::kFloat,
            "llama: Llama 3's rope scaling (rope_type llama3): long wavelengths divided by it; 0 "
            "(default): no scaling, else >= 1",
            {}},
           {"rope_low_freq_factor",
            T::kFloat,
            "llama: rope scaling's low_freq_factor, > 0; default 1",
            {}},
           {"rope_high_freq_factor",
            T::kFloat,
            "llama: rope scaling's high_freq_factor, > rope_low_freq_factor; default 4",
            {}},
           {"rope_original_max_positions",
            T::kInteger,
            "llama: rope scaling's original_max_position_embeddings, >= 1; default 8192",
            {}},
       }},
      {"train",
       false,
       "The optimizer, the schedule, the batch and validation.",
       {
           {"steps", T::kInteger, "optimizer steps, >= 1", {}},
           {"micro_batch", T::kInteger, "sequences per micro-step, >= 1", {}},
           {"grad_accum",
            T::kInteger,
            "micro-steps per optimizer step (a rank's batch is micro_batch x grad_accum), >= 1",
            {}},
           {"optimizer",
            T::kChoice,
            "the built-in optimizer (an optimizer-role plugin replaces it)",
            {"adamw", "sgd"}},
           {"lr", T::kFloat, "peak learning rate, > 0", {}},
           {"min_lr", T::kFloat, "where the cosine or linear decay ends, 0 to lr", {}},
           {"weight_decay",
            T::kFloat,
            "decoupled (AdamW) or L2 (SGD), >= 0; never on biases or LayerNorm gains",
            {}},
           {"beta1", T::kFloat, "AdamW's first-moment decay, in [0, 1)", {}},
           {"beta2", T::kFloat, "AdamW's second-moment decay, in [0, 1)", {}},
           {"eps", T::kFloat, "AdamW's denominator term, > 0", {}},
           {"momentum", T::kFloat, "SGD's momentum, in [0, 1); 0 keeps no optimizer state", {}},
           {"warmup_steps", T::kInteger, "linear warmup from lr / warmup_steps to lr, >= 0", {}},
           {"lr_schedule",
            T::kChoice,
            "the decay after warmup, from lr to min_lr",
            {"cosine", "linear", "constant"}},
           {"grad_clip", T::kFloat, "global-norm clipping threshold, >= 0; 0 turns it off", {}},
           {"seed", T::kInteger, "parameter initialisation (and stochastic rounding), >= 0", {}},
           {"log_every",
            T::kInteger,
            "steps between progress lines when stdout is not a terminal, >= 1",
            {}},
           {"init_from",
            T::kPath,
            "start from these weights: a safetensors file with Hugging Face GPT-2 names, or a "
            "Hugging Face folder (config.json with model.safetensors or an index and its shards; "
            "[model]'s shape from config.json when [model] gives none); F32, BF16, F16",
            {}},
           {"freeze",
            T::kStrings,
            "parameters that do not train: globs over their Hugging Face names (* any characters, "
            "dots included; \"wte.weight\", \"h.*.mlp.*\"); no gradient, optimizer state or "
            "master copy for them; each must match a parameter",
            {}},
           {"eval_every",
            T::kInteger,
            "the validation loss every this many steps and after the last; 0 = never; text and "
            "shards need validation data ([data] val_path, val_pattern or val_fraction)",
            {}},
           {"eval_batches",
            T::kInteger,
            "micro-batches of validation data per evaluation (the same ones each time), 1 to "
            "2^20",
            {}},
       }},
      {"data",
       false,
       "What the model reads, and its validation data (synthetic data validates on a stream of its "
       "own from the same chain).",
       {
           {"kind",
            T::kChoice,
            "synthetic: a seeded Markov chain of known entropy; text: a file's bytes; shards: "
            "llm.c token shards",
            {"synthetic", "text", "shards"}},
           {"path", T::kPath, "text: the file to train on (required with kind = \"text\")", {}},
           {"pattern",
            T::kPath,
            "shards: a glob of llm.c shards, \"data/*.bin\" (required with kind = \"shards\")",
            {}},
           {"seed", T::kInteger, "synthetic: the chain and the sampling; shards: the shuffle", {}},
           {"branching",
            T::kInteger,
            "synthetic: successors per token, 1 to 64 (entropy rate <= ln(branching))",
            {}},
           {"shuffle", T::kBoolean, "shards: seeded shuffling of shard order and positions", {}},
           {"workers", T::kInteger, "threads prefetching batches, 0 to 64; 0 reads inline", {}},
           {"prefetch", T::kInteger, "batches the prefetch queue holds, 1 to 1024", {}},
           {"val_path", T::kPath, "text: validate on this file", {}},
           {"val_pattern", T::kPath, "shards: validate on these shards (a glob)", {}},
           {"val_fraction",
            T::kFloat,
            "text, shards: hold out this last fraction of the data for validation, in (0, 1)",
            {}},
           {"tokenizer",
            T::kPath,
            "shards: the tokenizer that wrote them (tokenizer.json, or vocab.json with "
            "merges.txt beside it); `sample` decodes with it",
            {}},
       }},
      {"device",
       false,
       "Where the run computes, and its memory wall.",
       {
           {"kind", T::kChoice, "cuda needs a CUDA build and a GPU (else exit 2)", {"cpu", "cuda"}},
           {"index",
            T::kInteger,
            "which GPU, >= 0; unset, each rank of a multi-rank run takes its local rank's",
            {}},
           {"memory_limit",
            T::kSize,
            "the device memory the run may use, or \"none\"; past it a run stops with a report "
            "(exit 3). The CPU device is then one first-fit arena of that many bytes, at most "
            "256 TiB",
            {}},
           {"threads",
            T::kInteger,
            "CPU: threads of the kernels and GEMMs, 0 to 4096; unset or 0, OMP_NUM_THREADS when "
            "set, else the cores available; results are deterministic for a thread count",
            {}},
       }},
      {"host",
       false,
       "The host place beside the device: the host memory the run keeps in its host ledger "
       "(page-locked on CUDA unless the offload plugin says `pin_memory = false`; what the "
       "offload plugin moves there: the optimizer, the layers' outputs), and its wall.",
       {
           {"memory_limit",
            T::kSize,
            "the host memory the run's host ledger may hold, or \"none\"; past it a run stops "
            "with an out-of-memory report naming the host (exit 3), at most 256 TiB. On the CPU "
            "backend a ledger of its own over the same RAM as the device's",
            {}},
       }},
      {"snapshot",
       false,
       "Training snapshots, for `train --resume`.",
       {
           {"every", T::kInteger, "optimizer steps between snapshots; 0 = none", {}},
           {"dir", T::kPath, "where snapshots go (required when every > 0)", {}},
           {"keep", T::kInteger, "the newest this many are kept, 1 to 1000000", {}},
           {"save_weights", T::kBoolean, "also write step_N.safetensors beside each snapshot", {}},
       }},
      {"distributed",
       false,
       "Data parallelism across ranks (mpirun, srun); read at every world size, used above 1.",
       {
           {"bucket_size",
            T::kSizeString,
            "gradient bytes per all-reduce bucket (PyTorch DDP's default), > 0",
            {}},
           {"timeout_s",
            T::kFloat,
            "a collective not done after this many seconds stops the run, naming the ranks, > 0",
            {}},
           {"overlap",
            T::kBoolean,
            "start a bucket's all-reduce as soon as its layers are done; false: after the whole "
            "backward (to measure what overlap hides: the metrics' comm_wait_ms)",
            {}},
       }},
      {"plugins",
       true,
       "One [[plugins]] table per plugin, events dispatched in TOML order. These two keys are "
       "the host's; every other key is the plugin's own (an unknown one is an error).",
       {
           {"name",
            T::kString,
            "required: the plugin, [a-z0-9_]+, each at most once; its file is `<name>.so`",
            {}},
           {"path",
            T::kPath,
            "the plugin's shared library; unset, `<name>.so` is looked for in "
            "HEADROOM_PLUGIN_PATH, then lib/headroom/plugins beside the binary's folder, then the "
            "install's",
            {}},
       }},
  };
}

}  // namespace

const ConfigKey* ConfigSection::find(const std::string& key) const {
  for (const ConfigKey& k : keys)
    if (key == k.name) return &k;
  return nullptr;
}

std::vector<std::string> ConfigSection::key_names() const {
  std::vector<std::string> names;
  for (const ConfigKey& k : keys)
    names.push_back(k.name);
  return names;
}

const std::vector<ConfigSection>& config_sections() {
  static const std::vector<ConfigSection> sections = make_sections();
  return sections;
}

const ConfigSection* find_config_section(const std::string& name) {
  for (const ConfigSection& s : config_sections())
    if (name == s.name) return &s;
  return nullptr;
}

}  // namespace headroom
