#include "core/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"

namespace headroom {

namespace {

// Normal samples from a seeded mt19937_64 through Box-Muller: std::normal_distribution differs
// between standard libraries, and the same seed must give the same model everywhere.
class NormalRng {
 public:
  explicit NormalRng(uint64_t seed) : rng_(seed) {}
  double next() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    have_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }

 private:
  double uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }
  std::mt19937_64 rng_;
  bool have_spare_ = false;
  double spare_ = 0.0;
};

template <class T>
void fill_normal(Param<T>& p, NormalRng& rng, double std) {
  T* d = p.data();
  for (uint64_t i = 0; i < p.numel; ++i)
    d[i] = static_cast<T>(rng.next() * std);
}

template <class T>
void fill_value(Param<T>& p, T v) {
  T* d = p.data();
  for (uint64_t i = 0; i < p.numel; ++i)
    d[i] = v;
}

template <class T>
void zero(T* x, uint64_t n) {
  std::memset(x, 0, n * sizeof(T));
}

// ---------------------------------------------------------------------------------------------
// Embedding: tokens (B, T) -> wte[token] + wpe[position] (B, T, C)

template <class T>
class Embedding final : public Layer<T> {
 public:
  Embedding(const ModelConfig& m, Device& device) : Layer<T>("embedding", device), m_(m) {
    wte_ = &this->add_param("wte.weight", {m.vocab_size, m.n_embd}, true);
    wpe_ = &this->add_param("wpe.weight", {m.seq_len, m.n_embd}, true);
  }
  Param<T>& wte() { return *wte_; }
  Param<T>& wpe() { return *wpe_; }

  void forward(const T*, const Batch& b) override {
    out_ = this->save(uint64_t(b.B) * b.T * m_.n_embd, "out (B, T, C)");
    cpu::embedding_forward(out_, b.tokens, wte_->data(), wpe_->data(), b.B, b.T, m_.n_embd);
  }
  void backward(T*, const T* dout, const T*, const Batch& b) override {
    cpu::embedding_backward(wte_->gdata(), wpe_->gdata(), dout, b.tokens, b.B, b.T, m_.n_embd);
  }
  const T* output() const override { return out_; }

 private:
  ModelConfig m_;
  Param<T>* wte_;
  Param<T>* wpe_;
  T* out_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Transformer block, pre-LayerNorm:
//   res1 = x + attn_proj(attention(qkv(ln_1(x))))
//   out  = res1 + mlp_proj(gelu(fc(ln_2(res1))))

template <class T>
class Block final : public Layer<T> {
 public:
  Block(int index, const ModelConfig& m, Device& device)
      : Layer<T>("block " + std::to_string(index), device), m_(m) {
    const int64_t C = m.n_embd;
    const std::string h = "h." + std::to_string(index) + ".";
    ln1w_ = &this->add_param(h + "ln_1.weight", {C}, false);
    ln1b_ = &this->add_param(h + "ln_1.bias", {C}, false);
    qkvw_ = &this->add_param(h + "attn.c_attn.weight", {3 * C, C}, true);
    qkvb_ = &this->add_param(h + "attn.c_attn.bias", {3 * C}, false);
    projw_ = &this->add_param(h + "attn.c_proj.weight", {C, C}, true);
    projb_ = &this->add_param(h + "attn.c_proj.bias", {C}, false);
    ln2w_ = &this->add_param(h + "ln_2.weight", {C}, false);
    ln2b_ = &this->add_param(h + "ln_2.bias", {C}, false);
    fcw_ = &this->add_param(h + "mlp.c_fc.weight", {4 * C, C}, true);
    fcb_ = &this->add_param(h + "mlp.c_fc.bias", {4 * C}, false);
    fcprojw_ = &this->add_param(h + "mlp.c_proj.weight", {C, 4 * C}, true);
    fcprojb_ = &this->add_param(h + "mlp.c_proj.bias", {C}, false);
  }

