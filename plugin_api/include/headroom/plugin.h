/* headroom plugin ABI v1 — the only header a plugin needs (with the headroom/ext/ headers of the
 * extensions it uses).
 *
 * C99; depends on stdint.h and stddef.h only; compiles warning-free as C99, C11 and C++17.
 *
 * The contract, in brief (docs/plugin-guide.md has the whole of it):
 *
 *  - A plugin is a shared library that exports exactly one symbol, hr_plugin_entry. The host calls
 *    it once after loading, with the range of ABI versions it speaks; the plugin picks one and
 *    returns its descriptor. A different major version is refused at load time.
 *  - Every struct that crosses the boundary starts with `uint32_t struct_size`, set by whoever
 *    fills the struct to sizeof() as that side was compiled. Fields are only ever appended. A
 *    reader uses a field only if the writer's struct_size covers it (HR_HAS_FIELD). So an old
 *    plugin runs in a new host and a new plugin in an old host, within one major version.
 *  - Nothing C++ crosses the boundary: no exceptions (a plugin must not let one escape), no
 *    allocation ownership (memory is freed by the side that allocated it), plain C types only.
 *  - Errors are status codes. A failing hook returns a non-zero hr_status and may first hand its
 *    message to the host with services->set_error(); the host names the plugin and the event.
 *  - Threads: unless a hook says otherwise, the host calls it on the training thread, one call at a
 *    time; a plugin needs no locking for calls from the host. Device work a hook issues goes on the
 *    compute stream (hr_host_services.stream(); NULL on the CPU backend).
 *
 * Values of enums are never renumbered; new ones are only appended. */
#ifndef HEADROOM_PLUGIN_H
#define HEADROOM_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Versions */

#define HR_ABI_VERSION_MAJOR 1
#define HR_ABI_VERSION_MINOR 8
/* One number: major in the high 16 bits, minor in the low 16. */
#define HR_ABI_MAKE_VERSION(major, minor) ((((uint32_t)(major)) << 16) | ((uint32_t)(minor)))
#define HR_ABI_VERSION HR_ABI_MAKE_VERSION(HR_ABI_VERSION_MAJOR, HR_ABI_VERSION_MINOR)
#define HR_ABI_MAJOR(version) ((uint32_t)(version) >> 16)
#define HR_ABI_MINOR(version) (((uint32_t)(version)) & 0xFFFFu)

/* True when a struct whose writer set struct_size covers `field` (a reader checks this before
 * using any field added after v1.0). */
#define HR_HAS_FIELD(ptr, type, field) \
  ((ptr)->struct_size >= offsetof(type, field) + sizeof(((type*)0)->field))

/* ---------------------------------------------------------------------------------------------
 * Status codes */

typedef int32_t hr_status;
#define HR_OK 0
#define HR_ERROR 1               /* generic failure; the message says what */
#define HR_ERROR_CONFIG 2        /* the plugin's TOML table is wrong (the host exits with code 2) */
#define HR_ERROR_OUT_OF_MEMORY 3 /* an allocation failed */
#define HR_ERROR_UNSUPPORTED 4   /* e.g. a dtype or device op this backend does not have */
#define HR_ERROR_INVALID 5       /* a bad argument: an index out of range, a NULL pointer */
#define HR_ERROR_VERSION 6       /* no ABI version both sides speak */
#define HR_ERROR_NOT_ALLOWED                                           \
  7 /* ABI 1.5: a service called from an event, or by a plugin without \
     * the role, that its header comment does not allow; the message   \
     * (set by the host) says what may call it */

/* ---------------------------------------------------------------------------------------------
 * Events of the training loop. One optimizer step with A micro-steps and layers 0..L-1:
 *
 *   STEP_BEGIN
 *     A times:  FORWARD_BEGIN(l) FORWARD_END(l)     for l = 0 .. L-1
 *               BACKWARD_BEGIN(l) BACKWARD_END(l)   for l = L-1 .. 0
 *   GRADS_READY      every micro-step's gradient accumulated
 *   OPTIMIZER_STEP   just before the update (unless a plugin vetoed the step)
 *   STEP_END
 *
 * TRAIN_BEGIN before the first step, TRAIN_END after the last; ALLOC and FREE at every device
 * allocation and free, OOM when an allocation fails. With more than one rank (data parallelism):
 * BUCKET_LAUNCH when a gradient bucket's all-reduce starts, in the step's last micro-step right
 * after the BACKWARD_END of the lowest layer feeding it, and BUCKET_DONE when it has been waited
 * for, before GRADS_READY. EVAL_END (ABI 1.6) after each evaluation of the validation loss
 * ([train] eval_every), after the STEP_END of the step it follows. Plugins receive each event in
 * the order the TOML lists them. docs/design.md in headroom's source draws the whole loop.
 *
 * A plugin receives only the events of the ABI version it negotiated: 0 .. 12 from 1.0, BUCKET_*
 * from 1.5, EVAL_END from 1.6. A bit of hr_plugin_descriptor.events for an event newer than that
 * is ignored, so a plugin that subscribes to every bit never meets an event it cannot know. */
