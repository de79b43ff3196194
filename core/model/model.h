// GPT-2 as a list of layers — embedding, n_layer transformer blocks, head — each owning its
// parameters and the activations it saves for backward, so a strategy can drop a layer's
// activations and recompute them.
//
// The model is a template over the element type of its master parameters and their accumulated
// gradients: float for training, double for gradient checks. Everything the layers compute —
// activations, and the compute copies of the parameters with their per-micro-step gradients — is
// in the model's compute dtype: T's own (f32, f64), or bf16 / f16 when a plugin (amp) asks for
// them. All of it runs on the device's op table (core/device/backend.h), so the one model trains on
// the CPU and on CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"

namespace headroom {

// One micro-batch as the layers see it.
struct Batch {
  const int32_t* tokens = nullptr;   // (B, T)
  const int32_t* targets = nullptr;  // (B, T); a target < 0 is ignored
  int B = 0;
  int T = 0;
  double dloss = 0.0;  // d(objective)/d(per-token loss): 1 / (B·T·grad_accum) times the loss scale
  // A training micro-step's dropout draws (LoRA's lora_dropout: kernels/common/dropout.h): each
  // layer's from this; 0 draws nothing (evaluation, or no dropout configured).
  uint64_t dropout_seed = 0;
  // The targets in host memory, for counting the tokens of the loss; null when `targets` is host
  // memory itself (the CPU backend).
  const int32_t* host_targets = nullptr;
};

// The dtype of a native element type.
template <class T>
constexpr Dtype dtype_of();
template <>
constexpr Dtype dtype_of<float>() {
  return Dtype::kF32;
}
template <>
constexpr Dtype dtype_of<double>() {
  return Dtype::kF64;
}

// How the model state is laid out around the compute dtype: amp's choices (headroom.precision/1),
// checked by precision_problem(). The default is T's own dtype throughout.
struct Precision {
  Dtype compute = Dtype::kF32;  // what the layers compute in and read: T's own, or bf16 / f16
  // With a compute dtype other than T's: the gradients accumulate over the step's micro-steps in
  // the compute dtype (DeepSpeed's layout: no T-typed gradients at all), instead of in T with
  // each layer's compute-dtype gradients living only through its backward.
  bool grad_in_compute = false;
  // T-typed master weights beside the compute copies; without them the weights exist only in
  // the compute dtype (bf16), and the optimizer rounds its updates stochastically.
  bool masters = true;
  Dtype state = Dtype::kF32;  // the built-in optimizers' state: f32 or bf16
  Precision() = default;
  Precision(Dtype c) : compute(c) {}  // NOLINT(google-explicit-constructor): T's layout in c
};
// What is wrong with `p` for a model with f32 masters, in words ("" when nothing): grad_in_compute
// and masters = false need a compute copy, masters = false needs bf16, state is f32 or bf16.
std::string precision_problem(const Precision& p);

// A layer's parameters, one contiguous buffer per kind (a flat parameter, as FSDP's FlatParameter
// and DeepSpeed's contiguous buffers): every Param is a view at its offset. `padded` elements
// (numel rounded up to a multiple of the world size when the run shards, else numel) so that each
// rank's range is the same size; the padding is zero and never read by a layer.
struct FlatStorage {
  Buffer value;    // the masters (T), what the optimizer updates; none without masters
  Buffer grad;     // their gradients (T), accumulated over the step's micro-steps; none when they
                   // accumulate in the compute dtype
  Buffer compute;  // compute copies (the compute dtype), only with one other than T's
  // The compute copies' gradients: one micro-step's, made at the layer's backward and added into
  // `grad` at its end; or, accumulating in the compute dtype, the step's (there is no `grad`).
  Buffer compute_grad;
  uint64_t numel = 0;   // the layer's parameter elements
  uint64_t padded = 0;  // numel rounded up to a multiple of the ranks sharing it
};

template <class T>
struct Param {
  std::string name;            // Hugging Face GPT-2 name: "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // ours is (out, in) for matrices, as llm.c
  bool decay = false;          // weight decay applies: matrices and embeddings, not biases or gains
  // Frozen ([train] freeze): no gradient, no optimizer state, no master beside a compute copy
  // (with compute copies the weights are the compute copy alone); it lives in its layer's frozen
  // storage (Layer::frozen_flat), apart from the trainable parameters' flat buffers, and the
  // layer's backward computes no gradient for it (the GEMM's weight gradient is skipped).
  bool frozen = false;
  // A frozen weight stored quantized (a LoRA plugin's base_dtype): its bytes at `quant_offset` of
  // its layer's quantized storage (Layer::quantized_bytes), in kernels/common/quant.h's layout;
  // its values (master() in T) exist only around an access to the model whole
  // (Gpt::master_access), and a GEMM reads a transient dequantized copy. kNone: not quantized.
  QuantKind quant = QuantKind::kNone;
  uint64_t quant_offset = 0;
  uint64_t numel = 0;
  uint64_t offset = 0;                // elements from the start of its layer's flat buffers
  const FlatStorage* flat = nullptr;  // its layer's
  Dtype compute_dtype = dtype_of<T>();
  // The three copies a parameter has, each its values and gradient (either nullptr where there is
  // none: a buffer released while sharded, no masters, gradients accumulated in the compute dtype)
  // with their dtypes.
  template <class V>
  struct Copy {
    V* value = nullptr;
    V* grad = nullptr;
    Dtype dtype = dtype_of<T>();
    Dtype grad_dtype = dtype_of<T>();
  };
  // The masters (T) and their gradients, accumulated over the step's micro-steps.
  Copy<T> master() const {
    return {flat->value ? flat->value.as<T>() + offset : nullptr,
            flat->grad ? flat->grad.as<T>() + offset : nullptr, dtype_of<T>(), dtype_of<T>()};
  }
  // What the layers read and write: the compute copy and its gradient where there is one, else
  // the master's.
  Copy<void> compute() const {
    const Copy<T> m = master();
    const size_t at = offset * dtype_size(compute_dtype);
    return {flat->compute ? flat->compute.as<char>() + at : static_cast<void*>(m.value),
            flat->compute_grad ? flat->compute_grad.as<char>() + at : static_cast<void*>(m.grad),
            flat->compute ? compute_dtype : dtype_of<T>(),
            flat->compute_grad ? compute_dtype : dtype_of<T>()};
  }
  // What the optimizer updates — the master, or without masters the compute-dtype weights — and
  // what it reads: the step's accumulated gradient, in T or (accumulated in the compute dtype) in
  // that dtype.
  Copy<void> optimized() const {
    const Copy<T> m = master();
    const Copy<void> c = compute();
    return {flat->value ? static_cast<void*>(m.value) : c.value,
            flat->grad ? static_cast<void*>(m.grad) : c.grad,
            flat->value ? dtype_of<T>() : compute_dtype,
            flat->grad ? dtype_of<T>() : compute_dtype};
  }
};

// One parameter shrunk along one axis (structured pruning, headroom.resize/1): the elements
// `keep` names along `axis` stay, in order; everything else of it goes.
struct ParamResize {
  size_t param = 0;  // its index in Gpt::params() (and in whole_params' segments)
  int layer = 0;     // its layer, and its index there (layer_param's)
  int index = 0;
  std::string name;
  std::vector<int64_t> old_shape, new_shape;
  int axis = 0;                // 0: rows (the first dimension); 1: columns (the last, of a matrix)
  std::vector<uint32_t> keep;  // ascending, within old_shape[axis]
};
// Copies the kept part of a row-major tensor of `old_shape` (1 or 2 dimensions) with elements of
// `elem` bytes from `src` to `dst` (new_shape's elements).
void gather_kept(const ParamResize& r, const void* src, void* dst, size_t elem);

// Where a low-rank adapter (LoRA, Hu et al. 2021) can sit: one linear module of Hugging Face's,
// the rows [row0, row0 + rows) of one of our GEMMs' outputs (a fused GEMM holds several: a Llama's
// q_proj, k_proj and v_proj are rows of self_attn.qkv_proj), whose input has `in` features.
struct AdapterSite {
  int layer = 0;
  std::string module;  // "h.0.attn.c_attn", "model.layers.0.self_attn.q_proj"
  std::string weight;  // our parameter: "h.0.attn.c_attn.weight", "...self_attn.qkv_proj.weight"
  int64_t row0 = 0, rows = 0, in = 0;
};
// Every site of the model of `m`, block by block (GPT-2: attn.c_attn, attn.c_proj, mlp.c_fc,
// mlp.c_proj; Llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).
std::vector<AdapterSite> gpt_adapter_sites(const ModelConfig& m);
// One entry of PEFT's target_modules: the sites whose module is `target` or ends with "." target
// ("c_proj" is both GPT-2 projections, "attn.c_proj" the attention's alone); PEFT's "all-linear"
// (kAllLinear) is every site: each linear module of the blocks, not the LM head.
constexpr const char* kAllLinear = "all-linear";
bool lora_target_matches(const std::string& target, const std::string& module);
// LoRA on the modules `target` names: y += (alpha / rank) · B (A x), A (rank, in) initialised as
// PEFT does (Kaiming-uniform with a = sqrt(5): uniform in ±1/sqrt(in)), B (rows, rank) zero.
// Their parameters are "<module>.lora_A.weight" and "<module>.lora_B.weight"; everything else of
// the model is frozen.
struct LoraSpec {
  std::string target;
  int rank = 8;
  double alpha = 8;
  double dropout = 0;  // PEFT's lora_dropout on the adapter's input, in training; [0, 1)
};
// What a run trains of the model: every parameter, or all but those [train] freeze names, or
// only the adapters a plugin adds (headroom.adapters/1).
struct Tuning {
  std::vector<std::string> freeze;  // Hugging Face name globs (freeze_matches)
  std::vector<LoraSpec> lora;
  // With adapters: how the frozen linear weights of the blocks (every AdapterSite's weight, as
  // bitsandbytes quantizes every nn.Linear but the LM head) are stored — kNone: as the other
  // frozen parameters; bf16, int8 (bitsandbytes' dynamic 8-bit, blocks of 256) or nf4 (blocks
  // of 64), with the absmaxes quantized again when double_quant. Embeddings, norms and biases
  // stay as they are. Only for an f32 model (std::invalid_argument otherwise).
  QuantKind base = QuantKind::kNone;
  bool double_quant = false;
  bool empty() const { return freeze.empty() && lora.empty(); }
};
// "bf16", "int8", "nf4" (and "f32" or "": kNone); std::invalid_argument for anything else.
QuantKind parse_base_dtype(const std::string& s);
const char* quant_kind_name(QuantKind k);
// The bytes the quantized weights of a LoRA run's base take in the parameters category: every
// frozen block weight at an adapter site, each quant_tensor_bytes of its elements. 0 for kNone.
uint64_t gpt_quantized_base_bytes(const ModelConfig& m, QuantKind k, bool double_quant);
// Whether parameter `name` of the model of `m` is a weight a quantized base stores quantized.
bool is_quantizable_weight(const ModelConfig& m, const std::string& name);
// The adapters `lora` puts on the model of `m`, in the order the model adds them (spec by spec,
// site by site): a site two targets name gets one, the first's rank and dropout.
struct LoraAdapter {
  AdapterSite site;
  int rank = 0;
  double alpha = 0, dropout = 0;
};
std::vector<LoraAdapter> gpt_lora_adapters(const ModelConfig& m, const std::vector<LoraSpec>& lora);
// std::invalid_argument, saying what is valid, for a rank below 1, an alpha that is not finite and
// > 0, or a target that names no module of the model of `m`.
void check_lora(const ModelConfig& m, const LoraSpec& spec);
// Whether `name` is an adapter's parameter ("....lora_A.weight", "....lora_B.weight").
bool is_adapter_param(const std::string& name);

// One tensor a layer keeps from forward for backward.
struct SavedActivation {
  Buffer buffer;
  std::string what;  // "qkv (B, T, 3C)"
  uint64_t numel = 0;
  Dtype dtype = Dtype::kF32;  // the compute dtype, or the statistics' (LayerNorm mean and rstd)
  // Cheap to recompute from the tensors the layer keeps (LayerNorm, softmax, GELU outputs): a
  // selective drop frees it, Layer::recompute_cheap() makes it again.
  bool cheap = false;
  // In the host place's ledger (the output moved there by Layer::move_output), not the device's.
  bool on_host = false;
};

// What drop_activations frees (the values are the C ABI's HR_DROP_ALL and HR_DROP_CHEAP).
enum class Drop : uint32_t {
  kAll = 0,    // everything but the output; backward re-runs the whole forward
  kCheap = 1,  // only the tensors saved as cheap; backward recomputes just those (no GEMMs)
};

// The most bytes of T values the model's init holds at a time for one parameter
// (Layer::write_init): the bound on setup's f32 transient of a frozen weight kept in the compute
// dtype alone. 16 MiB unless set; a test sets it lower to run the chunks on a small model.
uint64_t frozen_init_chunk_bytes();
void set_frozen_init_chunk_bytes(uint64_t bytes);

template <class T>
class Layer {
 public:
  Layer(std::string name, Device& device, const Precision& precision)
      : name_(std::move(name)), device_(device), dt_(precision.compute), precision_(precision) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<std::unique_ptr<Param<T>>>& params() const { return params_; }
  // The trainable parameters' flat buffers (empty, numel 0, when every parameter is frozen).
  const FlatStorage& flat() const { return flat_; }
  // The frozen parameters' storage: their weights (`value` in T without compute copies, else
  // `compute` in the compute dtype alone), never gradients; numel 0 when none is frozen.
  const FlatStorage& frozen_flat() const { return frozen_; }
  // Moves every parameter `frozen` says yes to into the frozen storage (Param::frozen), the others
  // staying in the flat buffers in order. Before allocate_params; std::logic_error after.
  void freeze(const std::function<bool(const std::string&)>& frozen);
  bool has_frozen() const { return frozen_.numel > 0 || quant_.numel > 0; }
  // Stores the frozen parameters `which` says yes to quantized as `kind` (Param::quant): after
  // freeze, before allocate_params (std::logic_error otherwise). Their init is written quantized
  // (write_init).
  void quantize_frozen(const std::function<bool(const std::string&)>& which, QuantKind kind,
                       bool double_quant);
  bool has_quantized() const { return quant_.numel > 0; }
  // The quantized weights' T values (a model-whole access: Gpt::master_access), made when absent.
  // The init writes none: write_init quantizes each weight's values on the host.
  void allocate_quant_masters();
  // Quantizes the quantized weights' T values on the host into their storage and frees the
  // values. A weight whose values are those its codes already give keeps its codes, so a write
  // of what was read (a snapshot's resume on the same base) changes no bit.
  void quantize_params();
  // Dequantizes them into their T values (made when absent), for a reader of the model whole.
  void dequantize_params();
  void release_quant_masters() { quant_.value.reset(); }
  uint64_t quantized_bytes() const { return quant_bytes_; }
  // The quantized weights' storage (quantized_padded_bytes(): quantized_bytes() rounded up to a
  // multiple of 4 · ranks when allocate_params pads for ranks > 1, the padding zero); empty
  // while released.
  const Buffer& quantized_storage() const { return qdata_; }
  uint64_t quantized_padded_bytes() const { return quant_padded_; }
  // Sharded parameters (zero3) cover the frozen weights too (core/shard/sharding.h): their
  // storage — frozen_flat()'s weights (padded) and the quantized bytes — exists only while the
  // layer is gathered. release_frozen frees it; allocate_frozen makes it again (its contents
  // undefined until a gather fills it) when absent.
  void release_frozen();
  void allocate_frozen();
  // The frozen weights' buffer, in the compute dtype: the compute copy where there is one, else
  // the T values (empty while released).
  const Buffer& frozen_weights() const { return frozen_.compute ? frozen_.compute : frozen_.value; }
  // Every parameter element of the layer, trainable and frozen (quantized ones included).
  uint64_t num_params() const;
  // Adds a low-rank adapter at `site` (one of this layer's): its A and B as parameters at the end
  // of the flat buffers. Before allocate_params. init_adapters() gives them PEFT's init.
  void add_adapter(const AdapterSite& site, int rank, double scale, double dropout = 0);
  // A uniform in ±1/sqrt(in) from `rng_seed`'s stream, B zero: into the masters (T values).
  void init_adapters(uint64_t rng_seed);
  bool has_adapters() const { return !adapters_.empty(); }
  // This micro-step's dropout draws (Batch::dropout_seed mixed with the layer's index; 0: none).
  void set_dropout_seed(uint64_t seed) { dropout_seed_ = seed; }

