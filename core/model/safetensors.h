// Weights in the safetensors format (https://github.com/huggingface/safetensors), with Hugging Face
// GPT-2 names and layouts, so a model trained here opens in `transformers` and a pretrained GPT-2
// checkpoint starts a run here.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section that
// follows the header), then the data section. Every file read here is untrusted input: a bad one is
// a ConfigError that names the file and says what is wrong, never a crash or a read past its end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/model/model.h"

namespace headroom {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16" or "F16"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // offsets relative to the data section
};

// Parses and validates a safetensors header from the first `size` bytes of a file of `file_size`
// bytes (the 8-byte header length, then the JSON). Checks every length and offset against the file,
// the dtypes (F32, BF16, F16), the shapes against the byte ranges, and that no two tensors overlap;
// "__metadata__" (an object of strings) goes to *metadata when given. Entries come sorted by name.
// Throws ConfigError("FILE: ...").
std::vector<SafetensorsEntry> parse_safetensors_header(
    const uint8_t* data, size_t size, uint64_t file_size, const std::string& file,
    std::map<std::string, std::string>* metadata = nullptr);

// The header of the safetensors file `path`, parsed and validated as above (the data is not
// read). ConfigError naming the file when it cannot be read or is not valid. headroom's own files
// carry the model's shape in their metadata: n_layer, n_head, n_embd, seq_len, vocab_size (and a
// pruned model's mlp_hidden, attn_heads).
std::vector<SafetensorsEntry> read_safetensors_header(
    const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

// Writes every parameter as F32 under its Hugging Face GPT-2 name and layout: the Conv1D weights
// (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are stored (in, out), ours are (out, in).
// Written through an AtomicFile: a crash leaves the old file or the new one. OutputError when it
// cannot be written.
// `host`: the parameters' values as download_params read them, instead of reading the device.
// `pieces`: each parameter's tensors in the file, from its name and rows (a Hugging Face folder's
// "transformer.wte.weight", or Llama's fused qkv_proj as q_proj, k_proj and v_proj: rows of ours);
// empty: one tensor under the parameter's name.
struct TensorPiece {
  std::string name;
  int64_t row = 0, rows = 0;  // rows [row, row + rows) of the parameter
};
using TensorPieces = std::function<std::vector<TensorPiece>(const std::string& ours, int64_t rows)>;
void save_safetensors(const std::string& path, const Gpt<float>& model,
                      const std::vector<std::vector<float>>* host = nullptr,
                      const TensorPieces& pieces = nullptr);

// Reads tensor `e` of the safetensors file `path` (an entry its header gave) into dst as float
// (numel floats), converting BF16 and F16; with `transpose` a 2-D (rows, cols) tensor lands as its
// (cols, rows) transpose. ConfigError naming the file when it cannot be read or got shorter.
void read_safetensors_tensor(const std::string& path, const SafetensorsEntry& e, float* dst,
                             bool transpose);

// Every parameter's values on the host, in model order (layer by layer), each layer's read inside
// `access` (empty: read directly). With sharded masters every rank must call it (the access
// gathers); `keep` false reads but keeps nothing (a rank that writes nothing).
std::vector<std::vector<float>> download_params(const Gpt<float>& model,
                                                const MasterAccess& access = nullptr,
                                                bool keep = true);

// The loaders' last step: each parameter `host` holds (f32 values, numel of them) into its
// masters, layer by layer inside `access` (empty: directly), the others left as they are; then
// the compute copies made from the masters. A frozen parameter is written as the init writes it
// (Layer::write_init: into its compute copy or quantized bytes a chunk at a time), outside
// `access`, which a layer with nothing trainable to load is not given; inside `frozen_access`
// when set (zero3's sharded frozen weights: core/shard/sharding.h with_frozen).
void upload_params(Gpt<float>& model, const std::map<const Param<float>*, std::vector<float>>& host,
                   const MasterAccess& access = nullptr,
                   const MasterAccess& frozen_access = nullptr);

// Reads F32, BF16 or F16 tensors into the model's parameters, converting to float and transposing
// the Conv1D weights back. Names may carry a "transformer." prefix; the attention-mask buffers
// (h.N.attn.bias, h.N.attn.masked_bias) and an lm_head.weight tied to wte.weight are ignored. A
// missing, unknown or mis-shaped tensor is a ConfigError naming it; nothing is changed then.
// Each layer's uploads run inside `access` (empty: directly), layer by layer; its frozen
// weights' inside `frozen_access` (upload_params).
void load_safetensors(const std::string& path, Gpt<float>& model,
                      const MasterAccess& access = nullptr,
                      const MasterAccess& frozen_access = nullptr);

// The per-block MLP widths of the GPT-2 model of `m`'s shape that the file at `path` holds, read
// from its header's mlp.c_fc.weight shapes (a pruned model's, headroom.resize/1): what
// ModelConfig::mlp_hidden must be to load it; empty when every block has 4·n_embd. Throws
// ConfigError("FILE: ...") for a file whose header cannot be read.
std::vector<int> safetensors_mlp_widths(const std::string& path, const ModelConfig& m);
// "3072,1536,..": every block's MLP width, as the weights' metadata and snapshots record it.
std::string mlp_hidden_str(const ModelConfig& m);
// The same for the attention heads (a pruned model's, from the attn.c_attn.weight shapes), and
// "12,6,..": every block's heads.
std::vector<int> safetensors_attn_heads(const std::string& path, const ModelConfig& m);
std::string attn_heads_str(const ModelConfig& m);

// For the names and messages of the weight files (here, hf_folder.cpp, sample.cpp): a shape as
// "[a, b]"; a string from a file quoted and escaped as JSON, so that control characters in a
// hostile name cannot garble the message that reports it; whether `s` ends with `suffix`.
std::string shape_str(const std::vector<int64_t>& shape);
std::string json_quoted(const std::string& s);
bool ends_with(const std::string& s, const std::string& suffix);

}  // namespace headroom