typedef enum hr_event {
  HR_EVENT_TRAIN_BEGIN = 0,
  HR_EVENT_TRAIN_END = 1,
  HR_EVENT_STEP_BEGIN = 2,
  HR_EVENT_STEP_END = 3,
  HR_EVENT_FORWARD_BEGIN = 4,
  HR_EVENT_FORWARD_END = 5,
  HR_EVENT_BACKWARD_BEGIN = 6,
  HR_EVENT_BACKWARD_END = 7,
  HR_EVENT_GRADS_READY = 8,
  HR_EVENT_OPTIMIZER_STEP = 9,
  HR_EVENT_ALLOC = 10,
  HR_EVENT_FREE = 11,
  HR_EVENT_OOM = 12,
  HR_EVENT_COUNT_V1 = 13, /* the events of ABI 1.0 (0 .. 12); the ones below came after */
  /* World size > 1 only; never fired by a host of one rank. hr_event_info's `bytes` is the
   * bucket's size (its gradients in fp32), `layer` the lowest layer whose gradients it holds. */
  HR_EVENT_BUCKET_LAUNCH = 13, /* its all-reduce (average over ranks) started */
  HR_EVENT_BUCKET_DONE = 14,   /* its all-reduce waited for; the gradients copied back */
  /* ABI 1.6: an evaluation of the validation loss ([train] eval_every; every rank) finished.
   * `step` is the step it follows; `loss` the mean validation loss over its tokens (the mean
   * over ranks: what the metrics report as val_loss), `tokens` the tokens this rank evaluated.
   * Not fired for an evaluation a stop request cut short (it is not counted either). */
  HR_EVENT_EVAL_END = 15
} hr_event;

/* For hr_plugin_descriptor.events: HR_EVENT_BIT(HR_EVENT_STEP_END) | ... */
#define HR_EVENT_BIT(e) (((uint64_t)1) << (e))

/* What a buffer holds. Every device allocation carries exactly one; so does every byte of the
 * host ledger (ABI 1.8, headroom/ext/offload.h), which keeps the same categories. */
typedef enum hr_mem_category {
  HR_MEM_PARAMETERS = 0,
  HR_MEM_GRADIENTS = 1,
  HR_MEM_OPTIMIZER = 2,
  HR_MEM_ACTIVATIONS = 3,
  HR_MEM_WORKSPACE = 4,
  HR_MEM_DATA = 5,
  HR_MEM_COMMUNICATION = 6,
  HR_MEM_CATEGORY_COUNT_V1 = 7, /* the categories of ABI 1.0 (0 .. 6) */
  /* ABI 1.7: a plugin's own memory that is none of the above (a weight EMA's shadow copy, a
   * plugin's scratch buffers): only services->alloc of a plugin that negotiated 1.7 or later
   * takes it. The tracker, the memory report, the metrics and the out-of-memory report show it as
   * "plugin", split by the plugin that holds it; the planner adds what each plugin's estimate
   * says it holds (hr_mechanisms.plugin_bytes, headroom/ext/estimate.h). A plugin that
   * negotiated an older version never sees this value: ALLOC and FREE events, the allocator
   * role's allocate and memory_stats give it HR_MEM_OPTIMIZER instead, where plugins kept their
   * own memory before 1.7. */
  HR_MEM_PLUGIN = 7,
  HR_MEM_CATEGORY_COUNT = 8 /* the categories of this header */
} hr_mem_category;

typedef enum hr_dtype {
  HR_DTYPE_F32 = 0,
  HR_DTYPE_BF16 = 1,
  HR_DTYPE_F16 = 2,
  HR_DTYPE_F64 = 3,
  HR_DTYPE_I32 = 4
} hr_dtype;

