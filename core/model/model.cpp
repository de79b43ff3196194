#include "core/model/model.h"

#include <fnmatch.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <tuple>
#include <type_traits>

#include "kernels/common/dropout.h"
#include "kernels/cpu/quant.h"

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

// Parameters are initialised on the host and uploaded: the same values on every backend.
template <class T>
void upload(Device& device, Param<T>& p, const std::vector<T>& host) {
  device.backend().upload(p.master().value, host.data(), p.numel * sizeof(T));
  device.backend().synchronize();  // `host` goes out of scope
}

// The init's draws, in element order, through Layer::write_init. A dry run (plan --measure)
// computes nothing, and drawing gpt2-1558m's embedding is most of a variant's setup: write_init
// draws nothing there, the values are never read.
template <class T>
void fill_normal(Layer<T>& layer, Param<T>& p, NormalRng& rng, double std) {
  layer.write_init(p, [&](T* v, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i)
      v[i] = static_cast<T>(rng.next() * std);
  });
}

template <class T>
void fill_value(Layer<T>& layer, Param<T>& p, T x) {
  layer.write_init(p, [&](T* v, uint64_t n) { std::fill(v, v + n, x); });
}

uint64_t g_init_chunk_bytes = uint64_t(16) << 20;

// Quantizes a weight's n values into its codes q, unless the codes already give exactly those
// values: requantizing what the codes give need not give them back (the dynamic map has no -1;
// double quantization's mean moves), so a write of what was read changes no bit.
void quantize_unless_unchanged(QuantKind k, const float* v, uint64_t n, bool double_quant,
                               unsigned char* q) {
  std::vector<float> now(n);
  cpu::dequantize_tensor(k, q, n, double_quant, [&](uint64_t i, float x) { now[i] = x; });
  if (std::memcmp(now.data(), v, n * sizeof(float)) == 0) return;
  cpu::quantize_tensor(k, v, n, double_quant, q);
}

// ---------------------------------------------------------------------------------------------
// Embedding: tokens (B, T) -> wte[token] + wpe[position] (B, T, C). Llama has no position
// table (its positions are the blocks' rotations): wte[token], its wte named embed_tokens.

template <class T>
class Embedding final : public Layer<T> {
 public:
  Embedding(const ModelConfig& m, Device& device, const Precision& dt)
      : Layer<T>("embedding", device, dt), m_(m) {
    wte_ = &this->add_param(m.llama() ? "model.embed_tokens.weight" : "wte.weight",
                            {m.vocab_size, m.n_embd}, true);
    if (!m.llama()) wpe_ = &this->add_param("wpe.weight", {m.seq_len, m.n_embd}, true);
  }
  Param<T>& wte() { return *wte_; }
  Param<T>* wpe() { return wpe_; }  // nullptr for Llama

  void forward(const void*, const Batch& b) override {
    out_ = this->save(uint64_t(b.B) * b.T * m_.n_embd, "out (B, T, C)");
    this->ops().embedding_forward(this->dt_, out_, b.tokens, wte_->compute().value,
                                  wpe_ ? wpe_->compute().value : nullptr, b.B, b.T, m_.n_embd);
  }
  void backward(void*, const void* dout, const void*, const Batch& b) override {
    this->ops().embedding_backward(this->dt_, wte_->compute().grad,
                                   wpe_ ? wpe_->compute().grad : nullptr, dout, b.tokens, b.B, b.T,
                                   m_.n_embd);
  }
  const void* output() const override { return out_; }
  void relocate_output(void* now) override { out_ = now; }

 private:
  ModelConfig m_;
  Param<T>* wte_;
  Param<T>* wpe_ = nullptr;
  void* out_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Transformer block, pre-LayerNorm:
//   res1 = x + attn_proj(attention(qkv(ln_1(x))))
//   out  = res1 + mlp_proj(gelu(fc(ln_2(res1))))
// The MLP's hidden width H is GPT-2's 4C, and the attention's width A = NH·hs its C, unless the
// block was pruned (ModelConfig::mlp_width and heads, Gpt::resize_mlp and resize_heads); the
// comments say 4C and C for them.

template <class T>
class Block final : public Layer<T> {
 public:
  Block(int index, const ModelConfig& m, Device& device, const Precision& dt)
      : Layer<T>("block " + std::to_string(index), device, dt),
        m_(m),
        H_(m.mlp_width(index)),
        NH_(m.heads(index)),
        A_(m.attn_width(index)) {
    const int64_t C = m.n_embd, H = H_, A = A_;
    const std::string h = "h." + std::to_string(index) + ".";
    ln1w_ = &this->add_param(h + "ln_1.weight", {C}, false);
    ln1b_ = &this->add_param(h + "ln_1.bias", {C}, false);
    qkvw_ = &this->add_param(h + "attn.c_attn.weight", {3 * A, C}, true);
    qkvb_ = &this->add_param(h + "attn.c_attn.bias", {3 * A}, false);
    projw_ = &this->add_param(h + "attn.c_proj.weight", {C, A}, true);
    projb_ = &this->add_param(h + "attn.c_proj.bias", {C}, false);
    ln2w_ = &this->add_param(h + "ln_2.weight", {C}, false);
    ln2b_ = &this->add_param(h + "ln_2.bias", {C}, false);
    fcw_ = &this->add_param(h + "mlp.c_fc.weight", {H, C}, true);
    fcb_ = &this->add_param(h + "mlp.c_fc.bias", {H}, false);
    fcprojw_ = &this->add_param(h + "mlp.c_proj.weight", {C, H}, true);
    fcprojb_ = &this->add_param(h + "mlp.c_proj.bias", {C}, false);
  }

  void init(NormalRng& rng, double proj_std) {
    Layer<T>& d = *this;
    fill_value<T>(d, *ln1w_, 1);
    fill_value<T>(d, *ln1b_, 0);
    fill_normal(d, *qkvw_, rng, 0.02);
    fill_value<T>(d, *qkvb_, 0);
    fill_normal(d, *projw_, rng, proj_std);
    fill_value<T>(d, *projb_, 0);
    fill_value<T>(d, *ln2w_, 1);
    fill_value<T>(d, *ln2b_, 0);
    fill_normal(d, *fcw_, rng, 0.02);
    fill_value<T>(d, *fcb_, 0);
    fill_normal(d, *fcprojw_, rng, proj_std);
    fill_value<T>(d, *fcprojb_, 0);
  }

  int hidden() const { return H_; }
  void set_hidden(int H) { H_ = H; }
  int heads() const { return NH_; }
  void set_heads(int NH) {
    NH_ = NH;
    A_ = NH * (m_.n_embd / m_.n_head);
  }

  // What a block keeps for backward: the GEMM outputs qkv, res1, fc and out, the attention's
  // output and what its backward needs besides (the tiled kernels' row log-sum-exp, or the naive
  // ones' (B, NH, T, T) probabilities), and the four LayerNorm statistics: 10·N·C floats
  // unpruned. Not kept: the LayerNorm outputs and the GELU output, 6·N·C. Backward computes them
  // again, with the forward's kernels on the same inputs (bitwise the forward's), into buffers its
  // own gradients have not reached yet — two (B, T, C) LayerNorms and one element-wise pass over
  // (B, T, 4C) against the GEMMs' 24·N·C² multiply-adds — and forward holds them as one transient
  // (B, T, 4C) workspace. Cheap (a selective drop frees them, recompute_cheap() makes them again):
  // the attention's output and log-sum-exp or probabilities.
  void forward(const void* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, NH = NH_, H = H_, A = A_;
    const uint64_t N = uint64_t(B) * Tn;
    const Dtype st = stat_dtype(this->dt_);
    Backend& ops = this->ops();
    const Dtype dt = this->dt_;
    ln1_mean_ = this->save(N, "ln_1 mean (B, T)", false, st);
    ln1_rstd_ = this->save(N, "ln_1 rstd (B, T)", false, st);
    qkv_ = this->save(N * 3 * A, "qkv (B, T, 3C)");
    save_attention(B, Tn, NH);
    atty_ = this->save(N * A, "attention out (B, T, C)", true);
    res1_ = this->save(N * C, "residual (B, T, C)");
    ln2_mean_ = this->save(N, "ln_2 mean (B, T)", false, st);
    ln2_rstd_ = this->save(N, "ln_2 rstd (B, T)", false, st);
    fch_ = this->save(N * H, "fc (B, T, 4C)");
    out_ = this->save(N * C, "out (B, T, C)");
    // ln_1's output, then ln_2's, then GELU's: each read by one GEMM, then no longer needed.
    Buffer transient(this->device_, N * std::max(H, C) * dtype_size(dt), Category::kWorkspace,
                     this->name_ + " forward: ln_1, ln_2, gelu (B, T, 4C)");
    void* t = transient.as<void>();

    ln1_forward(t, x, N, C);
    this->linear_forward(qkv_, t, *qkvw_, qkvb_, N, C, 3 * A);
    attention_forward(B, Tn, A, NH);
    // The projection is written straight into res1 and the residual added in place: no separate
    // (B, T, C) buffer for the projection, which backward does not need.
    this->linear_forward(res1_, atty_, *projw_, projb_, N, A, C);
    // res1 += x and ln_2(res1) in one pass over res1 (bitwise the add, then ln2_forward's op).
    ops.residual_layernorm_forward(dt, t, ln2_mean_, ln2_rstd_, res1_, x, ln2w_->compute().value,
                                   ln2b_->compute().value, int(N), C);
    this->linear_forward(fch_, t, *fcw_, fcb_, N, C, H);
    ops.gelu_forward(dt, t, fch_, N * H);
    this->linear_forward(out_, t, *fcprojw_, fcprojb_, N, H, C);
    ops.add_inplace(dt, out_, res1_, N * C);
  }

  // After a selective drop: the attention's output and what it keeps, from qkv, through the call
  // forward() makes — the same kernel on the same input, so on the CPU bitwise the originals.
  // The GEMMs (qkv, the projections, fc) are not run again: that is the point.
  void recompute_cheap(const void*, const Batch& b) override {
    const int B = b.B, Tn = b.T, NH = NH_, A = A_;
    const uint64_t N = uint64_t(B) * Tn;
    save_attention(B, Tn, NH);
    atty_ = this->save(N * A, "attention out (B, T, C)", true);
    out_ = nullptr;  // freed by Layer::recompute; backward does not read it
    attention_forward(B, Tn, A, NH);
  }

  void backward(void* dx, const void* dout, const void* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, NH = NH_, H = H_, A = A_;
    const uint64_t N = uint64_t(B) * Tn;
    Backend& ops = this->ops();
    const Dtype dt = this->dt_;
    // dgelu's buffer holds dqkv (B, T, 3C) later: a block pruned below 3C gets 3C.
    Buffer d4c_a = this->workspace(N * std::max(H, 3 * A), "dgelu (B, T, 4C)");
    // dfc's holds GELU's output before, ln_1's after: a block pruned below C gets C.
    Buffer d4c_b = this->workspace(N * std::max(H, C), "dfc (B, T, 4C)");
    Buffer dres1_buf = this->workspace(N * C, "dresidual (B, T, C)");
    Buffer dtmp_buf = this->workspace(N * C, "dtmp (B, T, C)");
    // The naive attention's (T, T) backward scratch; the tiled attention needs none.
    Buffer scratch;
    if (!tiled_)
      scratch = this->workspace(ops.attention_scratch_numel(B, Tn, NH), "attention scratch");
    void* dgelu = d4c_a.as<void>();
    void* dfch = d4c_b.as<void>();
    void* dres1 = dres1_buf.as<void>();
    void* dtmp = dtmp_buf.as<void>();

    // MLP: out = res1 + fcproj(gelu(fc(ln_2(res1)))). Each activation gradient below has one
    // producer, which writes it (Grad::kWrite): no zero fill, no copy of the residual path.
    // GELU's output (B, T, 4C), again, in dfc's buffer until dfc is written over it.
    void* gelu = dfch;
    ops.gelu_forward(dt, gelu, fch_, N * H);
    this->linear_backward(dgelu, dout, gelu, *fcprojw_, fcprojb_, N, H, C, Grad::kWrite);
    // GELU's input gradient and, in the same pass, fc's bias gradient (so fc's backward below
    // is given no bias: it would sum dfc's columns again).
    ops.gelu_backward_bias(dt, dfch, fcb_ ? fcb_->compute().grad : nullptr, fch_, dgelu, int(N), H);
    // ln_2's output (B, T, C), again, in dres1's buffer until ln_2's backward writes dres1.
    void* ln2 = dres1;
    ln2_forward(ln2, N, C);
    this->linear_backward(dtmp, dfch, ln2, *fcw_, nullptr, N, C, H, Grad::kWrite);
    // dres1 = dout (the residual path) + ln_2's input gradient
    ops.layernorm_backward(dt, dres1, ln2w_->compute().grad, ln2b_->compute().grad, dtmp, res1_,
                           ln2w_->compute().value, ln2_mean_, ln2_rstd_, N, C, Grad::kWrite, dout);

    // Attention: res1 = x + proj(attention(qkv(ln_1(x))))
    // dtmp (B, T, C) holds the attention output's gradient (B, T, A), A <= C.
    this->linear_backward(dtmp, dres1, atty_, *projw_, projb_, N, A, C, Grad::kWrite);
    void* dqkv = dgelu;  // (B, T, 3C) fits in the (B, T, max(4C, 3C)) buffer, free again by now
    ops.fill(dt, dqkv, N * 3 * A, 0.0);
    if (tiled_) {
      ops.attention_tiled_backward(dt, dqkv, dtmp, qkv_, atty_, lse_, B, Tn, A, NH);
    } else {
      ops.attention_backward(dt, dqkv, scratch.as<void>(), dtmp, qkv_, att_, B, Tn, A, NH);
    }
    // ln_1's output (B, T, C), again, in dfc's buffer (read for the last time above).
    void* ln1 = dfch;
    ln1_forward(ln1, x, N, C);
    this->linear_backward(dtmp, dqkv, ln1, *qkvw_, qkvb_, N, C, 3 * A, Grad::kWrite);
    // dx = dres1 (the residual path) + ln_1's input gradient
    ops.layernorm_backward(dt, dx, ln1w_->compute().grad, ln1b_->compute().grad, dtmp, x,
                           ln1w_->compute().value, ln1_mean_, ln1_rstd_, N, C, Grad::kWrite, dres1);
  }
  const void* output() const override { return out_; }
  void relocate_output(void* now) override { out_ = now; }
  bool recomputable() const override { return true; }

