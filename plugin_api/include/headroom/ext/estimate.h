/* headroom.estimate/1 — offered by a plugin: what it would do to the run's peak memory and step
 * time, for `headroom plan` and the out-of-memory advice (ABI 1.5).
 *
 * Mechanism in core, policy in the plugin: core knows what its mechanisms cost (the bytes of a
 * block that keeps its activations and of one that drops them, of a compute dtype) and offers
 * that as query->peak(); the plugin knows which of them its policy sets, and how long a step then
 * takes. The host chains the estimates of the configured plugins in TOML order — each gets the
 * mechanisms the ones before it left — and then asks each plugin that is installed but not in
 * the config what it would propose.
 *
 * The plugin returns this table from hr_plugin_descriptor.get_extension(HR_EXT_ESTIMATE). */
#ifndef HEADROOM_EXT_ESTIMATE_H
#define HEADROOM_EXT_ESTIMATE_H

#include "headroom/ext/adapters.h"
#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_ESTIMATE "headroom.estimate/1"

/* hr_mechanisms.drop[layer]: HR_DROP_ALL, HR_DROP_CHEAP (headroom/plugin.h), or this. */
#define HR_KEEP_ACTIVATIONS 0xFFu

/* One parameter tensor of the model, for an estimate that depends on shapes (an optimizer's
 * factored or quantized state). */
typedef struct hr_estimate_param {
  uint32_t struct_size;
  int32_t layer;    /* 0 the embedding, 1 .. n_layer the blocks, n_layer + 1 the head */
  const char* name; /* Hugging Face GPT-2 name, as hr_tensor's */
  int32_t ndim;
  uint32_t weight_decay; /* as hr_tensor's */
  int64_t shape[HR_MAX_DIMS];
  uint64_t numel;
} hr_estimate_param;

/* The run's shapes. */
typedef struct hr_estimate_model {
  uint32_t struct_size;
  /* Transformer blocks; the model's layers are the embedding, the blocks and the head. */
  int32_t n_layer;
  int32_t n_head;
  int32_t n_embd;
  int32_t seq_len;
  int32_t vocab_size;
  uint64_t num_params;
  uint64_t memory_limit;   /* [device] memory_limit; 0 = none */
  const char* device_kind; /* "cpu", "cuda" */
  /* Appended (HR_HAS_FIELD): every parameter tensor the optimizer updates, layer by layer, in
   * layer_param's order: a frozen one (hr_tensor.frozen) is left out, LoRA's adapters are in
   * (their layer's last) once a plugin's estimate added them. */
  int32_t num_param_tensors;
  int32_t reserved0;
  const hr_estimate_param* param_tensors;
  /* Appended: [train] init_from, the weights the run starts from ("" for a fresh init): a
   * fine-tuning proposal (adapters on a frozen base) has a base to fine-tune only then. */
  const char* init_from;
} hr_estimate_model;

/* hr_mechanisms.grad_reduce: when sharded gradients (HR_SHARD_GRADIENTS) are reduced into their
 * shards, which decides how many layers' full gradients are live at once. 0: each layer's at its
 * BACKWARD_END, in every micro-step (zero2's defaults); or these bits: */
/* Every layer's after the whole backward (overlap off): they are all live at its end. */
#define HR_GRAD_REDUCE_AFTER_BACKWARD 1u
/* Only in the step's last micro-step: the full gradients accumulate over the ones before it. */
#define HR_GRAD_REDUCE_LAST_MICRO_STEP 2u

/* What core's mechanisms are set to, as far as the peak is concerned. The bytes are a rank's: the
 * fullest rank's (rank 0, whose ranges hold the fewest padding elements) unless the estimate runs
 * on a rank of a run of world_size ranks, which gets its own. */
