/* Test plugin (ABI 1.5): partitions the optimizer state through headroom.shard/1 and then never
 * reduces or gathers anything, so that the host's checks stop the run naming it and the layers.
 * Keys:
 *   reduce (bool, default false): reduce each layer at its BACKWARD_END as zero1 does, and still
 *     gather nothing (the STEP_END check).
 *   parameters (string): shard the parameters too (zero3's bits, every layer sharded) and reduce
 *     each layer at its BACKWARD_END; "never_gather": gather none (the check before a layer's
 *     forward); "never_release": gather every layer at layer 0's FORWARD_BEGIN and release none
 *     (the check that nothing gathered outlives a step). */
#include <headroom/ext/shard.h>
#include <headroom/plugin.h>
#include <stdlib.h>
#include <string.h>

typedef struct lazy {
  const hr_host_services* s;
  const hr_ext_shard* shard;
  int32_t reduce;
  int32_t gather; /* parameters = "never_release": gather every layer at the first forward */
} lazy;

static hr_status on_event(void* instance, const hr_event_info* info) {
  lazy* z = (lazy*)instance;
  if (z->gather && info->event == HR_EVENT_FORWARD_BEGIN && info->layer == 0) {
    int32_t l;
    for (l = 0; l < z->s->num_layers(z->s->host); ++l) {
      const hr_status st = z->shard->gather_parameters(z->s->host, l);
      if (st != HR_OK) return st;
    }
    return HR_OK;
  }
  if (!z->reduce || info->event != HR_EVENT_BACKWARD_END) return HR_OK;
  return z->shard->reduce_gradients(z->s->host, info->layer);
}

static hr_status create(const hr_host_services* s, void** instance) {
  lazy* z;
  const hr_ext_shard* shard = NULL;
  int32_t reduce = 0;
  char parameters[32] = "";
  uint32_t what = HR_SHARD_OPTIMIZER;
  hr_status st;
  if (HR_HAS_FIELD(s, hr_host_services, get_extension))
    shard = (const hr_ext_shard*)s->get_extension(s->host, HR_EXT_SHARD);
  if (!shard) return HR_ERROR_VERSION;
  if ((st = s->config_bool(s->host, "reduce", &reduce)) != HR_OK) return st;
  if ((st = s->config_string(s->host, "parameters", parameters, sizeof parameters)) != HR_OK)
    return st;
  if (parameters[0]) {
    if (strcmp(parameters, "never_gather") != 0 && strcmp(parameters, "never_release") != 0)
      return s->config_error(s->host, "parameters",
                             "must be \"never_gather\" or \"never_release\"");
    what = HR_SHARD_OPTIMIZER | HR_SHARD_GRADIENTS | HR_SHARD_PARAMETERS;
    reduce = 1;
  }
  if ((st = shard->partition(s->host, what)) != HR_OK) return st;
  z = (lazy*)calloc(1, sizeof *z);
  if (!z) return HR_ERROR_OUT_OF_MEMORY;
  z->s = s;
  z->shard = shard;
  z->reduce = reduce;
  z->gather = strcmp(parameters, "never_release") == 0;
  *instance = z;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "lazy_shard",
    .version = "1.0.0",
    .description = "test plugin: shards the optimizer state, then forgets to reduce or gather",
    .events = HR_EVENT_BIT(HR_EVENT_BACKWARD_END) | HR_EVENT_BIT(HR_EVENT_FORWARD_BEGIN),
    .roles = HR_ROLE_GRADIENT_REDUCTION,
    .create = create,
    .destroy = destroy,
    .on_event = on_event};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
