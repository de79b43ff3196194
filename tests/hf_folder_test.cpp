// Hugging Face folders ([train] init_from = "DIR", --save-weights DIR/): round trips, the sharded
// layout and its index, config.json's shape taking [model]'s place, every malformed folder a
// ConfigError naming the file (exit 2 from the binary), and parity with `transformers` itself
// (tests/hf/reference.py, run from .venv-test/; skipped where it cannot import torch and
// transformers).
#include "core/model/hf_folder.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config/hf_config.h"
#include "core/device/device.h"
#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::error_of;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

ModelConfig tiny() {
  ModelConfig m;
  m.n_layer = 2;
  m.n_head = 2;
  m.n_embd = 8;
  m.seq_len = 5;
  m.vocab_size = 11;
  return m;
}

// Written independently of the implementation: the four Conv1D weights HF stores (in, out).
bool conv1d(const std::string& name) {
  for (const std::string suffix :
       {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"})
    if (name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return true;
  return false;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[i] = char(v >> (8 * i));
  return s;
}

// One tensor of a hand-built file.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string file_of(const std::vector<Tensor>& tensors) {
  json header = json::object();
  std::string data;
  for (const Tensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  const std::string h = header.dump();
  return le64(h.size()) + h + data;
}

// Every parameter of `model` in Hugging Face names ("transformer."), layouts and F32 values.
std::vector<Tensor> hf_tensors(const Gpt<float>& model) {
  std::vector<Tensor> out;
  for (const Param<float>* p : model.params()) {
    std::vector<float> v(p->master().value, p->master().value + p->numel);
    std::vector<int64_t> shape = p->shape;
    if (conv1d(p->name)) {
      const int64_t r = p->shape[0], c = p->shape[1];
      shape = {c, r};
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j)
          v[size_t(j * r + i)] = p->master().value[i * c + j];
    }
    out.push_back({"transformer." + p->name, "F32", shape,
                   std::string(reinterpret_cast<const char*>(v.data()), 4 * v.size())});
  }
  return out;
}

json gpt2_config(const ModelConfig& m) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"n_layer", m.n_layer},
          {"n_head", m.n_head},
          {"n_embd", m.n_embd},
          {"n_positions", m.seq_len},
          {"vocab_size", m.vocab_size},
          {"layer_norm_epsilon", 1e-5},
          {"activation_function", "gelu_new"}};
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

bool same_params(const Gpt<float>& a, const Gpt<float>& b) {
  for (size_t i = 0; i < a.params().size(); ++i)
    if (std::memcmp(a.params()[i]->master().value, b.params()[i]->master().value,
                    4 * a.params()[i]->numel) != 0)
      return false;
  return true;
}

class HfFolder : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  // A folder `name` holding config.json and, split over `shards` files with an index when
  // shards > 1, every tensor of `model` (after `edit` changed the list).
  std::string folder(const std::string& name, const Gpt<float>& model, int shards = 1,
                     const std::function<void(std::vector<Tensor>&)>& edit = nullptr) {
    const std::string d = dir_ + "/" + name;
    fs::create_directories(d);
    write(d + "/config.json", gpt2_config(model.config()).dump());
    std::vector<Tensor> tensors = hf_tensors(model);
    if (edit) edit(tensors);
    if (shards == 1) {
      write(d + "/model.safetensors", file_of(tensors));
      return d;
    }
    json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
    for (int s = 0; s < shards; ++s) {
      char file[64];
      std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
      std::vector<Tensor> part;
      for (size_t i = size_t(s); i < tensors.size(); i += size_t(shards)) {
        part.push_back(tensors[i]);
        index["weight_map"][tensors[i].name] = file;
      }
      write(d + "/" + file, file_of(part));
    }
    write(d + "/model.safetensors.index.json", index.dump());
    return d;
  }

  std::unique_ptr<Device> device_ = Device::create(DeviceConfig{});
  std::string dir_;
};

TEST_F(HfFolder, SaveThenLoadReproducesEveryWeightBitwise) {
  Gpt<float> a(tiny(), *device_, 1);
  Gpt<float> b(tiny(), *device_, 2);
  ASSERT_FALSE(same_params(a, b));
  const std::string d = dir_ + "/out/";
  ASSERT_TRUE(names_hf_folder(d));
  save_weights_to(d, a);
  load_weights(d, b);
  EXPECT_TRUE(same_params(a, b));
}