typedef struct hr_mechanisms {
  uint32_t struct_size;
  uint32_t compute_dtype; /* hr_dtype: HR_DTYPE_F32, HR_DTYPE_BF16 or HR_DTYPE_F16 */
  int32_t micro_batch;    /* a rank's */
  int32_t grad_accum;
  int32_t num_layers; /* n_layer + 2: the length of drop */
  int32_t reserved0;
  uint8_t* drop; /* per layer: HR_KEEP_ACTIVATIONS, HR_DROP_ALL or HR_DROP_CHEAP */
  /* Appended (core reads them when struct_size covers them; a shorter struct, from a plugin
   * built before them, keeps the query's `before` values). */
  /* The ranks of the run: the launcher's (mpirun, srun) for the config as written, 1 without
   * one. A plugin that is not in the config may propose more. Above 1 with nothing sharded, core's
   * data parallelism holds one fp32 copy of every gradient in its buckets (communication). */
  int32_t world_size;
  /* What is sharded over those ranks: the HR_SHARD_* bits of headroom/ext/shard.h —
   * HR_SHARD_OPTIMIZER (1: the optimizer state of the rank's ranges), | HR_SHARD_GRADIENTS (2: the
   * gradient shards; a layer's full gradients only from its backward until reduced), |
   * HR_SHARD_PARAMETERS (4: the parameters' shards; a layer gathered whole only around its use,
   * as prefetch_layers and param_persistence_threshold say); 0 = nothing. Each layer's buffers
   * are padded to a multiple of world_size when anything is. */
  uint32_t shard;
  uint32_t grad_reduce;    /* with HR_SHARD_GRADIENTS: 0 or HR_GRAD_REDUCE_* bits */
  int32_t prefetch_layers; /* with HR_SHARD_PARAMETERS: the layers gathered ahead of the one
                            * computing, in the order of the pass (forward or backward) */
  /* With HR_SHARD_PARAMETERS: a layer of fewer parameter elements than this stays whole on every
   * rank (persistent); the others are sharded and gathered around their use. */
  uint64_t param_persistence_threshold;
  /* Appended: the model state's layout (headroom.precision/1). grad_dtype: HR_DTYPE_F32 or the
   * compute dtype; master_weights: 1 (f32 masters beside the compute copies) or 0 (only the
   * compute dtype, bf16); state_dtype: the built-in optimizer's state, HR_DTYPE_F32 or
   * HR_DTYPE_BF16. Without compute copies (compute_dtype f32) they must be F32, 1 and any. */
  uint32_t grad_dtype;
  uint32_t master_weights;
  uint32_t state_dtype;
  /* Where the parameter shards of sharded layers rest (hr_ext_offload.set_parameter_place):
   * HR_PLACE_DEVICE (0, core's default; this was reserved1, zero) or HR_PLACE_HOST (1: with
   * HR_SHARD_PARAMETERS, each sharded layer's parameter, master and gradient shards in the host
   * ledger, the device holding its full parameters and gradients only around their use) or
   * HR_PLACE_NVME (2, set_parameter_files: HR_PLACE_HOST with the compute, frozen and quantized
   * shards in a file, and the file's staging in the host ledger). */
  uint32_t parameter_place;
  /* The optimizer state of a rank in bytes when a plugin takes the optimizer role (its estimate
   * sets it from model->param_tensors), or HR_OPTIMIZER_BYTES_BUILTIN: core's AdamW / SGD. */
  uint64_t optimizer_bytes;
  /* Appended (ABI 1.7): the bytes the plugins hold in HR_MEM_PLUGIN (their own memory) on this
   * rank, for the whole run: each plugin's estimate adds what it holds to what the plugins before
   * it left (0 from core). Core counts them at every moment of the step, so the peak's plugin
   * category is this value; query->peak's out[] (ABI 1.0's seven categories) leaves it out, and
   * so may hr_estimate_result.bytes. */
  uint64_t plugin_bytes;
  /* Appended (ABI 1.8): where the built-in optimizer keeps its state and the f32 weights it
   * updates (headroom/ext/offload.h): HR_PLACE_DEVICE (0, core's default) or HR_PLACE_HOST (1:
   * the device holds no optimizer state; the host ledger holds it, an f32 copy of every
   * parameter and one staging buffer of the largest parameter's gradient) or HR_PLACE_NVME (2:
   * HR_PLACE_HOST's, with the state in a file and two staging buffers of the largest
   * piece's state in the host ledger instead: core/optim/state_layout.h). */
  uint32_t optimizer_place;
  /* Where each layer's output waits between the next layer's forward and backward
   * (hr_ext_offload.set_activation_place): HR_PLACE_DEVICE (0, core's default; this was
   * reserved2, zero) or HR_PLACE_HOST (1: in the host ledger's activations, the device holding
   * the two a backward reads next). */
  uint32_t activation_place;
  /* Appended: LoRA adapters (headroom/ext/adapters.h): num_adapters specs, each struct_size
   * apart, whose targets core resolves against the model's modules as add_lora does; with any,
   * every other parameter is frozen (no gradient, optimizer state or master copy). 0 and NULL:
   * none. base_dtype: how the frozen block weights are stored, as hr_base_spec.dtype (NULL or
   * "f32": as the model; "bf16", "int8", "nf4"), with base_double_quant as its double_quant.
   * What a plugin points to here stays valid until its next estimate call. */
  uint32_t num_adapters;
  uint32_t base_double_quant;
  const hr_lora_spec* adapters;
  const char* base_dtype;
} hr_mechanisms;