 private:
  // Shared by forward() and recompute_cheap(), so the two cannot drift apart.
  // What the attention keeps for backward besides its output: the tiled kernels' row
  // log-sum-exp (B, NH, T) in the statistics' dtype, or the naive ones' probabilities.
  void save_attention(int B, int Tn, int NH) {
    if (tiled_) {
      lse_ = this->save(uint64_t(B) * NH * Tn, "attention lse (B, NH, T)", true,
                        stat_dtype(this->dt_));
    } else {
      att_ = this->save(uint64_t(B) * NH * Tn * Tn, "att (B, NH, T, T)", true);
    }
  }
  void attention_forward(int B, int Tn, int A, int NH) {
    if (tiled_) {
      this->ops().attention_tiled_forward(this->dt_, atty_, lse_, qkv_, B, Tn, A, NH);
    } else {
      this->ops().attention_forward(this->dt_, atty_, att_, qkv_, B, Tn, A, NH);
    }
  }
  // ln_1 (B, T, C) into `out`, and its statistics (backward writes them again, the same values).
  void ln1_forward(void* out, const void* x, uint64_t N, int C) {
    this->ops().layernorm_forward(this->dt_, out, ln1_mean_, ln1_rstd_, x, ln1w_->compute().value,
                                  ln1b_->compute().value, N, C);
  }
  void ln2_forward(void* out, uint64_t N, int C) {
    this->ops().layernorm_forward(this->dt_, out, ln2_mean_, ln2_rstd_, res1_,
                                  ln2w_->compute().value, ln2b_->compute().value, N, C);
  }

  ModelConfig m_;
  int H_;                                 // the MLP's hidden width
  int NH_;                                // the attention's heads
  int A_;                                 // and its width, NH_ · (C / n_head)
  bool tiled_ = m_.attention != "naive";  // [model] attention
  Param<T>*ln1w_, *ln1b_, *qkvw_, *qkvb_, *projw_, *projb_, *ln2w_, *ln2b_, *fcw_, *fcb_, *fcprojw_,
      *fcprojb_;
  void *ln1_mean_ = nullptr, *ln1_rstd_ = nullptr, *qkv_ = nullptr, *att_ = nullptr,
       *atty_ = nullptr, *res1_ = nullptr, *ln2_mean_ = nullptr, *ln2_rstd_ = nullptr,
       *fch_ = nullptr, *out_ = nullptr, *lse_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Llama block, pre-RMSNorm, no biases:
//   res1 = x + o_proj(attention(rope(qkv_proj(rmsnorm_1(x)))))
//   out  = res1 + down_proj(swiglu(gate_up_proj(rmsnorm_2(res1))))
// with NH query heads and NKV key/value heads of size hs = C / NH (grouped-query attention: q is
// (B, T, C), k and v (B, T, KV), KV = NKV·hs, side by side in one GEMM's output of width
// W = C + 2·KV), and the SwiGLU MLP's gate and up in one GEMM's output (B, T, 2I). Hugging Face's
// names, with the two fused projections named for what they fuse: self_attn.qkv_proj (q_proj,
// k_proj and v_proj stacked by rows) and mlp.gate_up_proj (gate_proj above up_proj).
// A pruned block (Gpt::resize_mlp, resize_heads) has its own I, and its own NH query heads of
// NKV KV groups (the group size NH / NKV is the model's): q is then (B, T, A), A = NH·hs <= C,
// W = A + 2·KV; the comments say C for A.

template <class T>
class LlamaBlock final : public Layer<T> {
 public:
  LlamaBlock(int index, const ModelConfig& m, Device& device, const Precision& dt)
      : Layer<T>("block " + std::to_string(index), device, dt),
        m_(m),
        I_(m.mlp_width(index)),
        NH_(m.heads(index)),
        NKV_(m.kv_heads(index)),
        A_(m.attn_width(index)),
        W_(m.attn_width(index) + 2 * m.kv_width(index)) {
    if (NH_ < 1 || NKV_ < 1 || NH_ != NKV_ * (m.n_head / m.kv_heads()))
      throw std::invalid_argument("block " + std::to_string(index) + ": " + std::to_string(NH_) +
                                  " query heads are not whole key/value groups of " +
                                  std::to_string(m.n_head / m.kv_heads()) + " heads each");
    const int64_t C = m.n_embd, I = I_, W = W_, A = A_;
    const std::string h = "model.layers." + std::to_string(index) + ".";
    rms1w_ = &this->add_param(h + "input_layernorm.weight", {C}, false);
    qkvw_ = &this->add_param(h + "self_attn.qkv_proj.weight", {W, C}, true);
    ow_ = &this->add_param(h + "self_attn.o_proj.weight", {C, A}, true);
    rms2w_ = &this->add_param(h + "post_attention_layernorm.weight", {C}, false);
    guw_ = &this->add_param(h + "mlp.gate_up_proj.weight", {2 * I, C}, true);
    downw_ = &this->add_param(h + "mlp.down_proj.weight", {C, I}, true);
    rope_ = llama_rope_params(m);
  }

  // Hugging Face's LlamaPreTrainedModel: every projection normal(0, 0.02), the norms 1.
  void init(NormalRng& rng) {
    Layer<T>& d = *this;
    fill_value<T>(d, *rms1w_, 1);
    fill_normal(d, *qkvw_, rng, 0.02);
    fill_normal(d, *ow_, rng, 0.02);
    fill_value<T>(d, *rms2w_, 1);
    fill_normal(d, *guw_, rng, 0.02);
    fill_normal(d, *downw_, rng, 0.02);
  }

  int hidden() const { return I_; }
  void set_hidden(int I) { I_ = I; }
  int heads() const { return NH_; }
  int kv_heads() const { return NKV_; }
  // NH query heads, whole KV groups of the model's group size.
  void set_heads(int NH) {
    const int hs = m_.n_embd / m_.n_head, group = m_.n_head / m_.kv_heads();
    NH_ = NH;
    NKV_ = NH / group;
    A_ = NH * hs;
    W_ = A_ + 2 * NKV_ * hs;
  }

  // What the block keeps for backward: the GEMM outputs qkv (rotated, as the attention reads it),
  // res1, gate|up and out, the attention's output and row log-sum-exp (cheap), and the two
  // RMSNorm rstd. Not kept: the RMSNorm outputs and SwiGLU's, computed again in backward into
  // buffers its own gradients have not reached yet, as the GPT-2 block does; forward holds them
  // as one transient (B, T, max(I, C)) workspace.
  void forward(const void* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, I = I_, W = W_, A = A_;
    const uint64_t N = uint64_t(B) * Tn;
    const Dtype dt = this->dt_, st = stat_dtype(dt);
    Backend& ops = this->ops();
    rms1_rstd_ = this->save(N, "input_layernorm rstd (B, T)", false, st);
    qkv_ = this->save(N * W, "qkv (B, T, C + 2KV)");
    save_attention(B, Tn);
    atty_ = this->save(N * A, "attention out (B, T, C)", true);
    res1_ = this->save(N * C, "residual (B, T, C)");
    rms2_rstd_ = this->save(N, "post_attention_layernorm rstd (B, T)", false, st);
    gu_ = this->save(N * 2 * I, "gate|up (B, T, 2I)");
    out_ = this->save(N * C, "out (B, T, C)");
    // rmsnorm_1's output, then rmsnorm_2's, then SwiGLU's: each read by one GEMM.
    Buffer transient(this->device_, N * std::max(I, C) * dtype_size(dt), Category::kWorkspace,
                     this->name_ + " forward: rmsnorm_1, rmsnorm_2, swiglu (B, T, max(I, C))");
    void* t = transient.as<void>();

    rms1_forward(t, x, N, C);
    this->linear_forward(qkv_, t, *qkvw_, nullptr, N, C, W);
    ops.rope_forward(dt, qkv_, B, Tn, NH_, NKV_, C / m_.n_head, rope_);
    attention_forward(B, Tn);
    this->linear_forward(res1_, atty_, *ow_, nullptr, N, A, C);
    ops.add_inplace(dt, res1_, x, N * C);
    rms2_forward(t, N, C);
    this->linear_forward(gu_, t, *guw_, nullptr, N, C, 2 * I);
    ops.swiglu_forward(dt, t, gu_, N, I);
    this->linear_forward(out_, t, *downw_, nullptr, N, I, C);
    ops.add_inplace(dt, out_, res1_, N * C);
  }

  // After a selective drop: the attention's output and log-sum-exp from the kept (rotated) qkv.
  void recompute_cheap(const void*, const Batch& b) override {
    const uint64_t N = uint64_t(b.B) * b.T;
    save_attention(b.B, b.T);
    atty_ = this->save(N * A_, "attention out (B, T, C)", true);
    out_ = nullptr;  // freed by Layer::recompute; backward does not read it
    attention_forward(b.B, b.T);
  }

  void backward(void* dx, const void* dout, const void* x, const Batch& b) override {
    const int B = b.B, Tn = b.T, C = m_.n_embd, I = I_, W = W_, A = A_;
    const uint64_t N = uint64_t(B) * Tn;
    Backend& ops = this->ops();
    const Dtype dt = this->dt_;
    // wide: SwiGLU's output, then d(gate|up) (B, T, 2I), then dqkv (B, T, W).
    Buffer wide_buf = this->workspace(N * std::max(2 * I, W), "dgate|up (B, T, 2I)");
    // narrow: d(swiglu) (B, T, I), then rmsnorm_2's and rmsnorm_1's outputs (B, T, C).
    Buffer narrow_buf = this->workspace(N * std::max(I, C), "dswiglu (B, T, I)");
    Buffer dres1_buf = this->workspace(N * C, "dresidual (B, T, C)");
    Buffer dtmp_buf = this->workspace(N * C, "dtmp (B, T, C)");
    void* wide = wide_buf.as<void>();
    void* narrow = narrow_buf.as<void>();
    void* dres1 = dres1_buf.as<void>();
    void* dtmp = dtmp_buf.as<void>();

    // MLP: out = res1 + down(swiglu(gu)), gu = gate_up(rmsnorm_2(res1)).
    void* h = wide;  // SwiGLU's output (B, T, I), again
    ops.swiglu_forward(dt, h, gu_, N, I);
    this->linear_backward(narrow, dout, h, *downw_, nullptr, N, I, C, Grad::kWrite);
    void* dgu = wide;  // over h, read for the last time above
    ops.swiglu_backward(dt, dgu, gu_, narrow, N, I, Grad::kWrite);
    void* rms2 = narrow;  // rmsnorm_2's output (B, T, C), again
    rms2_forward(rms2, N, C);
    this->linear_backward(dtmp, dgu, rms2, *guw_, nullptr, N, C, 2 * I, Grad::kWrite);
    // dres1 = dout (the residual path) + rmsnorm_2's input gradient
    ops.rmsnorm_backward(dt, dres1, rms2w_->compute().grad, dtmp, res1_, rms2w_->compute().value,
                         rms2_rstd_, N, C, Grad::kWrite, dout);

    // Attention: res1 = x + o_proj(attention(rope(qkv_proj(rmsnorm_1(x)))))
    // dtmp (B, T, C) holds the attention output's gradient (B, T, A), A <= C.
    this->linear_backward(dtmp, dres1, atty_, *ow_, nullptr, N, A, C, Grad::kWrite);
    void* dqkv = wide;  // d(gate|up) is read for the last time above
    ops.fill(dt, dqkv, N * W, 0.0);
    ops.attention_gqa_backward(dt, dqkv, dtmp, qkv_, atty_, lse_, B, Tn, A, NH_, NKV_);
    ops.rope_backward(dt, dqkv, B, Tn, NH_, NKV_, C / m_.n_head, rope_);  // to the unrotated q, k
    void* rms1 = narrow;  // rmsnorm_1's output (B, T, C), again
    rms1_forward(rms1, x, N, C);
    this->linear_backward(dtmp, dqkv, rms1, *qkvw_, nullptr, N, C, W, Grad::kWrite);
    // dx = dres1 (the residual path) + rmsnorm_1's input gradient
    ops.rmsnorm_backward(dt, dx, rms1w_->compute().grad, dtmp, x, rms1w_->compute().value,
                         rms1_rstd_, N, C, Grad::kWrite, dres1);
  }
  const void* output() const override { return out_; }
  void relocate_output(void* now) override { out_ = now; }
  bool recomputable() const override { return true; }

