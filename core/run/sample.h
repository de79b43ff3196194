// `headroom sample SOURCE --prompt TEXT --tokens N`: text from a trained model.
//
// SOURCE is one of
//   - a config (.toml): its model, with the weights of the newest snapshot in its [snapshot] dir
//     if there is one, else of train.init_from, else its seeded initialisation (untrained; said);
//   - a snapshot (step_N.hrsnap) or a folder of them (the newest): the model shape it records, a
//     pruned model's widths included;
//   - a weights file (.safetensors, Hugging Face GPT-2 names): the shape from its tensors (a
//     pruned model's widths too), n_head from --config, else from the file's metadata (headroom
//     writes the model's shape there), else n_embd / 64 (GPT-2's head size; said).
// --config names the model and tokenizer for a snapshot or weights file. The tokenizer decodes as
// the data was encoded: --tokenizer, else the config's [data] tokenizer, else bytes.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "core/model/generate.h"

namespace headroom {

struct SampleRequest {
  std::string source;       // config, snapshot (file or folder) or weights file
  std::string config_file;  // --config: the model and tokenizer for a snapshot or weights file
  std::vector<std::string> sets;
  std::string tokenizer;  // --tokenizer: overrides the config's
  std::string prompt;
  int tokens = 0;
  SampleParams params;
  bool ids = false;  // print the token ids, one line, instead of the text
};

// Loads the model, generates, writes the prompt and what follows it to `out` as the tokens come
// (and a newline), and what was loaded from where to `log`. ConfigError for bad input (a source
// that is none of the above, a prompt token outside the vocabulary, a prompt longer than
// seq_len).
void run_sample(const SampleRequest& request, std::ostream& out, std::ostream& log);

}  // namespace headroom