/* Roles: a plugin providing one replaces the host's own for the whole run. At most one plugin per
 * role; two is a config error naming both. */
#define HR_ROLE_ALLOCATOR ((uint32_t)1) /* every device allocation goes through it */
#define HR_ROLE_OPTIMIZER ((uint32_t)2) /* it updates the parameters instead of AdamW / SGD */
/* ABI 1.5: it reduces the gradients across ranks itself (ZeRO shards them), through
 * headroom.comm/1; core's data-parallel bucket all-reduce is then off, and no BUCKET_* event
 * fires. It needs no hooks of its own: its reduction runs from its event hooks (GRADS_READY at
 * the latest, which comes after every micro-step's backward). */
#define HR_ROLE_GRADIENT_REDUCTION ((uint32_t)4)

/* Log levels for hr_host_services.log. */
#define HR_LOG_DEBUG 0
#define HR_LOG_INFO 1
#define HR_LOG_WARN 2
#define HR_LOG_ERROR 3

/* ---------------------------------------------------------------------------------------------
 * What the host tells a hook */

typedef struct hr_event_info {
  uint32_t struct_size;
  uint32_t event;     /* hr_event */
  int64_t step;       /* 1-based optimizer step; 0 before the first (and for TRAIN_BEGIN) */
  int32_t micro_step; /* 1-based within the step; 0 outside micro-steps */
  int32_t layer;      /* FORWARD_* / BACKWARD_*: the layer index; BUCKET_*: the bucket's lowest
                       * layer; -1 otherwise */
  /* ALLOC / FREE / OOM; BUCKET_* (bytes only: the bucket's size; ptr NULL) */
  const void* ptr;    /* the buffer (NULL for OOM) */
  uint64_t bytes;     /* its size, or the size requested (OOM) */
  uint32_t category;  /* hr_mem_category */
  uint32_t reserved0; /* zero */
  /* ABI 1.5 (HR_HAS_FIELD). BACKWARD_END: the micro-step's mean loss over its tokens and its
   * token count. GRADS_READY and STEP_END: the step's mean loss over all its micro-steps' tokens
   * and the step's token count. EVAL_END (1.6): the validation loss and its tokens. Other
   * events: loss 0, tokens 0. */
  double loss;
  uint64_t tokens;
} hr_event_info;

/* A tensor as a plugin sees it: a view, owned by the host. */
#define HR_MAX_DIMS 8
/* Out-structs (hr_tensor, hr_memory_stats): the caller sets struct_size to sizeof() as it was
 * compiled; the host fills what that covers (a zero struct_size counts as ABI 1.0's size). */
typedef struct hr_tensor {
  uint32_t struct_size;
  uint32_t dtype; /* hr_dtype */
  /* Parameters: Hugging Face's names, GPT-2's without "transformer." ("h.3.attn.c_attn.weight"),
   * Llama's as they are ("model.layers.3.mlp.down_proj.weight") but for two fused ones:
   * self_attn.qkv_proj (q_proj, k_proj, v_proj stacked by rows) and mlp.gate_up_proj (gate_proj,
   * then up_proj). */
  const char* name;
  int32_t ndim;
  int32_t reserved0; /* zero */
  /* Row-major, the last dimension contiguous. Every parameter matrix that multiplies an
   * activation is (out, in), as nn.Linear's weight: GPT-2 attn.c_attn.weight (3C, C),
   * attn.c_proj.weight (C, C), mlp.c_fc.weight (4C, C), mlp.c_proj.weight (C, 4C) — the
   * transpose of Hugging Face's Conv1D (in, out), which is what --save-weights writes for these
   * four. Llama: self_attn.qkv_proj.weight (C + 2 KV, C) (KV = n_kv_head * head size),
   * self_attn.o_proj.weight (C, C), mlp.gate_up_proj.weight (2I, C), mlp.down_proj.weight (C, I),
   * as Hugging Face's. Embeddings (vocab, C) and wpe (seq_len, C); lm_head (vocab, C); norms and
   * biases (n). docs/plugin-guide.md section 9.4 has the table. */
  int64_t shape[HR_MAX_DIMS];
  uint64_t numel;
  void* data;            /* device memory */
  void* grad;            /* parameters: the gradient (same dtype and shape); else NULL. Also
                          * NULL while a run that shards gradients (headroom.shard/1, zero2)
                          * holds only the layer's gradient shard */
  uint32_t weight_decay; /* parameters: 1 when weight decay applies (matrices, embeddings) */
  /* Parameters: 1 when frozen ([train] freeze, everything but LoRA's adapters): no gradient
   * (grad NULL), no optimizer state, never updated; an optimizer-role plugin skips it. 0 for a
   * trainable one, and from a host older than this meaning (the field was reserved, zero). */
  uint32_t frozen;
  /* Appended (ABI 1.5, HR_HAS_FIELD). Parameters: the dtype of `grad`, which differs from
   * `dtype` when amp accumulates the gradients in the compute dtype (headroom.precision/1
   * set_grad_dtype). A caller whose struct_size does not cover it gets grad NULL then. */
  uint32_t grad_dtype;
  uint32_t reserved2; /* zero */
} hr_tensor;