  void init(NormalRng& rng, double proj_std) {
    fill_value<T>(*ln1w_, 1);
    fill_value<T>(*ln1b_, 0);
    fill_normal(*qkvw_, rng, 0.02);
    fill_value<T>(*qkvb_, 0);
    fill_normal(*projw_, rng, proj_std);
    fill_value<T>(*projb_, 0);
    fill_value<T>(*ln2w_, 1);
    fill_value<T>(*ln2b_, 0);
    fill_normal(*fcw_, rng, 0.02);
    fill_value<T>(*fcb_, 0);
    fill_normal(*fcprojw_, rng, proj_std);
    fill_value<T>(*fcprojb_, 0);
  }

  void forward(const T* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, NH = m_.n_head;
    const uint64_t N = uint64_t(B) * Tn;
    // Cheap (a selective drop frees them): the LayerNorm outputs and statistics, the attention
    // probabilities and output, the GELU output. Kept: the GEMM outputs qkv, res1, fc and out.
    ln1_ = this->save(N * C, "ln_1 (B, T, C)", true);
    ln1_mean_ = this->save(N, "ln_1 mean (B, T)", true);
    ln1_rstd_ = this->save(N, "ln_1 rstd (B, T)", true);
    qkv_ = this->save(N * 3 * C, "qkv (B, T, 3C)");
    att_ = this->save(uint64_t(B) * NH * Tn * Tn, "att (B, NH, T, T)", true);
    atty_ = this->save(N * C, "attention out (B, T, C)", true);
    res1_ = this->save(N * C, "residual (B, T, C)");
    ln2_ = this->save(N * C, "ln_2 (B, T, C)", true);
    ln2_mean_ = this->save(N, "ln_2 mean (B, T)", true);
    ln2_rstd_ = this->save(N, "ln_2 rstd (B, T)", true);
    fch_ = this->save(N * 4 * C, "fc (B, T, 4C)");
    fch_gelu_ = this->save(N * 4 * C, "gelu (B, T, 4C)", true);
    out_ = this->save(N * C, "out (B, T, C)");

    ln1_forward(x, N, C);
    cpu::matmul_forward(qkv_, ln1_, qkvw_->data(), qkvb_->data(), N, C, 3 * C);
    cpu::attention_forward(atty_, att_, qkv_, B, Tn, C, NH);
    // The projection is written straight into res1 and the residual added in place: no separate
    // (B, T, C) buffer for the projection, which backward does not need.
    cpu::matmul_forward(res1_, atty_, projw_->data(), projb_->data(), N, C, C);
    cpu::add_inplace(res1_, x, N * C);
    ln2_forward(N, C);
    cpu::matmul_forward(fch_, ln2_, fcw_->data(), fcb_->data(), N, C, 4 * C);
    cpu::gelu_forward(fch_gelu_, fch_, N * 4 * C);
    cpu::matmul_forward(out_, fch_gelu_, fcprojw_->data(), fcprojb_->data(), N, 4 * C, C);
    cpu::add_inplace(out_, res1_, N * C);
  }

  // After a selective drop: the cheap tensors again, from x, qkv, res1 and fc, through the calls
  // forward() makes — the same kernels on the same inputs, so on the CPU bitwise the originals.
  // The GEMMs (qkv, the projections, fc) are not run again: that is the point.
  void recompute_cheap(const T* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, NH = m_.n_head;
    const uint64_t N = uint64_t(B) * Tn;
    ln1_ = this->save(N * C, "ln_1 (B, T, C)", true);
    ln1_mean_ = this->save(N, "ln_1 mean (B, T)", true);
    ln1_rstd_ = this->save(N, "ln_1 rstd (B, T)", true);
    att_ = this->save(uint64_t(B) * NH * Tn * Tn, "att (B, NH, T, T)", true);
    atty_ = this->save(N * C, "attention out (B, T, C)", true);
    ln2_ = this->save(N * C, "ln_2 (B, T, C)", true);
    ln2_mean_ = this->save(N, "ln_2 mean (B, T)", true);
    ln2_rstd_ = this->save(N, "ln_2 rstd (B, T)", true);
    fch_gelu_ = this->save(N * 4 * C, "gelu (B, T, 4C)", true);
    out_ = nullptr;  // freed by Layer::recompute; backward does not read it

    ln1_forward(x, N, C);
    cpu::attention_forward(atty_, att_, qkv_, B, Tn, C, NH);
    ln2_forward(N, C);
    cpu::gelu_forward(fch_gelu_, fch_, N * 4 * C);
  }