TEST_F(HfFolder, SavedFolderHasTransformersNamesAndConfig) {
  Gpt<float> a(tiny(), *device_, 1);
  save_hf_folder(dir_ + "/out", a);
  const json c = json::parse(test::read_file(dir_ + "/out/config.json"));
  EXPECT_EQ(c["model_type"], "gpt2");
  EXPECT_EQ(c["architectures"], json({"GPT2LMHeadModel"}));
  EXPECT_EQ(c["n_layer"], 2);
  EXPECT_EQ(c["n_head"], 2);
  EXPECT_EQ(c["n_embd"], 8);
  EXPECT_EQ(c["n_positions"], 5);
  EXPECT_EQ(c["vocab_size"], 11);
  EXPECT_EQ(c["tie_word_embeddings"], true);
  const auto entries = read_safetensors_header(dir_ + "/out/model.safetensors");
  ASSERT_EQ(entries.size(), a.params().size()) << "the tied lm_head is left out";
  for (const SafetensorsEntry& e : entries) {
    ASSERT_TRUE(test::starts_with(e.name, "transformer.")) << e.name;
    if (e.name == "transformer.h.0.mlp.c_fc.weight") {
      EXPECT_EQ(e.shape, (std::vector<int64_t>{8, 32}));
    }
  }
  // The folder config.json describes is what read_hf_config reads back.
  const HfModelConfig hf = read_hf_config(dir_ + "/out");
  EXPECT_EQ(hf.arch, "gpt2");
  for (const auto& k : hf.shape)
    EXPECT_EQ(k.value, model_shape_value(tiny(), k.model_key)) << k.model_key;
}

TEST_F(HfFolder, LoadsShardedFolderWithIndex) {
  Gpt<float> a(tiny(), *device_, 1);
  Gpt<float> b(tiny(), *device_, 2);
  load_hf_folder(folder("sharded", a, 3), b);
  EXPECT_TRUE(same_params(a, b));
}

TEST_F(HfFolder, LoadsNamesWithoutPrefixBf16AndATiedHead) {
  Gpt<float> a(tiny(), *device_, 1);
  Gpt<float> b(tiny(), *device_, 2);
  // GPT2Model's names (no "transformer."), the mask buffers and an lm_head equal to wte.
  const std::string d = folder("plain", a, 2, [](std::vector<Tensor>& ts) {
    std::string wte;
    for (Tensor& t : ts) {
      t.name = t.name.substr(12);
      if (t.name == "wte.weight") wte = t.bytes;
    }
    ts.push_back({"lm_head.weight", "F32", {11, 8}, wte});
    ts.push_back({"h.0.attn.bias", "F32", {1}, std::string(4, '\0')});
  });
  load_hf_folder(d, b);
  EXPECT_TRUE(same_params(a, b));

  // BF16 values exact in bf16 load as those values.
  Gpt<float> c(tiny(), *device_, 3);
  const std::string d2 = folder("bf16", a, 1, [](std::vector<Tensor>& ts) {
    for (Tensor& t : ts) {
      std::string b16;
      for (size_t i = 0; i < t.bytes.size(); i += 4) {
        b16 += char(0x80);  // -1.0 in bf16 is 0xBF80
        b16 += char(0xBF);
      }
      t.dtype = "BF16";
      t.bytes = b16;
    }
  });
  load_hf_folder(d2, c);
  for (const Param<float>* p : c.params())
    for (uint64_t i = 0; i < p->numel; ++i)
      ASSERT_EQ(p->master().value[i], -1.0f) << p->name;
}