 private:
  void save_attention(int B, int Tn) {
    lse_ =
        this->save(uint64_t(B) * NH_ * Tn, "attention lse (B, NH, T)", true, stat_dtype(this->dt_));
  }
  void attention_forward(int B, int Tn) {
    this->ops().attention_gqa_forward(this->dt_, atty_, lse_, qkv_, B, Tn, A_, NH_, NKV_);
  }
  void rms1_forward(void* out, const void* x, uint64_t N, int C) {
    this->ops().rmsnorm_forward(this->dt_, out, rms1_rstd_, x, rms1w_->compute().value, int(N), C,
                                m_.rms_norm_eps);
  }
  void rms2_forward(void* out, uint64_t N, int C) {
    this->ops().rmsnorm_forward(this->dt_, out, rms2_rstd_, res1_, rms2w_->compute().value, int(N),
                                C, m_.rms_norm_eps);
  }

  ModelConfig m_;
  int I_;    // the MLP's hidden width
  int NH_;   // query heads
  int NKV_;  // key/value heads
  int A_;    // the query heads' width, NH·hs (C unpruned)
  int W_;    // qkv's width, A + 2·NKV·hs
  RopeParams rope_;
  Param<T>*rms1w_, *qkvw_, *ow_, *rms2w_, *guw_, *downw_;
  void *rms1_rstd_ = nullptr, *qkv_ = nullptr, *atty_ = nullptr, *res1_ = nullptr,
       *rms2_rstd_ = nullptr, *gu_ = nullptr, *out_ = nullptr, *lse_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Head: final LayerNorm, logits through the tied token embedding, fused softmax + cross-entropy.
//
// [model] loss = "chunked" (the default) never holds more than one chunk of logits, (chunk, V),
// and computes them once a micro-step: a training forward keeps ln_f and stops there; backward
// takes each chunk's logits, its losses and dlogits over them in place (one fused kernel), and
// their contributions to d(ln_f) and d(wte) before the next chunk. The loss is so known from the
// head's backward on, not after forward (the ABI gives it at BACKWARD_END); evaluate(), which has
// no backward, computes the chunks' losses in forward. Three (N, C, V) GEMMs, as "full" runs.
// The alternative, taking the gradients in forward as Liger Kernel's FusedLinearCrossEntropy
// does, has to keep d(wte) (V, C) from forward to backward — as large as the embedding, more than
// everything else checkpointing leaves of gpt2-124m — because wte's gradient buffers are the
// embedding's (made by Gpt::backward, zeroed and cast by plugins at its events) and exist only in
// backward. Putting the whole loss in backward needs neither.

template <class T>
class Head final : public Layer<T> {
 public:
  // `wte`: the embedding's token table, the head's weight when the model ties them (GPT-2
  // always; Llama with tie_embeddings); else the head has its own lm_head (V, C).
  Head(const ModelConfig& m, Device& device, const Precision& dt, Param<T>& wte)
      : Layer<T>("head", device, dt), m_(m) {
    if (m.llama()) {
      lnfw_ = &this->add_param("model.norm.weight", {m.n_embd}, false);
    } else {
      lnfw_ = &this->add_param("ln_f.weight", {m.n_embd}, false);
      lnfb_ = &this->add_param("ln_f.bias", {m.n_embd}, false);
    }
    wte_ = m.tied() ? &wte : &this->add_param("lm_head.weight", {m.vocab_size, m.n_embd}, true);
  }
  void init(NormalRng& rng) {
    fill_value<T>(*this, *lnfw_, 1);
    if (lnfb_) fill_value<T>(*this, *lnfb_, 0);
    if (!m_.tied()) fill_normal(*this, *wte_, rng, 0.02);
  }
  // The mean loss over the last micro-batch's (non-ignored) tokens, and their count: from the
  // head's backward on (or its forward, with loss_in_forward).
  double loss() const { return loss_; }
  uint64_t tokens() const { return tokens_; }
  // Whether forward computes the losses. evaluate() needs them there, having no backward; a
  // training forward of the chunked loss leaves them to backward, which has to compute the
  // logits anyway (only then does wte's gradient exist). The full loss computes them in forward
  // either way: its logits are saved for backward.
  void set_loss_in_forward(bool in_forward) { loss_in_forward_ = in_forward; }

  void forward(const void* x, const Batch& b) override {
    const int C = m_.n_embd, V = m_.vocab_size;
    const uint64_t N = uint64_t(b.B) * b.T;
    const Dtype dt = this->dt_, st = stat_dtype(dt);
    Backend& ops = this->ops();
    lnf_ = this->save(N * C, "ln_f (B, T, C)");
    if (!m_.llama()) lnf_mean_ = this->save(N, "ln_f mean (B, T)", false, st);
    lnf_rstd_ = this->save(N, "ln_f rstd (B, T)", false, st);
    if (!chunked_) logits_ = this->save(N * V, "logits (B, T, V)");
    losses_ = this->save(N, "losses (B, T)", false, st);

    if (m_.llama()) {  // Llama's final norm is an RMSNorm, its statistic rstd alone
      ops.rmsnorm_forward(dt, lnf_, lnf_rstd_, x, lnfw_->compute().value, N, C, m_.rms_norm_eps);
    } else {
      ops.layernorm_forward(dt, lnf_, lnf_mean_, lnf_rstd_, x, lnfw_->compute().value,
                            lnfb_->compute().value, N, C);
    }
    batch_ = b;
    losses_filled_ = !chunked_ || loss_in_forward_;
    if (chunked_) {
      if (!loss_in_forward_) return;  // backward computes the logits, their losses and gradients
      chunk_losses(b);
    } else {
      ops.matmul_forward(dt, logits_, lnf_, wte_->compute().value, nullptr, N, C, V);
      // logits (B, T, V) become dlogits in place: no second (B, T, V) buffer.
      ops.crossentropy_forward_backward(dt, logits_, losses_, b.targets, N, V, b.dloss);
    }
    read_loss(b);
  }

  void backward(void* dx, const void*, const void* x, const Batch& b) override {
    const int C = m_.n_embd, V = m_.vocab_size;
    const uint64_t N = uint64_t(b.B) * b.T;
    const Dtype dt = this->dt_;
    Backend& ops = this->ops();
    Buffer dlnf_buf = this->workspace(N * C, "dln_f (B, T, C)");
    void* dlnf = dlnf_buf.as<void>();
    // d(ln_f) is written, not accumulated: each row has one producer, its chunk's GEMM.
    if (chunked_) {
      // Per chunk: the logits, their losses and dlogits over them in place, then their part of
      // d(ln_f) and d(wte).
      const uint64_t chunk = gpt_loss_chunk_tokens(m_, N, dt);
      const uint64_t es = dtype_size(dt);
      Buffer logits_buf = this->workspace(chunk * V, "dlogits (chunk, V)");
      void* logits = logits_buf.as<void>();
      for (uint64_t n0 = 0; n0 < N; n0 += chunk) {
        const int rows = int(std::min(chunk, N - n0));
        chunk_logits(logits, n0, rows);
        ops.crossentropy_forward_backward(dt, logits, stat_at(n0), b.targets + n0, rows, V,
                                          b.dloss);
        ops.matmul_backward(dt, static_cast<char*>(dlnf) + n0 * C * es, wte_->compute().grad,
                            nullptr, logits, static_cast<const char*>(lnf_) + n0 * C * es,
                            wte_->compute().value, rows, C, V, Grad::kWrite);
      }
      losses_filled_ = true;
      read_loss(b);  // the same losses evaluate()'s forward would have read
    } else {
      ops.matmul_backward(dt, dlnf, wte_->compute().grad, nullptr, logits_, lnf_,
                          wte_->compute().value, N, C, V, Grad::kWrite);
    }
    if (m_.llama()) {
      ops.rmsnorm_backward(dt, dx, lnfw_->compute().grad, dlnf, x, lnfw_->compute().value,
                           lnf_rstd_, N, C, Grad::kWrite);
    } else {
      ops.layernorm_backward(dt, dx, lnfw_->compute().grad, lnfb_->compute().grad, dlnf, x,
                             lnfw_->compute().value, lnf_mean_, lnf_rstd_, N, C, Grad::kWrite);
    }
  }

  // A training forward of the chunked loss leaves "losses (B, T)" to backward; a plugin that
  // reads it before (FORWARD_END, BACKWARD_BEGIN) gets it computed now, as evaluate()'s forward
  // computes it: the same kernels on the same chunks, so bitwise what backward writes again.
  bool fill_saved(size_t index, bool may_allocate) override {
    if (losses_filled_ || index >= this->saved_.size()) return true;
    if (this->saved_[index].buffer.template as<void>() != losses_) return true;
    if (!may_allocate) return false;
    chunk_losses(batch_);
    losses_filled_ = true;
    return true;
  }

 private:
  // losses (B, T) from ln_f, a chunk at a time: each chunk's logits (chunk, V), its losses, then
  // the next chunk over the same buffer. The cross-entropy kernel also writes dlogits over them,
  // which nothing reads.
  void chunk_losses(const Batch& b) {
    const int V = m_.vocab_size;
    const uint64_t N = uint64_t(b.B) * b.T;
    const Dtype dt = this->dt_;
    const uint64_t chunk = gpt_loss_chunk_tokens(m_, N, dt);
    Buffer logits(this->device_, chunk * V * dtype_size(dt), Category::kWorkspace,
                  this->name_ + " forward: logits (chunk, V)");
    for (uint64_t n0 = 0; n0 < N; n0 += chunk) {
      const int rows = int(std::min(chunk, N - n0));
      chunk_logits(logits.as<void>(), n0, rows);
      this->ops().crossentropy_forward_backward(dt, logits.as<void>(), stat_at(n0), b.targets + n0,
                                                rows, V, b.dloss);
    }
  }

  // The mean of the per-token losses over the batch's non-ignored targets, on the host: (B, T)
  // values, one small copy per micro-step.
  void read_loss(const Batch& b) {
    const uint64_t N = uint64_t(b.B) * b.T;
    std::vector<double> host(N);
    if (stat_dtype(this->dt_) == Dtype::kF64) {
      this->ops().download(host.data(), losses_, N * sizeof(double));
    } else {
      std::vector<float> f(N);
      this->ops().download(f.data(), losses_, N * sizeof(float));
      std::copy(f.begin(), f.end(), host.begin());
    }
    const int32_t* targets = b.host_targets ? b.host_targets : b.targets;
    double sum = 0.0;
    uint64_t counted = 0;
    for (uint64_t i = 0; i < N; ++i) {
      if (targets[i] < 0) continue;
      sum += host[i];
      ++counted;
    }
    loss_ = counted ? sum / counted : 0.0;
    tokens_ = counted;
  }
  // logits (rows, V) = ln_f rows n0 .. n0 + rows through the tied embedding
  void chunk_logits(void* logits, uint64_t n0, int rows) {
    const uint64_t C = uint64_t(m_.n_embd);
    this->ops().matmul_forward(this->dt_, logits,
                               static_cast<const char*>(lnf_) + n0 * C * dtype_size(this->dt_),
                               wte_->compute().value, nullptr, rows, int(C), m_.vocab_size);
  }
  void* stat_at(uint64_t n0) const {
    return static_cast<char*>(losses_) + n0 * dtype_size(stat_dtype(this->dt_));
  }

