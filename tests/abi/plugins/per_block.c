/* Test plugin: a known number of bytes per transformer block, for the planner's tests
 * (tests/plan_measure_test.cpp). At TRAIN_BEGIN it takes `bytes` of device memory (as optimizer
 * state) for each of the model's blocks (num_layers - 2: the embedding and the head have none) and
 * keeps them to the end. It offers no estimate: only a measurement can know it.
 *
 * Keys: bytes (integer, default 0). */
#include <headroom/plugin.h>
#include <stdlib.h>

typedef struct per_block {
  const hr_host_services* services;
  int64_t bytes;
  int32_t n;
  void** taken;
} per_block;

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  per_block* p = (per_block*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  if ((st = s->config_int(s->host, "bytes", &p->bytes)) != HR_OK) {
    free(p);
    return st;
  }
  if (p->bytes < 0) {
    s->set_error(s->host, "per_block: bytes must be 0 or more");
    free(p);
    return HR_ERROR_CONFIG;
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  per_block* p = (per_block*)instance;
  int32_t i;
  for (i = 0; i < p->n; ++i)
    if (p->taken[i]) p->services->free(p->services->host, p->taken[i]);
  free(p->taken);
  free(p);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  per_block* p = (per_block*)instance;
  const hr_host_services* s = p->services;
  int32_t blocks, i;
  if (info->event != HR_EVENT_TRAIN_BEGIN || p->bytes == 0 || p->taken) return HR_OK;
  blocks = s->num_layers(s->host) - 2;
  if (blocks <= 0) return HR_OK;
  p->taken = (void**)calloc((size_t)blocks, sizeof *p->taken);
  if (!p->taken) return HR_ERROR_OUT_OF_MEMORY;
  p->n = blocks;
  for (i = 0; i < blocks; ++i) {
    p->taken[i] =
        s->alloc(s->host, (uint64_t)p->bytes, HR_MEM_OPTIMIZER, "per_block (test plugin)");
    if (!p->taken[i]) {
      s->set_error(s->host, "per_block: could not take its bytes");
      return HR_ERROR_OUT_OF_MEMORY;
    }
  }
  return HR_OK;
}

static const hr_plugin_descriptor kDescriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                                                 .abi_version = HR_ABI_VERSION,
                                                 .name = "per_block",
                                                 .version = "1.0.0",
                                                 .description = "test plugin: bytes per block",
                                                 .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN),
                                                 .roles = 0,
                                                 .create = create,
                                                 .destroy = destroy,
                                                 .on_event = on_event};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
