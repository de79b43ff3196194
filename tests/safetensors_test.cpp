// safetensors import/export: round trips bitwise, reads BF16 and F16, uses Hugging Face's (in, out)
// layout for the Conv1D weights, and turns every kind of malformed file into a ConfigError that
// names the file.
#include "core/model/safetensors.h"
#include "core/os/output_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/model.h"
#include "kernels/common/dtype.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

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
  for (const char* s :
       {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}) {
    const std::string suffix = s;
    if (name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return true;
  }
  return false;
}

std::vector<int64_t> hf_shape_of(const Param<float>& p) {
  return conv1d(p.name) ? std::vector<int64_t>{p.shape[1], p.shape[0]} : p.shape;
}

// One tensor of a hand-written file: its bytes as they go into the data section.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[i] = char(v >> (8 * i));
  return s;
}

// The whole file: length prefix, `header` as given, then `data`.
std::string file_of(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// A well-formed file holding `tensors` back to back.
std::string file_of(const std::vector<Tensor>& tensors) {
  json header = json::object();
  std::string data;
  for (const Tensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  return file_of(header.dump(), data);
}

std::string write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

template <typename T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Every parameter of `model` in HF names and shapes, element k of each (row-major in HF layout)
// holding value(name, k) in `dtype`.
std::vector<Tensor> model_tensors(const Gpt<float>& model, const std::string& dtype,
                                  const std::function<float(const std::string&, uint64_t)>& value) {
  std::vector<Tensor> out;
  for (const Param<float>* p : model.params()) {
    Tensor t{p->name, dtype, hf_shape_of(*p), ""};
    if (dtype == "F32") {
      std::vector<float> v(p->numel);
      for (uint64_t k = 0; k < p->numel; ++k)
        v[k] = value(p->name, k);
      t.bytes = bytes_of(v);
    } else {
      std::vector<uint16_t> v(p->numel);
      for (uint64_t k = 0; k < p->numel; ++k)
        v[k] = dtype == "BF16" ? float_to_bf16(value(p->name, k)) : float_to_f16(value(p->name, k));
      t.bytes = bytes_of(v);
    }
    out.push_back(std::move(t));
  }
  return out;
}

// The value at our (out, in) index i of parameter p, given the file's values in HF layout.
float expected_at(const Param<float>& p, uint64_t i,
                  const std::function<float(const std::string&, uint64_t)>& value) {
  if (!conv1d(p.name)) return value(p.name, i);
  const uint64_t out_dim = uint64_t(p.shape[0]), in_dim = uint64_t(p.shape[1]);
  const uint64_t o = i / in_dim, in = i % in_dim;
  return value(p.name, in * out_dim + o);
}

// A value exact in BF16 and F16 (a multiple of 1/8 below 8), different per tensor and element.
float exact_value(const std::string& name, uint64_t k) {
  return float(int((k * 7 + name.size() * 3) % 61) - 30) * 0.125f;
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir(); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::unique_ptr<Device> device_ = Device::create(DeviceConfig{});
  std::string dir_;
};

TEST_F(Safetensors, ExportThenImportReproducesEveryWeightBitwise) {
  Gpt<float> a(tiny(), *device_, 1);
  Gpt<float> b(tiny(), *device_, 2);
  const std::string file = path("model.safetensors");
  save_safetensors(file, a);
  EXPECT_FALSE(fs::exists(file + ".tmp"));

  // The seeds differ, so a load that did nothing would fail the comparison.
  bool differed = false;
  for (size_t i = 0; i < a.params().size(); ++i)
    differed = differed || std::memcmp(a.params()[i]->master().value, b.params()[i]->master().value,
                                       4 * a.params()[i]->numel) != 0;
  ASSERT_TRUE(differed);

  load_safetensors(file, b);
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param<float>& pa = *a.params()[i];
    const Param<float>& pb = *b.params()[i];
    ASSERT_EQ(pa.name, pb.name);
    EXPECT_EQ(std::memcmp(pa.master().value, pb.master().value, 4 * pa.numel), 0) << pa.name;
  }
}

TEST_F(Safetensors, ExportWritesTheReferenceLayout) {
  Gpt<float> model(tiny(), *device_, 1);
  const std::string file = path("model.safetensors");
  write_bytes(file, "an older file that the save replaces");
  save_safetensors(file, model);

  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | uint8_t(bytes[i]);
  EXPECT_EQ(n % 8, 0u) << "header padded to a multiple of 8";
  const std::string text = bytes.substr(8, n);
  EXPECT_EQ(text.find_last_not_of(' ') + 1, text.find_last_of('}') + 1) << "padded with spaces";
  const json header = json::parse(text);
  // The model's shape beside the reference writer's keys (n_head is in no tensor's shape).
  EXPECT_EQ(header["__metadata__"], json({{"format", "pt"},
                                          {"producer", "headroom"},
                                          {"n_layer", "2"},
                                          {"n_head", "2"},
                                          {"n_embd", "8"},
                                          {"seq_len", "5"},
                                          {"vocab_size", "11"}}));

  const std::vector<SafetensorsEntry> entries = parse_safetensors_header(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), bytes.size(), file);
  ASSERT_EQ(entries.size(), model.params().size());
  // Sorted by name, and stored in that order with no gaps.
  uint64_t offset = 0;
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : entries)
    by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->begin < b->begin; });
  for (size_t i = 0; i < by_offset.size(); ++i) {
    if (i > 0) {
      EXPECT_LT(by_offset[i - 1]->name, by_offset[i]->name);
    }
    EXPECT_EQ(by_offset[i]->begin, offset);
    EXPECT_EQ(by_offset[i]->dtype, "F32");
    offset = by_offset[i]->end;
  }
  EXPECT_EQ(8 + n + offset, bytes.size());

  const int C = 8;
  const auto shape_of = [&](const std::string& name) { return header[name]["shape"]; };
  EXPECT_EQ(shape_of("h.0.attn.c_attn.weight"), json({C, 3 * C}));
  EXPECT_EQ(shape_of("h.0.attn.c_proj.weight"), json({C, C}));
  EXPECT_EQ(shape_of("h.1.mlp.c_fc.weight"), json({C, 4 * C}));
  EXPECT_EQ(shape_of("h.1.mlp.c_proj.weight"), json({4 * C, C}));
  EXPECT_EQ(shape_of("wte.weight"), json({11, C}));
  EXPECT_EQ(shape_of("wpe.weight"), json({5, C}));
  EXPECT_EQ(shape_of("ln_f.bias"), json({C}));

  // c_fc's (in, out) element [i][o] is our (out, in) element [o][i].
  const SafetensorsEntry& fc = *std::find_if(entries.begin(), entries.end(), [](const auto& e) {
    return e.name == "h.1.mlp.c_fc.weight";
  });
  const std::vector<Param<float>*> params = model.params();
  const Param<float>& p = **std::find_if(
      params.begin(), params.end(), [](const auto* x) { return x->name == "h.1.mlp.c_fc.weight"; });
  const float* stored = reinterpret_cast<const float*>(bytes.data() + 8 + n + fc.begin);
  for (int i = 0; i < C; ++i)
    for (int o = 0; o < 4 * C; ++o)
      ASSERT_EQ(stored[i * 4 * C + o], p.master().value[o * C + i]) << i << "," << o;
}

