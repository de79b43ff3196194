/* Test plugin built against the frozen ABI v1.4 header (tests/abi/v1.4) and nothing newer: every
 * later host must keep loading and running it. Appends to `out`:
 *
 *   frozen_v1_4 CREATE abi=1.<minor> granularity=<vm_granularity()>
 *   frozen_v1_4 <EVENT> step=<step>          at TRAIN_BEGIN, STEP_END and TRAIN_END
 *   frozen_v1_4 LOAD steps=<n>               when a resumed run hands back its state
 *
 * It keeps the number of STEP_ENDs seen as its snapshot state (save_state / load_state, 1.1), and
 * asks for vm_granularity (1.2) in create: without the allocator role, a 1.5 host answers 0. The
 * bytes after its descriptor are garbage where 1.5's get_extension would be: a host reading past
 * struct_size crashes. */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if HR_ABI_VERSION_MAJOR != 1 || HR_ABI_VERSION_MINOR != 4
#error "frozen_v1_4 must be built against the v1.4 header in tests/abi/v1.4"
#endif

typedef struct frozen {
  const hr_host_services* services;
  char out[4096];
  int64_t steps;
} frozen;

static hr_status append(frozen* f, const char* line) {
  FILE* file = fopen(f->out, "a");
  if (!file) {
    f->services->set_error(f->services->host, "frozen_v1_4: cannot open the `out` file");
    return HR_ERROR;
  }
  fprintf(file, "frozen_v1_4 %s\n", line);
  fclose(file);
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  frozen* f = (frozen*)instance;
  char line[128];
  const char* name = info->event == HR_EVENT_TRAIN_BEGIN ? "TRAIN_BEGIN"
                     : info->event == HR_EVENT_STEP_END  ? "STEP_END"
                     : info->event == HR_EVENT_TRAIN_END ? "TRAIN_END"
                                                         : "UNEXPECTED";
  if (info->event == HR_EVENT_STEP_END) ++f->steps;
  snprintf(line, sizeof line, "%s step=%lld", name, (long long)info->step);
  return append(f, line);
}

static hr_status create(const hr_host_services* s, void** instance) {
  char line[128];
  hr_status st;
  frozen* f = (frozen*)calloc(1, sizeof *f);
  if (!f) return HR_ERROR_OUT_OF_MEMORY;
  f->services = s;
  st = s->config_string(s->host, "out", f->out, sizeof f->out);
  if (st != HR_OK || f->out[0] == '\0') {
    free(f);
    return st != HR_OK ? st : s->config_error(s->host, "out", "frozen_v1_4 needs `out`");
  }
  snprintf(line, sizeof line, "CREATE abi=%u.%u granularity=%llu",
           (unsigned)HR_ABI_MAJOR(s->abi_version), (unsigned)HR_ABI_MINOR(s->abi_version),
           (unsigned long long)s->vm_granularity(s->host));
  st = append(f, line);
  if (st != HR_OK) {
    free(f);
    return st;
  }
  *instance = f;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static hr_status save_state(void* instance, const hr_state_writer* writer) {
  const frozen* f = (const frozen*)instance;
  return writer->write(writer->context, &f->steps, sizeof f->steps);
}

static hr_status load_state(void* instance, const void* data, uint64_t size) {
  frozen* f = (frozen*)instance;
  char line[64];
  if (size != sizeof f->steps) {
    f->services->set_error(f->services->host, "frozen_v1_4: not the bytes save_state wrote");
    return HR_ERROR_CONFIG;
  }
  memcpy(&f->steps, data, sizeof f->steps);
  snprintf(line, sizeof line, "LOAD steps=%lld", (long long)f->steps);
  return append(f, line);
}

static const struct {
  hr_plugin_descriptor descriptor;
  uint64_t trap[8];
} kPlugin = {
    .descriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                   .abi_version = HR_ABI_VERSION,
                   .name = "frozen_v1_4",
                   .version = "1.4.0",
                   .description = "test plugin: built against the frozen v1.4 header",
                   .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
                             HR_EVENT_BIT(HR_EVENT_TRAIN_END),
                   .roles = 0,
                   .create = create,
                   .destroy = destroy,
                   .on_event = on_event,
                   .allocator = NULL,
                   .optimizer = NULL,
                   .save_state = save_state,
                   .load_state = load_state},
    .trap = {UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF),
             UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF),
             UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF),
             UINT64_C(0xDEADBEEFDEADBEEF), UINT64_C(0xDEADBEEFDEADBEEF)}};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kPlugin.descriptor);
}