TEST_F(HfFolder, EveryMalformedFolderIsAnErrorNamingTheFile) {
  Gpt<float> a(tiny(), *device_, 1);
  Gpt<float> b(tiny(), *device_, 2);
  struct Case {
    std::string name;
    std::function<std::string()> make;  // the folder
    std::vector<std::string> says;      // what the message has
  };
  const auto with_config = [&](const std::string& n, const std::string& text) {
    const std::string d = folder(n, a);
    write(d + "/config.json", text);
    return d;
  };
  const std::vector<Case> cases = {
      {"no_config",
       [&] {
         const std::string d = folder("no_config", a);
         fs::remove(d + "/config.json");
         return d;
       },
       {"no_config/config.json", "missing"}},
      {"not_json",
       [&] { return with_config("not_json", "{\"n_layer\": 2,\n oops}"); },
       {"not_json/config.json", "not valid JSON", "line 2"}},
      {"unknown_type",
       [&] {
         json c = gpt2_config(tiny());
         c["model_type"] = "mamba";
         return with_config("unknown_type", c.dump());
       },
       {"unknown_type/config.json", "\"mamba\"", "gpt2"}},
      {"unknown_arch",
       [&] {
         json c = gpt2_config(tiny());
         c["architectures"] = {"GPT2ForSequenceClassification"};
         return with_config("unknown_arch", c.dump());
       },
       {"unknown_arch/config.json", "GPT2ForSequenceClassification"}},
      {"other_shape",
       [&] {
         json c = gpt2_config(tiny());
         c["n_embd"] = 16;
         return with_config("other_shape", c.dump());
       },
       {"other_shape/config.json", "n_embd is 16", "n_embd is 8"}},
      {"other_eps",
       [&] {
         json c = gpt2_config(tiny());
         c["layer_norm_epsilon"] = 1e-6;
         return with_config("other_eps", c.dump());
       },
       {"other_eps/config.json", "layer_norm_epsilon"}},
      {"no_weights",
       [&] {
         const std::string d = folder("no_weights", a);
         fs::remove(d + "/model.safetensors");
         return d;
       },
       {"no_weights: has neither model.safetensors nor model.safetensors.index.json"}},
      {"missing_shard",
       [&] {
         const std::string d = folder("missing_shard", a, 2);
         fs::remove(d + "/model-00002-of-00002.safetensors");
         return d;
       },
       {"model.safetensors.index.json", "model-00002-of-00002.safetensors is missing"}},
      {"index_names_missing_tensor",
       [&] {
         const std::string d = folder("index_names_missing_tensor", a, 2);
         json index = json::parse(test::read_file(d + "/model.safetensors.index.json"));
         index["weight_map"]["transformer.h.9.ln_1.weight"] = "model-00001-of-00002.safetensors";
         write(d + "/model.safetensors.index.json", index.dump());
         return d;
       },
       {"model.safetensors.index.json", "\"transformer.h.9.ln_1.weight\"", "has no such tensor"}},
      {"index_escapes",
       [&] {
         const std::string d = folder("index_escapes", a, 2);
         json index = json::parse(test::read_file(d + "/model.safetensors.index.json"));
         index["weight_map"]["transformer.wte.weight"] = "../elsewhere.safetensors";
         write(d + "/model.safetensors.index.json", index.dump());
         return d;
       },
       {"model.safetensors.index.json", "not the name of a file in the folder"}},
      {"index_not_json",
       [&] {
         const std::string d = folder("index_not_json", a, 2);
         write(d + "/model.safetensors.index.json", "{\"weight_map\": [");
         return d;
       },
       {"index_not_json/model.safetensors.index.json", "not valid JSON"}},
      {"shard_not_in_index",
       [&] {
         const std::string d = folder("shard_not_in_index", a, 2);
         json index = json::parse(test::read_file(d + "/model.safetensors.index.json"));
         index["weight_map"].erase("transformer.wte.weight");
         write(d + "/model.safetensors.index.json", index.dump());
         return d;
       },
       {".safetensors: holds tensor \"transformer.wte.weight\"", "does not place"}},
      {"wrong_dtype",
       [&] {
         return folder("wrong_dtype", a, 1, [](std::vector<Tensor>& ts) { ts[0].dtype = "I32"; });
       },
       {"wrong_dtype/model.safetensors", "\"I32\"", "F32, BF16, F16"}},
      {"wrong_shape",
       [&] {
         return folder("wrong_shape", a, 1, [](std::vector<Tensor>& ts) {
           for (Tensor& t : ts)
             if (t.name == "transformer.h.1.mlp.c_fc.weight") t.shape = {32, 8};
         });
       },
       {"wrong_shape/model.safetensors", "transformer.h.1.mlp.c_fc.weight", "[32, 8]",
        "expected [8, 32]"}},
      {"extra_tensor",
       [&] {
         return folder("extra_tensor", a, 1, [](std::vector<Tensor>& ts) {
           ts.push_back({"transformer.h.2.ln_1.weight", "F32", {8}, std::string(32, '\0')});
         });
       },
       {"extra_tensor/model.safetensors", "transformer.h.2.ln_1.weight",
        "not a parameter of this model"}},
      {"missing_tensor",
       [&] {
         return folder("missing_tensor", a, 2, [](std::vector<Tensor>& ts) {
           for (size_t i = 0; i < ts.size(); ++i)
             if (ts[i].name == "transformer.ln_f.bias") ts.erase(ts.begin() + long(i));
         });
       },
       {"missing_tensor: no file of the folder holds tensor transformer.ln_f.bias"}},
      {"untied_head",
       [&] {
         return folder("untied_head", a, 1, [](std::vector<Tensor>& ts) {
           ts.push_back({"lm_head.weight", "F32", {11, 8}, std::string(4 * 88, '\0')});
         });
       },
       {"untied_head/model.safetensors", "lm_head.weight", "untied"}},
      {"huge_header",
       [&] {
         const std::string d = folder("huge_header", a);
         write(d + "/model.safetensors", le64(uint64_t(1) << 40) + "{}");
         return d;
       },
       {"huge_header/model.safetensors", "header length"}},
      {"shape_past_the_file",
       [&] {
         return folder("shape_past_the_file", a, 1, [](std::vector<Tensor>& ts) {
           ts[0].shape = {int64_t(1) << 31, int64_t(1) << 31};
         });
       },
       {"shape_past_the_file/model.safetensors"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string d = c.make();
    const std::string msg = error_of([&] { load_hf_folder(d, b); });
    for (const std::string& s : c.says)
      EXPECT_HAS(msg, s);
    EXPECT_FALSE(same_params(a, b)) << "a refused folder changes nothing";
  }
}

TEST_F(HfFolder, ConfigTakesTheShapeFromConfigJsonAndRefusesAContradiction) {
  Gpt<float> a(tiny(), *device_, 1);
  const std::string d = folder("m", a);
  const Config c = test::config_from("[train]\ninit_from = \"" + d + "\"\n");
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.n_head, 2);
  EXPECT_EQ(c.model.n_embd, 8);
  EXPECT_EQ(c.model.seq_len, 5);
  EXPECT_EQ(c.model.vocab_size, 11);
  EXPECT_EQ(c.model.preset, "");
  // A [model] with only other keys takes the shape too; one that agrees is fine.
  EXPECT_EQ(test::config_from(
                "[model]\nattention = \"naive\"\nn_layer = 2\n[train]\ninit_from = \"" + d + "\"\n")
                .model.n_embd,
            8);

  const std::string key = error_of(
      [&] { test::config_from("[model]\nn_embd = 16\n[train]\ninit_from = \"" + d + "\"\n"); });
  EXPECT_HAS(key, "test.toml:2:");
  EXPECT_HAS(key, "model.n_embd = 16");
  EXPECT_HAS(key, "m/config.json's n_embd = 8");
  const std::string preset = error_of([&] {
    test::config_from("[model]\npreset = \"tiny\"\n[train]\ninit_from = \"" + d + "\"\n");
  });
  EXPECT_HAS(preset, "model.preset \"tiny\"");
  EXPECT_HAS(preset, "m/config.json's");
  fs::remove(d + "/config.json");
  const std::string missing =
      error_of([&] { test::config_from("[train]\ninit_from = \"" + d + "\"\n"); });
  EXPECT_HAS(missing, "train.init_from");
  EXPECT_HAS(missing, "m/config.json: missing");
}

TEST_F(HfFolder, TheBinaryExitsTwoForABadFolderAndTrainsFromAGoodOne) {
  Gpt<float> a(tiny(), *device_, 1);
  const std::string good = folder("good", a);
  const std::string bad = folder("bad", a, 2);
  fs::remove(bad + "/model-00001-of-00002.safetensors");
  const auto toml = [&](const std::string& d) {
    return test::write_file(dir_, fs::path(d).filename().string() + ".toml",
                            "[train]\nsteps = 1\nmicro_batch = 1\ninit_from = \"" + d + "\"\n");
  };
  for (const std::string cmd : {"train -q ", "check "}) {
    const test::RunResult r = test::run_headroom(cmd + toml(bad));
    EXPECT_EQ(r.exit_code, 2) << cmd << r.output;
    EXPECT_HAS(r.output, "train.init_from");
    EXPECT_HAS(r.output, "model-00001-of-00002.safetensors is missing");
  }
  EXPECT_EQ(test::run_headroom("check " + toml(good)).exit_code, 0);
  const test::RunResult ok =
      test::run_headroom("train -q " + toml(good) + " --save-weights " + dir_ + "/saved/");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(fs::exists(dir_ + "/saved/config.json"));
  EXPECT_TRUE(fs::exists(dir_ + "/saved/model.safetensors"));
  // `sample` builds the model from the folder's config.json alone: this one's vocab of 11 is too
  // small for the byte tokenizer, which it says.
  const test::RunResult sample =
      test::run_headroom("sample " + dir_ + "/saved --tokens 3 --prompt ab");
  EXPECT_EQ(sample.exit_code, 2) << sample.output;
  EXPECT_HAS(sample.output, "the model's vocab_size 11");
}

// A tiny Llama: grouped-query attention (2 key/value heads for 4), Llama 3's rope scaling, the
// head untied or tied.
ModelConfig tiny_llama(bool tied) {
  ModelConfig m;
  m.arch = "llama";
  m.n_layer = 2;
  m.n_head = 4;
  m.n_kv_head = 2;
  m.n_embd = 16;
  m.intermediate_size = 24;
  m.seq_len = 8;
  m.vocab_size = 13;
  m.rms_norm_eps = 1e-6;
  m.rope_theta = 500000.0;
  m.rope_scaling_factor = 8.0;
  m.rope_original_max_positions = 4;
  m.tie_embeddings = tied;
  return m;
}

TEST_F(HfFolder, LlamaSavesTransformersNamesAndLoadsBackBitwise) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    Gpt<float> a(tiny_llama(tied), *device_, 1);
    save_weights_to(dir_ + "/llama/", a);
    // Hugging Face's names: q, k, v and gate, up as their own tensors, no lm_head when tied.
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const SafetensorsEntry& e : read_safetensors_header(dir_ + "/llama/model.safetensors"))
      shapes[e.name] = e.shape;
    EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{16, 16}));
    EXPECT_EQ(shapes.at("model.layers.1.self_attn.k_proj.weight"), (std::vector<int64_t>{8, 16}));
    EXPECT_EQ(shapes.at("model.layers.1.self_attn.v_proj.weight"), (std::vector<int64_t>{8, 16}));
    EXPECT_EQ(shapes.at("model.layers.0.mlp.gate_proj.weight"), (std::vector<int64_t>{24, 16}));
    EXPECT_EQ(shapes.at("model.layers.0.mlp.up_proj.weight"), (std::vector<int64_t>{24, 16}));
    EXPECT_EQ(shapes.at("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{16, 24}));
    EXPECT_EQ(shapes.count("lm_head.weight"), tied ? 0u : 1u);
    EXPECT_EQ(shapes.count("model.layers.0.self_attn.qkv_proj.weight"), 0u);
    const json c = json::parse(test::read_file(dir_ + "/llama/config.json"));
    EXPECT_EQ(c["architectures"], json::array({"LlamaForCausalLM"}));
    EXPECT_EQ(c["num_key_value_heads"], 2);
    EXPECT_EQ(c["intermediate_size"], 24);
    EXPECT_EQ(c["tie_word_embeddings"], tied);
    EXPECT_EQ(c["rope_theta"], 500000.0);
    EXPECT_EQ(c["rms_norm_eps"], 1e-6);
    EXPECT_EQ(c["rope_scaling"]["rope_type"], "llama3");
    EXPECT_EQ(c["rope_scaling"]["original_max_position_embeddings"], 4);

    // The shape, arch and rope settings come back from config.json alone.
    const Config cfg = test::config_from("[train]\ninit_from = \"" + dir_ + "/llama\"\n");
    EXPECT_EQ(cfg.model.arch, "llama");
    EXPECT_EQ(cfg.model.kv_heads(), 2);
    EXPECT_EQ(cfg.model.intermediate_size, 24);
    EXPECT_EQ(cfg.model.tie_embeddings, tied);
    EXPECT_EQ(cfg.model.rope_theta, 500000.0);
    EXPECT_EQ(cfg.model.rms_norm_eps, 1e-6);
    EXPECT_EQ(cfg.model.rope_scaling_factor, 8.0);
    EXPECT_EQ(cfg.model.rope_original_max_positions, 4);
    Gpt<float> b(cfg.model, *device_, 2);
    EXPECT_FALSE(same_params(a, b));
    load_weights(dir_ + "/llama", b);
    EXPECT_TRUE(same_params(a, b));
    fs::remove_all(dir_ + "/llama");
  }
}