  ModelConfig m_;
  bool chunked_ = m_.loss != "full";  // [model] loss
  bool loss_in_forward_ = false;
  bool losses_filled_ = false;  // losses_ holds this micro-batch's per-token losses
  Batch batch_;                 // the micro-batch of the last forward, for fill_saved
  Param<T>* wte_;               // the head's weight: the embedding's when tied, else lm_head
  Param<T>* lnfw_ = nullptr;
  Param<T>* lnfb_ = nullptr;  // none for Llama
  void *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr, *logits_ = nullptr,
       *losses_ = nullptr;
  double loss_ = 0.0;
  uint64_t tokens_ = 0;  // the (non-ignored) tokens of loss_
};

}  // namespace

uint64_t frozen_init_chunk_bytes() {
  return g_init_chunk_bytes;
}
void set_frozen_init_chunk_bytes(uint64_t bytes) {
  g_init_chunk_bytes = bytes;
}

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
void Layer<T>::move_output(Device* host) {
  const void* out = output();
  if (!out) return;
  for (SavedActivation& a : saved_) {
    if (a.buffer.template as<const void>() != out) continue;
    if (a.on_host == (host != nullptr)) return;
    const uint64_t bytes = a.buffer.bytes();
    Buffer moved(host ? *host : device_, bytes, Category::kActivations,
                 name_ + " activations: " + a.what + (host ? " (on the host)" : ""));
    if (host) {
      ops().download(moved.as<void>(), a.buffer.template as<void>(), bytes);
    } else {
      ops().upload(moved.as<void>(), a.buffer.template as<void>(), bytes);
    }
    ops().synchronize();  // the old copy goes
    a.buffer = std::move(moved);
    a.on_host = host != nullptr;
    relocate_output(a.buffer.template as<void>());
    return;
  }
}

template <class T>
void Layer<T>::recompute(const void* input, const Batch& batch) {
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
  if (flat_.value) throw std::logic_error("add_param after allocate_params (" + name + ")");
  auto p = std::make_unique<Param<T>>();
  p->name = name;
  p->numel = 1;
  for (int64_t d : shape)
    p->numel *= static_cast<uint64_t>(d);
  p->shape = std::move(shape);
  p->decay = decay;
  p->offset = flat_.numel;
  p->flat = &flat_;
  p->compute_dtype = dt_;
  flat_.numel += p->numel;
  params_.push_back(std::move(p));
  return *params_.back();
}

template <class T>
void Layer<T>::freeze(const std::function<bool(const std::string&)>& frozen) {
  if (flat_.value || flat_.compute || frozen_.value || frozen_.compute || qdata_)
    throw std::logic_error(name_ + ": freeze after allocate_params");
  flat_.numel = frozen_.numel = 0;
  for (auto& p : params_) {
    p->frozen = frozen(p->name);
    FlatStorage& into = p->frozen ? frozen_ : flat_;
    p->flat = &into;
    p->offset = into.numel;
    into.numel += p->numel;
  }
}

template <class T>
void Layer<T>::quantize_frozen(const std::function<bool(const std::string&)>& which, QuantKind kind,
                               bool double_quant) {
  if (frozen_.value || frozen_.compute || quant_.value || qdata_)
    throw std::logic_error(name_ + ": quantize_frozen after allocate_params");
  if (!std::is_same_v<T, float>)
    throw std::invalid_argument("a quantized frozen base needs an f32 model");
  quant_kind_ = kind;
  double_quant_ = double_quant;
  frozen_.numel = quant_.numel = quant_bytes_ = 0;
  for (auto& p : params_) {
    if (!p->frozen) continue;
    const bool q = kind != QuantKind::kNone && which(p->name);
    FlatStorage& into = q ? quant_ : frozen_;
    p->flat = &into;
    p->offset = into.numel;
    into.numel += p->numel;
    p->quant = q ? kind : QuantKind::kNone;
    p->quant_offset = q ? quant_bytes_ : 0;
    if (q) quant_bytes_ += quant_tensor_bytes(kind, p->numel, double_quant);
  }
}

template <class T>
void Layer<T>::allocate_quant_masters() {
  if (quant_.value || quant_.numel == 0) return;
  quant_.value = Buffer(device_, quant_.numel * sizeof(T), Category::kParameters,
                        name_ + " quantized parameters (" + dtype_name(dtype_of<T>()) + " values)");
}

template <class T>
void Layer<T>::quantize_params() {
  if (quant_.numel == 0 || !quant_.value) return;
  // A dry run (plan --measure) has no values to quantize: only the bytes count.
  if (std::is_same_v<T, float> && !device_.dry()) {
    Backend& o = ops();
    std::vector<unsigned char> bytes(quant_bytes_);
    o.download(bytes.data(), qdata_.as<void>(), bytes.size());
    std::vector<float> v;
    for (const auto& p : params_) {
      if (p->quant == QuantKind::kNone) continue;
      v.resize(p->numel);
      o.download(v.data(), quant_.value.as<float>() + p->offset, p->numel * sizeof(float));
      quantize_unless_unchanged(p->quant, v.data(), p->numel, double_quant_,
                                bytes.data() + p->quant_offset);
    }
    o.upload(qdata_.as<void>(), bytes.data(), bytes.size());
    o.synchronize();  // the host copy goes out of scope
  }
  quant_.value.reset();
}

template <class T>
void Layer<T>::dequantize_params() {
  if (quant_.numel == 0) return;
  allocate_quant_masters();
  for (const auto& p : params_)
    if (p->quant != QuantKind::kNone)
      ops().dequantize(dtype_of<T>(), quant_.value.as<T>() + p->offset,
                       qdata_.as<char>() + p->quant_offset, p->quant, double_quant_, p->numel);
}

template <class T>
const void* Layer<T>::gemm_weight(const Param<T>& w, Buffer& buf, const char* what) {
  if (w.quant == QuantKind::kNone) return w.compute().value;
  // (OC, C) in the compute dtype, made before each GEMM that reads w and freed after it.
  buf = Buffer(
      device_, w.numel * dtype_size(dt_), Category::kWorkspace,
      name_ + " " + what + ": " + w.name + " dequantized (" + quant_kind_name(w.quant) + ")");
  ops().dequantize(dt_, buf.as<void>(), qdata_.as<char>() + w.quant_offset, w.quant, double_quant_,
                   w.numel);
  return buf.as<void>();
}

template <class T>
void Layer<T>::write_init(Param<T>& p, const std::function<void(T*, uint64_t)>& draw) {
  Backend& o = ops();
  const bool dry = device_.dry();
  const uint64_t n = p.numel;
  if (p.quant != QuantKind::kNone) {
    // Its values on the host, quantized there into its bytes: no T values on the device. A dry
    // run has no values to quantize: only the bytes count.
    if constexpr (std::is_same_v<T, float>) {
      if (dry) return;
      std::vector<float> v(n);
      draw(v.data(), n);
      std::vector<unsigned char> q(quant_tensor_bytes(p.quant, n, double_quant_));
      unsigned char* at = qdata_.as<unsigned char>() + p.quant_offset;
      o.download(q.data(), at, q.size());
      quantize_unless_unchanged(p.quant, v.data(), n, double_quant_, q.data());
      o.upload(at, q.data(), q.size());
      o.synchronize();  // the host copies go out of scope
    }
    return;
  }
  const FlatStorage& s = *p.flat;
  if (!s.value && !s.compute) throw std::logic_error(name_ + ": " + p.name + " is not allocated");
  // A chunk at a time: into the master itself, or through the f32 transient into the compute
  // copy (a frozen weight kept in the compute dtype alone).
  const uint64_t chunk = std::max<uint64_t>(1, std::min(n, g_init_chunk_bytes / sizeof(T)));
  std::vector<T> host(dry ? 0 : chunk);
  Buffer transient;
  if (!s.value)
    transient = Buffer(device_, chunk * sizeof(T), Category::kWorkspace,
                       name_ + " init: " + p.name + " (" + dtype_name(dtype_of<T>()) + " chunk)");
  for (uint64_t first = 0; first < n; first += chunk) {
    if (dry) break;
    const uint64_t k = std::min(chunk, n - first);
    draw(host.data(), k);
    if (s.value) {
      o.upload(s.value.as<T>() + p.offset + first, host.data(), k * sizeof(T));
    } else {
      o.upload(transient.as<T>(), host.data(), k * sizeof(T));
      o.cast(s.compute.as<char>() + (p.offset + first) * dtype_size(dt_), dt_, transient.as<void>(),
             dtype_of<T>(), k);
    }
    o.synchronize();  // `host` and the transient take the next chunk
  }
}

template <class T>
void Layer<T>::allocate_params(uint64_t ranks, bool grads) {
  // The quantized frozen weights: their bytes (write_init quantizes the init into them).
  // The quantized frozen weights: their bytes (write_init quantizes the init into them), and
  // the frozen weights, never gradients: T values without compute copies, else the compute copy
  // alone (write_init writes the init into it through a bounded transient). Padded like the flat
  // buffers (the bytes in 4-byte words), so that zero3 can shard them too.
  quant_.padded = quant_.numel;
  const uint64_t word = 4 * ranks;
  quant_padded_ = ranks > 1 ? (quant_bytes_ + word - 1) / word * word : quant_bytes_;
  frozen_.padded = (frozen_.numel + ranks - 1) / ranks * ranks;
  allocate_frozen();
  if (qdata_) ops().fill(Dtype::kF32, qdata_.as<void>(), quant_padded_ / 4, 0.0);  // all 0 bits
  if (frozen_.padded > frozen_.numel)  // the padding stays zero
    ops().fill(dt_, frozen_weights().template as<char>() + frozen_.numel * dtype_size(dt_),
               frozen_.padded - frozen_.numel, 0.0);
  flat_.padded = (flat_.numel + ranks - 1) / ranks * ranks;
  if (flat_.numel == 0) return;  // every parameter frozen: no flat buffers, no gradients
  flat_.value =
      Buffer(device_, flat_.padded * sizeof(T), Category::kParameters, name_ + " parameters");
  ops().fill(dtype_of<T>(), flat_.value.as<T>(), flat_.padded, 0.0);  // the padding stays zero
  if (dt_ != dtype_of<T>()) {
    flat_.compute = Buffer(device_, flat_.padded * dtype_size(dt_), Category::kParameters,
                           name_ + " parameters (" + dtype_name(dt_) + ")");
    ops().fill(dt_, flat_.compute.as<void>(), flat_.padded, 0.0);
  }
  if (grads) ensure_grads();
}

void gather_kept(const ParamResize& r, const void* src, void* dst, size_t elem) {
  const auto* in = static_cast<const unsigned char*>(src);
  auto* out = static_cast<unsigned char*>(dst);
  if (r.old_shape.size() == 1 || r.axis == 0) {
    // Whole rows (or elements of a vector): each kept index is one contiguous run.
    uint64_t row = elem;
    for (size_t d = 1; d < r.old_shape.size(); ++d)
      row *= uint64_t(r.old_shape[d]);
    for (size_t i = 0; i < r.keep.size(); ++i)
      std::memcpy(out + i * row, in + uint64_t(r.keep[i]) * row, row);
    return;
  }
  // Columns of a (rows, cols) matrix: the kept ones of every row.
  const uint64_t rows = uint64_t(r.old_shape[0]), cols = uint64_t(r.old_shape[1]);
  const uint64_t kept = r.keep.size();
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t j = 0; j < kept; ++j)
      std::memcpy(out + (i * kept + j) * elem, in + (i * cols + r.keep[j]) * elem, elem);
}

template <class T>
void Layer<T>::shrink_params(const std::vector<ParamResize>& changes) {
  if (flat_.padded != flat_.numel)
    throw std::logic_error(name_ + ": a layer padded for sharding cannot be resized");
  if (has_frozen())
    throw std::logic_error(name_ + ": a layer with frozen parameters cannot be resized (so far)");
  if (!saved_.empty())
    throw std::logic_error(name_ + ": cannot be resized while it holds activations");
  // The new layout: every parameter at its new size, in the same order.
  std::vector<const ParamResize*> change(params_.size(), nullptr);
  for (const ParamResize& r : changes) {
    if (r.index < 0 || size_t(r.index) >= params_.size())
      throw std::logic_error(name_ + ": no parameter " + std::to_string(r.index));
    change[size_t(r.index)] = &r;
  }
  std::vector<uint64_t> new_offset(params_.size()), new_numel(params_.size());
  uint64_t total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    uint64_t n = params_[i]->numel;
    if (change[i]) {
      n = 1;
      for (int64_t d : change[i]->new_shape)
        n *= uint64_t(d);
    }
    new_offset[i] = total;
    new_numel[i] = n;
    total += n;
  }
  // Each slot the layer has now: read whole, gathered on the host into the new layout.
  struct Slot {
    Buffer* buffer;
    Category category;
    std::string what;
    size_t elem;
    std::vector<unsigned char> next;
  };
  const std::string cd = dtype_name(dt_);
  std::vector<Slot> slots;
  if (flat_.value)
    slots.push_back({&flat_.value, Category::kParameters, name_ + " parameters", sizeof(T), {}});
  if (flat_.compute)
    slots.push_back({&flat_.compute,
                     Category::kParameters,
                     name_ + " parameters (" + cd + ")",
                     dtype_size(dt_),
                     {}});
  if (flat_.grad)
    slots.push_back({&flat_.grad, Category::kGradients, name_ + " gradients", sizeof(T), {}});
  if (flat_.compute_grad)
    slots.push_back({&flat_.compute_grad,
                     Category::kGradients,
                     name_ + " gradients (" + cd + ")",
                     dtype_size(dt_),
                     {}});
  Backend& o = ops();
  for (Slot& slot : slots) {
    std::vector<unsigned char> old(flat_.numel * slot.elem);
    o.download(old.data(), slot.buffer->template as<void>(), old.size());
    slot.next.assign(total * slot.elem, 0);
    for (size_t i = 0; i < params_.size(); ++i) {
      const unsigned char* from = old.data() + params_[i]->offset * slot.elem;
      unsigned char* to = slot.next.data() + new_offset[i] * slot.elem;
      if (change[i]) {
        gather_kept(*change[i], from, to, slot.elem);
      } else {
        std::memcpy(to, from, params_[i]->numel * slot.elem);
      }
    }
    slot.buffer->reset();  // before the next is made: never both sizes at once
  }
  for (Slot& slot : slots) {
    *slot.buffer = Buffer(device_, total * slot.elem, slot.category, slot.what);
    o.upload(slot.buffer->template as<void>(), slot.next.data(), slot.next.size());
  }
  o.synchronize();  // the host copies go out of scope
  for (size_t i = 0; i < params_.size(); ++i) {
    Param<T>& p = *params_[i];
    if (change[i]) p.shape = change[i]->new_shape;
    p.numel = new_numel[i];
    p.offset = new_offset[i];
  }
  flat_.numel = flat_.padded = total;
}

