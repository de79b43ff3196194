/* headroom.shard/1 — model state sharded across ranks, ZeRO's mechanism (ABI 1.5).
 *
 * Each layer's parameters, gradients and optimizer state live in one flat buffer per kind, its
 * element count padded to a multiple of the world size W and partitioned into W equal contiguous
 * ranges: rank r owns [r·S, (r+1)·S). What is sharded is chosen once, from create():
 *
 *   HR_SHARD_OPTIMIZER   the optimizer state, and with it the update, covers only the rank's
 *                        ranges (zero1). The gradients must be reduced into those ranges before
 *                        GRADS_READY, and the updated parameters gathered back by STEP_END.
 *   HR_SHARD_GRADIENTS   with HR_SHARD_OPTIMIZER: each layer keeps only its gradient shard; the
 *                        full gradients exist from the layer's backward until they are reduced
 *                        (zero2).
 *   HR_SHARD_PARAMETERS  with both: each layer keeps only its parameter shard (its masters' range
 *                        and, with amp, the compute copy's). The full parameters exist from
 *                        gather_parameters until release_parameters; the forward and the
 *                        backward of a layer need its own and its tied layer's gathered (zero3).
 *                        A layer of fewer elements than persist_below() set keeps its parameters
 *                        whole, as zero2's (layout's `whole`). Frozen parameters (no gradient:
 *                        LoRA's base, [train] freeze) are sharded, gathered and released with
 *                        their layer the same way, and never reduced; below zero3 they are
 *                        replicated.
 *
 * The plugin that shards takes the gradient-reduction role (HR_ROLE_GRADIENT_REDUCTION): core's
 * data-parallel buckets are then off. When it reduces, gathers and releases is its policy; the
 * host checks that every layer was reduced since its last backward before GRADS_READY, that every
 * whole layer was gathered after the update before STEP_END is over, that a sharded layer's
 * parameters (and its tied layer's) are gathered when it computes, and that none is still gathered
 * at the end of STEP_END, and stops the run with an error naming the plugin and the layers
 * otherwise. The host waits for a layer's gathering before it computes, and for whatever is still
 * in flight at the end of each micro-step's backward and at STEP_END. An allocation that fails in
 * a call here returns HR_ERROR_OUT_OF_MEMORY; the run then ends as out of memory (exit 3).
 *
 * Training thread. Collectives: never from inside an allocation (ALLOC, FREE, OOM hooks, the
 * allocator role's hooks). Every rank must make the same calls in the same order. */
#ifndef HEADROOM_EXT_SHARD_H
#define HEADROOM_EXT_SHARD_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_SHARD "headroom.shard/1"

#define HR_SHARD_OPTIMIZER 1u
#define HR_SHARD_GRADIENTS 2u
#define HR_SHARD_PARAMETERS 4u

/* An out-struct: the caller sets struct_size; the host fills what it covers. */
typedef struct hr_shard_layout {
  uint32_t struct_size;
  uint32_t what;      /* the HR_SHARD_* bits in force (0 before partition, or never) */
  int32_t rank;       /* this process's rank, 0 <= rank < world_size */
  int32_t world_size; /* W */
  uint64_t numel;     /* the layer's trainable parameter elements (its flat buffer) */
  uint64_t padded;    /* numel rounded up to a multiple of W (numel when nothing is sharded) */
  uint64_t shard;     /* padded / W: the elements of each rank's range */
  uint64_t begin;     /* this rank's range starts here: rank * shard */
  /* Since ABI 1.5's zero3 (check HR_HAS_FIELD): */
  uint32_t whole; /* 1: the layer's parameters are not sharded (no HR_SHARD_PARAMETERS, or a layer
                   * smaller than persist_below()): gather_parameters is its zero2 all-gather */
  int32_t tied;   /* the other layer whose parameters this layer's forward and backward read, or
                   * -1 (the head reads the embedding's tied token embedding: 0) */
} hr_shard_layout;