typedef struct hr_memory_stats {
  uint32_t struct_size;
  uint32_t reserved0;
  uint64_t limit;      /* [device] memory_limit; 0 = none */
  uint64_t live_bytes; /* now */
  uint64_t peak_bytes; /* highest so far */
  uint64_t live_by_category[HR_MEM_CATEGORY_COUNT_V1];
  uint64_t peak_by_category[HR_MEM_CATEGORY_COUNT_V1];
  uint64_t num_allocs; /* device allocations so far */
  /* Appended (ABI 1.7, HR_HAS_FIELD): HR_MEM_PLUGIN's live and peak bytes, which the arrays
   * above (ABI 1.0's seven) cannot hold. A plugin that negotiated 1.7 or later finds them here
   * and nowhere else: live_bytes is the sum of live_by_category and live_plugin. A plugin that
   * negotiated an older version finds them added to the HR_MEM_OPTIMIZER entries instead (the
   * peak as the sum of the two categories' own peaks). */
  uint64_t live_plugin;
  uint64_t peak_plugin;
} hr_memory_stats;

/* The optimizer role's step: update every parameter from its gradient. */
typedef struct hr_optimizer_step_info {
  uint32_t struct_size;
  uint32_t reserved0;
  int64_t step; /* 1-based */
  double lr;    /* from the host's schedule ([train] lr, warmup, decay) */
} hr_optimizer_step_info;

/* ---------------------------------------------------------------------------------------------
 * Host services: handed to the plugin's create(); valid until its destroy() returns. Every
 * function takes the `host` handle from this table as its first argument. All are called on the
 * training thread (the thread that called the hook) unless noted. */

typedef struct hr_host hr_host; /* opaque */

/* drop_activations' `what` (ABI 1.3). */
#define HR_DROP_ALL 0   /* everything but the output; backward re-runs the whole forward */
#define HR_DROP_CHEAP 1 /* selective: keep the GEMM outputs, recompute the cheap tensors */