template <class T>
void Layer<T>::release_parameters() {
  flat_.value.reset();
  flat_.compute.reset();
}

template <class T>
void Layer<T>::release_masters() {
  flat_.value.reset();
}

template <class T>
void Layer<T>::allocate_masters() {
  if (flat_.value || flat_.padded == 0) return;
  flat_.value = Buffer(device_, flat_.padded * sizeof(T), Category::kParameters,
                       name_ + " parameters (gathered)");
}

template <class T>
void Layer<T>::allocate_frozen_masters() {
  if (frozen_.value || frozen_.numel == 0) return;
  frozen_.value = Buffer(device_, frozen_.padded * sizeof(T), Category::kParameters,
                         name_ + " frozen parameters");
}

template <class T>
void Layer<T>::allocate_frozen() {
  if (quant_bytes_ > 0 && !qdata_)
    qdata_ = Buffer(device_, quant_padded_, Category::kParameters,
                    name_ + " frozen parameters (" + quant_kind_name(quant_kind_) +
                        (double_quant_ ? ", double-quantized absmax)" : ")"));
  if (frozen_.numel == 0 || frozen_weights()) return;
  if (dt_ == dtype_of<T>()) {
    allocate_frozen_masters();
  } else {
    frozen_.compute = Buffer(device_, frozen_.padded * dtype_size(dt_), Category::kParameters,
                             name_ + " frozen parameters (" + dtype_name(dt_) + ")");
  }
}

template <class T>
void Layer<T>::release_frozen() {
  frozen_.value.reset();
  frozen_.compute.reset();
  qdata_.reset();
}

template <class T>
uint64_t Layer<T>::num_params() const {
  uint64_t n = 0;
  for (const auto& p : params_)
    n += p->numel;
  return n;
}

template <class T>
void Layer<T>::release_frozen_masters() {
  if (frozen_.compute) frozen_.value.reset();  // without compute copies they are the weights
}

template <class T>
void Layer<T>::allocate_compute() {
  if (flat_.compute || dt_ == dtype_of<T>() || flat_.padded == 0) return;
  flat_.compute = Buffer(device_, flat_.padded * dtype_size(dt_), Category::kParameters,
                         name_ + " parameters (" + dtype_name(dt_) + ", gathered)");
}

template <class T>
void Layer<T>::release_grads() {
  flat_.grad.reset();
  flat_.compute_grad.reset();
  drop_parked_grads();
}

template <class T>
std::string Layer<T>::grad_name() const {
  return name_ + " gradients";
}

template <class T>
std::string Layer<T>::compute_grad_name() const {
  return name_ + " gradients (" + dtype_name(dt_) +
         (precision_.grad_in_compute ? ")" : ", one micro-step)");
}

template <class T>
void Layer<T>::ensure_grads() {
  if (grads_parked()) {  // back from the host, in new device buffers: the bits they left with
    for (auto [parked, on_device, name] :
         {std::tuple{&parked_grad_, &flat_.grad, grad_name()},
          std::tuple{&parked_compute_grad_, &flat_.compute_grad, compute_grad_name()}}) {
      if (!*parked) continue;
      *on_device = Buffer(device_, parked->bytes(), Category::kGradients, name);
      ops().upload(on_device->template as<void>(), parked->template as<void>(), parked->bytes());
      ops().synchronize();  // the host copy goes
      parked->reset();
    }
  }
  if (has_grads()) return;  // else amp's f32 ones, which the head did not write: made here
  if (precision_.grad_in_compute && dt_ != dtype_of<T>()) {  // the step's, in the compute dtype
    flat_.compute_grad =
        Buffer(device_, flat_.padded * dtype_size(dt_), Category::kGradients, compute_grad_name());
    ops().fill(dt_, flat_.compute_grad.as<void>(), flat_.padded, 0.0);
    return;
  }
  flat_.grad = Buffer(device_, flat_.padded * sizeof(T), Category::kGradients, grad_name());
  ops().fill(dtype_of<T>(), flat_.grad.as<T>(), flat_.padded, 0.0);
}

template <class T>
void Layer<T>::park_grads(Device& host) {
  for (auto [on_device, parked] : {std::pair{&flat_.grad, &parked_grad_},
                                   std::pair{&flat_.compute_grad, &parked_compute_grad_}}) {
    if (!*on_device) continue;
    const uint64_t bytes = on_device->bytes();
    *parked = Buffer(host, bytes, Category::kGradients, name_ + " gradients (parked on the host)");
    ops().download(parked->template as<void>(), on_device->template as<void>(), bytes);
    on_device->reset();
  }
}

template <class T>
void Layer<T>::drop_parked_grads() {
  parked_grad_.reset();
  parked_compute_grad_.reset();
}

template <class T>
void Layer<T>::make_compute_grads() {
  if (dt_ == dtype_of<T>() || precision_.grad_in_compute || flat_.compute_grad || flat_.numel == 0)
    return;
  flat_.compute_grad =
      Buffer(device_, flat_.padded * dtype_size(dt_), Category::kGradients, compute_grad_name());
  ops().fill(dt_, flat_.compute_grad.as<void>(), flat_.padded, 0.0);
}

template <class T>
void Layer<T>::release_compute_grads() {
  if (!precision_.grad_in_compute) flat_.compute_grad.reset();
}

template <class T>
void* Layer<T>::save(uint64_t numel, const char* what, bool cheap) {
  return save(numel, what, cheap, dt_);
}

template <class T>
void* Layer<T>::save(uint64_t numel, const char* what, bool cheap, Dtype dtype) {
  SavedActivation a;
  a.cheap = cheap;
  a.dtype = dtype;
  a.buffer = Buffer(device_, numel * dtype_size(dtype), Category::kActivations,
                    name_ + " activations: " + what);
  a.what = what;
  a.numel = numel;
  saved_.push_back(std::move(a));
  return saved_.back().buffer.template as<void>();
}

template <class T>
Buffer Layer<T>::workspace(uint64_t numel, const char* what) {
  return Buffer(device_, numel * dtype_size(dt_), Category::kWorkspace,
                name_ + " backward: " + what);
}

template <class T>
void Layer<T>::add_adapter(const AdapterSite& site, int rank, double scale, double dropout) {
  const Param<T>* w = nullptr;
  for (const auto& p : params_)
    if (p->name == site.weight) w = p.get();
  if (!w) throw std::logic_error(name_ + " has no parameter " + site.weight);
  Param<T>& A = add_param(site.module + ".lora_A.weight", {rank, site.in}, true);
  Param<T>& B = add_param(site.module + ".lora_B.weight", {site.rows, rank}, true);
  adapters_.push_back({w, site.row0, site.rows, rank, scale, &A, &B, dropout});
}

template <class T>
void Layer<T>::init_adapters(uint64_t rng_seed) {
  // PEFT's reset_lora_parameters: kaiming_uniform_(A, a=sqrt(5)), whose bound is
  // gain · sqrt(3 / fan_in) with gain = sqrt(2 / (1 + a^2)): 1 / sqrt(in); B zero. Uniforms from
  // mt19937_64's raw bits (53 of them), the same on every standard library.
  std::mt19937_64 rng(rng_seed);
  for (const Adapter& a : adapters_) {
    const double bound = 1.0 / std::sqrt(double(a.A->shape[1]));
    std::vector<T> v(a.A->numel);
    for (T& x : v)
      x = T((2.0 * double(rng() >> 11) * 0x1p-53 - 1.0) * bound);
    upload(device_, *a.A, v);
    upload(device_, *a.B, std::vector<T>(a.B->numel, T(0)));
  }
}

template <class T>
void Layer<T>::scaled_b(const Adapter& a, int OC, Buffer& buf) {
  const uint64_t n = uint64_t(OC) * uint64_t(a.rank), es = dtype_size(dt_);
  buf = Buffer(device_, n * es, Category::kWorkspace, name_ + " lora: scaled B (OC, r)");
  Backend& o = ops();
  if (a.rows != OC) o.fill(dt_, buf.as<void>(), n, 0.0);
  o.copy(buf.as<char>() + uint64_t(a.row0) * a.rank * es, a.B->compute().value,
         uint64_t(a.rows) * a.rank * es);
  o.scale(dt_, buf.as<void>(), n, a.scale);
}

template <class T>
const void* Layer<T>::dropped_input(const Adapter& a, const void* inp, uint64_t N, int C,
                                    Buffer& buf) {
  if (a.dropout == 0 || dropout_seed_ == 0) return inp;
  buf = Buffer(device_, N * uint64_t(C) * dtype_size(dt_), Category::kWorkspace,
               name_ + " lora: dropout(x) (N, in)");
  ops().dropout(dt_, buf.as<void>(), inp, N * uint64_t(C), a.dropout, adapter_seed(a));
  return buf.as<void>();
}

template <class T>
uint64_t Layer<T>::adapter_seed(const Adapter& a) const {
  return dropout_mix(dropout_seed_ + uint64_t(&a - adapters_.data()));
}

template <class T>
void Layer<T>::linear_forward(void* out, const void* inp, const Param<T>& w, const Param<T>* b,
                              uint64_t N, int C, int OC) {
  Backend& o = ops();
  {
    Buffer wq;  // a quantized weight's transient, freed once its GEMM is done
    o.matmul_forward(dt_, out, inp, gemm_weight(w, wq, "forward"), b ? b->compute().value : nullptr,
                     int(N), C, OC);
  }
  for (const Adapter& a : adapters_) {
    if (a.weight != &w) continue;
    const int r = int(a.rank);
    Buffer xd;
    const void* x = dropped_input(a, inp, N, C, xd);  // (N, C)
    Buffer t(device_, N * r * dtype_size(dt_), Category::kWorkspace, name_ + " lora: A x (N, r)");
    o.matmul_forward(dt_, t.as<void>(), x, a.A->compute().value, nullptr, int(N), C, r);
    xd.reset();
    Buffer bs;
    scaled_b(a, OC, bs);
    Buffer u(device_, N * OC * dtype_size(dt_), Category::kWorkspace,
             name_ + " lora: B A x (N, OC)");
    o.matmul_forward(dt_, u.as<void>(), t.as<void>(), bs.as<void>(), nullptr, int(N), r, OC);
    o.add_inplace(dt_, out, u.as<void>(), N * OC);
  }
}

template <class T>
void Layer<T>::linear_backward(void* dinp, const void* dout, const void* inp, const Param<T>& w,
                               const Param<T>* b, uint64_t N, int C, int OC, Grad mode) {
  Backend& o = ops();
  // A frozen weight's gradient is null: the weight-gradient GEMM does not run, and the input
  // gradient's GEMM reads a quantized weight's transient, freed right after.
  {
    Buffer wq;
    o.matmul_backward(dt_, dinp, w.compute().grad, b ? b->compute().grad : nullptr, dout, inp,
                      gemm_weight(w, wq, "backward"), int(N), C, OC, mode);
  }
  for (const Adapter& a : adapters_) {
    if (a.weight != &w) continue;
    const int r = int(a.rank);
    const uint64_t es = dtype_size(dt_);
    // x: the adapter's input, with forward's dropout drawn again.
    Buffer xd;
    const void* x = dropped_input(a, inp, N, C, xd);  // (N, C)
    Buffer t(device_, N * r * es, Category::kWorkspace, name_ + " lora: A x (N, r)");
    o.matmul_forward(dt_, t.as<void>(), x, a.A->compute().value, nullptr, int(N), C, r);
    Buffer bs;
    scaled_b(a, OC, bs);
    // dt = dout · (s B) (N, r); d(B) in the GEMM's (OC, r) layout, of which B's rows are added
    // into its gradient, times s.
    Buffer dt(device_, N * r * es, Category::kWorkspace, name_ + " lora: d(A x) (N, r)");
    Buffer db(device_, uint64_t(OC) * r * es, Category::kWorkspace, name_ + " lora: dB (OC, r)");
    o.fill(dt_, db.as<void>(), uint64_t(OC) * r, 0.0);
    o.matmul_backward(dt_, dt.as<void>(), db.as<void>(), nullptr, dout, t.as<void>(), bs.as<void>(),
                      int(N), r, OC, Grad::kWrite);
    o.axpy(dt_, a.B->compute().grad, db.as<char>() + uint64_t(a.row0) * r * es,
           uint64_t(a.rows) * r, a.scale);
    // dA += dt^T · x; dinp += dt · A, through the dropout's mask where x had one
    if (x == inp) {
      o.matmul_backward(dt_, dinp, a.A->compute().grad, nullptr, dt.as<void>(), inp,
                        a.A->compute().value, int(N), C, r, Grad::kAccumulate);
      continue;
    }
    Buffer dx(device_, N * uint64_t(C) * es, Category::kWorkspace,
              name_ + " lora: d(dropout(x)) (N, in)");
    o.matmul_backward(dt_, dx.as<void>(), a.A->compute().grad, nullptr, dt.as<void>(), x,
                      a.A->compute().value, int(N), C, r, Grad::kWrite);
    xd.reset();
    o.dropout(dt_, dx.as<void>(), dx.as<void>(), N * uint64_t(C), a.dropout, adapter_seed(a));
    o.add_inplace(dt_, dinp, dx.as<void>(), N * uint64_t(C));
  }
}

// ---------------------------------------------------------------------------------------------
// Gpt

