/* headroom.adapters/1 — low-rank adapters beside the model's GEMMs (LoRA).
 *
 * The mechanism a fine-tuning plugin drives: it names the linear modules to adapt by their Hugging
 * Face names, with a rank and an alpha, while it is created; core adds each adapter's A (rank, in)
 * and B (out, rank) as trainable parameters ("<module>.lora_A.weight", "<module>.lora_B.weight"),
 * initialises them as PEFT does (A Kaiming-uniform with a = sqrt(5), B zero), freezes every other
 * parameter of the model (no gradient, optimizer state or master copy), and adds
 * (alpha / rank) · B (A x) to each adapted module's output in forward, with its gradients in
 * backward. Snapshots and the optimizer see the adapters as parameters like any other.
 *
 * Modules: GPT-2's attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; Llama's self_attn.q_proj,
 * k_proj, v_proj, o_proj and mlp.gate_proj, up_proj, down_proj (rows of the fused GEMMs core runs).
 * A target is one entry of PEFT's target_modules: a module whose name is it or ends with "." and
 * it ("c_proj" adapts both of GPT-2's projections, "attn.c_proj" the attention's alone).
 *
 * Any plugin, training thread, from create() only (the model is built after every plugin is
 * created); one plugin of a run adds adapters. When a config is only checked or planned nothing
 * is built: add_lora checks its arguments and answers as it would, changing nothing. */
#ifndef HEADROOM_EXT_ADAPTERS_H
#define HEADROOM_EXT_ADAPTERS_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_ADAPTERS "headroom.adapters/1"

/* An in-struct: the caller sets struct_size to its size; fields are only appended. */
typedef struct hr_lora_spec {
  uint32_t struct_size;
  uint32_t rank;      /* r, >= 1 */
  const char* target; /* one entry of target_modules (above); the host copies it */
  double alpha;       /* the update is scaled by alpha / rank; finite, > 0 */
  const char* key;    /* the plugin's config key the target came from, for messages; may be NULL */
  /* Appended: PEFT's lora_dropout, in [0, 1): the adapter's input dropped in training, each
   * element with this probability (the rest scaled by 1 / (1 - dropout)); 0 (or a spec without
   * the field) for none. */
  double dropout;
} hr_lora_spec;

/* An in-struct (appended in headroom.adapters/1's second revision): how the frozen base is
 * stored. */
typedef struct hr_base_spec {
  uint32_t struct_size;
  uint32_t
      double_quant;  /* nonzero: the absmaxes quantized again (bitsandbytes' compress_statistics) */
  const char* dtype; /* "f32" (as the other frozen parameters), "bf16", "int8", "nf4" */
  const char* key;   /* the plugin's config key dtype came from, for messages; may be NULL */
} hr_base_spec;

typedef struct hr_ext_adapters {
  uint32_t struct_size;
  uint32_t reserved0;
  /* From create() only: adapters of rank spec->rank on every module spec->target names.
   * HR_ERROR_CONFIG for a target that names no module of the run's model (the message lists the
   * valid ones), a rank below 1 or an alpha that is not finite and > 0: the message starts with
   * spec->key's file:line:column when key is set (HR_ERROR_INVALID and no position when not);
   * HR_ERROR_INVALID for a NULL spec or target; HR_ERROR_NOT_ALLOWED outside create() or when
   * another plugin added adapters. The plugin returns the status from create(). */
  hr_status (*add_lora)(hr_host* host, const hr_lora_spec* spec);
  /* From create() only, by the plugin that adds the adapters (appended: check struct_size): the
   * frozen linear weights of the blocks — every module an adapter could sit on — stored as
   * spec->dtype: bf16 (2 bytes), int8 (bitsandbytes' dynamic 8-bit codes, one f32 absmax per 256)
   * or nf4 (4-bit normal-float codes, one f32 absmax per 64), the absmaxes 8-bit in blocks of
   * 256 with double_quant; each GEMM reads a transient dequantized in the compute dtype.
   * Embeddings, norms, biases and the LM head stay in the model's dtype. HR_ERROR_CONFIG for a
   * dtype that is none of those (at spec->key's file:line:column when key is set), or a model
   * that is not f32; HR_ERROR_INVALID for a NULL spec or dtype; HR_ERROR_NOT_ALLOWED outside
   * create(), twice, or by another plugin than the adapters'. */
  hr_status (*set_base)(hr_host* host, const hr_base_spec* spec);
} hr_ext_adapters;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_ADAPTERS_H */