typedef struct hr_ext_shard {
  uint32_t struct_size;
  uint32_t reserved0;
  /* From create() only, once for the run: what is sharded (HR_SHARD_OPTIMIZER, optionally |
   * HR_SHARD_GRADIENTS, optionally | HR_SHARD_PARAMETERS with both). HR_ERROR_INVALID for other
   * bits, a stage without the ones below it, a plugin
   * without HR_ROLE_GRADIENT_REDUCTION, or an optimizer-role plugin in the run (its state is its
   * own: it cannot be partitioned); each with a message. What the host shards may be less: on
   * one rank only HR_SHARD_OPTIMIZER (a shard would be the whole), unless the parameters' shards
   * rest in host memory (headroom.offload/1 set_parameter_place). layout()'s `what` says what is
   * in force, from TRAIN_BEGIN: a plugin reads it there. */
  hr_status (*partition)(hr_host* host, uint32_t what);
  /* Layer `layer`'s partition, any time after create(); HR_ERROR_INVALID for a layer out of
   * range or before the model exists. */
  hr_status (*layout)(hr_host* host, int32_t layer, hr_shard_layout* out);
  /* Starts reducing layer `layer`'s gradients (the rank's micro-steps so far, averaged over the
   * ranks) into this rank's range; asynchronous. From BACKWARD_END of that layer or later in the
   * same micro-step. Without HR_SHARD_GRADIENTS only in the step's last micro-step (the other
   * ranges are overwritten). With it, the result is added into the layer's gradient shard and the
   * full gradients are freed when done; the next backward makes them again, zeroed. HR_ERROR
   * with a message when the layer's gradients were reduced already since its backward, or the
   * communicator failed. */
  hr_status (*reduce_gradients)(hr_host* host, int32_t layer);
  /* Starts gathering layer `layer`'s parameters from every rank's range; asynchronous.
   * A whole layer (layout's `whole`): its updated ranges, in place, from STEP_END (after the
   * update); with amp the compute copy follows when done.
   * A sharded layer (HR_SHARD_PARAMETERS): into a full buffer of the compute dtype (the
   * parameters' bytes rise by the layer's), any time in the step; nothing when it is gathered or
   * being gathered already. The host waits for it before the layer computes. */
  hr_status (*gather_parameters)(hr_host* host, int32_t layer);
  /* Waits for every reduction and gathering started and finishes each. HR_ERROR with a message
   * naming the rank when a collective cannot complete. */
  hr_status (*wait)(hr_host* host);
  /* Layer `layer`'s gradients as the optimizer will read them on this rank, once reduced: its
   * range of the full gradients (HR_SHARD_OPTIMIZER) or its gradient shard (with
   * HR_SHARD_GRADIENTS); f32, `shard` elements, the padding included (zero). For a plugin that
   * checks or rescales the gradients at GRADS_READY (amp's loss scaler) when they are sharded:
   * each rank sees only its ranges, so such a plugin agrees with the other ranks
   * (headroom.comm/1) before acting. With the parameters offloaded (headroom.offload/1
   * set_parameter_place) a sharded layer's shard is host memory: read it through the host's
   * services (headroom.precision/1 nonfinite_many routes each span to its place), not a kernel
   * of one's own on the device. HR_ERROR_INVALID when nothing is sharded or for a layer out of
   * range. */
  hr_status (*gradient_range)(hr_host* host, int32_t layer, hr_tensor* out);
  /* Since ABI 1.5's zero3 (check HR_HAS_FIELD): */
  /* From create() only, with HR_SHARD_PARAMETERS: layers of fewer than `elements` parameter
   * elements, frozen ones included, keep their parameters whole (DeepSpeed's
   * param_persistence_threshold, here per layer: a layer's parameters are one flat buffer, and
   * its frozen ones another). 0, the default: every layer sharded. */
  hr_status (*persist_below)(hr_host* host, uint64_t elements);
  /* Frees layer `layer`'s gathered parameters, waiting first if their gathering is in flight;
   * nothing when they are not gathered. Any time in the step; by the end of STEP_END every
   * sharded layer must be released (the host checks: nothing gathered outlives a step).
   * HR_ERROR_INVALID for a whole layer or a layer out of range. */
  hr_status (*release_parameters)(hr_host* host, int32_t layer);
} hr_ext_shard;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_SHARD_H */