std::string precision_problem(const Precision& p) {
  const bool copies = p.compute != Dtype::kF32;
  if (p.grad_in_compute && !copies)
    return "gradients in the compute dtype need one other than f32 (bf16 or f16)";
  if (!p.masters && p.compute != Dtype::kBF16)
    return std::string(
               "weights without f32 masters need the bf16 compute dtype (this run "
               "computes in ") +
           dtype_name(p.compute) + ")";
  if (p.state != Dtype::kF32 && p.state != Dtype::kBF16)
    return std::string("optimizer state in ") + dtype_name(p.state) + " (valid: f32, bf16)";
  return "";
}

template <class T>
Gpt<T>::Gpt(const ModelConfig& config, Device& device, uint64_t seed, const Precision& precision,
            uint64_t shard_ranks, bool grads_on_demand,
            const std::function<void(Layer<T>&)>& placed, const Tuning& tuning)
    : config_(config), device_(device), dt_(precision.compute), precision_(precision) {
  const Dtype compute = precision.compute;
  const bool ok = compute == dtype_of<T>() || (dtype_of<T>() == Dtype::kF32 &&
                                               (compute == Dtype::kBF16 || compute == Dtype::kF16));
  if (!ok)
    throw std::invalid_argument(std::string("a model with ") + dtype_name(dtype_of<T>()) +
                                " parameters cannot compute in " + dtype_name(compute) +
                                " (valid: its own dtype; bf16 or f16 for f32 parameters)");
  if constexpr (std::is_same_v<T, float>) {
    const std::string why = precision_problem(precision);
    if (!why.empty()) throw std::invalid_argument(why);
  } else if (precision.grad_in_compute || !precision.masters) {
    throw std::invalid_argument("only a model with f32 masters has other state layouts");
  }
  if (config.llama() && !device.backend().llama_ops())
    throw std::invalid_argument(
        "arch = \"llama\" has no kernels on this device's backend (RMSNorm, rotary embeddings, "
        "SwiGLU, grouped-query attention: the CPU and CUDA backends have them): train it with "
        "[device] kind = \"cpu\" or \"cuda\"");
  auto emb = std::make_unique<Embedding<T>>(config, device, precision);
  Embedding<T>& e = *emb;
  layers_.push_back(std::move(emb));
  for (int l = 0; l < config.n_layer; ++l) {
    if (config.llama()) {
      layers_.push_back(std::make_unique<LlamaBlock<T>>(l, config, device, precision));
    } else {
      layers_.push_back(std::make_unique<Block<T>>(l, config, device, precision));
    }
  }
  auto head = std::make_unique<Head<T>>(config, device, precision, e.wte());
  Head<T>& h = *head;
  layers_.push_back(std::move(head));
  // GPT-2 init, in a fixed order: wte, wpe, then each block, then the head's LayerNorm (and a
  // Llama's untied lm_head); each layer allocated just before its turn and placed right after it.
  NormalRng rng(seed);
  const double proj_std = 0.02 / std::sqrt(2.0 * config.n_layer);
  // LoRA adapters where a target names a module, then the frozen parameters: with adapters,
  // everything but them.
  if (!tuning.lora.empty()) {
    const std::vector<AdapterSite> sites = gpt_adapter_sites(config);
    for (const LoraSpec& spec : tuning.lora) {
      if (spec.rank < 1) throw std::invalid_argument("LoRA rank must be at least 1");
      if (std::none_of(sites.begin(), sites.end(), [&](const AdapterSite& site) {
            return lora_target_matches(spec.target, site.module);
          }))
        throw std::invalid_argument("LoRA target \"" + spec.target + "\" names no module of this " +
                                    config.arch + " model");
    }
    for (const LoraAdapter& a : gpt_lora_adapters(config, tuning.lora))
      layers_[size_t(a.site.layer)]->add_adapter(a.site, a.rank, a.alpha / a.rank, a.dropout);
  }
  if (!tuning.empty())
    for (auto& layer : layers_)
      layer->freeze([&](const std::string& name) {
        return is_frozen(tuning.freeze, name) || (!tuning.lora.empty() && !is_adapter_param(name));
      });
  if (tuning.base != QuantKind::kNone) {
    if (tuning.lora.empty())
      throw std::invalid_argument(
          "a quantized base (base_dtype) needs LoRA adapters: it stores the frozen weights");
    for (auto& layer : layers_)
      layer->quantize_frozen(
          [&](const std::string& name) { return is_quantizable_weight(config, name); }, tuning.base,
          tuning.double_quant);
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer<T>& layer = *layers_[l];
    layer.allocate_params(shard_ranks, !grads_on_demand);
    if (l == 0) {
      fill_normal(e, e.wte(), rng, 0.02);
      if (e.wpe()) fill_normal(e, *e.wpe(), rng, 0.02);
    } else if (l + 1 < layers_.size()) {
      if (config.llama()) {
        static_cast<LlamaBlock<T>&>(layer).init(rng);
      } else {
        static_cast<Block<T>&>(layer).init(rng, proj_std);
      }
      // The adapters from a stream of their own: the base weights are those of the same seed
      // without them.
      if (layer.has_adapters()) layer.init_adapters(seed ^ (0x4c6f5241ULL + l));
    } else {
      h.init(rng);
    }
    const FlatStorage& f = layer.flat();
    if (f.compute)  // the compute copy follows its masters
      device.backend().cast(f.compute.template as<void>(), dt_, f.value.template as<void>(),
                            dtype_of<T>(), f.padded);
    // Without masters the f32 values were only the init's: the weights are the compute copy.
    // (Frozen weights beside compute copies never had any, and quantized ones were written as
    // their bytes: Layer::write_init.)
    if (!precision.masters) layer.release_masters();
    if (placed) placed(layer);
  }
}

template <class T>
Gpt<T>::~Gpt() = default;

// Layer l's dropout draws of the micro-step `batch` is: 0 (none) when the batch draws none.
static uint64_t layer_dropout_seed(const Batch& batch, size_t l) {
  return batch.dropout_seed == 0 ? 0 : dropout_mix(batch.dropout_seed ^ (uint64_t(l) << 48)) | 1;
}

template <class T>
void Gpt<T>::forward(const Batch& batch, LayerEvents* events) {
  const void* x = nullptr;
  static_cast<Head<T>&>(*layers_.back()).set_loss_in_forward(false);  // backward follows
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l]->set_dropout_seed(layer_dropout_seed(batch, l));
    if (events) events->forward_begin(static_cast<int>(l));
    layers_[l]->forward(x, batch);
    x = layers_[l]->output();
    if (events) events->forward_end(static_cast<int>(l));
    // Activation offload: the input this layer read waits on the host for its backward (not the
    // head's input: the head's backward comes next).
    if (activation_host_ && l >= 1 && l + 1 < layers_.size())
      layers_[l - 1]->move_output(activation_host_);
  }
}

template <class T>
double Gpt<T>::evaluate(const Batch& batch) {
  const void* x = nullptr;
  static_cast<Head<T>&>(*layers_.back()).set_loss_in_forward(true);  // no backward comes
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l]->set_dropout_seed(0);  // evaluation drops nothing
    layers_[l]->forward(x, batch);
    // No backward comes: a block keeps only its output, the next layer's input, and the layer
    // before it, whose output this one has read, keeps nothing.
    if (layers_[l]->recomputable()) layers_[l]->drop_activations(Drop::kAll);
    if (l > 0) layers_[l - 1]->release_activations();
    x = layers_[l]->output();
  }
  const double mean = loss();
  layers_.back()->release_activations();
  return mean;
}

template <class T>
double Gpt<T>::loss() const {
  return static_cast<const Head<T>&>(*layers_.back()).loss();
}

template <class T>
uint64_t Gpt<T>::loss_tokens() const {
  return static_cast<const Head<T>&>(*layers_.back()).tokens();
}

template <class T>
void Gpt<T>::backward(const Batch& batch, LayerEvents* events) {
  const uint64_t n = uint64_t(batch.B) * batch.T * config_.n_embd;
  // Two (B, T, C) buffers in turn: the gradient flowing into a layer and the one it passes down.
  const uint64_t bytes = n * dtype_size(dt_);
  Buffer a(device_, bytes, Category::kWorkspace, "backward: dresidual (B, T, C)");
  Buffer b(device_, bytes, Category::kWorkspace, "backward: dresidual (B, T, C)");
  void* dout = a.as<void>();
  void* dinput = b.as<void>();
  // Sharded gradients (zero2) exist only while needed: the head adds into the tied wte, which the
  // embedding (layer 0, the last backward) owns, so layer 0's are there from the start — the
  // ones the head writes: with amp's f32 accumulation the micro-step's compute-dtype gradients,
  // the f32 ones made in the embedding's backward (ensure_grads below), when they are added in.
  if (!accumulates_compute_grads()) layers_[0]->ensure_grads();
  layers_[0]->make_compute_grads();
  for (int l = static_cast<int>(layers_.size()) - 1; l >= 0; --l) {
    // Activation offload: this layer's input back on the device, and the next one's, ahead.
    if (activation_host_)
      for (int k = l - 1; k >= std::max(0, l - 2); --k)
        layers_[size_t(k)]->move_output(nullptr);
    layers_[l]->ensure_grads();
    layers_[l]->make_compute_grads();
    if (events) events->backward_begin(l);
    const void* input = l > 0 ? layers_[l - 1]->output() : nullptr;
    layers_[l]->set_dropout_seed(layer_dropout_seed(batch, size_t(l)));  // forward's draws
    // A dropped layer's kept output is not needed by its backward: recompute() frees it first,
    // so the recomputation holds one block's activations, not one and an output.
    if (layers_[l]->needs_recompute()) layers_[l]->recompute(input, batch);
    layers_[l]->backward(l > 0 ? dinput : nullptr, dout, input, batch);
    layers_[l]->release_activations();
    std::swap(dout, dinput);
    // The layer's compute gradients are final now (the head adds into the tied wte, which the
    // embedding, layer 0, owns): into the fp32 masters before BACKWARD_END, so that the layer's
    // gradient buckets can start reducing while the layers below run their backward.
    accumulate_compute_grads(l);
    if (events) events->backward_end(l);
    // The head has added its part of the tied wte's gradient; the embedding adds the rest last
    // (ensure_grads above brings them back).
    if (grad_park_ && tied_layer(l) == 0 && l > 1) layers_[0]->park_grads(*grad_park_);
  }
}

template <class T>
void Gpt<T>::accumulate_compute_grads(int layer) {
  if constexpr (std::is_same_v<T, float>) {  // only fp32 masters have compute copies
    // Accumulating in the compute dtype, the backward added into the step's gradients itself.
    if (!accumulates_compute_grads()) return;
    Layer<T>& lay = *layers_[size_t(layer)];
    const FlatStorage& f = lay.flat();
    if (!f.grad) return;  // every parameter of the layer frozen
    Backend& ops = device_.backend();
    ops.accumulate(f.grad.as<float>(), f.compute_grad.as<void>(), dt_, f.padded);  // f32 += cgrad
    lay.release_compute_grads();  // the next micro-step's backward makes them again, zeroed
  } else {
    (void)layer;
  }
}

template <class T>
std::function<void(int, const std::function<void()>&)> Gpt<T>::master_access(bool gather,
                                                                             bool scatter) {
  // Frozen weights beside compute copies have no masters either (Param::frozen).
  const bool frozen_copies = has_compute_copies() && has_frozen();
  bool quantized = false;
  for (const auto& layer : layers_)
    quantized = quantized || layer->has_quantized();
  if (precision_.masters && !frozen_copies && !quantized) return nullptr;
  return [this, gather, scatter](int l, const std::function<void()>& f) {
    Layer<T>& lay = *layers_[size_t(l)];
    const FlatStorage& fs = lay.flat();
    const FlatStorage& zs = lay.frozen_flat();
    const bool flat = !precision_.masters && fs.padded > 0;
    const bool frozen = zs.numel > 0 && zs.compute;
    if (flat) lay.allocate_masters();
    if (frozen) lay.allocate_frozen_masters();
    // Quantized weights are read whole (a write of some of them leaves the others' codes).
    const bool quant = lay.has_quantized();
    if (quant) lay.dequantize_params();
    struct Release {  // however f ends
      Layer<T>& layer;
      bool flat, frozen, quant;
      ~Release() {
        if (flat) layer.release_masters();
        if (frozen) layer.release_frozen_masters();
        if (quant) layer.release_quant_masters();
      }
    } release{lay, flat, frozen, quant};
    Backend& ops = device_.backend();
    auto to_masters = [&](const FlatStorage& s) {
      ops.cast(s.value.template as<void>(), dtype_of<T>(), s.compute.template as<void>(), dt_,
               s.padded);
    };
    auto to_compute = [&](const FlatStorage& s) {
      ops.cast(s.compute.template as<void>(), dt_, s.value.template as<void>(), dtype_of<T>(),
               s.padded);
    };
    if (gather && flat) to_masters(fs);
    // Frozen masters are made from the weights whatever the caller asked: a loader that writes
    // some parameters (a snapshot's trainable ones, an adapter) scatters the rest back unchanged.
    if (frozen) to_masters(zs);
    f();
    if (scatter) {
      if (flat) to_compute(fs);
      if (frozen) to_compute(zs);
      if (quant) lay.quantize_params();
    }
    ops.synchronize();
  };
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
  Backend& ops = device_.backend();
  for (const auto& layer : layers_) {
    layer->drop_parked_grads();  // an abandoned backward's: gone, as if released
    const FlatStorage& f = layer->flat();
    if (f.grad) ops.fill(dtype_of<T>(), f.grad.as<T>(), f.padded, 0.0);
    if (f.compute_grad) ops.fill(dt_, f.compute_grad.as<void>(), f.padded, 0.0);
  }
}