  // Writes p's init (p one of this layer's parameters): `draw(values, n)` gives its next n values
  // in element order, at most frozen_init_chunk_bytes() of them at a time. Into its master; for a
  // frozen parameter with a compute copy alone (no T values, allocate_params), through an f32
  // transient of at most that many bytes (workspace) that the device's cast writes into the
  // compute copy, a chunk at a time (the bytes of a cast of the whole tensor); for a quantized
  // weight, quantized on the host into its bytes (as quantize_params would its values). A dry run
  // draws nothing and holds the same transient. Virtual only so that the loaders' upload_params
  // (core/model/safetensors.cpp, whose fuzz target links without model.cpp) reach it through the
  // layer instead of by its symbol.
  virtual void write_init(Param<T>& p, const std::function<void(T*, uint64_t)>& draw);

  // Allocates the flat buffers of the parameters the constructor added (zeroed gradients, unless
  // `grads` is false: sharded gradients are made by ensure_grads when the backward needs them),
  // with numel rounded up to a multiple of `ranks` (1: no padding), and the frozen storage: T
  // values without compute copies, else the compute copy alone, padded the same; the quantized
  // weights' bytes (rounded up to a multiple of 4 · ranks when ranks > 1, for zero3's gather). Gpt
  // calls it once per layer, just before the layer's init.
  void allocate_params(uint64_t ranks, bool grads = true);
  // Sharded gradients (zero2, zero3): the full gradients of the layer exist only while it runs
  // its backward. release_grads frees them (master and compute); ensure_grads makes them again,
  // zeroed, when released. has_grads: they exist.
  void release_grads();
  void ensure_grads();
  // The tied embedding's full gradients between the head's backward, which adds into them, and
  // the embedding's (Gpt::set_gradient_park): park_grads moves them (master and compute) into
  // `host`'s ledger and frees them on the device; ensure_grads brings them back, into new device
  // buffers, bitwise; drop_parked_grads forgets them (zero_grad).
  void park_grads(Device& host);
  void drop_parked_grads();
  bool grads_parked() const { return bool(parked_grad_) || bool(parked_compute_grad_); }
  bool has_grads() const {
    return flat_.numel == 0 || bool(flat_.grad) ||
           (precision_.grad_in_compute && flat_.compute_grad);
  }
  // The compute-dtype gradients of one micro-step (gradients accumulated in T): made, zeroed,
  // before the layer's backward (layer 0's before the head's: the tied wte) and freed once added
  // into the T-typed ones (Gpt::backward). Nothing to do otherwise.
  void make_compute_grads();
  void release_compute_grads();
  // Sharded parameters (zero3): the layer's full masters and compute copy exist only while
  // gathered. release_parameters frees both; allocate_masters / allocate_compute make one again
  // (its contents undefined until a gather or a load fills it) when absent. A released layer's
  // Param::data() and cdata() are nullptr.
  void release_parameters();
  void release_masters();  // the masters alone: a whole compute copy stays (amp, zero1/zero2)
  void allocate_masters();
  // The frozen parameters' T-typed values beside their compute copy, made around an access to
  // the model whole (Gpt::master_access) and released after: frozen weights have no masters.
  void allocate_frozen_masters();
  void release_frozen_masters();
  void allocate_compute();
  Dtype compute_dtype() const { return dt_; }
  const Precision& precision() const { return precision_; }
  // Shrinks the parameters `changes` names (their `index`) to their new_shape, keeping the
  // elements each names; the others move to their new offsets. Every slot the layer has (masters,
  // compute copy, gradients of either dtype) is read to the host, freed, and made again at the
  // new size in its category — so the device never holds both sizes — with the kept elements.
  // Whole layers only: std::logic_error for one padded for sharding, or while it holds
  // activations.
  void shrink_params(const std::vector<ParamResize>& changes);

