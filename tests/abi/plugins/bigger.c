/* Test plugin from a newer minor version of the ABI, as an older host meets it: its descriptor is
 * the first member of a larger struct whose struct_size covers fields this header does not know,
 * and it says it was compiled against 1.<this header's minor + 1>. The host must read only the
 * fields it knows and run the hooks as usual. Appends to `out`:
 *
 *   bigger CREATE abi=<major>.<minor>      (services->abi_version: the version the host chose)
 *   bigger STEP_END step=<step>
 *
 * Built as `bigger`, which picks the newest version both sides speak, and as `bigger_naive`
 * (NAIVE_NEGOTIATE), which answers its own version whatever the host's range, as v1.0's
 * hr_negotiate does (it answers HR_ABI_VERSION, never clamped to host_abi_max). */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef PLUGIN_NAME
#define PLUGIN_NAME "bigger"
#endif

/* One minor version newer than the header it is compiled against. */
#define BIGGER_ABI HR_ABI_MAKE_VERSION(1, HR_ABI_VERSION_MINOR + 1)

typedef struct bigger_descriptor {
  hr_plugin_descriptor base; /* what a host of this header's version reads */
  /* What a later minor version might append: a host must not touch them. */
  uint64_t future_flags;
  const char* future_text;
  hr_status (*future_hook)(void* instance, uint64_t value);
  uint8_t future_padding[256];
} bigger_descriptor;

typedef struct bigger {
  const hr_host_services* services;
  char out[4096];
} bigger;

static hr_status append(bigger* b, const char* line) {
  FILE* f = fopen(b->out, "a");
  if (!f) {
    b->services->set_error(b->services->host, PLUGIN_NAME ": cannot open the `out` file");
    return HR_ERROR;
  }
  fprintf(f, "%s\n", line);
  fclose(f);
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  char line[64];
  if (info->event != HR_EVENT_STEP_END) return HR_OK;
  snprintf(line, sizeof line, PLUGIN_NAME " STEP_END step=%lld", (long long)info->step);
  return append((bigger*)instance, line);
}

static hr_status future_hook(void* instance, uint64_t value) {
  (void)instance;
  (void)value;
  return HR_ERROR; /* never called by a host that knows only this header */
}

static hr_status create(const hr_host_services* s, void** instance) {
  bigger* b = (bigger*)calloc(1, sizeof *b);
  if (!b) return HR_ERROR_OUT_OF_MEMORY;
  b->services = s;
  const hr_status st = s->config_string(s->host, "out", b->out, sizeof b->out);
  if (st != HR_OK || b->out[0] == '\0') {
    free(b);
    return st != HR_OK ? st : s->config_error(s->host, "out", PLUGIN_NAME " needs `out`");
  }
  char line[64];
  snprintf(line, sizeof line, PLUGIN_NAME " CREATE abi=%u.%u",
           (unsigned)HR_ABI_MAJOR(s->abi_version), (unsigned)HR_ABI_MINOR(s->abi_version));
  const hr_status w = append(b, line);
  if (w != HR_OK) {
    free(b);
    return w;
  }
  *instance = b;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const bigger_descriptor kDescriptor = {
    .base = {.struct_size = sizeof(bigger_descriptor),
             .abi_version = BIGGER_ABI,
             .name = PLUGIN_NAME,
             .version = "1.1.0",
             .description = "test plugin: a descriptor larger than v1.0's",
             .events = HR_EVENT_BIT(HR_EVENT_STEP_END),
             .roles = 0,
             .create = create,
             .destroy = destroy,
             .on_event = on_event,
             .allocator = NULL,
             .optimizer = NULL},
    .future_flags = ~(uint64_t)0,
    .future_text = "a field from the future",
    .future_hook = future_hook,
    .future_padding = {0xFF}};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  if (HR_ABI_MAJOR(args->host_abi_min) > 1 || HR_ABI_MAJOR(args->host_abi_max) < 1)
    return HR_ERROR_VERSION;
#ifdef NAIVE_NEGOTIATE
  args->plugin_abi = BIGGER_ABI;
#else
  args->plugin_abi = HR_ABI_MAJOR(args->host_abi_max) > 1 || args->host_abi_max >= BIGGER_ABI
                         ? BIGGER_ABI
                         : args->host_abi_max;
#endif
  args->descriptor = &kDescriptor.base;
  return HR_OK;
}
