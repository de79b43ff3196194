/* Test plugin (ABI 1.5): partitions the optimizer state through headroom.shard/1 and then never
 * reduces or gathers anything, so that the host's checks stop the run naming it and the layers.
 * Key: reduce (bool, default false): reduce each layer at its BACKWARD_END as zero1 does, and
 * still gather nothing (the STEP_END check). */
#include <headroom/ext/shard.h>
#include <headroom/plugin.h>
#include <stdlib.h>

typedef struct lazy {
  const hr_host_services* s;
  const hr_ext_shard* shard;
  int32_t reduce;
} lazy;

static hr_status on_event(void* instance, const hr_event_info* info) {
  lazy* z = (lazy*)instance;
  if (!z->reduce || info->event != HR_EVENT_BACKWARD_END) return HR_OK;
  return z->shard->reduce_gradients(z->s->host, info->layer);
}

static hr_status create(const hr_host_services* s, void** instance) {
  lazy* z;
  const hr_ext_shard* shard = NULL;
  int32_t reduce = 0;
  hr_status st;
  if (HR_HAS_FIELD(s, hr_host_services, get_extension))
    shard = (const hr_ext_shard*)s->get_extension(s->host, HR_EXT_SHARD);
  if (!shard) return HR_ERROR_VERSION;
  if ((st = s->config_bool(s->host, "reduce", &reduce)) != HR_OK) return st;
  if ((st = shard->partition(s->host, HR_SHARD_OPTIMIZER)) != HR_OK) return st;
  z = (lazy*)calloc(1, sizeof *z);
  if (!z) return HR_ERROR_OUT_OF_MEMORY;
  z->s = s;
  z->shard = shard;
  z->reduce = reduce;
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
    .events = HR_EVENT_BIT(HR_EVENT_BACKWARD_END),
    .roles = HR_ROLE_GRADIENT_REDUCTION,
    .create = create,
    .destroy = destroy,
    .on_event = on_event};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
