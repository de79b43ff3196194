/* Test plugin: calls drop_activations (ABI 1.3) from an event of its choice, to show where the
 * host honours it and where it refuses.
 *
 * Keys: event (string: "FORWARD_END" (default), "FORWARD_BEGIN" or "BACKWARD_BEGIN"), offset
 * (int, default 0: drop layer info->layer + offset), all_layers (bool, default false: also the
 * embedding and the head; otherwise only the blocks 1 .. num_layers-2), what (int, default 0 =
 * HR_DROP_ALL; 1 = HR_DROP_CHEAP; anything else to see it refused). A refusal is returned as is,
 * so the run stops with the host's message. */
#include <headroom/plugin.h>
#include <stdlib.h>
#include <string.h>

typedef struct dropper {
  const hr_host_services* services;
  uint32_t event;
  int64_t offset;
  int32_t all_layers;
  uint32_t what;
} dropper;

static hr_status create(const hr_host_services* s, void** instance) {
  char event[32] = "FORWARD_END";
  dropper* d;
  int64_t offset = 0;
  int64_t what = HR_DROP_ALL;
  int32_t all_layers = 0;
  hr_status st;
  if (!HR_HAS_FIELD(s, hr_host_services, drop_activations)) {
    s->set_error(s->host, "needs ABI 1.3");
    return HR_ERROR_UNSUPPORTED;
  }
  st = s->config_string(s->host, "event", event, sizeof event);
  if (st == HR_OK) st = s->config_int(s->host, "offset", &offset);
  if (st == HR_OK) st = s->config_bool(s->host, "all_layers", &all_layers);
  if (st == HR_OK) st = s->config_int(s->host, "what", &what);
  if (st != HR_OK) return st;
  d = (dropper*)calloc(1, sizeof *d);
  if (!d) return HR_ERROR_OUT_OF_MEMORY;
  d->services = s;
  d->offset = offset;
  d->all_layers = all_layers;
  d->what = (uint32_t)what;
  if (strcmp(event, "FORWARD_BEGIN") == 0) {
    d->event = HR_EVENT_FORWARD_BEGIN;
  } else if (strcmp(event, "BACKWARD_BEGIN") == 0) {
    d->event = HR_EVENT_BACKWARD_BEGIN;
  } else if (strcmp(event, "FORWARD_END") == 0) {
    d->event = HR_EVENT_FORWARD_END;
  } else {
    free(d);
    return s->config_error(s->host, "event", "FORWARD_END, FORWARD_BEGIN or BACKWARD_BEGIN");
  }
  *instance = d;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  dropper* d = (dropper*)instance;
  const hr_host_services* s = d->services;
  const int32_t n = s->num_layers(s->host);
  const int32_t target = (int32_t)(info->layer + d->offset);
  if (info->event != d->event) return HR_OK;
  if (!d->all_layers && (target < 1 || target > n - 2)) return HR_OK;
  return s->drop_activations(s->host, target, d->what);
}

static const hr_plugin_descriptor kDescriptor = {sizeof(hr_plugin_descriptor),
                                                 HR_ABI_VERSION,
                                                 "dropper",
                                                 "0.1.0",
                                                 "test: drop_activations from a chosen event",
                                                 HR_EVENT_BIT(HR_EVENT_FORWARD_BEGIN) |
                                                     HR_EVENT_BIT(HR_EVENT_FORWARD_END) |
                                                     HR_EVENT_BIT(HR_EVENT_BACKWARD_BEGIN),
                                                 0,
                                                 0,
                                                 create,
                                                 destroy,
                                                 on_event,
                                                 NULL,
                                                 NULL,
                                                 NULL,
                                                 NULL,
                                                 NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