TEST_F(Safetensors, ParsesFromTheHeaderBytesAlone) {
  // A caller may read only the length and the JSON; offsets are still checked against the file.
  const std::string file = file_of(
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", std::string(8, '\0'));
  const uint64_t header_end = file.size() - 8;
  const auto* data = reinterpret_cast<const uint8_t*>(file.data());
  const std::vector<SafetensorsEntry> entries =
      parse_safetensors_header(data, header_end, file.size(), "part.safetensors");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].name, "a");
  EXPECT_EQ(entries[0].dtype, "F32");
  EXPECT_EQ(entries[0].shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(entries[0].begin, 0u);
  EXPECT_EQ(entries[0].end, 8u);
  // Fewer bytes than the header needs is an error, not a read past them.
  const std::string m = test::error_of(
      [&] { parse_safetensors_header(data, header_end - 1, file.size(), "part.safetensors"); });
  EXPECT_HAS(m, "part.safetensors: only ");
  EXPECT_HAS(m, "bytes were read, but the header needs");
}

TEST_F(Safetensors, ImportLandsConv1DWeightsTransposed) {
  // A c_attn weight written in HF's (in, out) layout with [in][out] = 100*in + out.
  Gpt<float> model(tiny(), *device_, 1);
  const auto value = [](const std::string& name, uint64_t k) {
    if (name == "h.0.attn.c_attn.weight") return float((k / 24) * 100 + k % 24);
    return float(k) + 0.5f;
  };
  const std::string file =
      write_bytes(path("hf.safetensors"), file_of(model_tensors(model, "F32", value)));
  load_safetensors(file, model);

  const Param<float>& qkv = *model.params()[4];
  ASSERT_EQ(qkv.name, "h.0.attn.c_attn.weight");
  ASSERT_EQ(qkv.shape, (std::vector<int64_t>{24, 8}));
  for (int o = 0; o < 24; ++o)
    for (int i = 0; i < 8; ++i)
      ASSERT_EQ(qkv.master().value[o * 8 + i], float(i * 100 + o)) << "out " << o << " in " << i;
  // Everything else, transposed where HF transposes and as-is where it does not.
  for (const Param<float>* p : model.params())
    for (uint64_t i = 0; i < p->numel; ++i)
      ASSERT_EQ(p->master().value[i], expected_at(*p, i, value)) << p->name << "[" << i << "]";
}