  void backward(T* dx, const T* dout, const T* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, NH = m_.n_head;
    const uint64_t N = uint64_t(B) * Tn;
    Buffer d4c_a = this->workspace(N * 4 * C, "dgelu (B, T, 4C)");
    Buffer d4c_b = this->workspace(N * 4 * C, "dfc (B, T, 4C)");
    Buffer dres1_buf = this->workspace(N * C, "dresidual (B, T, C)");
    Buffer dtmp_buf = this->workspace(N * C, "dtmp (B, T, C)");
    Buffer scratch = this->workspace(uint64_t(Tn) * Tn, "attention scratch (T, T)");
    T* dgelu = d4c_a.as<T>();
    T* dfch = d4c_b.as<T>();
    T* dres1 = dres1_buf.as<T>();
    T* dtmp = dtmp_buf.as<T>();

    // MLP: out = res1 + fcproj(gelu(fc(ln_2(res1))))
    zero(dgelu, N * 4 * C);
    cpu::matmul_backward(dgelu, fcprojw_->gdata(), fcprojb_->gdata(), dout, fch_gelu_,
                         fcprojw_->data(), N, 4 * C, C);
    zero(dfch, N * 4 * C);
    cpu::gelu_backward(dfch, fch_, dgelu, N * 4 * C);
    zero(dtmp, N * C);
    cpu::matmul_backward(dtmp, fcw_->gdata(), fcb_->gdata(), dfch, ln2_, fcw_->data(), N, C, 4 * C);
    std::memcpy(dres1, dout, N * C * sizeof(T));  // the residual path
    cpu::layernorm_backward(dres1, ln2w_->gdata(), ln2b_->gdata(), dtmp, res1_, ln2w_->data(),
                            ln2_mean_, ln2_rstd_, N, C);

    // Attention: res1 = x + proj(attention(qkv(ln_1(x))))
    zero(dtmp, N * C);
    cpu::matmul_backward(dtmp, projw_->gdata(), projb_->gdata(), dres1, atty_, projw_->data(), N, C,
                         C);
    T* dqkv = dgelu;  // (B, T, 3C) fits in the (B, T, 4C) buffer, free again by now
    zero(dqkv, N * 3 * C);
    cpu::attention_backward(dqkv, scratch.as<T>(), dtmp, qkv_, att_, B, Tn, C, NH);
    zero(dtmp, N * C);
    cpu::matmul_backward(dtmp, qkvw_->gdata(), qkvb_->gdata(), dqkv, ln1_, qkvw_->data(), N, C,
                         3 * C);
    std::memcpy(dx, dres1, N * C * sizeof(T));
    cpu::layernorm_backward(dx, ln1w_->gdata(), ln1b_->gdata(), dtmp, x, ln1w_->data(), ln1_mean_,
                            ln1_rstd_, N, C);
  }
  const T* output() const override { return out_; }
  bool recomputable() const override { return true; }

 private:
  // Shared by forward() and recompute_cheap(), so the two cannot drift apart.
  void ln1_forward(const T* x, uint64_t N, int C) {
    cpu::layernorm_forward(ln1_, ln1_mean_, ln1_rstd_, x, ln1w_->data(), ln1b_->data(), N, C);
  }
  void ln2_forward(uint64_t N, int C) {
    cpu::layernorm_forward(ln2_, ln2_mean_, ln2_rstd_, res1_, ln2w_->data(), ln2b_->data(), N, C);
  }

