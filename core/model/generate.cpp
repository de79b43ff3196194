#include "core/model/generate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>

namespace headroom {

namespace {

// The model's parameters by Hugging Face name: what layer() reads.
std::map<std::string, const Param<float>*> params_by_name(const Gpt<float>& model) {
  std::map<std::string, const Param<float>*> by;
  for (const Param<float>* p : model.params())
    by[p->name] = p;
  return by;
}

const Param<float>& param(const std::map<std::string, const Param<float>*>& by,
                          const std::string& name) {
  const auto it = by.find(name);
  if (it == by.end() || !it->second->compute().value)
    throw std::logic_error("generate: the model has no parameter " + name + " in memory");
  return *it->second;
}

}  // namespace

KvDecoder::KvDecoder(const Gpt<float>& model)
    : model_(model),
      device_(model.device()),
      C_(model.config().n_embd),
      NH_(model.config().n_head),
      T_(model.config().seq_len),
      V_(model.config().vocab_size) {
  if (model.config().llama())
    throw std::invalid_argument(
        "generation with a KV cache is built for arch = \"gpt2\" only, not \"llama\" yet");
  if (model.compute_dtype() != Dtype::kF32)
    throw std::logic_error("KvDecoder: generation reads f32 parameters");
  const auto by = params_by_name(model);
  wte_ = param(by, "wte.weight").compute().value;
  wpe_ = param(by, "wpe.weight").compute().value;
  lnfw_ = param(by, "ln_f.weight").compute().value;
  lnfb_ = param(by, "ln_f.bias").compute().value;
  int fc_max = 0;
  for (int l = 0; l < model.config().n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    BlockParams b;
    b.ln1w = param(by, h + "ln_1.weight").compute().value;
    b.ln1b = param(by, h + "ln_1.bias").compute().value;
    b.qkvw = param(by, h + "attn.c_attn.weight").compute().value;
    b.qkvb = param(by, h + "attn.c_attn.bias").compute().value;
    b.projw = param(by, h + "attn.c_proj.weight").compute().value;
    b.projb = param(by, h + "attn.c_proj.bias").compute().value;
    b.ln2w = param(by, h + "ln_2.weight").compute().value;
    b.ln2b = param(by, h + "ln_2.bias").compute().value;
    const Param<float>& fcw = param(by, h + "mlp.c_fc.weight");
    b.fcw = fcw.compute().value;
    b.fc = int(fcw.shape[0]);  // (F, C): the MLP's width
    b.fcb = param(by, h + "mlp.c_fc.bias").compute().value;
    b.fcprojw = param(by, h + "mlp.c_proj.weight").compute().value;
    b.fcprojb = param(by, h + "mlp.c_proj.bias").compute().value;
    fc_max = std::max(fc_max, b.fc);
    blocks_.push_back(b);
  }
  const uint64_t f = sizeof(float), C = uint64_t(C_), T = uint64_t(T_);
  const Category act = Category::kActivations;
  for (int l = 0; l < model.config().n_layer; ++l)
    cache_.emplace_back(device_, T * 3 * C * f, act, "kv cache qkv (T, 3C)");
  token_ = Buffer(device_, sizeof(int32_t), Category::kData, "sample token");
  x_ = Buffer(device_, C * f, act, "sample x (1, C)");
  ln_ = Buffer(device_, C * f, act, "sample ln (1, C)");
  mean_ = Buffer(device_, f, act, "sample mean");
  rstd_ = Buffer(device_, f, act, "sample rstd");
  atty_ = Buffer(device_, C * f, act, "sample attention out (1, C)");
  res_ = Buffer(device_, C * f, act, "sample residual (1, C)");
  fch_ = Buffer(device_, uint64_t(fc_max) * f, act, "sample fc (1, F)");
  fcg_ = Buffer(device_, uint64_t(fc_max) * f, act, "sample gelu (1, F)");
  logits_ = Buffer(device_, uint64_t(V_) * f, act, "sample logits (1, V)");
}

std::vector<float> KvDecoder::step(int32_t token) {
  if (pos_ >= T_)
    throw std::logic_error("KvDecoder: the context of " + std::to_string(T_) + " is full");
  if (token < 0 || token >= V_)
    throw std::invalid_argument("KvDecoder: token " + std::to_string(token) +
                                " outside the vocabulary of " + std::to_string(V_));
  Backend& ops = device_.backend();
  const Dtype dt = Dtype::kF32;
  const int C = C_, t = pos_;
  const uint64_t row = uint64_t(C) * sizeof(float);
  auto at = [](const void* p, uint64_t bytes) {
    return static_cast<const void*>(static_cast<const char*>(p) + bytes);
  };
  ops.upload(token_.as<void>(), &token, sizeof token);
  // x (1, C) = wte[token] + wpe[t]: the embedding op at one position, wpe seen from row t.
  ops.embedding_forward(dt, x_.as<void>(), token_.as<int32_t>(), wte_, at(wpe_, uint64_t(t) * row),
                        1, 1, C);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const BlockParams& b = blocks_[l];
    char* qkv = cache_[l].as<char>();  // (T, 3C), rows 0..t-1 cached
    ops.layernorm_forward(dt, ln_.as<void>(), mean_.as<void>(), rstd_.as<void>(), x_.as<void>(),
                          b.ln1w, b.ln1b, 1, C);
    ops.matmul_forward(dt, qkv + uint64_t(t) * 3 * row, ln_.as<void>(), b.qkvw, b.qkvb, 1, C,
                       3 * C);
    // This token's query over the cached rows 0..t: (t+1, 3C) -> (1, C).
    ops.attention_decode(dt, atty_.as<void>(), qkv, t + 1, C, NH_);
    ops.matmul_forward(dt, res_.as<void>(), atty_.as<void>(), b.projw, b.projb, 1, C, C);
    ops.add_inplace(dt, res_.as<void>(), x_.as<void>(), C);
    ops.layernorm_forward(dt, ln_.as<void>(), mean_.as<void>(), rstd_.as<void>(), res_.as<void>(),
                          b.ln2w, b.ln2b, 1, C);
    ops.matmul_forward(dt, fch_.as<void>(), ln_.as<void>(), b.fcw, b.fcb, 1, C, b.fc);
    ops.gelu_forward(dt, fcg_.as<void>(), fch_.as<void>(), uint64_t(b.fc));
    ops.matmul_forward(dt, x_.as<void>(), fcg_.as<void>(), b.fcprojw, b.fcprojb, 1, b.fc, C);
    ops.add_inplace(dt, x_.as<void>(), res_.as<void>(), C);
  }
  ops.layernorm_forward(dt, ln_.as<void>(), mean_.as<void>(), rstd_.as<void>(), x_.as<void>(),
                        lnfw_, lnfb_, 1, C);
  ops.matmul_forward(dt, logits_.as<void>(), ln_.as<void>(), wte_, nullptr, 1, C, V_);
  std::vector<float> logits(static_cast<size_t>(V_));
  ops.download(logits.data(), logits_.as<void>(), logits.size() * sizeof(float));
  ++pos_;
  return logits;
}