  // Tensors are device memory of the compute dtype.
  // input (B, T, C) is the previous layer's output (unused by the embedding). Saves what backward
  // needs and, except for the head, leaves its output (B, T, C) in output().
  virtual void forward(const void* input, const Batch& batch) = 0;
  // dout (B, T, C) -> dinput (B, T, C), overwritten; parameter gradients (Param::cgrad)
  // accumulate. The head takes no dout (its gradient starts at the loss); the embedding writes no
  // dinput.
  virtual void backward(void* dinput, const void* dout, const void* input, const Batch& batch) = 0;
  virtual const void* output() const { return nullptr; }

  // Frees every activation this layer saved (and forgets a pending recomputation).
  void release_activations() {
    saved_.clear();
    recompute_ = Recompute::kNone;
  }
  uint64_t saved_bytes() const;
  const std::vector<SavedActivation>& saved() const { return saved_; }
  // Activation offload (headroom.offload/1's activation place): the saved tensor holding
  // output() moved into `host`'s ledger (the host place), or back onto the layer's device when
  // `host` is null; output() follows it. Nothing when the layer holds no output or it is there
  // already. A copy through the device's backend, waited for.
  void move_output(Device* host);
  // Fills saved tensor `index` now if the layer fills it later than its forward, for a reader
  // between forward and backward (a plugin's layer_activation): the chunked head's per-token
  // losses, which its backward computes. Computing them early costs what the forward of the
  // full loss would (the chunks' logits again, a (chunk, V) workspace), and only when asked. The
  // other tensors are whole after forward: nothing to do. False when it is not filled and
  // `may_allocate` is false (a reader inside an allocation, which must not start another).
  virtual bool fill_saved(size_t index, bool may_allocate) {
    (void)index;
    (void)may_allocate;
    return true;
  }