TEST_F(Safetensors, ImportConvertsBf16) {
  Gpt<float> model(tiny(), *device_, 1);
  std::vector<Tensor> tensors = model_tensors(model, "BF16", exact_value);
  // One value that only converts right if the bits are read as bf16: 0x4049 = 3.140625.
  for (Tensor& t : tensors)
    if (t.name == "ln_f.weight") t.bytes[0] = 0x49, t.bytes[1] = 0x40;
  load_safetensors(write_bytes(path("bf16.safetensors"), file_of(tensors)), model);
  for (const Param<float>* p : model.params())
    for (uint64_t i = 0; i < p->numel; ++i) {
      if (p->name == "ln_f.weight" && i == 0) {
        EXPECT_EQ(p->master().value[i], 3.140625f);
        continue;
      }
      ASSERT_EQ(p->master().value[i], expected_at(*p, i, exact_value))
          << p->name << "[" << i << "]";
    }
}

TEST_F(Safetensors, ImportConvertsF16) {
  Gpt<float> model(tiny(), *device_, 1);
  std::vector<Tensor> tensors = model_tensors(model, "F16", exact_value);
  // 0x4248 = 3.140625 in IEEE half; 0x0001, the smallest subnormal, is 2^-24.
  for (Tensor& t : tensors)
    if (t.name == "ln_f.weight") {
      t.bytes[0] = 0x48, t.bytes[1] = 0x42;
      t.bytes[2] = 0x01, t.bytes[3] = 0x00;
    }
  load_safetensors(write_bytes(path("f16.safetensors"), file_of(tensors)), model);
  for (const Param<float>* p : model.params())
    for (uint64_t i = 0; i < p->numel; ++i) {
      if (p->name == "ln_f.weight" && i < 2) {
        EXPECT_EQ(p->master().value[i], i == 0 ? 3.140625f : std::ldexp(1.0f, -24));
        continue;
      }
      ASSERT_EQ(p->master().value[i], expected_at(*p, i, exact_value))
          << p->name << "[" << i << "]";
    }
}

TEST_F(Safetensors, ImportAcceptsTransformerPrefixMaskBuffersAndTiedHead) {
  Gpt<float> model(tiny(), *device_, 1);
  std::vector<Tensor> tensors = model_tensors(model, "F32", exact_value);
  std::string wte_bytes;
  for (Tensor& t : tensors) {
    if (t.name == "wte.weight") wte_bytes = t.bytes;
    t.name = "transformer." + t.name;
  }
  // What older transformers versions saved beside the weights.
  const std::vector<float> mask(25, 1.0f);
  tensors.push_back({"transformer.h.0.attn.bias", "F32", {1, 1, 5, 5}, bytes_of(mask)});
  tensors.push_back({"transformer.h.1.attn.bias", "F32", {1, 1, 5, 5}, bytes_of(mask)});
  tensors.push_back({"transformer.h.0.attn.masked_bias", "F32", {}, bytes_of(mask).substr(0, 4)});
  tensors.push_back({"lm_head.weight", "F32", {11, 8}, wte_bytes});
  load_safetensors(write_bytes(path("hf.safetensors"), file_of(tensors)), model);
  for (const Param<float>* p : model.params())
    for (uint64_t i = 0; i < p->numel; ++i)
      ASSERT_EQ(p->master().value[i], expected_at(*p, i, exact_value))
          << p->name << "[" << i << "]";
}

// ---------------------------------------------------------------------------------------------
// Malformed files: each is refused with a message that names the file and what is wrong.