TEST_F(HfFolder, LlamaConfigJsonThatHeadroomCannotBuildIsAnErrorNamingTheKey) {
  Gpt<float> a(tiny_llama(false), *device_, 1);
  save_weights_to(dir_ + "/l/", a);
  const json good = json::parse(test::read_file(dir_ + "/l/config.json"));
  const auto with = [&](const std::function<void(json&)>& edit) {
    json c = good;
    edit(c);
    write(dir_ + "/l/config.json", c.dump());
    return error_of([&] { read_hf_config(dir_ + "/l"); });
  };
  EXPECT_HAS(with([](json& c) { c["rope_scaling"]["rope_type"] = "yarn"; }),
             "rope_scaling.rope_type is \"yarn\"");
  EXPECT_HAS(with([](json& c) { c["num_key_value_heads"] = 3; }),
             "num_key_value_heads 3 does not divide num_attention_heads 4");
  EXPECT_HAS(with([](json& c) { c["hidden_act"] = "gelu"; }), "hidden_act is \"gelu\"");
  EXPECT_HAS(with([](json& c) { c["attention_bias"] = true; }), "attention_bias is true");
  EXPECT_HAS(with([](json& c) { c["head_dim"] = 8; }), "head_dim is 8");
  EXPECT_HAS(with([](json& c) { c["rms_norm_eps"] = "small"; }), "rms_norm_eps is \"small\"");
  EXPECT_HAS(with([](json& c) { c.erase("intermediate_size"); }), "has no intermediate_size");
  EXPECT_HAS(with([](json& c) { c["model_type"] = "qwen2"; }), "model_type \"qwen2\"");
  EXPECT_HAS(with([](json& c) { c["rope_scaling"].erase("factor"); }),
             "rope_scaling.factor is missing");
  // transformers 5's form: rope_theta and the scaling inside rope_parameters.
  json v5_config = good;
  v5_config["rope_parameters"] = good["rope_scaling"];
  v5_config["rope_parameters"]["rope_theta"] = good["rope_theta"];
  v5_config.erase("rope_scaling");
  v5_config.erase("rope_theta");
  write(dir_ + "/l/config.json", v5_config.dump());
  const HfModelConfig v5 = read_hf_config(dir_ + "/l");
  const ModelConfig m = model_config_of(v5);
  EXPECT_EQ(m.rope_theta, 500000.0);
  EXPECT_EQ(m.rope_scaling_factor, 8.0);
  EXPECT_EQ(m.rope_original_max_positions, 4);

  // A [model] that contradicts the folder names both; a shorter seq_len is a Llama's choice.
  write(dir_ + "/l/config.json", good.dump());
  const std::string at = "[train]\ninit_from = \"" + dir_ + "/l\"\n";
  const std::string kv = error_of([&] { test::config_from("[model]\nn_kv_head = 4\n" + at); });
  EXPECT_HAS(kv, "test.toml:2:");
  EXPECT_HAS(kv, "model.n_kv_head = 4 contradicts");
  EXPECT_HAS(kv, "num_key_value_heads = 2");
  const std::string eps =
      error_of([&] { test::config_from("[model]\nrms_norm_eps = 1e-5\n" + at); });
  EXPECT_HAS(eps, "model.rms_norm_eps = 1e-05 contradicts");
  EXPECT_HAS(eps, "rms_norm_eps = 1e-06");
  const std::string arch = error_of([&] { test::config_from("[model]\narch = \"gpt2\"\n" + at); });
  EXPECT_HAS(arch, "model.arch = \"gpt2\" contradicts");
  EXPECT_EQ(test::config_from("[model]\nseq_len = 4\n" + at).model.seq_len, 4);
  EXPECT_HAS(error_of([&] { test::config_from("[model]\nseq_len = 16\n" + at); }),
             "it may be at most the folder's");
  // An untied folder loaded into a tied model: the head differs from the embedding.
  Gpt<float> tied(tiny_llama(true), *device_, 1);
  EXPECT_HAS(error_of([&] { load_weights(dir_ + "/l", tied); }), "tie_word_embeddings is false");
}