  // Activation recomputation. A layer that can be recomputed (a transformer block: its forward
  // needs nothing but its input and its parameters) may drop every saved tensor after its forward
  // except its output, the next layer's input; backward then runs its forward again from its
  // input before its own backward. The embedding and the head cannot: their output is all they
  // would keep, or nothing is left to drop.
  virtual bool recomputable() const { return false; }
  //
  // Drop::kAll keeps only the tensor holding output(); Drop::kCheap (selective recomputation,
  // Korthikanti et al. 2022) also keeps every tensor not saved as cheap — for a block the GEMM
  // outputs — and frees the rest, which recompute_cheap() rebuilds from what was kept. Marks the
  // layer for recomputation. Dropping again is harmless; kAll after kCheap drops the rest too,
  // kCheap after kAll changes nothing. Throws std::logic_error for a layer that is not
  // recomputable or holds no activations.
  void drop_activations(Drop what = Drop::kAll);
  bool needs_recompute() const { return recompute_ != Recompute::kNone; }
  // Rebuilds what drop_activations freed, from `input` (the previous layer's output), before
  // backward. The output is freed first in either case: backward reads dout, never the output,
  // so the recomputation holds one tensor less.
  void recompute(const void* input, const Batch& batch);

 protected:
  // A parameter at the end of the layer's flat buffers (allocated later, by allocate_params).
  Param<T>& add_param(const std::string& name, std::vector<int64_t> shape, bool decay);
  // A saved activation of `numel` elements of the compute dtype (or `dtype`), alive until
  // release_activations(). `cheap`: see SavedActivation::cheap.
  void* save(uint64_t numel, const char* what, bool cheap = false);
  void* save(uint64_t numel, const char* what, bool cheap, Dtype dtype);
  // Re-saves the cheap tensors after a Drop::kCheap and recomputes them from the kept ones with
  // the forward's kernels. Only a layer that saves cheap tensors is ever asked to.
  virtual void recompute_cheap(const void*, const Batch&) {}
  // The tensor output() returns moved to `now` (move_output). Every layer with an output.
  virtual void relocate_output(void* now) { (void)now; }
  // A scratch buffer of the compute dtype for backward, freed when the Buffer goes out of scope.
  Buffer workspace(uint64_t numel, const char* what);
  // A linear layer's GEMM and its adapters: out (N, OC) = inp (N, C) · w^T + b, plus each
  // adapter's (alpha / r) · B (A inp) on its rows. Its backward: the GEMM's (Grad `mode` for dinp;
  // no weight gradient for a frozen w), then each adapter's A and B gradients and its part of
  // dinp (added). The adapters keep nothing from forward: A inp (N, r) is computed again.
  void linear_forward(void* out, const void* inp, const Param<T>& w, const Param<T>* b, uint64_t N,
                      int C, int OC);
  void linear_backward(void* dinp, const void* dout, const void* inp, const Param<T>& w,
                       const Param<T>* b, uint64_t N, int C, int OC, Grad mode);
  Backend& ops() { return device_.backend(); }