typedef struct hr_host_services {
  uint32_t struct_size;
  uint32_t abi_version; /* the version the host chose for this plugin */
  hr_host* host;

  /* Logging and errors. set_error hands the host the message for the failure the current hook is
   * about to return (copied; the last call wins). */
  void (*log)(hr_host* host, int32_t level, const char* message);
  void (*set_error)(hr_host* host, const char* message);

  /* The plugin's own [[plugins]] table. Each getter returns HR_OK and writes *out when the key is
   * present and has the right type; HR_ERROR_CONFIG (with a message naming file:line:column)
   * when it has the wrong type; and leaves *out untouched, returning HR_OK, when it is absent —
   * so initialise *out to the default first. Call only from create(). When create() returns,
   * every key of the table no getter asked for is an error (an unknown key): exit code 2. */
  hr_status (*config_int)(hr_host* host, const char* key, int64_t* out);
  hr_status (*config_float)(hr_host* host, const char* key, double* out); /* integers accepted */
  hr_status (*config_bool)(hr_host* host, const char* key, int32_t* out);
  /* Copies a NUL-terminated string into out[0..size); HR_ERROR_INVALID if it does not fit. */
  hr_status (*config_string)(hr_host* host, const char* key, char* out, size_t size);
  /* A size: an integer number of bytes or a string with B, KiB, MiB or GiB ("256MiB"). */
  hr_status (*config_size)(hr_host* host, const char* key, uint64_t* out);
  /* An error about a value the plugin found out of range: the message is prefixed with the key's
   * file:line:column. Returns HR_ERROR_CONFIG, for the plugin to return. */
  hr_status (*config_error)(hr_host* host, const char* key, const char* message);

  /* Device memory in a category, through the same path as the host's own (the memory limit,
   * the tracker, ALLOC / FREE events). NULL when it does not fit (no OOM event is fired for a
   * plugin's own request). free takes only pointers from alloc. Not from ALLOC, FREE or OOM hooks
   * or allocator hooks: those run inside an allocation, and must not start another. A buffer
   * that belongs to no category of core's (a shadow copy of the weights, a plugin's scratch) is
   * HR_MEM_PLUGIN (ABI 1.7), which the reports show under the plugin's name; an optimizer-role
   * plugin's state is HR_MEM_OPTIMIZER. NULL with a message for a category the plugin's version
   * does not have. */
  void* (*alloc)(hr_host* host, uint64_t bytes, uint32_t category, const char* what);
  void (*free)(hr_host* host, void* ptr);
  /* The backend's own memory, for the allocator role only: what the allocator builds its pools
   * from. Not counted by the tracker (the tracker counts what the allocator hands out); on the
   * CPU backend with a memory_limit it comes out of the same limited memory. raw_alloc returns
   * NULL when the backend has none. */
  void* (*raw_alloc)(hr_host* host, uint64_t bytes);
  void (*raw_free)(hr_host* host, void* ptr);
  hr_status (*memory_stats)(hr_host* host, hr_memory_stats* out);

  /* The model: layers 0 .. num_layers-1 (embedding, blocks, head). Tensors are views valid until
   * the next event. A layer's activations exist from its FORWARD_END through its
   * BACKWARD_BEGIN (they are freed when its backward is done). The head's "losses (B, T)" (f32)
   * are the micro-batch's per-token losses whenever read: the chunked loss computes them in the
   * head's backward, so a read before it has the host compute them then (it allocates: not from
   * ALLOC, FREE or OOM hooks). A parameter's data (the f32
   * masters) is NULL while its layer's masters are sharded across ranks (headroom.shard/1 with
   * a compute copy, or HR_SHARD_PARAMETERS), and its grad NULL while only a gradient shard
   * exists, and always for a frozen parameter ([train] freeze, headroom.adapters/1's base): it
   * has no gradient, and with a compute copy its data is that copy (its dtype says so). */
  int32_t (*num_layers)(hr_host* host);
  hr_status (*layer_name)(hr_host* host, int32_t layer, char* out, size_t size);
  int32_t (*layer_num_params)(hr_host* host, int32_t layer);
  hr_status (*layer_param)(hr_host* host, int32_t layer, int32_t index, hr_tensor* out);
  int32_t (*layer_num_activations)(hr_host* host, int32_t layer);
  hr_status (*layer_activation)(hr_host* host, int32_t layer, int32_t index, hr_tensor* out);

  /* Device ops on the current backend, on the compute stream, over n elements of dtype.
   * op_sum_squares and op_nonfinite wait for their result: it is ready when they return. */
  hr_status (*op_fill)(hr_host* host, void* x, uint32_t dtype, uint64_t n, double value);
  hr_status (*op_copy)(hr_host* host, void* dst, const void* src, uint64_t bytes); /* no overlap */
  hr_status (*op_cast)(hr_host* host, void* dst, uint32_t dst_dtype, const void* src,
                       uint32_t src_dtype, uint64_t n); /* round to nearest even */
  hr_status (*op_scale)(hr_host* host, void* x, uint32_t dtype, uint64_t n, double s);
  /* y += a * x */
  hr_status (*op_axpy)(hr_host* host, void* y, const void* x, uint32_t dtype, uint64_t n, double a);
  hr_status (*op_sum_squares)(hr_host* host, const void* x, uint32_t dtype, uint64_t n,
                              double* out);
  /* *out = 1 when any element is NaN or infinite, else 0 */
  hr_status (*op_nonfinite)(hr_host* host, const void* x, uint32_t dtype, uint64_t n, int32_t* out);

  /* The device and the distributed run. */
  const char* (*device_kind)(hr_host* host); /* "cpu", "cuda" */
  int32_t (*device_index)(hr_host* host);
  void* (*stream)(hr_host* host); /* the compute stream (cudaStream_t); NULL on the CPU */
  int32_t (*rank)(hr_host* host);
  int32_t (*world_size)(hr_host* host);

  /* Step control. veto_step: from any event of the step up to and including OPTIMIZER_STEP, the
   * optimizer update is skipped (OPTIMIZER_STEP is not dispatched when the veto came earlier);
   * the step still ends with STEP_END. A veto at STEP_END is too late and is ignored.
   * request_retry: from the OOM event, the failed micro-step is run again once its memory is
   * released — honoured while no layer of the micro-step has finished its backward (gradients
   * untouched); otherwise the run stops with the OOM report. */
  void (*veto_step)(hr_host* host, const char* reason);
  void (*request_retry)(hr_host* host, const char* reason);

  /* ABI 1.2: virtual memory, for allocators that grow a segment page by page so that a large
   * request never needs one contiguous hole (CUDA: cuMemAddressReserve, cuMemCreate + cuMemMap +
   * cuMemSetAccess, cuMemUnmap, cuMemAddressFree; the CPU backend models the same over its
   * memory arena). Sizes and addresses are multiples of vm_granularity(). vm_reserve returns an
   * address range with no memory behind it (NULL on failure); vm_map backs [addr, addr+bytes)
   * with device memory, HR_ERROR_OUT_OF_MEMORY when there is not enough; vm_unmap gives it back;
   * vm_release returns the whole range (unmapped first). Allocator role only. */
  uint64_t (*vm_granularity)(hr_host* host);
  void* (*vm_reserve)(hr_host* host, uint64_t bytes);
  hr_status (*vm_map)(hr_host* host, void* addr, uint64_t bytes);
  hr_status (*vm_unmap)(hr_host* host, void* addr, uint64_t bytes);
  hr_status (*vm_release)(hr_host* host, void* addr, uint64_t bytes);

  /* ABI 1.3: activation recomputation. From FORWARD_END(layer) only, for that layer: frees
   * activations the layer saved and marks it for recomputation; in backward, after
   * BACKWARD_BEGIN(layer) and before the layer's backward, the host rebuilds them (no FORWARD_*
   * events; ALLOC / FREE fire) — on the CPU bitwise equal to the originals, same kernels on the
   * same inputs. `what`:
   *  - HR_DROP_ALL: everything but the output (the next layer's input); backward re-runs the
   *    layer's whole forward from its input.
   *  - HR_DROP_CHEAP: selective recomputation (Korthikanti et al. 2022): a block keeps its GEMM
   *    outputs (qkv, the attention residual, fc), its output and its LayerNorm statistics, and
   *    frees the attention output and what the attention keeps besides it (its log-sum-exp or
   *    its probabilities); backward recomputes just those, no GEMM. (A block keeps no LayerNorm
   *    or GELU output: its backward computes them again in any case.)
   * Only transformer blocks (layers 1 .. num_layers-2) can be dropped; the embedding, the head, a
   * layer out of range, another `what`, or a call from any other event is HR_ERROR_INVALID with a
   * message. Calling it twice for one layer is harmless (ALL after CHEAP frees the rest; CHEAP
   * after ALL changes nothing). */
  hr_status (*drop_activations)(hr_host* host, int32_t layer, uint32_t what);

  /* ABI 1.4: precision, the mechanism the amp plugin drives.
   * set_compute_dtype: only from create (the model is built after every plugin is created). The
   * model then computes in `dtype` (HR_DTYPE_BF16 or HR_DTYPE_F16; HR_DTYPE_F32 is the default):
   * activations and compute copies of the parameters in that dtype, cast from the f32 masters
   * (round to nearest even) after every optimizer step; each micro-step's gradients in that dtype,
   * added into f32 gradients as each layer's backward ends. layer_param keeps returning the f32
   * masters and f32 gradients (what the optimizer updates); layer_activation views carry the
   * compute dtype.
   * HR_ERROR_INVALID (with a message) from any other event, for another dtype, or when another
   * plugin already chose a different one.
   * set_loss_scale: the backward of every micro-step of each step whose STEP_BEGIN dispatch ends
   * after the call starts from the loss gradient times `scale` (finite, > 0; default 1), so the
   * f32 gradients at GRADS_READY are scaled by it: a plugin that scales unscales them (op_scale)
   * before the optimizer runs, or vetoes the step. The metrics report it as loss_scale. Any
   * event. */
  hr_status (*set_compute_dtype)(hr_host* host, uint32_t dtype);
  hr_status (*set_loss_scale)(hr_host* host, double scale);

  /* ABI 1.5: extensions. The table above is frozen at 1.4; every service from 1.5 on is an
   * extension: a versioned table of functions named by an id such as "headroom.tensors/1", each
   * with its header in headroom/ext/. get_extension returns the host's table for `id`, valid
   * until destroy() returns, or NULL when this host has no such extension (or no such version):
   * the plugin then does without it, or fails create() with a message. Any thread, any time.
   * A role-only extension (headroom.vm/1: the allocator role) is returned to every plugin, but its
   * functions answer HR_ERROR_NOT_ALLOWED (with a message) to a plugin without the role — as do
   * the 1.4 table's vm_* and raw_* functions. */
  const void* (*get_extension)(hr_host* host, const char* id);
} hr_host_services;