std::vector<float> forward_logits(const Gpt<float>& model, const std::vector<int32_t>& tokens) {
  const ModelConfig& m = model.config();
  const int N = int(tokens.size()), C = m.n_embd, V = m.vocab_size, NH = m.n_head;
  if (N < 1 || N > m.seq_len) throw std::invalid_argument("forward_logits: 1 to seq_len tokens");
  if (model.compute_dtype() != Dtype::kF32)
    throw std::logic_error("forward_logits: reads f32 parameters");
  Device& device = model.device();
  Backend& ops = device.backend();
  const Dtype dt = Dtype::kF32;
  const uint64_t f = sizeof(float), n = uint64_t(N);
  const Category act = Category::kActivations;
  const auto by = params_by_name(model);
  int fc_max = 0;
  for (int l = 0; l < m.n_layer; ++l)
    fc_max =
        std::max(fc_max, int(param(by, "h." + std::to_string(l) + ".mlp.c_fc.weight").shape[0]));
  Buffer tok(device, n * sizeof(int32_t), Category::kData, "tokens (T)");
  Buffer x(device, n * C * f, act, "x (T, C)"), ln(device, n * C * f, act, "ln (T, C)");
  Buffer mean(device, n * f, act, "mean (T)"), rstd(device, n * f, act, "rstd (T)");
  Buffer qkv(device, n * 3 * C * f, act, "qkv (T, 3C)"), atty(device, n * C * f, act, "atty");
  Buffer att(device, uint64_t(NH) * n * n * f, act, "att (NH, T, T)");
  Buffer res(device, n * C * f, act, "res (T, C)");
  Buffer fch(device, n * fc_max * f, act, "fc (T, F)"), fcg(device, n * fc_max * f, act, "gelu");
  Buffer logits(device, n * V * f, act, "logits (T, V)");
  ops.upload(tok.as<void>(), tokens.data(), n * sizeof(int32_t));
  ops.embedding_forward(dt, x.as<void>(), tok.as<int32_t>(),
                        param(by, "wte.weight").compute().value,
                        param(by, "wpe.weight").compute().value, 1, N, C);
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    auto p = [&](const char* name) { return param(by, h + name).compute().value; };
    const int F = int(param(by, h + "mlp.c_fc.weight").shape[0]);
    ops.layernorm_forward(dt, ln.as<void>(), mean.as<void>(), rstd.as<void>(), x.as<void>(),
                          p("ln_1.weight"), p("ln_1.bias"), N, C);
    ops.matmul_forward(dt, qkv.as<void>(), ln.as<void>(), p("attn.c_attn.weight"),
                       p("attn.c_attn.bias"), N, C, 3 * C);
    ops.attention_forward(dt, atty.as<void>(), att.as<void>(), qkv.as<void>(), 1, N, C, NH);
    ops.matmul_forward(dt, res.as<void>(), atty.as<void>(), p("attn.c_proj.weight"),
                       p("attn.c_proj.bias"), N, C, C);
    ops.add_inplace(dt, res.as<void>(), x.as<void>(), n * C);
    ops.layernorm_forward(dt, ln.as<void>(), mean.as<void>(), rstd.as<void>(), res.as<void>(),
                          p("ln_2.weight"), p("ln_2.bias"), N, C);
    ops.matmul_forward(dt, fch.as<void>(), ln.as<void>(), p("mlp.c_fc.weight"), p("mlp.c_fc.bias"),
                       N, C, F);
    ops.gelu_forward(dt, fcg.as<void>(), fch.as<void>(), n * F);
    ops.matmul_forward(dt, x.as<void>(), fcg.as<void>(), p("mlp.c_proj.weight"),
                       p("mlp.c_proj.bias"), N, F, C);
    ops.add_inplace(dt, x.as<void>(), res.as<void>(), n * C);
  }
  ops.layernorm_forward(dt, ln.as<void>(), mean.as<void>(), rstd.as<void>(), x.as<void>(),
                        param(by, "ln_f.weight").compute().value,
                        param(by, "ln_f.bias").compute().value, N, C);
  ops.matmul_forward(dt, logits.as<void>(), ln.as<void>(), param(by, "wte.weight").compute().value,
                     nullptr, N, C, V);
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