  std::string name_;
  Device& device_;
  Dtype dt_;  // the compute dtype
  Precision precision_;
  std::vector<std::unique_ptr<Param<T>>> params_;
  FlatStorage flat_;
  FlatStorage frozen_;                        // the frozen parameters' weights
  Buffer parked_grad_, parked_compute_grad_;  // park_grads: flat_'s grad and compute_grad
  std::string grad_name() const;
  std::string compute_grad_name() const;
  // The quantized frozen weights: their T values only while made (master_access), and
  // their quantized bytes, every weight's at its Param::quant_offset.
  FlatStorage quant_;
  Buffer qdata_;
  uint64_t quant_bytes_ = 0;
  uint64_t quant_padded_ = 0;  // qdata_'s bytes: quant_bytes_ padded for the ranks
  QuantKind quant_kind_ = QuantKind::kNone;
  bool double_quant_ = false;
  // w's values for a GEMM: its compute copy, or for a quantized w a transient dequantized one
  // in `buf` (the compute dtype, workspace).
  const void* gemm_weight(const Param<T>& w, Buffer& buf, const char* what);
  struct Adapter {
    const Param<T>* weight;
    int64_t row0, rows, rank;
    double scale;
    Param<T>* A;         // (rank, in)
    Param<T>* B;         // (rows, rank)
    double dropout = 0;  // on its input x, in training (dropout_seed_ nonzero)
  };
  // The micro-step's dropout draws of this layer (Gpt sets it from Batch::dropout_seed before each
  // forward, recomputation and backward; 0 in evaluation).
  uint64_t dropout_seed_ = 0;
  // x (N, C) with adapter a's dropout, drawn from the layer's seed and a's place: the same mask in
  // forward and backward, into `buf` (a workspace).
  const void* dropped_input(const Adapter& a, const void* inp, uint64_t N, int C, Buffer& buf);
  // Adapter a's draws this micro-step: the layer's seed mixed with a's place.
  uint64_t adapter_seed(const Adapter& a) const;
  std::vector<Adapter> adapters_;
  // B scaled by `scale` in the GEMM's (OC, rank) layout (zero outside its rows), in `buf`.
  void scaled_b(const Adapter& a, int OC, Buffer& buf);
  std::vector<SavedActivation> saved_;
  // Dropped after forward: backward runs forward again (kAll) or recompute_cheap (kCheap) first.
  enum class Recompute { kNone, kAll, kCheap };
  Recompute recompute_ = Recompute::kNone;
};

// Layer l's forward and backward, announced around each call (the trainer turns them into
// FORWARD_BEGIN/END and BACKWARD_BEGIN/END).
class LayerEvents {
 public:
  virtual ~LayerEvents() = default;
  virtual void forward_begin(int layer) = 0;
  virtual void forward_end(int layer) = 0;
  virtual void backward_begin(int layer) = 0;
  virtual void backward_end(int layer) = 0;
};

template <class T>
class Gpt {
 public:
  // Allocates parameters and gradients on `device` and initialises the parameters as GPT-2 does
  // (normal 0.02, residual projections scaled by 1/sqrt(2·n_layer)), deterministically from seed.
  // `compute`: the dtype the layers compute in — T's own, or bf16 / f16 for a float model, which
  // then also holds compute copies of the parameters and their gradients (Param::compute).
  // Throws std::invalid_argument for another combination.
  // `shard_ranks`: the ranks each layer's flat buffers are partitioned over (its numel padded to a
  // multiple of it); 1 when nothing is sharded. `grads_on_demand` (sharded gradients): no full
  // gradients until a layer's backward makes them (Layer::ensure_grads).
  // `placed`, when set, gets each layer as soon as it is allocated and initialised, in order, the
  // next layer not yet allocated (core/shard/sharding.h keeps only its shard of a layer's
  // parameters, so the whole model never exists at once).
  // `tuning`: the parameters [train] freeze's globs match are frozen (Param::frozen); with LoRA
  // adapters (tuning.lora) every parameter but theirs is. std::invalid_argument for a LoRA target
  // that names no module of the model.
  Gpt(const ModelConfig& config, Device& device, uint64_t seed,
      const Precision& precision = Precision(dtype_of<T>()), uint64_t shard_ranks = 1,
      bool grads_on_demand = false, const std::function<void(Layer<T>&)>& placed = nullptr,
      const Tuning& tuning = {});
  ~Gpt();