/* ---------------------------------------------------------------------------------------------
 * What a plugin provides */

/* Where save_state writes (ABI 1.1): write() appends bytes to the plugin's part of the snapshot. */
typedef struct hr_state_writer {
  uint32_t struct_size;
  uint32_t reserved0;
  void* context;
  hr_status (*write)(void* context, const void* data, uint64_t size);
} hr_state_writer;

/* What an allocator holds (ABI 1.2), for the memory report and `headroom replay`. */
typedef struct hr_allocator_stats {
  uint32_t struct_size;
  uint32_t reserved0;
  uint64_t allocated;          /* bytes in blocks handed out now */
  uint64_t reserved;           /* bytes taken from the device (segments and mapped pages) */
  uint64_t largest_free_block; /* the largest request it could serve now without the device */
  uint64_t device_allocs;      /* calls to raw_alloc / vm_map so far */
  uint64_t retries;            /* requests served after releasing its cache */
  uint64_t ooms;               /* requests it could not serve */
} hr_allocator_stats;

/* The allocator role. Both on the training thread, on `stream` (NULL on the CPU). allocate returns
 * at least `bytes` of device memory, or NULL when there is none (the host then reports OOM). */
typedef struct hr_allocator_hooks {
  uint32_t struct_size;
  uint32_t reserved0;
  void* (*allocate)(void* instance, uint64_t bytes, uint32_t category, void* stream);
  void (*deallocate)(void* instance, void* ptr, uint64_t bytes, void* stream);
  /* ABI 1.2; may be NULL. Training thread. */
  hr_status (*stats)(void* instance, hr_allocator_stats* out);
} hr_allocator_hooks;

