// Generation from a trained GPT: one token at a time with a KV cache, on the device's op table
// (core/device/backend.h), so it runs wherever the model trains (CPU, CUDA).
//
// The cache holds, for every block, the qkv rows (T, 3C) of the positions fed so far: a new token
// runs every layer on its one row (embedding at its position, LayerNorms, GEMMs, MLP), appends
// its qkv row, and attends over the cached rows with the op table's attention_decode: O(t C) per
// token. forward_logits() is the full recompute every step would otherwise be, and the test holds
// the two equal.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/model/model.h"

namespace headroom {

class KvDecoder {
 public:
  // The model's parameters are read in place (its compute copies, f32 here); the cache and the
  // scratch are activations on the model's device.
  explicit KvDecoder(const Gpt<float>& model);
  // Feeds `token` at the next position (position() < seq_len) and returns the logits (V) of the
  // token after it, on the host.
  std::vector<float> step(int32_t token);
  int position() const { return pos_; }
  // Forgets every position: the next step() is position 0.
  void reset() { pos_ = 0; }

 private:
  struct BlockParams {
    const void *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw,
        *fcprojb;
    int fc;  // the MLP's width (4C unless pruned)
  };
  const Gpt<float>& model_;
  Device& device_;
  int C_, NH_, T_, V_;
  const void *wte_, *wpe_, *lnfw_, *lnfb_;
  std::vector<BlockParams> blocks_;
  std::vector<Buffer> cache_;  // per block: qkv (T, 3C)
  Buffer token_, x_, ln_, mean_, rstd_, atty_, res_, fch_, fcg_, logits_;
  int pos_ = 0;
};

// The full recompute: every layer over all of `tokens` at once (as training's forward), and the
// logits (T, V) of every position, on the host.
std::vector<float> forward_logits(const Gpt<float>& model, const std::vector<int32_t>& tokens);

struct SampleParams {
  double temperature = 1.0;  // 0: always the most likely token
  int top_k = 0;             // draw among the k most likely; 0: among all
  uint64_t seed = 1;
};

// A token drawn from softmax(logits / temperature) over the top_k, with `rng`'s next 53 bits (the
// same on every platform).
int32_t sample_token(const std::vector<float>& logits, const SampleParams& params,
                     std::mt19937_64& rng);

// `n` tokens after `prompt` (at least one token), each handed to on_token as it is drawn. When
// the context is full (seq_len), the cache restarts from the last seq_len / 2 tokens.
std::vector<int32_t> generate(const Gpt<float>& model, const std::vector<int32_t>& prompt, int n,
                              const SampleParams& params,
                              const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace headroom