  // Every layer's forward, for training: backward follows, and the loss is known once the head's
  // backward has run (the chunked loss computes the logits once, there; loss()).
  void forward(const Batch& batch, LayerEvents* events = nullptr);
  // Forward only, for evaluation: the mean loss over the batch's tokens, touching no gradient.
  // A block keeps only its output once its forward is done, and that goes once the next layer
  // has read it: one layer's activations and the output before it live at once, never more than
  // a training forward holds at that layer. No events fire.
  double evaluate(const Batch& batch);
  // The last micro-batch's mean loss over its (non-ignored) tokens, and those tokens: from the
  // head's backward on (the top layer's backward_end), or from the head's forward in evaluate().
  double loss() const;
  uint64_t loss_tokens() const;
  // Every layer's backward, last to first, accumulating into the gradients and freeing each
  // layer's activations as soon as it is done. A layer whose activations were dropped runs its
  // forward again from its input (the previous layer's output) right after backward_begin: the
  // same kernels on the same inputs, so its saved tensors are bitwise the originals; a layer that
  // dropped only its cheap tensors recomputes just those. No forward_* events fire for the
  // recomputation (its allocations do).
  void backward(const Batch& batch, LayerEvents* events = nullptr);
  // Activation offload (headroom.offload/1's activation place; null, the default: none): each
  // layer's output, which the next layer reads in its forward and again in its backward, waits
  // between the two in `host`'s ledger — moved there once the next layer's forward is done, back
  // when the backward reaches the layer above the next (one layer ahead of its use). The last
  // block's output, the head's input, stays: the head's backward follows its forward at once.
  void set_activation_place(Device* host) { activation_host_ = host; }
  // The tied embedding's gradient parked (null, the default: not): with sharded gradients a
  // layer's full gradients live only around its backward, but the embedding's are made before the
  // head's (the head adds into the tied wte) and would live through every block's. Parked, they
  // wait in `host`'s ledger from the end of the head's backward to the start of the embedding's
  // (Layer::park_grads), and the blocks' backward holds none of them. An untied head (a
  // Llama's) parks nothing.
  void set_gradient_park(Device* host) { grad_park_ = host; }
  // Layer `layer`'s Layer::drop_activations(), between its forward and its backward. Throws
  // std::logic_error (with the reason) for an index out of range, the embedding or the head, or a
  // layer that holds no activations.
  void drop_activations(int layer, Drop what = Drop::kAll);
  // Zeroes the gradients (master and compute).
  void zero_grad();
  // Casts every master parameter to its compute copy (round to nearest even): after the optimizer
  // updated the masters, or after they were loaded. Nothing to do without compute copies.
  // `written`: layer l is skipped where written[l] (an update wrote its compute copy in its own
  // pass: core/optim's compute_copies_written). Inline, walking the layers:
  // core/model/safetensors.cpp calls it and links without model.cpp (its fuzz target).
  void sync_compute_params(const std::vector<bool>& written = {}) {
    if (!has_compute_copies()) return;
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (l < written.size() && written[l]) continue;
      const FlatStorage& f = layers_[l]->flat();
      if (!f.value || !f.compute) continue;  // sharded parameters: core/shard casts the shards
      device_.backend().cast(f.compute.as<void>(), dt_, f.value.as<void>(), dtype_of<T>(),
                             f.padded);
    }
  }
  Dtype compute_dtype() const { return dt_; }
  bool has_compute_copies() const { return dt_ != dtype_of<T>(); }
  const Precision& precision() const { return precision_; }
  // Without masters: runs f with layer `layer`'s masters made from its compute-dtype weights
  // (exact: bf16 widens to f32 losslessly) when `gather`, and cast back into them when `scatter`
  // (round to nearest even: a loaded f32 value becomes the nearest bf16), one layer at a time.
  // Empty when the model has masters.
  std::function<void(int, const std::function<void()>&)> master_access(bool gather, bool scatter);
  // Frees every layer's saved activations: after a forward that has no backward (evaluation,
  // gradient checks) or an abandoned micro-step.
  void release_activations();
  // An abandoned micro-step (out of memory): its activations, and the compute-dtype gradients a
  // half-done backward made (amp's fp32 accumulation; the step's own bf16 gradients stay).
  void release_micro_step();
  // Structured pruning of block `layer`'s MLP (layers 1 .. n_layer): keeps the hidden units
  // `keep` names (ascending, distinct, within its width, at least one) — their rows of
  // mlp.c_fc.weight and mlp.c_fc.bias, their columns of mlp.c_proj.weight; a Llama's rows j and
  // I + j of mlp.gate_up_proj.weight (gate and up) and column j of mlp.down_proj.weight — and
  // removes the rest from every slot (Layer::shrink_params). The block computes with the new
  // width from its next forward on; config().mlp_hidden says it. Returns what changed, for the
  // optimizer's state. std::invalid_argument for a bad layer or `keep`; std::logic_error for a
  // sharded layer or one that holds activations.
  std::vector<ParamResize> resize_mlp(int layer, const std::vector<uint32_t>& keep);
  // The same for block `layer`'s attention heads: keeps the heads `keep` names — their q, k and v
  // rows of attn.c_attn.weight and its bias, their columns of attn.c_proj.weight — so the block's
  // attention width becomes count · (n_embd / n_head); config().attn_heads says it. A Llama's
  // heads go in whole key/value groups: `keep` must list every query head of each group it keeps
  // (G = n_head / n_kv_head consecutive heads sharing one KV head; std::invalid_argument
  // otherwise), and the block keeps their q rows and the groups' k and v rows of
  // self_attn.qkv_proj.weight and their columns of self_attn.o_proj.weight
  // (config().kv_heads(block) follows).
  std::vector<ParamResize> resize_heads(int layer, const std::vector<uint32_t>& keep);