/* The optimizer role. step() runs after OPTIMIZER_STEP was dispatched, on the training thread; it
 * reads parameters and gradients through layer_param and keeps its state in memory from alloc
 * (category HR_MEM_OPTIMIZER). */
typedef struct hr_resize_info hr_resize_info; /* headroom/ext/resize.h */
typedef struct hr_optimizer_hooks {
  uint32_t struct_size;
  uint32_t reserved0;
  hr_status (*step)(void* instance, const hr_optimizer_step_info* info);
  /* Appended (ABI 1.5, HR_HAS_FIELD); may be NULL. Structured pruning (headroom/ext/resize.h)
   * shrank one parameter: keep the state of the elements it kept, drop the rest. Training thread,
   * inside the resize call that shrank it (STEP_END or TRAIN_BEGIN), after layer_param already
   * describes its new shape; once per shrunk parameter. A plugin without it cannot be used with
   * pruning: the resize is refused before anything changes. */
  hr_status (*resize)(void* instance, const hr_resize_info* info);
} hr_optimizer_hooks;

typedef struct hr_plugin_descriptor {
  uint32_t struct_size;
  uint32_t abi_version;    /* HR_ABI_VERSION the plugin was compiled against */
  const char* name;        /* [a-z0-9_]+, what [[plugins]] name = "..." matches */
  const char* version;     /* the plugin's own, e.g. "1.2.0" */
  const char* description; /* one line for `headroom plugins` */
  uint64_t events;         /* HR_EVENT_BIT()s of the events on_event wants */
  uint32_t roles;          /* HR_ROLE_* it provides, or 0 */
  uint32_t reserved0;      /* zero */

  /* Training thread, once, after loading and before TRAIN_BEGIN. Reads its config through the
   * services (which stay valid until destroy returns) and sets *instance. On failure: set_error
   * and a non-zero status; destroy is then not called. */
  hr_status (*create)(const hr_host_services* services, void** instance);
  /* Training thread, once, after TRAIN_END (or after a failed run), before the library is
   * unloaded. Frees what create and the hooks allocated. */
  void (*destroy)(void* instance);
  /* Training thread, for each subscribed event, in TOML order across plugins. A non-zero status
   * (HR_ERROR_OUT_OF_MEMORY included) stops the run with exit code 1 and a message naming the
   * plugin and the event. */
  hr_status (*on_event)(void* instance, const hr_event_info* info);

  const hr_allocator_hooks* allocator; /* when roles has HR_ROLE_ALLOCATOR; else NULL */
  const hr_optimizer_hooks* optimizer; /* when roles has HR_ROLE_OPTIMIZER; else NULL */

  /* ABI 1.1: training snapshots ([snapshot] in the config, `headroom train --resume`). Either may
   * be NULL: a plugin without save_state has nothing in snapshots.
   * save_state: training thread, after STEP_END of a snapshot step; writes everything the plugin
   * needs to continue exactly (e.g. a loss scale and its counters) through writer->write.
   * load_state: training thread, once, in a resumed run whose snapshot holds the plugin's state:
   * after create(), the model's build and the snapshot's values loaded into it, before
   * TRAIN_BEGIN; gets back exactly the bytes save_state wrote. The model may be read there
   * (headroom/ext/state.h says exactly what exists). A non-zero status stops the run. */
  hr_status (*save_state)(void* instance, const hr_state_writer* writer);
  hr_status (*load_state)(void* instance, const void* data, uint64_t size);

  /* ABI 1.5; may be NULL. What the plugin offers the host, by id, the same way the host offers
   * its services: "headroom.state/1" (instead of save_state / load_state),
   * "headroom.allocator/1" and "headroom.optimizer/1" (the role hooks, instead of the two fields
   * above; the role bits in roles still say which roles it takes), "headroom.estimate/1" (what
   * it would do to the run's memory, for `headroom plan` and the out-of-memory advice). Returns
   * a static table, or NULL for an id it does not offer. Any thread, any time after the entry
   * point returned, also for a library whose plugin was never created. A descriptor field, when
   * set, wins over the extension of the same purpose. */
  const void* (*get_extension)(const char* id);
} hr_plugin_descriptor;