template <class T>
void Gpt<T>::release_activations() {
  for (auto& layer : layers_)
    layer->release_activations();
}

template <class T>
void Gpt<T>::release_micro_step() {
  for (auto& layer : layers_) {
    layer->release_activations();
    layer->release_compute_grads();
  }
}

namespace {

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

// What a resize keeps of `count` units (MLP units, heads): ascending, distinct, below `count`, at
// least one. std::invalid_argument naming the block and the first that is not.
void check_kept(const std::string& block, const std::vector<uint32_t>& keep, uint32_t count,
                const char* unit, const std::string& bound, const char* short_unit) {
  if (keep.empty())
    throw std::invalid_argument(block + ": keeps no " + unit + " (at least one must stay)");
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i] >= count || (i > 0 && keep[i] <= keep[i - 1]))
      throw std::invalid_argument(
          block + ": the kept " + unit + "s must be ascending, distinct and below " + bound + " (" +
          short_unit + " " + std::to_string(keep[i]) + " at position " + std::to_string(i) + ")");
}

// resize_mlp / resize_heads: block `layer` of `layers` (std::invalid_argument for another layer),
// a GPT-2 Block or a LlamaBlock.
template <class T>
Layer<T>& block_to_resize(const std::vector<std::unique_ptr<Layer<T>>>& layers, int n_layer,
                          int layer) {
  if (layer < 1 || layer > n_layer)
    throw std::invalid_argument("layer " + std::to_string(layer) +
                                " is no transformer block (blocks are layers 1 .. " +
                                std::to_string(n_layer) + ")");
  return *layers[size_t(layer)];
}

// The index of layer `layer`'s first parameter in Gpt::params().
template <class T>
size_t first_param(const std::vector<std::unique_ptr<Layer<T>>>& layers, int layer) {
  size_t first = 0;
  for (int l = 0; l < layer; ++l)
    first += layers[size_t(l)]->params().size();
  return first;
}

// How one parameter of a block shrinks: its name's tail, new shape, axis and kept indices.
struct Shrink {
  const char* tail;
  std::vector<int64_t> new_shape;
  int axis;
  std::vector<uint32_t> keep;
};

// What `block` (layer `layer`) changes: one ParamResize per parameter a Shrink names.
template <class T>
std::vector<ParamResize> resizes_of(const std::vector<std::unique_ptr<Layer<T>>>& layers, int layer,
                                    const std::vector<Shrink>& shrinks) {
  const Layer<T>& block = *layers[size_t(layer)];
  const size_t first = first_param(layers, layer);
  std::vector<ParamResize> out;
  const auto& ps = block.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    for (const Shrink& s : shrinks) {
      if (!ends_with(ps[i]->name, s.tail)) continue;
      ParamResize r;
      r.param = first + i;
      r.layer = layer;
      r.index = int(i);
      r.name = ps[i]->name;
      r.old_shape = ps[i]->shape;
      r.new_shape = s.new_shape;
      r.axis = s.axis;
      r.keep = s.keep;
      out.push_back(std::move(r));
    }
  }
  return out;
}

// The kept heads' elements of one section of heads of `hs` elements each.
std::vector<uint32_t> head_elements(const std::vector<uint32_t>& heads, int64_t hs,
                                    int64_t offset = 0) {
  std::vector<uint32_t> out;
  for (uint32_t h : heads)
    for (int64_t e = 0; e < hs; ++e)
      out.push_back(uint32_t(offset + int64_t(h) * hs + e));
  return out;
}

}  // namespace

template <class T>
std::vector<ParamResize> Gpt<T>::resize_mlp(int layer, const std::vector<uint32_t>& keep) {
  Layer<T>& block = block_to_resize(layers_, config_.n_layer, layer);
  auto* gpt2 = dynamic_cast<Block<T>*>(&block);
  auto* llama = dynamic_cast<LlamaBlock<T>*>(&block);
  const int H = gpt2 ? gpt2->hidden() : llama->hidden();
  check_kept(block.name(), keep, uint32_t(H), "MLP unit", "its width " + std::to_string(H), "unit");
  const int64_t C = config_.n_embd, K = int64_t(keep.size());
  std::vector<ParamResize> out;
  if (gpt2) {
    out = resizes_of(layers_, layer,
                     {{"mlp.c_fc.weight", {K, C}, 0, keep},
                      {"mlp.c_fc.bias", {K}, 0, keep},
                      {"mlp.c_proj.weight", {C, K}, 1, keep}});
  } else {
    // gate_up_proj's rows are gate (H) above up (H): unit j is rows j and H + j.
    std::vector<uint32_t> rows = keep;
    for (uint32_t j : keep)
      rows.push_back(uint32_t(H) + j);
    out = resizes_of(layers_, layer,
                     {{"mlp.gate_up_proj.weight", {2 * K, C}, 0, rows},
                      {"mlp.down_proj.weight", {C, K}, 1, keep}});
  }
  block.shrink_params(out);
  if (gpt2) {
    gpt2->set_hidden(int(K));
  } else {
    llama->set_hidden(int(K));
  }
  if (config_.mlp_hidden.empty())
    config_.mlp_hidden.assign(size_t(config_.n_layer), config_.default_mlp_width());
  config_.mlp_hidden[size_t(layer - 1)] = int(K);
  return out;
}