  const ModelConfig& config() const { return config_; }
  Device& device() const { return device_; }
  const std::vector<std::unique_ptr<Layer<T>>>& layers() const { return layers_; }
  std::vector<Param<T>*> params() const;
  // The parameters that train (params() without the frozen ones): what the optimizer updates.
  std::vector<Param<T>*> trainable_params() const;
  uint64_t num_params() const;
  bool has_frozen() const;
  // The other layer whose parameters layer l's forward and backward read, or -1: the head reads
  // the embedding's token embedding (tied), so the head's is 0.
  // An untied Llama's head reads its own lm_head: -1 for every layer.
  int tied_layer(int layer) const {
    return config_.tied() && layer == int(layers_.size()) - 1 ? 0 : -1;
  }

 private:
  Device* activation_host_ = nullptr;  // set_activation_place
  Device* grad_park_ = nullptr;        // set_gradient_park
  // Each micro-step's gradients in the compute dtype, added into the f32 ones as a layer's
  // backward ends (amp with fp32 accumulation): what accumulate_compute_grads adds.
  bool accumulates_compute_grads() const {
    return has_compute_copies() && !precision_.grad_in_compute;
  }
  // Adds each compute gradient of layer `layer`'s micro-step into its master gradient, in fp32,
  // and zeroes the compute gradient.
  void accumulate_compute_grads(int layer);