  ModelConfig m_;
  Param<T>*ln1w_, *ln1b_, *qkvw_, *qkvb_, *projw_, *projb_, *ln2w_, *ln2b_, *fcw_, *fcb_, *fcprojw_,
      *fcprojb_;
  T *ln1_ = nullptr, *ln1_mean_ = nullptr, *ln1_rstd_ = nullptr, *qkv_ = nullptr, *att_ = nullptr,
    *atty_ = nullptr, *res1_ = nullptr, *ln2_ = nullptr, *ln2_mean_ = nullptr, *ln2_rstd_ = nullptr,
    *fch_ = nullptr, *fch_gelu_ = nullptr, *out_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Head: final LayerNorm, logits through the tied token embedding, fused softmax + cross-entropy.

template <class T>
class Head final : public Layer<T> {
 public:
  Head(const ModelConfig& m, Device& device, Param<T>& wte)
      : Layer<T>("head", device), m_(m), wte_(wte) {
    lnfw_ = &this->add_param("ln_f.weight", {m.n_embd}, false);
    lnfb_ = &this->add_param("ln_f.bias", {m.n_embd}, false);
  }
  void init() {
    fill_value<T>(*lnfw_, 1);
    fill_value<T>(*lnfb_, 0);
  }
  double loss() const { return loss_; }

  void forward(const T* x, const Batch& b) override {
    const int C = m_.n_embd, V = m_.vocab_size;
    const uint64_t N = uint64_t(b.B) * b.T;
    lnf_ = this->save(N * C, "ln_f (B, T, C)");
    lnf_mean_ = this->save(N, "ln_f mean (B, T)");
    lnf_rstd_ = this->save(N, "ln_f rstd (B, T)");
    logits_ = this->save(N * V, "logits (B, T, V)");
    T* losses = this->save(N, "losses (B, T)");

    cpu::layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, x, lnfw_->data(), lnfb_->data(), N, C);
    cpu::matmul_forward(logits_, lnf_, wte_.data(), static_cast<const T*>(nullptr), N, C, V);
    // logits (B, T, V) become dlogits in place: no second (B, T, V) buffer.
    cpu::crossentropy_forward_backward(logits_, losses, b.targets, N, V, static_cast<T>(b.dloss));
    double sum = 0.0;
    uint64_t counted = 0;
    for (uint64_t i = 0; i < N; ++i) {
      if (b.targets[i] < 0) continue;
      sum += losses[i];
      ++counted;
    }
    loss_ = counted ? sum / counted : 0.0;
  }

  void backward(T* dx, const T*, const T* x, const Batch& b) override {
    const int C = m_.n_embd, V = m_.vocab_size;
    const uint64_t N = uint64_t(b.B) * b.T;
    Buffer dlnf_buf = this->workspace(N * C, "dln_f (B, T, C)");
    T* dlnf = dlnf_buf.as<T>();
    zero(dlnf, N * C);
    cpu::matmul_backward(dlnf, wte_.gdata(), static_cast<T*>(nullptr), logits_, lnf_, wte_.data(),
                         N, C, V);
    zero(dx, N * C);
    cpu::layernorm_backward(dx, lnfw_->gdata(), lnfb_->gdata(), dlnf, x, lnfw_->data(), lnf_mean_,
                            lnf_rstd_, N, C);
  }

