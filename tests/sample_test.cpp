// Generation (core/model/generate.h) and `headroom sample` (core/run/sample.h): the KV cache
// against a full recompute, the recompute against the model's own loss, a trained model's samples
// against the synthetic source's transitions, and the same text twice from one seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include "core/data/data.h"
#include "core/device/device.h"
#include "core/model/generate.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

using test::contains;

ModelConfig tiny_model() {
  ModelConfig m;
  m.n_layer = 2;
  m.n_head = 2;
  m.n_embd = 16;
  m.seq_len = 12;
  m.vocab_size = 40;
  return m;
}

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t)
    x = int32_t(rng() % uint64_t(vocab));
  return t;
}

// The models generation is checked on: GPT-2 (and with a block's heads and MLP pruned) and
// Llama (grouped-query attention, untied head, Llama 3's rope scaling; and tied, no grouping).
struct ModelCase {
  const char* name;
  std::function<ModelConfig()> config;
  bool prune = false;  // block 1 keeps one of its 2 heads and 24 of its MLP units
};

void PrintTo(const ModelCase& c, std::ostream* os) {
  *os << c.name;
}

ModelConfig tiny_llama(int n_kv_head, bool tied, double rope_factor) {
  ModelConfig m = tiny_model();
  m.arch = "llama";
  m.n_head = 4;
  m.n_kv_head = n_kv_head;
  m.intermediate_size = 40;
  m.tie_embeddings = tied;
  m.rope_theta = 500.0;
  m.rope_scaling_factor = rope_factor;
  m.rope_original_max_positions = 8;
  return m;
}

class SampleModels : public ::testing::TestWithParam<ModelCase> {
 protected:
  std::unique_ptr<Gpt<float>> make(Device& device, uint64_t seed) const {
    auto model = std::make_unique<Gpt<float>>(GetParam().config(), device, seed);
    if (GetParam().prune) {
      model->resize_heads(1, {1});
      std::vector<uint32_t> keep;
      for (uint32_t j = 0; j < 48; j += 2)
        keep.push_back(j);
      model->resize_mlp(1, keep);
    }
    return model;
  }
};