TEST_F(HfFolder, TheBinaryTrainsALlamaFromAFolderAndSavesOne) {
  Gpt<float> a(tiny_llama(false), *device_, 1);
  save_weights_to(dir_ + "/start/", a);
  const std::string toml = test::write_file(
      dir_, "l.toml", "[train]\nsteps = 2\nmicro_batch = 1\ninit_from = \"" + dir_ + "/start\"\n");
  const test::RunResult ok =
      test::run_headroom("train -q " + toml + " --save-weights " + dir_ + "/trained/");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  const Config cfg = test::config_from("[train]\ninit_from = \"" + dir_ + "/trained\"\n");
  EXPECT_EQ(cfg.model.arch, "llama");
  Gpt<float> b(cfg.model, *device_, 1);
  load_weights(dir_ + "/trained", b);
  EXPECT_FALSE(same_params(a, b));  // trained: two steps moved the weights
  // A single .safetensors file holds GPT-2 shapes only: refused before any work, saying why.
  const test::RunResult file =
      test::run_headroom("train -q " + toml + " --save-weights " + dir_ + "/w.safetensors");
  EXPECT_EQ(file.exit_code, 2) << file.output;
  EXPECT_HAS(file.output, "end the path with /");
  EXPECT_FALSE(fs::exists(dir_ + "/w.safetensors"));
}

