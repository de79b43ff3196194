/* Test plugin: memory pressure from outside the model, for dynamic_batch's tests. At STEP_BEGIN
 * of step `at_step` it takes `bytes` of device memory through the host's alloc (so they count
 * against the memory wall, as workspace), at STEP_BEGIN of step at_step + 1 another `more_bytes`,
 * and at STEP_BEGIN of step `release_at` it gives both back (0: keeps them to the end).
 *
 * Keys: at_step, bytes, more_bytes, release_at (integers; default 0: no pressure). */
#include <headroom/plugin.h>
#include <stdlib.h>

typedef struct pressure {
  const hr_host_services* services;
  int64_t at_step, bytes, more_bytes, release_at;
  void* taken[2];
} pressure;

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  pressure* p = (pressure*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  if ((st = s->config_int(s->host, "at_step", &p->at_step)) != HR_OK ||
      (st = s->config_int(s->host, "bytes", &p->bytes)) != HR_OK ||
      (st = s->config_int(s->host, "more_bytes", &p->more_bytes)) != HR_OK ||
      (st = s->config_int(s->host, "release_at", &p->release_at)) != HR_OK) {
    free(p);
    return st;
  }
  *instance = p;
  return HR_OK;
}

static void give_back(pressure* p) {
  int i;
  for (i = 0; i < 2; ++i) {
    if (p->taken[i]) p->services->free(p->services->host, p->taken[i]);
    p->taken[i] = NULL;
  }
}

static void destroy(void* instance) {
  give_back((pressure*)instance);
  free(instance);
}

static hr_status take(pressure* p, int slot, int64_t bytes) {
  const hr_host_services* s = p->services;
  if (bytes <= 0) return HR_OK;
  p->taken[slot] = s->alloc(s->host, (uint64_t)bytes, HR_MEM_WORKSPACE, "pressure (test plugin)");
  if (!p->taken[slot]) {
    s->set_error(s->host, "pressure: could not take its bytes");
    return HR_ERROR_OUT_OF_MEMORY;
  }
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  pressure* p = (pressure*)instance;
  if (info->event != HR_EVENT_STEP_BEGIN || p->at_step <= 0) return HR_OK;
  if (p->release_at > 0 && info->step == p->release_at) give_back(p);
  if (info->step == p->at_step) return take(p, 0, p->bytes);
  if (info->step == p->at_step + 1) return take(p, 1, p->more_bytes);
  return HR_OK;
}

static const hr_plugin_descriptor kDescriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                                                 .abi_version = HR_ABI_VERSION,
                                                 .name = "pressure",
                                                 .version = "1.0.0",
                                                 .description = "test plugin: memory pressure",
                                                 .events = HR_EVENT_BIT(HR_EVENT_STEP_BEGIN),
                                                 .roles = 0,
                                                 .create = create,
                                                 .destroy = destroy,
                                                 .on_event = on_event};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
