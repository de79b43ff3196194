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

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_ESTIMATE "headroom.estimate/1"

/* hr_mechanisms.drop[layer]: HR_DROP_ALL, HR_DROP_CHEAP (headroom/plugin.h), or this. */
#define HR_KEEP_ACTIVATIONS 0xFFu

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
} hr_estimate_model;

/* What core's mechanisms are set to, as far as the peak is concerned. */
typedef struct hr_mechanisms {
  uint32_t struct_size;
  uint32_t compute_dtype; /* hr_dtype: HR_DTYPE_F32, HR_DTYPE_BF16 or HR_DTYPE_F16 */
  int32_t micro_batch;
  int32_t grad_accum;
  int32_t num_layers; /* n_layer + 2: the length of drop */
  int32_t reserved0;
  uint8_t* drop; /* per layer: HR_KEEP_ACTIVATIONS, HR_DROP_ALL or HR_DROP_CHEAP */
} hr_mechanisms;

typedef struct hr_estimate_query {
  uint32_t struct_size;
  uint32_t reserved0;
  const hr_estimate_model* model;
  const hr_mechanisms* before;                 /* as the plugins before this one leave them */
  uint64_t baseline[HR_MEM_CATEGORY_COUNT_V1]; /* the peak bytes by category with `before` */
  /* Core's closed form: the peak bytes by category (out[HR_MEM_CATEGORY_COUNT_V1]) with the
   * mechanisms set as `m`. Exact on the CPU backend for HR_DROP_ALL and every layer kept; an upper
   * bound for HR_DROP_CHEAP (counted as kept). */
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
} hr_ext_estimate;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_ESTIMATE_H */
