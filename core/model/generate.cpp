#include "core/model/generate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

namespace headroom {

namespace {

// The model's parameters by Hugging Face name: what the blocks read.
std::map<std::string, const Param<float>*> params_by_name(const Gpt<float>& model) {
  std::map<std::string, const Param<float>*> by;
  for (const Param<float>* p : model.params())
    by[p->name] = p;
  return by;
}

const Param<float>* find_param(const std::map<std::string, const Param<float>*>& by,
                               const std::string& name) {
  const auto it = by.find(name);
  if (it == by.end() || !it->second->compute().value)
    throw std::logic_error("generate: the model has no parameter " + name + " in memory");
  return it->second;
}

// One block's weights (null: the architecture has none: Llama's biases, RMSNorm's) and widths,
// read from its tensors' shapes so that a pruned block is what it is.
struct BlockParams {
  const void *norm1w = nullptr, *norm1b = nullptr, *qkvw = nullptr, *qkvb = nullptr,
             *projw = nullptr, *projb = nullptr, *norm2w = nullptr, *norm2b = nullptr,
             *fcw = nullptr, *fcb = nullptr, *downw = nullptr, *downb = nullptr;
  int nh = 0;   // query heads (n_head unless pruned)
  int nkv = 0;  // key/value heads (GPT-2: nh)
  int mlp = 0;  // the MLP's hidden width (GPT-2's F, Llama's I)
  int qkv_width(int hs) const { return (nh + 2 * nkv) * hs; }
};

// Every parameter generation reads, for either architecture.
struct Weights {
  const void *embed = nullptr, *wpe = nullptr, *normw = nullptr, *normb = nullptr, *head = nullptr;
  std::vector<BlockParams> blocks;
  int max_qkv = 0, max_a = 0, max_fc = 0, max_mlp = 0;  // the widest block's widths
};

Weights weights_of(const Gpt<float>& model) {
  const ModelConfig& m = model.config();
  if (model.compute_dtype() != Dtype::kF32)
    throw std::logic_error("generate: generation reads f32 parameters");
  const auto by = params_by_name(model);
  auto value = [&](const std::string& name) { return find_param(by, name)->compute().value; };
  auto rows = [&](const std::string& name, size_t dim) {
    return int(find_param(by, name)->shape.at(dim));
  };
  const int hs = m.n_embd / m.n_head;
  Weights w;
  for (int l = 0; l < m.n_layer; ++l) {
    BlockParams b;
    if (m.llama()) {
      const std::string h = "model.layers." + std::to_string(l) + ".";
      b.norm1w = value(h + "input_layernorm.weight");
      b.qkvw = value(h + "self_attn.qkv_proj.weight");  // (A + 2·NKV·hs, C)
      b.projw = value(h + "self_attn.o_proj.weight");   // (C, A)
      b.norm2w = value(h + "post_attention_layernorm.weight");
      b.fcw = value(h + "mlp.gate_up_proj.weight");  // (2I, C)
      b.downw = value(h + "mlp.down_proj.weight");   // (C, I)
      b.nh = rows(h + "self_attn.o_proj.weight", 1) / hs;
      b.nkv = (rows(h + "self_attn.qkv_proj.weight", 0) - b.nh * hs) / (2 * hs);
      b.mlp = rows(h + "mlp.gate_up_proj.weight", 0) / 2;
    } else {
      const std::string h = "h." + std::to_string(l) + ".";
      b.norm1w = value(h + "ln_1.weight");
      b.norm1b = value(h + "ln_1.bias");
      b.qkvw = value(h + "attn.c_attn.weight");  // (3A, C)
      b.qkvb = value(h + "attn.c_attn.bias");
      b.projw = value(h + "attn.c_proj.weight");  // (C, A)
      b.projb = value(h + "attn.c_proj.bias");
      b.norm2w = value(h + "ln_2.weight");
      b.norm2b = value(h + "ln_2.bias");
      b.fcw = value(h + "mlp.c_fc.weight");  // (F, C)
      b.fcb = value(h + "mlp.c_fc.bias");
      b.downw = value(h + "mlp.c_proj.weight");  // (C, F)
      b.downb = value(h + "mlp.c_proj.bias");
      b.nh = b.nkv = rows(h + "attn.c_attn.weight", 0) / (3 * hs);
      b.mlp = rows(h + "mlp.c_fc.weight", 0);
    }
    if (b.nh < 1 || b.nkv < 1 || b.nh % b.nkv != 0 || b.mlp < 1)
      throw std::logic_error("generate: block " + std::to_string(l) + " has " +
                             std::to_string(b.nh) + " query heads over " + std::to_string(b.nkv) +
                             " key/value heads and an MLP of " + std::to_string(b.mlp));
    w.max_qkv = std::max(w.max_qkv, b.qkv_width(hs));
    w.max_a = std::max(w.max_a, b.nh * hs);
    w.max_fc = std::max(w.max_fc, m.llama() ? 2 * b.mlp : b.mlp);
    w.max_mlp = std::max(w.max_mlp, b.mlp);
    w.blocks.push_back(b);
  }
  if (m.llama()) {
    w.embed = value("model.embed_tokens.weight");
    w.normw = value("model.norm.weight");
    w.head = m.tied() ? w.embed : value("lm_head.weight");
  } else {
    w.embed = w.head = value("wte.weight");
    w.wpe = value("wpe.weight");
    w.normw = value("ln_f.weight");
    w.normb = value("ln_f.bias");
  }
  return w;
}

// Activations for N rows through one block at a time, sized for the widest block.
struct RowScratch {
  Buffer ln, mean, rstd, qkv, atty, res, fc, act;
  RowScratch(Device& d, uint64_t N, const ModelConfig& m, const Weights& w) {
    const uint64_t f = sizeof(float), C = uint64_t(m.n_embd);
    const Category a = Category::kActivations;
    ln = Buffer(d, N * C * f, a, "sample norm (N, C)");
    mean = Buffer(d, N * f, a, "sample mean (N)");
    rstd = Buffer(d, N * f, a, "sample rstd (N)");
    qkv = Buffer(d, N * uint64_t(w.max_qkv) * f, a, "sample qkv (N, A + 2KV)");
    atty = Buffer(d, N * uint64_t(w.max_a) * f, a, "sample attention out (N, A)");
    res = Buffer(d, N * C * f, a, "sample residual (N, C)");
    fc = Buffer(d, N * uint64_t(w.max_fc) * f, a, "sample fc or gate|up (N, F or 2I)");
    act = Buffer(d, N * uint64_t(w.max_mlp) * f, a, "sample gelu or swiglu (N, F or I)");
  }
};

// out (N, C) = the model's norm of inp: LayerNorm (GPT-2) or RMSNorm (Llama; bias null).
void norm(Backend& ops, const ModelConfig& m, RowScratch& s, void* out, const void* inp,
          const void* w, const void* b, int N) {
  if (m.llama())
    ops.rmsnorm_forward(Dtype::kF32, out, s.rstd.as<void>(), inp, w, N, m.n_embd, m.rms_norm_eps);
  else
    ops.layernorm_forward(Dtype::kF32, out, s.mean.as<void>(), s.rstd.as<void>(), inp, w, b, N,
                          m.n_embd);
}

// x (N, C) through one block, in place. `attend` turns s.qkv (N, A + 2KV), as the block's GEMM
// wrote it, into s.atty (N, A): the whole causal attention over N rows, or one row's over a cache.
void run_block(Backend& ops, const ModelConfig& m, const BlockParams& b, RowScratch& s, void* x,
               int N, const std::function<void()>& attend) {
  const Dtype dt = Dtype::kF32;
  const int C = m.n_embd, hs = C / m.n_head, A = b.nh * hs, I = b.mlp;
  norm(ops, m, s, s.ln.as<void>(), x, b.norm1w, b.norm1b, N);
  ops.matmul_forward(dt, s.qkv.as<void>(), s.ln.as<void>(), b.qkvw, b.qkvb, N, C, b.qkv_width(hs));
  attend();
  ops.matmul_forward(dt, s.res.as<void>(), s.atty.as<void>(), b.projw, b.projb, N, A, C);
  ops.add_inplace(dt, s.res.as<void>(), x, uint64_t(N) * C);
  norm(ops, m, s, s.ln.as<void>(), s.res.as<void>(), b.norm2w, b.norm2b, N);
  if (m.llama()) {
    ops.matmul_forward(dt, s.fc.as<void>(), s.ln.as<void>(), b.fcw, nullptr, N, C, 2 * I);
    ops.swiglu_forward(dt, s.act.as<void>(), s.fc.as<void>(), N, I);
  } else {
    ops.matmul_forward(dt, s.fc.as<void>(), s.ln.as<void>(), b.fcw, b.fcb, N, C, I);
    ops.gelu_forward(dt, s.act.as<void>(), s.fc.as<void>(), uint64_t(N) * I);
  }
  ops.matmul_forward(dt, x, s.act.as<void>(), b.downw, b.downb, N, I, C);
  ops.add_inplace(dt, x, s.res.as<void>(), uint64_t(N) * C);
}

// logits (N, V) of x (N, C): the final norm and the head.
void run_head(Backend& ops, const ModelConfig& m, const Weights& w, RowScratch& s, void* logits,
              const void* x, int N) {
  norm(ops, m, s, s.ln.as<void>(), x, w.normw, w.normb, N);
  ops.matmul_forward(Dtype::kF32, logits, s.ln.as<void>(), w.head, nullptr, N, m.n_embd,
                     m.vocab_size);
}

char* at(void* p, uint64_t bytes) {
  return static_cast<char*>(p) + bytes;
}
const char* at(const void* p, uint64_t bytes) {
  return static_cast<const char*>(p) + bytes;
}

}  // namespace

struct KvDecoder::State {
  State(const Gpt<float>& model)
      : m(model.config()),
        device(model.device()),
        w(weights_of(model)),
        rows(device, 1, m, w),
        rope(llama_rope_params(m)) {
    const uint64_t f = sizeof(float), T = uint64_t(m.seq_len), hs = uint64_t(m.n_embd / m.n_head);
    const Category act = Category::kActivations;
    for (const BlockParams& b : w.blocks)
      cache.emplace_back(device, T * 3 * uint64_t(b.nh) * hs * f, act, "kv cache qkv (T, 3A)");
    if (m.llama()) {
      // The rotation is by position: the new row is rotated as row t of a (t+1)-row sequence
      // whose earlier rows (stale, never read) the op rotates too. O(t hs) per token, as the
      // attention over the cache is.
      rope_rows = Buffer(device, T * uint64_t(w.max_qkv) * f, act, "sample rope rows (T, W)");
      device.backend().fill(Dtype::kF32, rope_rows.as<void>(), T * uint64_t(w.max_qkv), 0.0);
    }
    token = Buffer(device, sizeof(int32_t), Category::kData, "sample token");
    x = Buffer(device, uint64_t(m.n_embd) * f, act, "sample x (1, C)");
    logits = Buffer(device, uint64_t(m.vocab_size) * f, act, "sample logits (1, V)");
  }