 private:
  ModelConfig m_;
  Param<T>& wte_;  // tied: owned by the embedding
  Param<T>*lnfw_, *lnfb_;
  T *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr, *logits_ = nullptr;
  double loss_ = 0.0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Layer

template <class T>
uint64_t Layer<T>::saved_bytes() const {
  uint64_t total = 0;
  for (const SavedActivation& a : saved_)
    total += a.buffer.bytes();
  return total;
}

template <class T>
void Layer<T>::drop_activations(Drop what) {
  if (what != Drop::kAll && what != Drop::kCheap)
    throw std::logic_error("drop " + std::to_string(static_cast<uint32_t>(what)) +
                           " is neither all (0) nor cheap (1)");
  if (!recomputable())
    throw std::logic_error(name_ +
                           " cannot drop its activations: only transformer blocks can be "
                           "recomputed (the embedding and the head cannot)");
  const void* out = output();
  auto is_output = [&](const SavedActivation& a) {
    return out && a.buffer.template as<const void>() == out;
  };
  if (std::none_of(saved_.begin(), saved_.end(), is_output))
    throw std::logic_error(name_ +
                           " holds no activations to drop (it has not run forward, or "
                           "its backward is done)");
  // The output stays where it is (the next layer reads it); so does every non-cheap tensor for a
  // selective drop. The rest is freed; the survivors are moved, their memory stays put.
  std::vector<SavedActivation> kept;
  for (SavedActivation& a : saved_)
    if (is_output(a) || (what == Drop::kCheap && !a.cheap)) kept.push_back(std::move(a));
  saved_ = std::move(kept);
  recompute_ =
      what == Drop::kAll || recompute_ == Recompute::kAll ? Recompute::kAll : Recompute::kCheap;
}

template <class T>
void Layer<T>::recompute(const T* input, const Batch& batch) {
  const Recompute mode = recompute_;
  if (mode == Recompute::kNone) return;
  if (mode == Recompute::kAll) {
    release_activations();
    forward(input, batch);
    return;
  }
  const void* out = output();
  saved_.erase(std::remove_if(saved_.begin(), saved_.end(),
                              [&](const SavedActivation& a) {
                                return a.buffer.template as<const void>() == out;
                              }),
               saved_.end());
  recompute_cheap(input, batch);
  recompute_ = Recompute::kNone;
}

template <class T>
Param<T>& Layer<T>::add_param(const std::string& name, std::vector<int64_t> shape, bool decay) {
  auto p = std::make_unique<Param<T>>();
  p->name = name;
  p->numel = 1;
  for (int64_t d : shape)
    p->numel *= static_cast<uint64_t>(d);
  p->shape = std::move(shape);
  p->decay = decay;
  p->value = Buffer(device_, p->numel * sizeof(T), Category::kParameters, name);
  p->grad = Buffer(device_, p->numel * sizeof(T), Category::kGradients, name + " grad");
  zero(p->gdata(), p->numel);
  params_.push_back(std::move(p));
  return *params_.back();
}

template <class T>
T* Layer<T>::save(uint64_t numel, const char* what, bool cheap) {
  SavedActivation a;
  a.cheap = cheap;
  a.buffer =
      Buffer(device_, numel * sizeof(T), Category::kActivations, name_ + " activations: " + what);
  a.what = what;
  a.numel = numel;
  saved_.push_back(std::move(a));
  return saved_.back().buffer.template as<T>();
}

template <class T>
Buffer Layer<T>::workspace(uint64_t numel, const char* what) {
  return Buffer(device_, numel * sizeof(T), Category::kWorkspace, name_ + " backward: " + what);
}

// ---------------------------------------------------------------------------------------------
// Gpt

template <class T>
Gpt<T>::Gpt(const ModelConfig& config, Device& device, uint64_t seed)
    : config_(config), device_(device) {
  auto emb = std::make_unique<Embedding<T>>(config, device);
  Embedding<T>& e = *emb;
  layers_.push_back(std::move(emb));
  for (int l = 0; l < config.n_layer; ++l)
    layers_.push_back(std::make_unique<Block<T>>(l, config, device));
  auto head = std::make_unique<Head<T>>(config, device, e.wte());
  Head<T>& h = *head;
  layers_.push_back(std::move(head));

  // GPT-2 init, in a fixed order: wte, wpe, then each block.
  NormalRng rng(seed);
  fill_normal(e.wte(), rng, 0.02);
  fill_normal(e.wpe(), rng, 0.02);
  const double proj_std = 0.02 / std::sqrt(2.0 * config.n_layer);
  for (int l = 0; l < config.n_layer; ++l)
    static_cast<Block<T>&>(*layers_[1 + l]).init(rng, proj_std);
  h.init();
}

template <class T>
Gpt<T>::~Gpt() = default;

template <class T>
double Gpt<T>::forward(const Batch& batch, LayerEvents* events) {
  const T* x = nullptr;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (events) events->forward_begin(static_cast<int>(l));
    layers_[l]->forward(x, batch);
    x = layers_[l]->output();
    if (events) events->forward_end(static_cast<int>(l));
  }
  return static_cast<const Head<T>&>(*layers_.back()).loss();
}

template <class T>
void Gpt<T>::backward(const Batch& batch, LayerEvents* events) {
  const uint64_t n = uint64_t(batch.B) * batch.T * config_.n_embd;
  // Two (B, T, C) buffers in turn: the gradient flowing into a layer and the one it passes down.
  Buffer a(device_, n * sizeof(T), Category::kWorkspace, "backward: dresidual (B, T, C)");
  Buffer b(device_, n * sizeof(T), Category::kWorkspace, "backward: dresidual (B, T, C)");
  T* dout = a.as<T>();
  T* dinput = b.as<T>();
  for (int l = static_cast<int>(layers_.size()) - 1; l >= 0; --l) {
    if (events) events->backward_begin(l);
    const T* input = l > 0 ? layers_[l - 1]->output() : nullptr;
    // A dropped layer's kept output is not needed by its backward: recompute() frees it first,
    // so the recomputation holds one block's activations, not one and an output.
    if (layers_[l]->needs_recompute()) layers_[l]->recompute(input, batch);
    layers_[l]->backward(l > 0 ? dinput : nullptr, dout, input, batch);
    layers_[l]->release_activations();
    std::swap(dout, dinput);
    if (events) events->backward_end(l);
  }
}

template <class T>
void Gpt<T>::drop_activations(int layer, Drop what) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()))
    throw std::logic_error("layer " + std::to_string(layer) + " does not exist (the model has " +
                           std::to_string(layers_.size()) + " layers)");
  layers_[layer]->drop_activations(what);
}