class SafetensorsMalformed : public Safetensors {
 protected:
  // Loads `bytes` written as bad.safetensors into a fresh model; returns the error. Also checks
  // that the refused load changed no parameter.
  std::string load_error(const std::string& bytes) {
    Gpt<float> model(tiny(), *device_, 1);
    std::vector<std::vector<float>> before;
    for (const Param<float>* p : model.params())
      before.emplace_back(p->master().value, p->master().value + p->numel);
    const std::string file = write_bytes(path("bad.safetensors"), bytes);
    const std::string message = test::error_of([&] { load_safetensors(file, model); });
    EXPECT_TRUE(test::starts_with(message, file + ": ")) << message;
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_EQ(
          std::memcmp(before[i].data(), model.params()[i]->master().value, 4 * before[i].size()), 0)
          << model.params()[i]->name << " changed by a refused load";
    return message;
  }
  // The header parser alone, on bytes in memory.
  static std::string parse_error(const std::string& bytes) {
    const std::string message = test::error_of([&] {
      parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                               bytes.size(), "mem.safetensors");
    });
    EXPECT_TRUE(test::starts_with(message, "mem.safetensors: ")) << message;
    return message;
  }
  // A valid file of the tiny model, with `edit` applied to its tensors first.
  std::string model_file(const std::function<void(std::vector<Tensor>&)>& edit = {}) {
    Gpt<float> model(tiny(), *device_, 1);
    std::vector<Tensor> tensors = model_tensors(model, "F32", exact_value);
    if (edit) edit(tensors);
    return file_of(tensors);
  }
};

TEST_F(SafetensorsMalformed, BadJson) {
  const std::string m = load_error(file_of(R"({"a": {"dtype": "F32", "shape": [1],)", "xxxx"));
  EXPECT_HAS(m, "header is not valid JSON");
  EXPECT_HAS(parse_error(file_of("not json at all", "")), "header is not valid JSON");
  EXPECT_HAS(parse_error(file_of("[1, 2]", "")), "not a JSON object");
  EXPECT_HAS(parse_error(file_of(R"({"a": 3})", "")), "not an object with dtype, shape");
}

TEST_F(SafetensorsMalformed, OffsetsOutOfRange) {
  const std::string m = load_error(
      file_of(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", "12345678"));
  EXPECT_HAS(m, "tensor \"a\": data_offsets [4, 12] lie outside the data section");
  EXPECT_HAS(m, "holds 8 bytes");
  EXPECT_HAS(parse_error(file_of(R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})",
                                 "12345678")),
             "data_offsets [8, 4] end before they begin");
  EXPECT_HAS(parse_error(file_of(
                 R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", "12345678")),
             "not a pair of non-negative integers");
  EXPECT_HAS(parse_error(file_of(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
                                 "12345678")),
             "not a pair of non-negative integers");
}

TEST_F(SafetensorsMalformed, OverlappingTensors) {
  const std::string m = load_error(file_of(R"({"a": {"dtype": "F32", "shape": [2],
    "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                           std::string(12, '\0')));
  EXPECT_HAS(m, "tensors \"a\" [0, 8] and \"b\" [4, 12] overlap");
}

TEST_F(SafetensorsMalformed, WrongDtypeString) {
  const std::string m = load_error(
      file_of(R"({"a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", "12345678"));
  EXPECT_HAS(m, "tensor \"a\": dtype \"F64\" is not supported (valid: F32, BF16, F16)");
  EXPECT_HAS(
      parse_error(file_of(R"({"a": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}})", "1234")),
      "dtype is a JSON number, not a string");
  EXPECT_HAS(parse_error(file_of(R"({"a": {"shape": [1], "data_offsets": [0, 4]}})", "1234")),
             "tensor \"a\": has no dtype");
}

TEST_F(SafetensorsMalformed, HeaderLengthPastEndOfFile) {
  const std::string m = load_error(le64(1000) + "{}");
  EXPECT_HAS(m, "header length 1000 runs past the end of the file (10 bytes)");
  EXPECT_HAS(parse_error(le64(uint64_t(1) << 62)), "is over the limit of 100000000 bytes");
  EXPECT_HAS(parse_error("\x02\0\0"), "too short for a safetensors file");
  EXPECT_HAS(load_error(""), "is 0 bytes, too short for a safetensors file");
}

TEST_F(SafetensorsMalformed, TruncatedFile) {
  const std::string full = model_file();
  const std::string m = load_error(full.substr(0, full.size() - 4));
  EXPECT_HAS(m, "lie outside the data section");
}

TEST_F(SafetensorsMalformed, ShapeDisagreesWithOffsets) {
  EXPECT_HAS(load_error(file_of(R"({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})",
                                "12345678")),
             "shape [3] of BF16 needs 6 bytes, but data_offsets [0, 8] span 8");
  EXPECT_HAS(
      parse_error(file_of(
          R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 0]}})",
          "")),
      "needs more than 2^64 bytes");
  EXPECT_HAS(parse_error(file_of(
                 R"({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}})", "")),
             "shape has a negative dimension -1");
  EXPECT_HAS(parse_error(
                 file_of(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 0]}})", "")),
             "shape 2.5 is not an integer dimension");
  EXPECT_HAS(parse_error(file_of(R"({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})",
                                 "12345678")),
             "shape is a JSON number, not an array");
}