  // s.qkv's one row at position t into block l's cache row t (a Llama's rotated, its key/value
  // heads repeated over their groups), then that row's query over cache rows 0..t.
  void attend(size_t l, int t) {
    Backend& ops = device.backend();
    const BlockParams& b = w.blocks[l];
    const uint64_t f = sizeof(float), hs = uint64_t(m.n_embd / m.n_head), A = uint64_t(b.nh) * hs;
    const uint64_t W = uint64_t(b.qkv_width(int(hs)));
    char* dst = at(cache[l].as<void>(), uint64_t(t) * 3 * A * f);  // (3A) row t
    const void* row = rows.qkv.as<void>();
    if (m.llama()) {
      char* rot = at(rope_rows.as<void>(), uint64_t(t) * W * f);
      ops.copy(rot, row, W * f);
      ops.rope_forward(Dtype::kF32, rope_rows.as<void>(), 1, t + 1, b.nh, b.nkv, int(hs), rope);
      row = rot;
    }
    if (b.nkv == b.nh) {
      ops.copy(dst, row, 3 * A * f);
    } else {
      // [q (A) | k (NKV hs) | v (NKV hs)] -> [q | k repeated per query head | v likewise]
      const uint64_t group = uint64_t(b.nh / b.nkv), KV = uint64_t(b.nkv) * hs;
      ops.copy(dst, row, A * f);
      for (uint64_t h = 0; h < uint64_t(b.nh); ++h) {
        const uint64_t g = h / group;
        ops.copy(dst + (A + h * hs) * f, at(row, (A + g * hs) * f), hs * f);
        ops.copy(dst + (2 * A + h * hs) * f, at(row, (A + KV + g * hs) * f), hs * f);
      }
    }
    ops.attention_decode(Dtype::kF32, rows.atty.as<void>(), cache[l].as<void>(), t + 1, int(A),
                         b.nh);
  }