  ModelConfig config_;
  Device& device_;
  Dtype dt_;
  Precision precision_;
  std::vector<std::unique_ptr<Layer<T>>> layers_;
};

// Runs f with layer `layer`'s fp32 masters on the device (Param::data() valid): a model whose
// masters are sharded across ranks (core/shard/sharding.h) makes them whole around f, one layer at
// a time; an empty one: they always are.
using MasterAccess = std::function<void(int layer, const std::function<void()>& f)>;

// Closed forms the tests check the tracker against.
// A Llama's rotary embeddings as its config sets them ([model] rope_theta, rope_scaling): what
// its blocks rotate by, in training and in generation.
RopeParams llama_rope_params(const ModelConfig& m);

uint64_t gpt_num_params(const ModelConfig& m);
// Every parameter the model of `m` has, in layer_param's order, without building it (an
// estimate's shapes); tests check it against a built model's.
struct ParamShape {
  int layer;
  std::string name;
  std::vector<int64_t> shape;
  bool decay;
};
std::vector<ParamShape> gpt_param_shapes(const ModelConfig& m);
// Whether Hugging Face parameter name `name` matches glob `pattern` ([train] freeze): `*` any run
// of characters (dots included: "h.*.mlp.*"), `?` one, `[...]` one of a set.
bool freeze_matches(const std::string& pattern, const std::string& name);
// Whether any of `patterns` matches `name`.
bool is_frozen(const std::vector<std::string>& patterns, const std::string& name);
// Checks [train] freeze against the model of `m`: a ConfigError naming the pattern's
// file:line:column for one that matches no parameter (with some of the names it could match),
// and for one that freezes every parameter.
void check_freeze(const ModelConfig& m, const TrainConfig& t);
// The chunked loss's default chunk: at most this many bytes of logits (gpt2's V in fp32: 333
// tokens; 1024 tokens then go in 4 chunks of 256). Smaller chunks cost step time on the CPU: each
// chunk's d(wte) GEMM reads and writes all of d(wte) (V, C) (docs/results/activations.md).
constexpr uint64_t kLossChunkBytes = uint64_t(64) << 20;
// Tokens per chunk of the chunked loss over N tokens: [model] chunk_tokens, or the fewest chunks
// of at most kLossChunkBytes of (chunk, V) logits in `dt`, split evenly; at least 1, at most N.
uint64_t gpt_loss_chunk_tokens(const ModelConfig& m, uint64_t N, Dtype dt);
// Bytes of activations one transformer block saves for a (B, T) micro-batch in compute dtype `dt`
// (its LayerNorm statistics and, with the tiled attention, its (B, NH, T) row log-sum-exp in
// stat_dtype(dt); with the naive attention its (B, NH, T, T) probabilities in `dt`).
// Block `block`'s, at its MLP width (ModelConfig::mlp_width); block 0 when not given.
uint64_t gpt_block_activation_bytes(const ModelConfig& m, int B, int T, Dtype dt, int block = 0);
// The part of those a selective drop (Drop::kCheap) frees and recompute_cheap() makes again: the
// attention's output (B, T, attention width) in `dt` and its (B, NH, T) row log-sum-exp in
// stat_dtype(dt) (the naive attention's (B, NH, T, T) probabilities in `dt`).
uint64_t gpt_block_cheap_activation_bytes(const ModelConfig& m, int B, int T, Dtype dt,
                                          int block = 0);
// Bytes of activations the head saves for a (B, T) micro-batch in compute dtype `dt`: ln_f (B, T,
// C) and, with [model] loss = "full", the logits (B, T, V), in `dt`; ln_f's two statistics and
// the per-token losses (B, T) in stat_dtype(dt). The chunked loss keeps no logits.
uint64_t gpt_head_activation_bytes(const ModelConfig& m, int B, int T, Dtype dt);
// Bytes of the head's largest workspace: backward's d(ln_f) (B, T, C) and, chunked, one chunk's
// logits (chunk, V), in `dt` (a training forward holds none; evaluate's forward the chunk).
uint64_t gpt_head_workspace_bytes(const ModelConfig& m, int B, int T, Dtype dt);
// Elements of block `block`'s parameters at its MLP width.
uint64_t gpt_block_params(const ModelConfig& m, int block);
// Bytes of the workspace a block's backward holds for a (B, T) micro-batch besides the two
// (B, T, C) gradients Gpt::backward passes between layers, with `attention_scratch` elements of
// the naive attention's scratch (0 when tiled). GPT-2's: dgelu (B, T, max(H, 3A)), dfc (B, T,
// max(H, C)), two (B, T, C), the scratch; Llama's: d(gate|up) (B, T, max(2I, C + 2KV)), dswiglu
// (B, T, max(I, C)), two (B, T, C).
uint64_t gpt_block_workspace_bytes(const ModelConfig& m, int B, int T, Dtype dt, int block,
                                   uint64_t attention_scratch);

}  // namespace headroom
