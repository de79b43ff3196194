/* headroom.model/1 — the model's architecture and shape (ABI 1.5).
 *
 * What a plugin needs to size its own work by the model without walking its layers: the
 * architecture, the transformer's dimensions, and how many layers the layer services number.
 *
 * Any plugin, training thread, once the model is built: from TRAIN_BEGIN on, in every hook and
 * role hook after. Before (in create(); in the ALLOC events of the model's own buffers; when a
 * config is only checked or planned, which builds no model) shape answers HR_ERROR_INVALID with a
 * message. */
#ifndef HEADROOM_EXT_MODEL_H
#define HEADROOM_EXT_MODEL_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_MODEL "headroom.model/1"

/* An out-struct: the caller sets struct_size; the host fills what it covers. Fields are only
 * appended. */
typedef struct hr_model_shape {
  uint32_t struct_size;
  uint32_t reserved0;
  const char* architecture; /* "gpt2"; the host's, valid until the plugin's destroy() returns */
  int32_t n_layer;          /* transformer blocks */
  int32_t n_head;           /* attention heads per block as configured (a pruned block has
                             * fewer: headroom.resize/1's attn_heads) */
  int32_t n_embd;           /* the residual stream's width */
  int32_t vocab_size;       /* the embedding's rows, the LM head's outputs */
  int32_t seq_len;          /* the context the model is built for (its position embedding) */
  int32_t num_layers;       /* the layers the services number (num_layers()): n_layer + 2 —
                             * 0 the embedding, 1..n_layer the blocks, n_layer + 1 the final
                             * LayerNorm and the LM head */
} hr_model_shape;

typedef struct hr_ext_model {
  uint32_t struct_size;
  uint32_t reserved0;
  /* Any plugin, once the model is built (above): fills *out as far as out->struct_size reaches.
   * HR_ERROR_INVALID, with a message, before the model is built or for a NULL out. */
  hr_status (*shape)(hr_host* host, hr_model_shape* out);
} hr_ext_model;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_MODEL_H */