// Every position's next-token logits from the KV cache, one token at a time, equal those of the
// full forward over all the tokens (to float rounding: the GEMMs see 1 row instead of T).
TEST_P(SampleModels, KvCacheLogitsEqualTheFullRecompute) {
  auto device = Device::create(DeviceConfig{});
  const std::unique_ptr<Gpt<float>> model = make(*device, 7);
  const ModelConfig& m = model->config();
  const std::vector<int32_t> tokens = random_tokens(m.seq_len, m.vocab_size, 3);
  const std::vector<float> full = forward_logits(*model, tokens);  // (T, V)
  KvDecoder decoder(*model);
  double worst = 0.0;
  for (int t = 0; t < m.seq_len; ++t) {
    const std::vector<float> step = decoder.step(tokens[size_t(t)]);
    ASSERT_EQ(step.size(), size_t(m.vocab_size));
    for (int v = 0; v < m.vocab_size; ++v) {
      const double want = full[size_t(t) * m.vocab_size + v];
      worst = std::max(worst, std::fabs(step[size_t(v)] - want) / (1e-3 + std::fabs(want)));
    }
    // The last position alone, recomputed from the prefix, is the same again.
    const std::vector<int32_t> prefix(tokens.begin(), tokens.begin() + t + 1);
    const std::vector<float> again = forward_logits(*model, prefix);
    for (int v = 0; v < m.vocab_size; ++v)
      EXPECT_NEAR(again[size_t(t) * m.vocab_size + v], step[size_t(v)], 1e-4);
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_EQ(decoder.position(), m.seq_len);
  EXPECT_THROW(decoder.step(0), std::logic_error);  // the context is full
  // Starting again gives the first position's logits again.
  decoder.reset();
  const std::vector<float> first = decoder.step(tokens[0]);
  for (int v = 0; v < m.vocab_size; ++v)
    EXPECT_NEAR(first[size_t(v)], full[size_t(v)], 1e-4);
}

// The full recompute is the model's own forward: its cross-entropy is the loss Gpt::evaluate
// reports on the same tokens.
TEST_P(SampleModels, FullRecomputeIsTheModelsForward) {
  auto device = Device::create(DeviceConfig{});
  const std::unique_ptr<Gpt<float>> model = make(*device, 11);
  const ModelConfig& m = model->config();
  const std::vector<int32_t> seq = random_tokens(m.seq_len + 1, m.vocab_size, 5);
  const std::vector<int32_t> in(seq.begin(), seq.end() - 1), target(seq.begin() + 1, seq.end());
  const std::vector<float> logits = forward_logits(*model, in);
  double ce = 0.0;
  for (int t = 0; t < m.seq_len; ++t) {
    const float* row = &logits[size_t(t) * m.vocab_size];
    double mx = row[0], sum = 0.0;
    for (int v = 0; v < m.vocab_size; ++v)
      mx = std::max(mx, double(row[v]));
    for (int v = 0; v < m.vocab_size; ++v)
      sum += std::exp(row[v] - mx);
    ce += std::log(sum) + mx - row[target[size_t(t)]];
  }
  ce /= m.seq_len;
  Batch b;
  b.tokens = in.data();
  b.targets = target.data();
  b.B = 1;
  b.T = m.seq_len;
  b.dloss = 1.0 / m.seq_len;
  const double loss = model->evaluate(b);
  EXPECT_NEAR(ce, loss, 1e-5 * loss);
}

INSTANTIATE_TEST_SUITE_P(
    Archs, SampleModels,
    ::testing::Values(ModelCase{"Gpt2", tiny_model}, ModelCase{"Gpt2Pruned", tiny_model, true},
                      ModelCase{"LlamaGqaUntiedRopeScaled",
                                [] { return tiny_llama(2, false, 4.0); }},
                      ModelCase{"LlamaTiedNoGrouping", [] { return tiny_llama(4, true, 0.0); }},
                      ModelCase{"LlamaOneKvHead", [] { return tiny_llama(1, false, 0.0); }}),
    [](const auto& info) { return std::string(info.param.name); });

// The op behind the cache: one query over T cached rows is attention_forward's row T-1.
TEST(Sample, AttentionDecodeIsTheForwardsLastRow) {
  auto device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  const int C = 16, NH = 4;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int T : {1, 2, 7, 33}) {
    std::vector<float> qkv(size_t(T) * 3 * C), out(size_t(T) * C), att(size_t(NH) * T * T), one(C);
    for (float& x : qkv)
      x = normal(rng);
    ops.attention_forward(Dtype::kF32, out.data(), att.data(), qkv.data(), 1, T, C, NH);
    ops.attention_decode(Dtype::kF32, one.data(), qkv.data(), T, C, NH);
    for (int c = 0; c < C; ++c)
      EXPECT_NEAR(one[size_t(c)], out[size_t(T - 1) * C + c], 1e-5)
          << "T " << T << ", column " << c;
  }
}

TEST(Sample, TopKAndTemperatureZero) {
  const std::vector<float> logits = {0.0f, 3.0f, 1.0f, 2.9f, -5.0f};
  std::mt19937_64 rng(1);
  SampleParams greedy;
  greedy.temperature = 0.0;
  EXPECT_EQ(sample_token(logits, greedy, rng), 1);
  SampleParams top2;
  top2.top_k = 2;
  std::map<int32_t, int> seen;
  for (int i = 0; i < 400; ++i)
    ++seen[sample_token(logits, top2, rng)];
  EXPECT_EQ(seen.size(), 2u);  // only 1 and 3
  EXPECT_GT(seen[1], 100);
  EXPECT_GT(seen[3], 100);
}