// The transformers reference of `arch` (tests/hf/reference.py make), made once for the tests
// below: its folders, batch, loss, gradients and SGD losses; `skip` says why there is none.
struct Reference {
  std::string arch, dir, skip, python;
  json ref;
  test::TokenBatch ids;  // the batch
};

const Reference& reference(const std::string& arch) {
  static std::map<std::string, Reference> made;
  if (made.count(arch)) return made.at(arch);
  Reference& ref = made[arch];
  ref = [&] {
    Reference r;
    r.arch = arch;
    r.python = std::string(HEADROOM_SOURCE_DIR) + "/.venv-test/bin/python";
    if (!fs::exists(r.python)) {
      r.skip = "no " + r.python + " (the test-only reference; scripts/setup makes it)";
      return r;
    }
    r.dir = test::temp_dir();
    const test::RunResult run = test::run_command(
        r.python + " " + HEADROOM_SOURCE_DIR + "/tests/hf/reference.py make " + arch + " " + r.dir);
    // 77: torch or transformers not importable (the script says so; scripts/setup installs them).
    // No import probe first: importing them is most of the script's time.
    if (run.exit_code == 77) {
      r.skip = run.output;
      return r;
    }
    EXPECT_EQ(run.exit_code, 0) << run.output;
    r.ref = json::parse(test::read_file(r.dir + "/reference.json"));
    r.ids = test::read_batch_json(r.dir + "/batch.json");
    return r;
  }();
  return ref;
}

