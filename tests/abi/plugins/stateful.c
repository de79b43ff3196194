/* Test plugin with a state in snapshots: save_state writes a few bytes; load_state gets them back
 * and, when the table says so, refuses them.
 *
 * Keys: load_status (int: what load_state returns; default 0, HR_OK), load_message (string: the
 * message it hands set_error first; default none), create_message (string: when given, create
 * hands it to set_error and returns HR_ERROR_CONFIG, as a plugin does for a problem with its
 * table that no one key is to blame for). */
#include <headroom/plugin.h>
#include <stdlib.h>
#include <string.h>

static const char kState[] = "stateful v1";

typedef struct stateful {
  const hr_host_services* services;
  int64_t load_status;
  char load_message[256];
  char create_message[256];
} stateful;

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  stateful* p = (stateful*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  if ((st = s->config_int(s->host, "load_status", &p->load_status)) != HR_OK ||
      (st = s->config_string(s->host, "load_message", p->load_message, sizeof p->load_message)) !=
          HR_OK ||
      (st = s->config_string(s->host, "create_message", p->create_message,
                             sizeof p->create_message)) != HR_OK) {
    free(p);
    return st;
  }
  if (p->create_message[0] != '\0') {
    s->set_error(s->host, p->create_message);
    free(p);
    return HR_ERROR_CONFIG;
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static hr_status save_state(void* instance, const hr_state_writer* writer) {
  (void)instance;
  return writer->write(writer->context, kState, sizeof kState);
}

static hr_status load_state(void* instance, const void* data, uint64_t size) {
  stateful* p = (stateful*)instance;
  const hr_host_services* s = p->services;
  if (p->load_status != HR_OK) {
    if (p->load_message[0] != '\0') s->set_error(s->host, p->load_message);
    return (hr_status)p->load_status;
  }
  if (size != sizeof kState || memcmp(data, kState, sizeof kState) != 0) {
    s->set_error(s->host, "stateful: not the bytes save_state wrote");
    return HR_ERROR;
  }
  return HR_OK;
}

static const hr_plugin_descriptor kDescriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                                                 .abi_version = HR_ABI_VERSION,
                                                 .name = "stateful",
                                                 .version = "1.0.0",
                                                 .description = "test plugin: state in snapshots",
                                                 .events = 0,
                                                 .roles = 0,
                                                 .create = create,
                                                 .destroy = destroy,
                                                 .on_event = NULL,
                                                 .allocator = NULL,
                                                 .optimizer = NULL,
                                                 .save_state = save_state,
                                                 .load_state = load_state};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