// A tiny model trained on the synthetic Markov source: 50 sampled tokens from a fixed seed are the
// same twice, and every step of them is one of the chain's transitions.
TEST(Sample, TrainedModelFollowsTheSyntheticTransitions) {
  const Config c = test::config_from(
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 16\n"
      "[train]\nsteps = 120\nmicro_batch = 8\nlr = 1e-2\nwarmup_steps = 5\nweight_decay = 0.0\n"
      "[data]\nkind = \"synthetic\"\nbranching = 2\nseed = 9\n");
  Trainer trainer(c, TrainOptions{});
  trainer.run();
  const MarkovChain chain(c.model.vocab_size, c.data.branching, c.data.seed);
  SampleParams p;
  p.seed = 42;
  p.top_k = c.data.branching;  // the model's top-2 must be the chain's 2 successors
  const std::vector<int32_t> prompt = {chain.start()};
  const std::vector<int32_t> a = generate(trainer.model(), prompt, 50, p);
  const std::vector<int32_t> b = generate(trainer.model(), prompt, 50, p);
  ASSERT_EQ(a.size(), 50u);
  EXPECT_EQ(a, b);
  int32_t prev = prompt[0];
  int followed = 0;
  for (int32_t t : a) {
    const int32_t* next = chain.successors(prev);
    followed += std::find(next, next + c.data.branching, t) != next + c.data.branching;
    prev = t;
  }
  EXPECT_EQ(followed, 50) << "transitions the chain has, of 50";
  // Another seed draws another path through the same transitions (50 draws between 2 successors
  // agree by chance with probability ~2^-50 for a model near the chain's probabilities).
  p.seed = 43;
  EXPECT_NE(generate(trainer.model(), prompt, 50, p), a);
  // Past the context (seq_len 16) the cache restarts from the last half and goes on.
  EXPECT_EQ(generate(trainer.model(), prompt, 40, p).size(), 40u);
}

// `headroom sample` from a trained text model's weights: the same text twice from one seed,
// starting with the prompt; another seed, other text.
TEST(Sample, CliSamplesTheSameTextTwiceFromOneSeed) {
  const std::string dir = test::temp_dir();
  std::string corpus;
  for (int i = 0; i < 40; ++i)
    corpus += "the cat sat on the mat. the dog sat on the log. ";
  test::write_file(dir, "corpus.txt", corpus);
  const std::string cfg = test::write_file(
      dir, "text.toml",
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 32\nvocab_size = 256\n"
      "[train]\nsteps = 30\nmicro_batch = 4\nlr = 1e-2\n[data]\nkind = \"text\"\npath = "
      "\"corpus.txt\"\n");
  const test::RunResult train =
      test::run_headroom("train -q " + cfg + " --save-weights " + dir + "/w.safetensors");
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const std::string args = "sample " + dir + "/w.safetensors --config " + cfg +
                           " --prompt 'the ' --tokens 50 --top-k 5 --seed ";
  // stdout alone: the text.
  auto text = [&](const std::string& seed) {
    return test::run_command("(" + std::string(HEADROOM_BINARY) + " " + args + seed +
                             " 2>/dev/null)");
  };
  const test::RunResult a = text("3"), b = text("3"), other = text("4");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output, b.output);
  EXPECT_NE(a.output, other.output);
  EXPECT_TRUE(test::starts_with(a.output, "the ")) << a.output;
  EXPECT_EQ(a.output.size(), 4 + 50 + 1u) << a.output;  // prompt, 50 byte tokens, newline
  // What it loaded, and from where, on stderr.
  const test::RunResult said = test::run_headroom(args + "3");
  EXPECT_TRUE(contains(said.output, "sampling from weights " + dir + "/w.safetensors"))
      << said.output;
  EXPECT_TRUE(contains(said.output, "tokens: bytes (vocab 256)")) << said.output;
  // A run that starts from these weights says what it loaded, and from where.
  const test::RunResult init = test::run_headroom("train " + cfg + " --set train.steps=1 --set " +
                                                  "train.init_from=" + dir + "/w.safetensors");
  EXPECT_EQ(init.exit_code, 0) << init.output;
  EXPECT_TRUE(contains(init.output, "init_from: loaded 16 tensors (")) << init.output;
  EXPECT_TRUE(contains(init.output, " parameters) from " + dir + "/w.safetensors\n"))
      << init.output;
  // A source of no known kind: exit 2, saying so.
  const test::RunResult bad =
      test::run_headroom("sample " + dir + "/corpus.txt --prompt x --tokens 1");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "not a config (.toml)")) << bad.output;
}