// ||a - b|| / ||b||.
double rel_error(const float* a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The reference's model (its folder `name`) as init_from builds it: the shape from config.json.
struct Loaded {
  Config config;
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  std::unique_ptr<Gpt<float>> model;
  Batch batch;
};
std::unique_ptr<Loaded> load_reference(const Reference& r, const std::string& name) {
  auto l = std::make_unique<Loaded>();
  l->config = test::config_from("[train]\ninit_from = \"" + r.dir + "/" + name + "\"\n");
  l->model = std::make_unique<Gpt<float>>(l->config.model, *l->device, 1);
  load_weights(l->config.train.init_from, *l->model);
  // The mean over the counted tokens, as cross_entropy takes it.
  l->batch = r.ids.batch(r.ids.mean_dloss());
  return l;
}

void expect_rel(double ours, double theirs, double tol, const std::string& what) {
  EXPECT_LE(std::abs(ours - theirs), tol * std::abs(theirs))
      << what << ": headroom " << ours << ", transformers " << theirs;
}

class HfParity : public ::testing::TestWithParam<std::string> {};

// GPT2LMHeadModel, and LlamaForCausalLM with grouped-query attention, an untied head and Llama 3's
// rope scaling.
TEST_P(HfParity, LossGradientsAndSgdStepsMatchTransformers) {
  HEADROOM_REFERENCE_IN_RELEASE_PASS("HfFolder.*");
  const Reference& r = reference(GetParam());
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  for (const std::string name : {"single", "sharded"}) {
    SCOPED_TRACE(name);
    auto l = load_reference(r, name);
    Gpt<float>& model = *l->model;
    EXPECT_EQ(l->config.model.arch, r.arch);
    EXPECT_EQ(l->config.model.n_embd, 64);
    EXPECT_EQ(l->config.model.vocab_size, 300);
    if (r.arch == "llama") {
      EXPECT_EQ(l->config.model.kv_heads(), 2);
      EXPECT_FALSE(l->config.model.tied());
      EXPECT_EQ(l->config.model.rope_scaling_factor, 8.0);
      EXPECT_EQ(l->config.model.rope_original_max_positions, 32);
    }
    model.zero_grad();
    model.forward(l->batch);
    model.backward(l->batch);
    expect_rel(model.loss(), r.ref["loss"].get<double>(), 1e-5, "loss");

    // Every gradient, from transformers' (in headroom's names; GPT-2's Conv1D weights (in, out)).
    const std::string grads = r.dir + "/grads.safetensors";
    std::map<std::string, SafetensorsEntry> by_name;
    for (SafetensorsEntry& e : read_safetensors_header(grads))
      by_name[e.name] = std::move(e);
    ASSERT_EQ(by_name.size(), model.params().size());
    double worst = 0;
    for (const Param<float>* p : model.params()) {
      const auto it = by_name.find(p->name);
      ASSERT_NE(it, by_name.end()) << p->name;
      std::vector<float> theirs(p->numel);
      read_safetensors_tensor(grads, it->second, theirs.data(),
                              r.arch == "gpt2" && conv1d(p->name));
      const double e = rel_error(p->master().grad, theirs);
      worst = std::max(worst, e);
      EXPECT_LT(e, 1e-4) << p->name;
    }
    std::cout << "[ parity ] " << r.arch << " " << name << ": loss relative difference "
              << std::abs(model.loss() / r.ref["loss"].get<double>() - 1)
              << ", worst gradient relative error " << worst << "\n";

    // Ten SGD steps on the same batch: each step's loss, before its update.
    const double lr = r.ref["lr"].get<double>();
    const std::vector<double> theirs = r.ref["sgd_losses"].get<std::vector<double>>();
    double worst_sgd = 0;
    for (size_t step = 0; step < theirs.size(); ++step) {
      model.zero_grad();
      model.forward(l->batch);
      model.backward(l->batch);
      expect_rel(model.loss(), theirs[step], 1e-5, "SGD step " + std::to_string(step + 1));
      worst_sgd = std::max(worst_sgd, std::abs(model.loss() / theirs[step] - 1));
      for (Param<float>* p : model.params())
        for (uint64_t i = 0; i < p->numel; ++i)
          p->master().value[i] -= float(lr) * p->master().grad[i];
      model.sync_compute_params();
    }
    std::cout << "[ parity ] " << r.arch << " " << name << ": " << theirs.size()
              << " SGD steps, worst loss relative difference " << worst_sgd << "\n";
    if (name != "single") continue;
    // The trained model, saved as a folder, loads in transformers as the same model: its loss
    // there is headroom's.
    const double ours = model.evaluate(l->batch);
    save_weights_to(r.dir + "/trained/", model);
    const test::RunResult run =
        test::run_command(r.python + " " + HEADROOM_SOURCE_DIR + "/tests/hf/reference.py check " +
                          r.arch + " " + r.dir + " " + r.dir + "/trained");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const json check = json::parse(test::read_file(r.dir + "/check.json"));
    expect_rel(ours, check["loss"].get<double>(), 1e-5, "the saved model's loss in transformers");
  }
}

TEST_P(HfParity, SavedFolderGivesTransformersTheSameLogits) {
  HEADROOM_REFERENCE_IN_RELEASE_PASS("HfFolder.*");
  const Reference& r = reference(GetParam());
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  auto l = load_reference(r, "single");
  save_weights_to(r.dir + "/resaved/", *l->model);
  const test::RunResult run =
      test::run_command(r.python + " " + HEADROOM_SOURCE_DIR + "/tests/hf/reference.py check " +
                        r.arch + " " + r.dir + " " + r.dir + "/resaved");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json check = json::parse(test::read_file(r.dir + "/check.json"));
  // The same weights, bitwise: the same logits up to the float rounding of one forward.
  EXPECT_LE(check["max_logit_diff"].get<double>(), 1e-6 * check["max_logit"].get<double>())
      << check.dump();
  std::cout << "[ parity ] " << r.arch
            << ": logits of headroom's saved folder vs the original: largest difference "
            << check["max_logit_diff"].get<double>() << " (largest logit "
            << check["max_logit"].get<double>() << ")\n";
}

INSTANTIATE_TEST_SUITE_P(Archs, HfParity, ::testing::Values("gpt2", "llama"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace headroom