template <class T>
std::vector<ParamResize> Gpt<T>::resize_heads(int layer, const std::vector<uint32_t>& keep) {
  Layer<T>& block = block_to_resize(layers_, config_.n_layer, layer);
  auto* gpt2 = dynamic_cast<Block<T>*>(&block);
  auto* llama = dynamic_cast<LlamaBlock<T>*>(&block);
  const int NH = gpt2 ? gpt2->heads() : llama->heads();
  check_kept(block.name(), keep, uint32_t(NH), "attention head",
             "its " + std::to_string(NH) + " heads", "head");
  const int64_t C = config_.n_embd, hs = C / config_.n_head, A = int64_t(NH) * hs;
  const int64_t A2 = int64_t(keep.size()) * hs;
  // The kept heads' elements of one (A)-wide section: hs of them a head.
  const std::vector<uint32_t> section = head_elements(keep, hs);
  std::vector<ParamResize> out;
  if (gpt2) {
    // qkv's rows are q, k, v sections of A each (the attention kernels' layout).
    std::vector<uint32_t> qkv;
    for (int64_t part = 0; part < 3; ++part)
      for (uint32_t e : section)
        qkv.push_back(uint32_t(part * A + e));
    out = resizes_of(layers_, layer,
                     {{"attn.c_attn.weight", {3 * A2, C}, 0, qkv},
                      {"attn.c_attn.bias", {3 * A2}, 0, qkv},
                      {"attn.c_proj.weight", {C, A2}, 1, section}});
  } else {
    // Grouped-query attention: KV head g serves query heads g·G .. g·G + G - 1 (G = n_head /
    // n_kv_head). Heads go in whole groups, so that every KV head left has all its query heads
    // and the group size stays the model's.
    const uint32_t G = uint32_t(config_.n_head / config_.kv_heads());
    std::vector<uint32_t> groups;
    for (size_t i = 0; i < keep.size(); i += G) {
      bool whole = i + G <= keep.size() && keep[i] % G == 0;
      for (uint32_t e = 1; whole && e < G; ++e)
        whole = keep[i + e] == keep[i] + e;
      if (!whole)
        throw std::invalid_argument(
            block.name() + ": the kept attention heads must be whole key/value groups (each KV " +
            "head is shared by " + std::to_string(G) + " consecutive query heads, " +
            "n_head / n_kv_head): head " + std::to_string(keep[i]) + " at position " +
            std::to_string(i) + " does not start a whole group");
      groups.push_back(keep[i] / G);
    }
    const int64_t KV = int64_t(llama->kv_heads()) * hs, KV2 = int64_t(groups.size()) * hs;
    // qkv_proj's rows: q (A: the query heads), k (KV), v (KV).
    std::vector<uint32_t> qkv = section;
    for (uint32_t e : head_elements(groups, hs, A))
      qkv.push_back(e);
    for (uint32_t e : head_elements(groups, hs, A + KV))
      qkv.push_back(e);
    out = resizes_of(layers_, layer,
                     {{"self_attn.qkv_proj.weight", {A2 + 2 * KV2, C}, 0, qkv},
                      {"self_attn.o_proj.weight", {C, A2}, 1, section}});
  }
  block.shrink_params(out);
  if (gpt2) {
    gpt2->set_heads(int(keep.size()));
  } else {
    llama->set_heads(int(keep.size()));
  }
  if (config_.attn_heads.empty())
    config_.attn_heads.assign(size_t(config_.n_layer), config_.n_head);
  config_.attn_heads[size_t(layer - 1)] = int(keep.size());
  return out;
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
std::vector<Param<T>*> Gpt<T>::trainable_params() const {
  std::vector<Param<T>*> out;
  for (Param<T>* p : params())
    if (!p->frozen) out.push_back(p);
  return out;
}

template <class T>
bool Gpt<T>::has_frozen() const {
  for (const auto& layer : layers_)
    if (layer->has_frozen()) return true;
  return false;
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

uint64_t gpt_block_params(const ModelConfig& m, int block) {
  const uint64_t C = m.n_embd, H = uint64_t(m.mlp_width(block));
  if (m.llama()) {
    // two RMSNorms, qkv_proj (A + 2KV, C), o_proj (C, A), gate_up_proj (2I, C), down_proj (C, I);
    // A = C and KV = kv_width() unpruned
    const uint64_t A = uint64_t(m.attn_width(block)), KV = uint64_t(m.kv_width(block));
    return 2 * C + (A + 2 * KV) * C + C * A + 3 * H * C;
  }
  const uint64_t A = uint64_t(m.attn_width(block));
  // ln_1, c_attn (3A, C) and its bias, attn c_proj (C, A) and its bias, ln_2, c_fc (H, C) and its
  // bias, mlp c_proj (C, H) and its bias
  return 2 * C + (3 * A * C + 3 * A) + (C * A + C) + 2 * C + (H * C + H) + (C * H + C);
}

RopeParams llama_rope_params(const ModelConfig& m) {
  RopeParams p;
  p.theta = m.rope_theta;
  p.factor = m.rope_scaling_factor;
  p.low_freq_factor = m.rope_low_freq_factor;
  p.high_freq_factor = m.rope_high_freq_factor;
  p.original_max_position_embeddings = m.rope_original_max_positions;
  return p;
}

uint64_t gpt_num_params(const ModelConfig& m) {
  const uint64_t C = m.n_embd, V = uint64_t(m.vocab_size);
  uint64_t blocks = 0;
  for (int b = 0; b < m.n_layer; ++b)
    blocks += gpt_block_params(m, b);
  // Llama: embed_tokens + the blocks + the final RMSNorm + an untied lm_head
  if (m.llama()) return V * C + blocks + C + (m.tied() ? 0 : V * C);
  // GPT-2: wte + wpe + the blocks + ln_f
  return V * C + uint64_t(m.seq_len) * C + blocks + 2 * C;
}

std::vector<ParamShape> gpt_param_shapes(const ModelConfig& m) {
  const int64_t C = m.n_embd;
  using Shapes = std::vector<std::tuple<const char*, std::vector<int64_t>, bool>>;
  if (m.llama()) {
    std::vector<ParamShape> out = {{0, "model.embed_tokens.weight", {m.vocab_size, C}, true}};
    for (int l = 0; l < m.n_layer; ++l) {
      const std::string h = "model.layers." + std::to_string(l) + ".";
      const int64_t I = m.mlp_width(l), A = m.attn_width(l), W = A + 2 * int64_t(m.kv_width(l));
      for (const auto& [name, shape, decay] :
           Shapes{{"input_layernorm.weight", {C}, false},
                  {"self_attn.qkv_proj.weight", {W, C}, true},
                  {"self_attn.o_proj.weight", {C, A}, true},
                  {"post_attention_layernorm.weight", {C}, false},
                  {"mlp.gate_up_proj.weight", {2 * I, C}, true},
                  {"mlp.down_proj.weight", {C, I}, true}})
        out.push_back({l + 1, h + name, shape, decay});
    }
    out.push_back({m.n_layer + 1, "model.norm.weight", {C}, false});
    if (!m.tied()) out.push_back({m.n_layer + 1, "lm_head.weight", {m.vocab_size, C}, true});
    return out;
  }
  std::vector<ParamShape> out = {{0, "wte.weight", {m.vocab_size, C}, true},
                                 {0, "wpe.weight", {m.seq_len, C}, true}};
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    const int layer = l + 1;
    const int64_t H = m.mlp_width(l), A = m.attn_width(l);
    for (const auto& [name, shape, decay] : Shapes{{"ln_1.weight", {C}, false},
                                                   {"ln_1.bias", {C}, false},
                                                   {"attn.c_attn.weight", {3 * A, C}, true},
                                                   {"attn.c_attn.bias", {3 * A}, false},
                                                   {"attn.c_proj.weight", {C, A}, true},
                                                   {"attn.c_proj.bias", {C}, false},
                                                   {"ln_2.weight", {C}, false},
                                                   {"ln_2.bias", {C}, false},
                                                   {"mlp.c_fc.weight", {H, C}, true},
                                                   {"mlp.c_fc.bias", {H}, false},
                                                   {"mlp.c_proj.weight", {C, H}, true},
                                                   {"mlp.c_proj.bias", {C}, false}})
      out.push_back({layer, h + name, shape, decay});
  }
  out.push_back({m.n_layer + 1, "ln_f.weight", {C}, false});
  out.push_back({m.n_layer + 1, "ln_f.bias", {C}, false});
  return out;
}

std::vector<AdapterSite> gpt_adapter_sites(const ModelConfig& m) {
  std::vector<AdapterSite> out;
  const int64_t C = m.n_embd;
  for (int b = 0; b < m.n_layer; ++b) {
    const int layer = b + 1;
    const int64_t A = m.attn_width(b), H = m.mlp_width(b);
    if (m.llama()) {
      const std::string h = "model.layers." + std::to_string(b) + ".";
      const int64_t KV = m.kv_width(b);
      const std::string qkv = h + "self_attn.qkv_proj.weight", gu = h + "mlp.gate_up_proj.weight";
      out.push_back({layer, h + "self_attn.q_proj", qkv, 0, A, C});
      out.push_back({layer, h + "self_attn.k_proj", qkv, A, KV, C});
      out.push_back({layer, h + "self_attn.v_proj", qkv, A + KV, KV, C});
      out.push_back({layer, h + "self_attn.o_proj", h + "self_attn.o_proj.weight", 0, C, A});
      out.push_back({layer, h + "mlp.gate_proj", gu, 0, H, C});
      out.push_back({layer, h + "mlp.up_proj", gu, H, H, C});
      out.push_back({layer, h + "mlp.down_proj", h + "mlp.down_proj.weight", 0, C, H});
    } else {
      const std::string h = "h." + std::to_string(b) + ".";
      out.push_back({layer, h + "attn.c_attn", h + "attn.c_attn.weight", 0, 3 * A, C});
      out.push_back({layer, h + "attn.c_proj", h + "attn.c_proj.weight", 0, C, A});
      out.push_back({layer, h + "mlp.c_fc", h + "mlp.c_fc.weight", 0, H, C});
      out.push_back({layer, h + "mlp.c_proj", h + "mlp.c_proj.weight", 0, C, H});
    }
  }
  return out;
}

bool lora_target_matches(const std::string& target, const std::string& module) {
  if (target.empty()) return false;
  if (target == kAllLinear) return true;  // every site is a linear module of a block
  if (module == target) return true;
  return module.size() > target.size() &&
         module.compare(module.size() - target.size(), target.size(), target) == 0 &&
         module[module.size() - target.size() - 1] == '.';
}

std::vector<LoraAdapter> gpt_lora_adapters(const ModelConfig& m,
                                           const std::vector<LoraSpec>& lora) {
  const std::vector<AdapterSite> sites = gpt_adapter_sites(m);
  std::vector<LoraAdapter> out;
  for (const LoraSpec& spec : lora)
    for (const AdapterSite& site : sites) {
      if (!lora_target_matches(spec.target, site.module)) continue;
      const bool placed = std::any_of(out.begin(), out.end(), [&](const LoraAdapter& a) {
        return a.site.weight == site.weight && a.site.row0 == site.row0;
      });
      if (!placed) out.push_back({site, spec.rank, spec.alpha, spec.dropout});
    }
  return out;
}

void check_lora(const ModelConfig& m, const LoraSpec& spec) {
  if (spec.rank < 1)
    throw std::invalid_argument("rank " + std::to_string(spec.rank) + " (valid: 1 or more)");
  if (!(spec.alpha > 0) || !std::isfinite(spec.alpha))
    throw std::invalid_argument("alpha must be a finite number > 0");
  if (!(spec.dropout >= 0 && spec.dropout < 1))
    throw std::invalid_argument("dropout must be in [0, 1)");
  const std::vector<AdapterSite> sites = gpt_adapter_sites(m);
  bool any = false;
  for (const AdapterSite& s : sites)
    any = any || lora_target_matches(spec.target, s.module);
  if (!any) {
    // The modules of one block by their last two parts, as PEFT's target_modules may name them.
    std::string names, last;
    for (const AdapterSite& s : sites) {
      if (s.layer != 1) continue;
      const size_t dot = s.module.rfind('.'), prev = s.module.rfind('.', dot - 1);
      names += (names.empty() ? "" : ", ") + s.module.substr(prev + 1);
      if (last.empty()) last = s.module.substr(dot + 1);
    }
    throw std::invalid_argument("\"" + spec.target + "\" names no module of this " + m.arch +
                                " model (valid: " + names + ", the part after a dot of one, as \"" +
                                last + "\", or \"" + kAllLinear + "\")");
  }
}

QuantKind parse_base_dtype(const std::string& s) {
  if (s.empty() || s == "f32") return QuantKind::kNone;
  if (s == "bf16") return QuantKind::kBF16;
  if (s == "int8") return QuantKind::kInt8;
  if (s == "nf4") return QuantKind::kNF4;
  throw std::invalid_argument("base_dtype \"" + s +
                              "\" is none of \"f32\", \"bf16\", \"int8\", \"nf4\"");
}

const char* quant_kind_name(QuantKind k) {
  switch (k) {
    case QuantKind::kBF16:
      return "bf16";
    case QuantKind::kInt8:
      return "int8";
    case QuantKind::kNF4:
      return "nf4";
    default:
      return "f32";
  }
}

bool is_quantizable_weight(const ModelConfig& m, const std::string& name) {
  for (const AdapterSite& s : gpt_adapter_sites(m))
    if (s.weight == name) return true;
  return false;
}

uint64_t gpt_quantized_base_bytes(const ModelConfig& m, QuantKind k, bool double_quant) {
  if (k == QuantKind::kNone) return 0;
  uint64_t bytes = 0;
  for (const ParamShape& p : gpt_param_shapes(m)) {
    if (!is_quantizable_weight(m, p.name)) continue;
    uint64_t n = 1;
    for (int64_t d : p.shape)
      n *= uint64_t(d);
    bytes += quant_tensor_bytes(k, n, double_quant);
  }
  return bytes;
}

bool is_adapter_param(const std::string& name) {
  return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight");
}

bool freeze_matches(const std::string& pattern, const std::string& name) {
  return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

bool is_frozen(const std::vector<std::string>& patterns, const std::string& name) {
  for (const std::string& p : patterns)
    if (freeze_matches(p, name)) return true;
  return false;
}

void check_freeze(const ModelConfig& m, const TrainConfig& t) {
  if (t.freeze.empty()) return;
  const std::vector<ParamShape> shapes = gpt_param_shapes(m);
  auto where = [&](size_t i) {
    return i < t.freeze_pos.size() ? t.freeze_pos[i].str() + ": " : std::string();
  };
  for (size_t i = 0; i < t.freeze.size(); ++i) {
    bool any = false;
    for (const ParamShape& s : shapes)
      any = any || freeze_matches(t.freeze[i], s.name);
    if (any) continue;
    // Some names of the first block, and the ones outside the blocks, as examples.
    std::string names;
    for (const ParamShape& s : shapes) {
      if (s.layer > 1 && s.layer <= m.n_layer) continue;
      names += (names.empty() ? "" : ", ") + s.name;
    }
    throw ConfigError(where(i) + "train.freeze: \"" + t.freeze[i] +
                      "\" matches no parameter of this " + m.arch +
                      " model (a glob over Hugging Face names: * any characters, dots "
                      "included, ? one; its names: " +
                      names + ", the other blocks' alike)");
  }
  size_t frozen = 0;
  for (const ParamShape& s : shapes)
    frozen += is_frozen(t.freeze, s.name);
  if (frozen == shapes.size())
    throw ConfigError(where(0) +
                      "train.freeze freezes every parameter of the model: nothing "
                      "would train; leave at least one out");
}

uint64_t gpt_block_workspace_bytes(const ModelConfig& m, int B, int T, Dtype dt, int block,
                                   uint64_t attention_scratch) {
  const uint64_t N = uint64_t(B) * T, C = m.n_embd, H = uint64_t(m.mlp_width(block));
  if (m.llama()) {
    const uint64_t W = uint64_t(m.attn_width(block)) + 2 * uint64_t(m.kv_width(block));
    return dtype_size(dt) * (N * std::max(2 * H, W) + N * std::max(H, C) + 2 * N * C);
  }
  const uint64_t A = uint64_t(m.attn_width(block));
  return dtype_size(dt) *
         (N * std::max(H, 3 * A) + N * std::max(H, C) + 2 * N * C + attention_scratch);
}

uint64_t gpt_loss_chunk_tokens(const ModelConfig& m, uint64_t N, Dtype dt) {
  if (m.chunk_tokens > 0) return std::max<uint64_t>(1, std::min(uint64_t(m.chunk_tokens), N));
  // The default: as few chunks as kLossChunkBytes allows, of equal size (1024 tokens of gpt2 in
  // fp32: 4 of 256, not 3 of 333 and one of 25, whose GEMMs run at half the rate).
  const uint64_t most = std::max<uint64_t>(
      1, std::min(kLossChunkBytes / (uint64_t(m.vocab_size) * dtype_size(dt)), N));
  const uint64_t chunks = (N + most - 1) / most;
  return (N + chunks - 1) / chunks;
}

uint64_t gpt_head_activation_bytes(const ModelConfig& m, int B, int T, Dtype dt) {
  const uint64_t N = uint64_t(B) * T, C = m.n_embd, V = uint64_t(m.vocab_size);
  const bool full = m.loss == "full";
  // ln_f (B, T, C) [, logits]; LayerNorm's mean and rstd (RMSNorm's rstd) and the losses (B, T)
  const uint64_t stats = m.llama() ? 2 : 3;
  return dtype_size(dt) * (N * C + (full ? N * V : 0)) + dtype_size(stat_dtype(dt)) * stats * N;
}

uint64_t gpt_head_workspace_bytes(const ModelConfig& m, int B, int T, Dtype dt) {
  const uint64_t N = uint64_t(B) * T, C = m.n_embd, V = uint64_t(m.vocab_size);
  const bool full = m.loss == "full";
  return dtype_size(dt) * (N * C + (full ? 0 : gpt_loss_chunk_tokens(m, N, dt) * V));
}

uint64_t gpt_block_activation_bytes(const ModelConfig& m, int B, int T, Dtype dt, int block) {
  const uint64_t N = uint64_t(B) * T, C = m.n_embd, H = uint64_t(m.mlp_width(block));
  if (m.llama()) {
    // qkv (B, T, A + 2KV), attention out (B, T, A), residual and out (B, T, C) each, gate|up
    // (B, T, 2I); two RMSNorm rstd (B, T) and the tiled attention's (B, NH, T) log-sum-exp in the
    // statistics' dtype (the RMSNorm and SwiGLU outputs are computed again in backward). A = C,
    // KV = kv_width() and NH = n_head unpruned.
    const uint64_t A = uint64_t(m.attn_width(block)), NH = uint64_t(m.heads(block));
    const uint64_t W = A + 2 * uint64_t(m.kv_width(block));
    return dtype_size(dt) * (N * W + N * A + 2 * N * C + 2 * N * H) +
           dtype_size(stat_dtype(dt)) * (2 * N + N * NH);
  }
  const uint64_t A = uint64_t(m.attn_width(block));
  // residual, out: 2·N·C; qkv (3) and attention out: 4·N·A; fc: N·H (10·N·C unpruned; the
  // LayerNorm and GELU outputs are computed again in backward); four (B, T) LayerNorm statistics
  // in the statistics' dtype; and what the attention keeps for its heads: the (B, NH, T) row
  // log-sum-exp in the statistics' dtype when tiled, the (B, NH, T, T) probabilities in the
  // compute dtype when naive.
  const uint64_t NH = uint64_t(m.heads(block));
  const bool tiled = m.attention != "naive";
  return dtype_size(dt) * (2 * N * C + 4 * N * A + N * H + (tiled ? 0 : N * NH * T)) +
         dtype_size(stat_dtype(dt)) * (4 * N + (tiled ? N * NH : 0));
}

uint64_t gpt_block_cheap_activation_bytes(const ModelConfig& m, int B, int T, Dtype dt, int block) {
  // What the blocks save as cheap (Layer::save's `cheap`): the attention's output and what the
  // attention keeps besides it (save_attention), in the same dtypes as
  // gpt_block_activation_bytes counts them.
  const uint64_t N = uint64_t(B) * T, NH = uint64_t(m.heads(block));
  if (m.llama())
    return dtype_size(dt) * N * uint64_t(m.n_embd) + dtype_size(stat_dtype(dt)) * N * NH;
  const uint64_t A = uint64_t(m.attn_width(block));
  const bool tiled = m.attention != "naive";
  return dtype_size(dt) * (N * A + (tiled ? 0 : N * NH * T)) +
         (tiled ? dtype_size(stat_dtype(dt)) * N * NH : 0);
}

}  // namespace headroom