/* ---------------------------------------------------------------------------------------------
 * The entry point */

typedef struct hr_entry_args {
  uint32_t struct_size;
  uint32_t host_abi_min;                  /* in: the oldest ABI version the host speaks */
  uint32_t host_abi_max;                  /* in: the newest */
  uint32_t plugin_abi;                    /* out: the version the plugin chose, within [min, max] */
  const hr_plugin_descriptor* descriptor; /* out: static storage, valid while loaded */
  char* error;                            /* in: a buffer for the plugin's message on failure */
  size_t error_size;
} hr_entry_args;

typedef hr_status (*hr_plugin_entry_fn)(hr_entry_args* args);

#define HR_PLUGIN_ENTRY_SYMBOL "hr_plugin_entry"

#if defined(_WIN32)
#define HR_PLUGIN_EXPORT __declspec(dllexport)
#else
#define HR_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

/* A plugin defines this, and nothing else is exported:
 *   HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) { ... } */
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args);

/* The usual negotiation: accept the host's range when it includes this header's major version,
 * and answer the newer of the two sides' common versions (an older host gets its own). A refusal
 * still reports this header's version in plugin_abi, so the host's message can name both. */
static inline hr_status hr_negotiate(hr_entry_args* args, const hr_plugin_descriptor* descriptor) {
  if (HR_ABI_MAJOR(args->host_abi_min) > HR_ABI_VERSION_MAJOR ||
      HR_ABI_MAJOR(args->host_abi_max) < HR_ABI_VERSION_MAJOR) {
    args->plugin_abi = HR_ABI_VERSION;
    return HR_ERROR_VERSION;
  }
  args->plugin_abi = args->host_abi_max < HR_ABI_VERSION ? args->host_abi_max : HR_ABI_VERSION;
  args->descriptor = descriptor;
  return HR_OK;
}

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_PLUGIN_H */