TEST_F(SafetensorsMalformed, HostileStructure) {
  EXPECT_HAS(parse_error(file_of(R"({"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
                                     "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}})",
                                 "1234")),
             "tensor \"a\" appears twice in the header");
  EXPECT_HAS(parse_error(file_of(std::string(1000, '[') + std::string(1000, ']'), "")),
             "nests deeper than");
  EXPECT_HAS(parse_error(file_of(R"({"__metadata__": {"format": 1}})", "")),
             "__metadata__ value \"format\" is a JSON number, not a string");
  // A control character in a name is escaped in the message, not printed raw.
  EXPECT_HAS(parse_error(file_of("{\"a\\nb\": 1}", "")), "tensor \"a\\nb\"");
  // Metadata and an empty file of tensors are fine for the parser.
  const std::string ok = file_of(R"({"__metadata__": {"format": "pt"}})", "");
  EXPECT_TRUE(parse_safetensors_header(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(),
                                       ok.size(), "ok.safetensors")
                  .empty());
}

TEST_F(SafetensorsMalformed, MissingTensor) {
  const std::string m = load_error(model_file([](std::vector<Tensor>& t) {
    t.erase(std::remove_if(t.begin(), t.end(),
                           [](const Tensor& x) { return x.name == "h.1.mlp.c_fc.weight"; }),
            t.end());
  }));
  EXPECT_HAS(m, "missing tensor h.1.mlp.c_fc.weight");
  EXPECT_HAS(load_error(file_of("{}", "")), "missing tensor h.0.attn.c_attn.bias (and 27 more)");
}

TEST_F(SafetensorsMalformed, ExtraTensor) {
  const std::string m = load_error(model_file([](std::vector<Tensor>& t) {
    t.push_back({"h.2.ln_1.weight", "F32", {8}, std::string(32, '\0')});
  }));
  EXPECT_HAS(m, "tensor \"h.2.ln_1.weight\" is not a parameter of this model");
  EXPECT_HAS(m, "n_layer 2");
  EXPECT_HAS(
      load_error(model_file([](std::vector<Tensor>& t) {
        t.push_back({"transformer.wte.weight", "F32", {11, 8}, std::string(352, '\0')});
      })),
      "tensors \"transformer.wte.weight\" and \"wte.weight\" both hold parameter wte.weight");
}

TEST_F(SafetensorsMalformed, MisShapedTensor) {
  // c_attn written in our (out, in) layout rather than HF's (in, out).
  const std::string m = load_error(model_file([](std::vector<Tensor>& t) {
    for (Tensor& x : t)
      if (x.name == "h.0.attn.c_attn.weight") x.shape = {24, 8};
  }));
  EXPECT_HAS(m, "tensor \"h.0.attn.c_attn.weight\" has shape [24, 8], expected [8, 24]");
  EXPECT_HAS(m, "Hugging Face GPT-2 layout");
}

TEST_F(SafetensorsMalformed, UntiedHead) {
  const std::string m = load_error(model_file([](std::vector<Tensor>& t) {
    t.push_back({"lm_head.weight", "F32", {11, 8}, std::string(352, '\0')});
  }));
  EXPECT_HAS(m, "tensor \"lm_head.weight\" differs from wte.weight");
}

TEST_F(SafetensorsMalformed, UnreadableAndUnwritablePaths) {
  Gpt<float> model(tiny(), *device_, 1);
  const std::string missing = path("no-such.safetensors");
  const std::string m = test::error_of([&] { load_safetensors(missing, model); });
  EXPECT_TRUE(test::starts_with(m, missing + ": cannot open")) << m;
  const std::string dir_m = test::error_of([&] { load_safetensors(dir_, model); });
  EXPECT_TRUE(test::starts_with(dir_m, dir_ + ": is not a regular file")) << dir_m;
  // Writing is an output: OutputError, naming the file and the OS's reason.
  const std::string target = path("no-such-dir/model.safetensors");
  try {
    save_safetensors(target, model);
    ADD_FAILURE() << "wrote into a missing folder";
  } catch (const OutputError& e) {
    EXPECT_TRUE(test::starts_with(e.what(), "weights " + target + ": cannot create ")) << e.what();
    EXPECT_TRUE(test::contains(e.what(), "No such file or directory")) << e.what();
  }
}

}  // namespace
}  // namespace headroom