template <class T>
void Gpt<T>::zero_grad() {
  for (Param<T>* p : params())
    zero(p->gdata(), p->numel);
}

template <class T>
void Gpt<T>::release_activations() {
  for (auto& layer : layers_)
    layer->release_activations();
}

template <class T>
std::vector<Param<T>*> Gpt<T>::params() const {
  std::vector<Param<T>*> out;
  for (const auto& layer : layers_)
    for (const auto& p : layer->params())
      out.push_back(p.get());
  return out;
}

template <class T>
uint64_t Gpt<T>::num_params() const {
  uint64_t n = 0;
  for (Param<T>* p : params())
    n += p->numel;
  return n;
}

template class Layer<float>;
template class Layer<double>;
template class Gpt<float>;
template class Gpt<double>;

uint64_t gpt_num_params(const ModelConfig& m) {
  const uint64_t C = m.n_embd, L = m.n_layer;
  // wte + wpe + per block (ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj) + ln_f
  const uint64_t per_block =
      2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C);
  return uint64_t(m.vocab_size) * C + uint64_t(m.seq_len) * C + L * per_block + 2 * C;
}

uint64_t gpt_block_activation_bytes(const ModelConfig& m, int B, int T, uint64_t es) {
  const uint64_t N = uint64_t(B) * T, C = m.n_embd;
  // ln_1, qkv (3), attention out, residual, ln_2, fc (4), gelu (4), out: 16·N·C;
  // four (B, T) LayerNorm statistics; the (B, NH, T, T) attention probabilities.
  return es * (16 * N * C + 4 * N + uint64_t(B) * m.n_head * T * T);
}

}  // namespace headroom
