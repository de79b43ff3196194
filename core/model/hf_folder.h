// Hugging Face model folders: config.json beside model.safetensors, or beside
// model-0000k-of-0000n.safetensors shards and their model.safetensors.index.json (which tensor is
// in which shard). `[train] init_from = "DIR"` loads one; `--save-weights DIR/` writes one that
// `transformers` loads (from_pretrained).
//
// What is architecture-specific is one table per architecture (hf_folder.cpp: HfNames): each
// parameter's Hugging Face name, which weights Hugging Face stores transposed, which tensors are
// buffers to skip, and how the output head is tied. config.json's side is core/config/hf_config.h.
// Every file of a folder is untrusted input: a bad one is a ConfigError naming it.
#pragma once

#include <string>
#include <vector>

#include "core/model/model.h"

namespace headroom {

// True when `path` names a folder to write (`--save-weights DIR/`): it ends with '/' or is an
// existing folder. Anything else is a single safetensors file, as before.
bool names_hf_folder(const std::string& path);

// Loads the folder `dir` into `model`: checks config.json against the model's shape (ConfigError
// naming both), finds every tensor through the index (or the one model.safetensors), matches each
// to a parameter by its Hugging Face name and shape, and only then reads (F32, BF16, F16, converted
// to float) and uploads, layer by layer inside `access` (empty: directly). A missing shard, an
// index naming a tensor its shard lacks, a tensor the model lacks or a parameter no file holds, a
// wrong shape or dtype: ConfigError naming the file; the model is left as it was.
void load_hf_folder(const std::string& dir, Gpt<float>& model, const MasterAccess& access = nullptr,
                    const MasterAccess& frozen_access = nullptr);

// What load_hf_folder checks before it reads a weight, for a model of shape `m`, from the folder's
// config.json and safetensors headers alone (`headroom check`). ConfigError naming the file.
void check_hf_folder(const std::string& dir, const ModelConfig& m);

// Writes `dir`/config.json and `dir`/model.safetensors (F32, Hugging Face names and layouts, the
// tied head and any LoRA adapters left out: a base model, as `transformers` saves it), creating
// `dir`. `host`: the parameters' values
// as download_params reads them (null: read the device). ConfigError for a model Hugging Face's
// config.json cannot describe (a pruned one); OutputError when it cannot be written.
void save_hf_folder(const std::string& dir, const Gpt<float>& model,
                    const std::vector<std::vector<float>>* host = nullptr);

// init_from's loader: a folder (load_hf_folder) or a safetensors file (load_safetensors).
void load_weights(const std::string& path, Gpt<float>& model, const MasterAccess& access = nullptr,
                  const MasterAccess& frozen_access = nullptr);

// --save-weights' writer: a folder when names_hf_folder(path), else one safetensors file.
void save_weights_to(const std::string& path, const Gpt<float>& model,
                     const std::vector<std::vector<float>>* host = nullptr);

}  // namespace headroom
