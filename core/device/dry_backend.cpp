#include "core/device/dry_backend.h"

namespace headroom {

namespace {

class DryBackend final : public Backend {
 public:
  explicit DryBackend(Backend& real) : real_(real) {}

  // --- computing ops: nothing -------------------------------------------------------------------
  void embedding_forward(Dtype, void*, const int32_t*, const void*, const void*, int, int,
                         int) override {}
  void embedding_backward(Dtype, void*, void*, const void*, const int32_t*, int, int,
                          int) override {}
  void layernorm_forward(Dtype, void*, void*, void*, const void*, const void*, const void*, int,
                         int) override {}
  void layernorm_backward(Dtype, void*, void*, void*, const void*, const void*, const void*,
                          const void*, const void*, int, int, Grad, const void*) override {}
  void matmul_forward(Dtype, void*, const void*, const void*, const void*, int, int, int) override {
  }
  void matmul_backward(Dtype, void*, void*, void*, const void*, const void*, const void*, int, int,
                       int, Grad) override {}
  void attention_forward(Dtype, void*, void*, const void*, int, int, int, int) override {}
  void attention_backward(Dtype, void*, void*, const void*, const void*, const void*, int, int, int,
                          int) override {}
  uint64_t attention_scratch_numel(int B, int T, int NH) const override {
    return real_.attention_scratch_numel(B, T, NH);  // a size: the workspace is allocated alike
  }
  void attention_tiled_forward(Dtype, void*, void*, const void*, int, int, int, int) override {}
  void attention_tiled_backward(Dtype, void*, const void*, const void*, const void*, const void*,
                                int, int, int, int) override {}
  void attention_decode(Dtype, void*, const void*, int, int, int) override {}
  bool llama_ops() const override { return true; }  // nothing to compute: any arch runs dry
  void rmsnorm_forward(Dtype, void*, void*, const void*, const void*, int, int, double) override {}
  void rmsnorm_backward(Dtype, void*, void*, const void*, const void*, const void*, const void*,
                        int, int, Grad, const void*) override {}
  void swiglu_forward(Dtype, void*, const void*, int, int) override {}
  void swiglu_backward(Dtype, void*, const void*, const void*, int, int, Grad) override {}
  void rope_forward(Dtype, void*, int, int, int, int, int, const RopeParams&) override {}
  void rope_backward(Dtype, void*, int, int, int, int, int, const RopeParams&) override {}
  void attention_gqa_forward(Dtype, void*, void*, const void*, int, int, int, int, int) override {}
  void attention_gqa_backward(Dtype, void*, const void*, const void*, const void*, const void*, int,
                              int, int, int, int) override {}
  void dequantize(Dtype, void*, const void*, QuantKind, bool, uint64_t) override {}
  void dropout(Dtype, void*, const void*, uint64_t, double, uint64_t) override {}
  void gelu_forward(Dtype, void*, const void*, uint64_t) override {}
  void gelu_backward(Dtype, void*, const void*, const void*, uint64_t, Grad) override {}
  void add_inplace(Dtype, void*, const void*, uint64_t) override {}
  void crossentropy_forward_backward(Dtype dt, void*, void* losses, const int32_t*, int N, int,
                                     double) override {
    real_.fill(stat_dtype(dt), losses, uint64_t(N), 0.0);  // a finite loss: the normal path
  }
  void adamw_update(float*, const float*, float*, float*, uint64_t, float, float, float, float,
                    float, int64_t) override {}
  void sgd_update(float*, const float*, float*, uint64_t, float, float, float) override {}
  void adamw_update_stored(const Stored&, void*, const void*, void*, void*, uint64_t, float, float,
                           float, float, float, int64_t) override {}
  void sgd_update_stored(const Stored&, void*, const void*, void*, uint64_t, float, float,
                         float) override {}
  void scale(Dtype, void*, uint64_t, double) override {}
  void axpy(Dtype, void*, const void*, uint64_t, double) override {}
  void binary(BinaryOp, Dtype, void*, const void*, const void*, uint64_t) override {}
  void unary(UnaryOp, Dtype, void*, const void*, uint64_t) override {}
  void lerp(Dtype, void*, const void*, const void*, float, uint64_t) override {}
  void affine(Dtype, void*, const void*, float, float, uint64_t) override {}
  void accumulate(float*, const void*, Dtype, uint64_t) override {}
  double sum_squares(Dtype, const void*, uint64_t) override {
    count_host_sync();
    return 0.0;
  }
  bool any_nonfinite(Dtype, const void*, uint64_t) override {
    count_host_sync();
    return false;
  }
  double sum_squares_many(const std::vector<Span>&) override {
    count_host_sync();
    return 0.0;
  }
  bool any_nonfinite_many(const std::vector<Span>&) override {
    count_host_sync();
    return false;
  }

  // --- values: nothing ---------------------------------------------------------------------------
  // Filling, casting, copying and uploading place no memory: they only write values, which a dry
  // run never reads. Skipped, they leave the buffers untouched, so the CPU device's dry buffers
  // (mapped without backing) commit no host memory: the weights' upload, the optimizer's zeroed
  // state, the casts of amp's copies and zero's shard copies cost nothing.
  void fill(Dtype, void*, uint64_t, double) override {}
  void cast(void*, Dtype, const void*, Dtype, uint64_t) override {}
  void copy(void*, const void*, uint64_t) override {}
  void upload(void*, const void*, uint64_t) override {}

  // --- memory: the real backend's ---------------------------------------------------------------
  void download(void* dst, const void* src, uint64_t bytes) override {
    if (bytes > 0) count_host_sync();  // as the backends count it
    real_.download(dst, src, bytes);
  }
  void synchronize() override {
    count_host_sync();
    real_.synchronize();
  }
  void mark_uploads(int slot) override { real_.mark_uploads(slot); }
  void wait_uploads(int slot) override {
    // The wrapped backend counts its own waits; the run reads this table's count.
    const uint64_t before = real_.host_syncs();
    real_.wait_uploads(slot);
    if (real_.host_syncs() != before) count_host_sync();
  }
  void* host_alloc(uint64_t bytes) override { return real_.host_alloc(bytes); }
  void host_free(void* ptr) override { real_.host_free(ptr); }
  void* native_stream() override { return real_.native_stream(); }
  std::string describe() const override { return real_.describe() + " (dry: no arithmetic)"; }

 private:
  Backend& real_;
};

}  // namespace

std::unique_ptr<Backend> make_dry_backend(Backend& real) {
  return std::make_unique<DryBackend>(real);
}

}  // namespace headroom
