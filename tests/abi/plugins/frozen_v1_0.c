/* Test plugin built against the frozen ABI v1.0 header (tests/abi/v1.0) and nothing newer: every
 * later host must keep loading it. Appends "frozen_v1_0 <EVENT> step=<step>" to `out` at
 * TRAIN_BEGIN, STEP_END and TRAIN_END. */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>

#if HR_ABI_VERSION_MAJOR != 1 || HR_ABI_VERSION_MINOR != 0
#error "frozen_v1_0 must be built against the v1.0 header in tests/abi/v1.0"
#endif

typedef struct frozen {
  const hr_host_services* services;
  char out[4096];
} frozen;

static hr_status on_event(void* instance, const hr_event_info* info) {
  frozen* f = (frozen*)instance;
  const char* name = info->event == HR_EVENT_TRAIN_BEGIN ? "TRAIN_BEGIN"
                     : info->event == HR_EVENT_STEP_END  ? "STEP_END"
                     : info->event == HR_EVENT_TRAIN_END ? "TRAIN_END"
                                                         : "UNEXPECTED";
  FILE* file = fopen(f->out, "a");
  if (!file) {
    f->services->set_error(f->services->host, "frozen_v1_0: cannot open the `out` file");
    return HR_ERROR;
  }
  fprintf(file, "frozen_v1_0 %s step=%lld\n", name, (long long)info->step);
  fclose(file);
  return HR_OK;
}

static hr_status create(const hr_host_services* s, void** instance) {
  frozen* f = (frozen*)calloc(1, sizeof *f);
  if (!f) return HR_ERROR_OUT_OF_MEMORY;
  f->services = s;
  const hr_status st = s->config_string(s->host, "out", f->out, sizeof f->out);
  if (st != HR_OK || f->out[0] == '\0') {
    free(f);
    return st != HR_OK ? st : s->config_error(s->host, "out", "frozen_v1_0 needs `out`");
  }
  *instance = f;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

/* The v1.0 descriptor (struct_size 88), followed by what a host reading past struct_size would take
 * for fields of a later minor version (1.1's save_state and load_state): non-NULL garbage, so that
 * such a host crashes rather than passes. */
static const struct {
  hr_plugin_descriptor descriptor;
  uint64_t trap[8];
} kPlugin = {
    .descriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                   .abi_version = HR_ABI_VERSION,
                   .name = "frozen_v1_0",
                   .version = "1.0.0",
                   .description = "test plugin: built against the frozen v1.0 header",
                   .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
                             HR_EVENT_BIT(HR_EVENT_TRAIN_END),
                   .roles = 0,
                   .create = create,
                   .destroy = destroy,
                   .on_event = on_event,
                   .allocator = NULL,
                   .optimizer = NULL},
    .trap = {UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF),
             UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF),
             UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF),
             UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF)}};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kPlugin.descriptor);
}