// `headroom sample` from a Llama's snapshot alone (GQA, untied, rope scaling: the snapshot
// records them) writes what sampling with the config writes.
TEST(Sample, CliSamplesALlamaFromItsSnapshotAlone) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(
      dir, "llama.toml",
      "[model]\narch = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 32\n"
      "intermediate_size = 48\nseq_len = 16\nvocab_size = 256\nrope_theta = 500.0\n"
      "rms_norm_eps = 1e-6\nrope_scaling_factor = 4.0\nrope_original_max_positions = 8\n"
      "[train]\nsteps = 3\nmicro_batch = 2\n[snapshot]\ndir = \"" +
          dir + "/snap\"\nevery = 3\n");
  const test::RunResult train = test::run_headroom("train -q " + cfg);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const std::string tail = " --ids --prompt ab --tokens 20 --top-k 5 --seed 2 2>/dev/null";
  // stdout alone: the ids.
  auto ids = [&](const std::string& source) {
    return test::run_command("(" + std::string(HEADROOM_BINARY) + " sample " + source + tail + ")");
  };
  const test::RunResult with_config = ids(cfg), alone = ids(dir + "/snap");
  ASSERT_EQ(with_config.exit_code, 0) << with_config.output;
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_EQ(alone.output, with_config.output);
  EXPECT_EQ(std::count(alone.output.begin(), alone.output.end(), ' '), 2 + 20 - 1);  // ids
  EXPECT_TRUE(test::starts_with(alone.output, "97 98 ")) << alone.output;
}
// A run on a frozen base writes its trainable parameters alone; `headroom sample` from its
// snapshot takes the base from where the run took it (train.seed's init, or init_from's file) and
// writes what sampling from the run's full weights writes. A LoRA run's snapshot is refused,
// pointing at --merge.
TEST(Sample, CliSamplesARunOnAFrozenBaseFromItsSnapshot) {
  const std::string dir = test::temp_dir();
  const std::string model =
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n";
  const std::string base = dir + "/base.safetensors";
  ASSERT_EQ(test::run_headroom("train -q " +
                               test::write_file(dir, "b.toml", model + "[train]\nsteps = 2\n") +
                               " --save-weights " + base)
                .exit_code,
            0);
  const std::string tail = " --ids --prompt ab --tokens 12 --top-k 5 --seed 2 2>/dev/null";
  auto ids = [&](const std::string& source) {
    return test::run_command("(" + std::string(HEADROOM_BINARY) + " sample " + source + tail + ")");
  };
  for (const std::string& init : {std::string(), "init_from = \"" + base + "\"\n"}) {
    const std::string sub = dir + (init.empty() ? "/seed" : "/file");
    const std::string cfg = test::write_file(
        dir, init.empty() ? "seed.toml" : "file.toml",
        model + "[train]\nsteps = 3\nseed = 7\nlr = 1e-2\nfreeze = [\"wte.weight\", \"h.0.*\"]\n" +
            init + "[snapshot]\ndir = \"" + sub + "\"\nevery = 3\n");
    const test::RunResult train =
        test::run_headroom("train -q " + cfg + " --save-weights " + sub + ".safetensors");
    ASSERT_EQ(train.exit_code, 0) << train.output;
    const test::RunResult alone = ids(sub), full = ids(sub + ".safetensors --config " + cfg);
    ASSERT_EQ(alone.exit_code, 0) << alone.output;
    EXPECT_EQ(alone.output, full.output) << (init.empty() ? "on the seed's init" : "on a file");
  }
  // The base file changed since: refused, saying so.
  ASSERT_EQ(test::run_headroom("train -q " +
                               test::write_file(dir, "b2.toml", model + "[train]\nsteps = 1\n") +
                               " --save-weights " + base)
                .exit_code,
            0);
  const test::RunResult changed =
      test::run_headroom("sample " + dir + "/file --prompt a --tokens 1");
  EXPECT_EQ(changed.exit_code, 2) << changed.output;
  EXPECT_TRUE(contains(changed.output, "that is no longer what it was")) << changed.output;
  // A LoRA run's snapshot: its adapters are not applied by sampling.
  const std::string lora = test::write_file(
      dir, "lora.toml",
      model + "[train]\nsteps = 1\n[snapshot]\ndir = \"" + dir +
          "/lora\"\nevery = 1\n[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = \"c_attn\"\n");
  ASSERT_EQ(test::run_headroom("train -q " + lora).exit_code, 0);
  const test::RunResult adapters =
      test::run_headroom("sample " + dir + "/lora --prompt a --tokens 1");
  EXPECT_EQ(adapters.exit_code, 2) << adapters.output;
  EXPECT_TRUE(contains(adapters.output, "--save-weights DIR/ --merge")) << adapters.output;
}
}  // namespace
}  // namespace headroom