#define HR_OPTIMIZER_BYTES_BUILTIN UINT64_MAX

typedef struct hr_estimate_query {
  uint32_t struct_size;
  uint32_t reserved0;
  const hr_estimate_model* model;
  const hr_mechanisms* before;                 /* as the plugins before this one leave them */
  uint64_t baseline[HR_MEM_CATEGORY_COUNT_V1]; /* the peak bytes by category with `before` */
  /* Core's closed form: the peak bytes by category (out[HR_MEM_CATEGORY_COUNT_V1]) of a rank with
   * the mechanisms set as `m`. Exact on the CPU backend for every layer kept, HR_DROP_ALL and
   * HR_DROP_CHEAP, with or without HR_SHARD_OPTIMIZER and HR_SHARD_GRADIENTS.
   * HR_SHARD_PARAMETERS follows zero3's schedule as core/report/advice.cpp draws it. */
  void* context;
  hr_status (*peak)(void* context, const hr_mechanisms* m, uint64_t* out);
  /* At an out-of-memory failure: the failed request, the free bytes then and the largest free
   * block. All 0 for `headroom plan`. */
  uint64_t oom_requested;
  uint64_t oom_free_bytes;
  uint64_t oom_largest_free;
} hr_estimate_query;

typedef struct hr_estimate_result {
  uint32_t struct_size;
  uint32_t reserved0;
  hr_mechanisms* after; /* in: a copy of query->before (its own drop array); out: the plugin
                         * changes what its policy sets */
  uint64_t bytes[HR_MEM_CATEGORY_COUNT_V1]; /* out: the peak bytes by category it leaves
                                             * (in: the baseline) */
  uint64_t makes_usable;   /* out: free bytes now in holes too small for the failed request that it
                            * would make usable (an allocator); 0 for most plugins */
  double step_time_factor; /* out: step time with it over step time without it (in: 1); its
                            * source, a measurement in docs/results, in the plugin's comment */
  char what[160];          /* out: one line: "activation recomputation, policy sqrt" */
  char toml[512]; /* out: the keys of its [[plugins]] table that turn it on as estimated, one
                   * `key = value` a line, without the [[plugins]] header and the name */
} hr_estimate_result;

/* One documented mode of a plugin (a checkpoint policy, an amp dtype): what `headroom plan
 * --measure --search` tries besides the plugin's proposal. Plugin-owned static strings. */
typedef struct hr_estimate_mode {
  uint32_t struct_size;
  uint32_t reserved0;
  const char* what; /* one line: "policy selective" */
  const char* toml; /* the keys of its [[plugins]] table, as hr_estimate_result.toml ("" for the
                     * defaults) */
} hr_estimate_mode;

typedef struct hr_ext_estimate {
  uint32_t struct_size;
  uint32_t reserved0;
  /* instance: the plugin as the config creates it (its own keys read), to estimate the config as
   * written; or NULL: the plugin is not in the config, and proposes the setting it would suggest
   * — the lightest that fits model->memory_limit when one does. HR_OK with the result filled, or
   * HR_ERROR_UNSUPPORTED when it has nothing to offer this run (the advice then leaves it out).
   * Training thread, any time after the entry point (also when the plugin was never created);
   * no device work. */
  hr_status (*estimate)(void* instance, const hr_estimate_query* query, hr_estimate_result* result);
  /* Appended (read when struct_size covers them): the plugin's documented modes, which the search
   * measures one by one and in pairs with other plugins' — the planner knows no plugin by name.
   * num_modes 0 (or a shorter struct): the search tries what estimate proposes alone. */
  uint32_t num_modes;
  uint32_t reserved1;
  const hr_estimate_mode* modes; /* num_modes of them, each struct_size-sized */
} hr_ext_estimate;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_ESTIMATE_H */
