// Generation from a trained GPT: one token at a time with a KV cache, on the device's op table
// (core/device/backend.h), so it runs wherever the model trains (CPU, CUDA).
//
// Both architectures: GPT-2's blocks (LayerNorm, GELU MLP, learned positions) and Llama's
// (RMSNorm, SwiGLU, rotary positions, grouped-query attention), pruned or not. The cache holds,
// for every block, the qkv rows (T, 3A) of the positions fed so far (A: the block's query heads
// times the head size): a new token runs every layer on its one row (embedding, norms, GEMMs,
// MLP), appends its qkv row — a Llama's rotated at its position, its NKV key/value heads repeated
// for each query head of their group — and attends over the cached rows with the op table's
// attention_decode: O(t C) per token. forward_logits() is the full recompute every step would
// otherwise be, and the test holds the two equal.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "core/model/model.h"

namespace headroom {

class KvDecoder {
 public:
  // The model's parameters are read in place (its compute copies, f32 here); the cache and the
  // scratch are activations on the model's device.
  explicit KvDecoder(const Gpt<float>& model);
  ~KvDecoder();
  // Feeds `token` at the next position (position() < seq_len) and returns the logits (V) of the
  // token after it, on the host.
  std::vector<float> step(int32_t token);
  int position() const { return pos_; }
  // Forgets every position: the next step() is position 0.
  void reset() { pos_ = 0; }

 private:
  struct State;  // the parameters' places, the cache and the scratch (generate.cpp)
  std::unique_ptr<State> s_;
  int T_, V_;
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