  ModelConfig m;
  Device& device;
  Weights w;
  RowScratch rows;
  RopeParams rope;
  std::vector<Buffer> cache;  // per block: qkv (T, 3A)
  Buffer rope_rows, token, x, logits;
};

KvDecoder::KvDecoder(const Gpt<float>& model)
    : s_(std::make_unique<State>(model)),
      T_(model.config().seq_len),
      V_(model.config().vocab_size) {}

KvDecoder::~KvDecoder() = default;

std::vector<float> KvDecoder::step(int32_t token) {
  if (pos_ >= T_)
    throw std::logic_error("KvDecoder: the context of " + std::to_string(T_) + " is full");
  if (token < 0 || token >= V_)
    throw std::invalid_argument("KvDecoder: token " + std::to_string(token) +
                                " outside the vocabulary of " + std::to_string(V_));
  State& s = *s_;
  Backend& ops = s.device.backend();
  const int C = s.m.n_embd, t = pos_;
  ops.upload(s.token.as<void>(), &token, sizeof token);
  // x (1, C) = wte[token] (+ wpe[t]: the embedding op at one position, wpe seen from row t).
  const void* wpe = s.w.wpe ? at(s.w.wpe, uint64_t(t) * C * sizeof(float)) : nullptr;
  ops.embedding_forward(Dtype::kF32, s.x.as<void>(), s.token.as<int32_t>(), s.w.embed, wpe, 1, 1,
                        C);
  for (size_t l = 0; l < s.w.blocks.size(); ++l)
    run_block(ops, s.m, s.w.blocks[l], s.rows, s.x.as<void>(), 1, [&] { s.attend(l, t); });
  run_head(ops, s.m, s.w, s.rows, s.logits.as<void>(), s.x.as<void>(), 1);
  std::vector<float> logits(static_cast<size_t>(V_));
  ops.download(logits.data(), s.logits.as<void>(), logits.size() * sizeof(float));
  ++pos_;
  return logits;
}

std::vector<float> forward_logits(const Gpt<float>& model, const std::vector<int32_t>& tokens) {
  const ModelConfig& m = model.config();
  const int N = int(tokens.size()), C = m.n_embd, V = m.vocab_size, hs = C / m.n_head;
  if (N < 1 || N > m.seq_len) throw std::invalid_argument("forward_logits: 1 to seq_len tokens");
  const Weights w = weights_of(model);
  Device& device = model.device();
  Backend& ops = device.backend();
  const Dtype dt = Dtype::kF32;
  const uint64_t f = sizeof(float), n = uint64_t(N);
  const Category act = Category::kActivations;
  RowScratch s(device, n, m, w);
  Buffer tok(device, n * sizeof(int32_t), Category::kData, "tokens (T)");
  Buffer x(device, n * C * f, act, "x (T, C)");
  // GPT-2's attention keeps its probabilities (NH, T, T), the GQA attention its lse (NH, T).
  int max_nh = 0;
  for (const BlockParams& b : w.blocks)
    max_nh = std::max(max_nh, b.nh);
  Buffer att(device, uint64_t(max_nh) * n * (m.llama() ? 1 : n) * f, act, "att (NH, T, T or 1)");
  Buffer logits(device, n * V * f, act, "logits (T, V)");
  const RopeParams rope = llama_rope_params(m);
  ops.upload(tok.as<void>(), tokens.data(), n * sizeof(int32_t));
  ops.embedding_forward(dt, x.as<void>(), tok.as<int32_t>(), w.embed, w.wpe, 1, N, C);
  for (const BlockParams& b : w.blocks) {
    const int A = b.nh * hs;
    run_block(ops, m, b, s, x.as<void>(), N, [&] {
      if (m.llama()) {
        ops.rope_forward(dt, s.qkv.as<void>(), 1, N, b.nh, b.nkv, hs, rope);
        ops.attention_gqa_forward(dt, s.atty.as<void>(), att.as<void>(), s.qkv.as<void>(), 1, N, A,
                                  b.nh, b.nkv);
      } else {
        ops.attention_forward(dt, s.atty.as<void>(), att.as<void>(), s.qkv.as<void>(), 1, N, A,
                              b.nh);
      }
    });
  }
  run_head(ops, m, w, s, logits.as<void>(), x.as<void>(), N);
  std::vector<float> host(n * V);
  ops.download(host.data(), logits.as<void>(), host.size() * sizeof(float));
  return host;
}

int32_t sample_token(const std::vector<float>& logits, const SampleParams& params,
                     std::mt19937_64& rng) {
  const int V = int(logits.size());
  std::vector<int32_t> order(static_cast<size_t>(V));
  for (int i = 0; i < V; ++i)
    order[size_t(i)] = i;
  // Most likely first; equal logits by id, so the order never depends on the sort.
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
  if (params.temperature <= 0.0) return order[0];
  const int k = params.top_k > 0 ? std::min(params.top_k, V) : V;
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[size_t(order[0])];
  double sum = 0.0;
  for (int i = 0; i < k; ++i) {
    p[size_t(i)] = std::exp((double(logits[size_t(order[size_t(i)])]) - top) / params.temperature);
    sum += p[size_t(i)];
  }
  const double u = double(rng() >> 11) * 0x1.0p-53 * sum;  // uniform in [0, sum)
  double acc = 0.0;
  for (int i = 0; i < k; ++i) {
    acc += p[size_t(i)];
    if (u < acc) return order[size_t(i)];
  }
  return order[size_t(k - 1)];
}

std::vector<int32_t> generate(const Gpt<float>& model, const std::vector<int32_t>& prompt, int n,
                              const SampleParams& params,
                              const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt needs a token");
  // A NaN temperature would make every probability NaN and always pick the last of the top k.
  if (!std::isfinite(params.temperature) || params.temperature < 0.0)
    throw std::invalid_argument("generate: temperature " + std::to_string(params.temperature) +
                                " is not a finite number >= 0");
  if (params.top_k < 0)
    throw std::invalid_argument("generate: top_k " + std::to_string(params.top_k) + " is below 0");
  const int T = model.config().seq_len;
  KvDecoder decoder(model);
  std::mt19937_64 rng(params.seed);
  std::vector<int32_t> all(prompt.end() - std::min<ptrdiff_t>(ptrdiff_t(prompt.size()), T),
                           prompt.end());
  std::vector<float> logits;
  for (int32_t t : all)
    logits = decoder.step(t);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t next = sample_token(logits, params, rng);
    out.push_back(next);
    all.push_back(next);
    if (on_token) on_token(next);
    if (i + 1 == n) break;
    if (decoder.position() == T) {
      // The context is full: start again from the last T / 2 tokens.
      decoder.reset();
      for (size_t j = all.size() - size_t(std::max(1, T / 2)); j < all.size(); ++j)
        logits = decoder.step(all[j]);
    } else {
      logits = decoder.step(next);
    }
  }
  return out;
}

}  // namespace headroom
