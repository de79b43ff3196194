/* headroom.resize/1 — structured pruning: parameters that shrink mid-run (ABI 1.5).
 *
 * The mechanism the pruning plugin drives. keep_mlp_units removes hidden units of one transformer
 * block's MLP: the rows of mlp.c_fc.weight and mlp.c_fc.bias and the columns of
 * mlp.c_proj.weight (ours are (out, in), as llm.c: hr_tensor in plugin.h) of every unit not kept.
 * keep_attn_heads removes attention heads the same way: a head's q, k and v rows of
 * attn.c_attn.weight and its bias (hs = n_embd / n_head rows in each of the three sections) and its
 * hs columns of attn.c_proj.weight; the block's attention then runs its remaining heads. Everything
 * attached to them shrinks with them, in place of the old: the f32 masters, the compute copies
 * (amp), the gradients of either dtype, the optimizer's state (the built-in AdamW's m and v, SGD's
 * momentum; an optimizer-role plugin's through its hr_optimizer_hooks.resize) and, from the block's
 * next forward on, its MLP activations (B, T, H) and backward scratch. The old buffers are freed
 * before the new ones are made (their contents pass through host memory), so no moment holds
 * both sizes. Snapshots, weights files and estimates know each block's width.
 *
 * A Llama block (arch = "llama"): keep_mlp_units keeps SwiGLU unit j's row j (gate) and row
 * I + j (up) of mlp.gate_up_proj.weight and column j of mlp.down_proj.weight; keep_attn_heads
 * takes whole key/value groups only (every one of the n_head / n_kv_head consecutive query heads
 * of each KV head it keeps; HR_ERROR_INVALID for a list that splits one) and keeps their q rows,
 * the groups' k and v rows of self_attn.qkv_proj.weight and their columns of
 * self_attn.o_proj.weight. attn_heads counts query heads.
 *
 * Training thread, from STEP_END or TRAIN_BEGIN only (no activations alive, the step's update
 * done); HR_ERROR_NOT_ALLOWED from any other moment. Refused (HR_ERROR_UNSUPPORTED, with a
 * message, nothing changed) when the run shards its model state (a zero plugin), runs on more
 * than one rank, or has an optimizer-role plugin without a resize hook. */
#ifndef HEADROOM_EXT_RESIZE_H
#define HEADROOM_EXT_RESIZE_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_RESIZE "headroom.resize/1"

/* One parameter that shrank, for the optimizer role's resize hook. */
struct hr_resize_info {
  uint32_t struct_size;
  int32_t layer; /* layer_param's layer and index of the parameter */
  int32_t index;
  uint32_t axis; /* 0: rows were kept (the first dimension); 1: columns (the last, of a matrix) */
  int32_t ndim;  /* 1 or 2 */
  uint32_t num_keep;
  const char* name;               /* its Hugging Face name, "h.3.mlp.c_fc.weight" */
  int64_t old_shape[HR_MAX_DIMS]; /* before */
  int64_t new_shape[HR_MAX_DIMS]; /* now: new_shape[axis] == num_keep */
  const uint32_t* keep;           /* the kept indices along axis, ascending; valid for the call */
};

typedef struct hr_ext_resize {
  uint32_t struct_size;
  uint32_t reserved0;
  /* Any time: block layer's MLP width now (layers 1 .. num_layers-2); -1 for another layer. */
  int32_t (*mlp_width)(hr_host* host, int32_t layer);
  /* STEP_END or TRAIN_BEGIN: keeps the `count` hidden units `keep` names (ascending, distinct,
   * below the width, count >= 1) of block `layer` and removes the others. HR_ERROR_INVALID for
   * a bad layer or list, HR_ERROR_UNSUPPORTED for a run that cannot resize (above),
   * HR_ERROR_OUT_OF_MEMORY when the smaller buffers cannot be made; each with a message. */
  hr_status (*keep_mlp_units)(hr_host* host, int32_t layer, const uint32_t* keep, uint32_t count);
  /* Any time: block layer's attention heads now; -1 for another layer. */
  int32_t (*attn_heads)(hr_host* host, int32_t layer);
  /* STEP_END or TRAIN_BEGIN: keeps the `count` heads `keep` names (ascending, distinct, below
   * its heads, count >= 1) of block `layer`; errors as keep_mlp_units'. */
  hr_status (*keep_attn_heads)(hr_host* host, int32_t layer, const uint32_t* keep, uint32_t count);
} hr_ext_resize;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_RESIZE_H */
