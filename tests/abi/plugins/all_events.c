/* Test plugin that subscribes to every bit of hr_plugin_descriptor.events (~0), built three times:
 * against the frozen v1.4 header (all_events_v1_4), the frozen v1.5 one (all_events_v1_5) and
 * today's (all_events). A host gives a plugin only the events of the ABI version it negotiated,
 * so the 1.4 build never sees BUCKET_* (1.5) and neither frozen build sees EVAL_END (1.6).
 * Appends to `out`, for every event but ALLOC and FREE:
 *
 *   <name> CREATE abi=1.<minor>
 *   <name> EVENT <number> step=<step> loss=<%.17g> tokens=<n>
 *
 * and before TRAIN_END's EVENT line, the categories its ALLOC events carried (bit c for category
 * c): `<name> CATEGORIES <mask>`. A plugin older than 1.7 never sees HR_MEM_PLUGIN (7). At
 * TRAIN_BEGIN it asks for 64 bytes of category 7, which only a 1.7 plugin gets, and frees them:
 * `<name> ALLOC7 granted|refused`.
 *
 * It uses only what ABI 1.0 offers besides hr_event_info's loss and tokens, which it reads when
 * its header has them (1.5 on) and the host's struct_size covers them.
 *
 * Built for 1.8, its config key `set_events` (an integer) narrows its events in create() through
 * headroom.step/1's set_events (a refusal fails create() with the host's message; `widen_after =
 * true` then asks for all of them back), and at each STEP_BEGIN it receives it tries again, too
 * late: `<name> SET_EVENTS_LATE <status>`. */
#include <headroom/plugin.h>
#if PLUGIN_MINOR >= 8
#include <headroom/ext/step.h>
#endif
#include <stdio.h>
#include <stdlib.h>

#ifndef PLUGIN_NAME
#error "define PLUGIN_NAME"
#endif
#ifndef PLUGIN_MINOR
#error "define PLUGIN_MINOR (the minor of the header it must be built against)"
#endif
#if HR_ABI_VERSION_MAJOR != 1 || HR_ABI_VERSION_MINOR != PLUGIN_MINOR
#error "built against another header than PLUGIN_MINOR says"
#endif

typedef struct all_events {
  const hr_host_services* services;
  FILE* out;
  unsigned long categories; /* bit c: an ALLOC of category c */
} all_events;

static hr_status on_event(void* instance, const hr_event_info* info) {
  all_events* p = (all_events*)instance;
  double loss = 0.0;
  unsigned long long tokens = 0;
  if (info->event == HR_EVENT_ALLOC && info->category < 32) p->categories |= 1ul << info->category;
  if (info->event == HR_EVENT_ALLOC || info->event == HR_EVENT_FREE) return HR_OK;
#if PLUGIN_MINOR >= 8
  if (info->event == HR_EVENT_STEP_BEGIN) {
    const hr_ext_step* step =
        (const hr_ext_step*)p->services->get_extension(p->services->host, HR_EXT_STEP);
    fprintf(p->out, "%s SET_EVENTS_LATE %d\n", PLUGIN_NAME,
            (int)step->set_events(p->services->host, HR_EVENT_BIT(HR_EVENT_STEP_BEGIN)));
  }
#endif
  if (info->event == HR_EVENT_TRAIN_END)
    fprintf(p->out, "%s CATEGORIES %lu\n", PLUGIN_NAME, p->categories);
  if (info->event == HR_EVENT_TRAIN_BEGIN) {
    /* Category 7 (HR_MEM_PLUGIN from 1.7): a plugin of an older version may not ask for it. */
    const hr_host_services* s = p->services;
    void* b = s->alloc(s->host, 64, 7, "category 7 probe");
    fprintf(p->out, "%s ALLOC7 %s\n", PLUGIN_NAME, b ? "granted" : "refused");
    if (b) s->free(s->host, b);
  }
#if PLUGIN_MINOR >= 5
  if (HR_HAS_FIELD(info, hr_event_info, tokens)) {
    loss = info->loss;
    tokens = (unsigned long long)info->tokens;
  }
#endif
  fprintf(p->out, "%s EVENT %u step=%lld loss=%.17g tokens=%llu\n", PLUGIN_NAME,
          (unsigned)info->event, (long long)info->step, loss, tokens);
  fflush(p->out);
  return HR_OK;
}

static hr_status create(const hr_host_services* s, void** instance) {
  char path[4096] = {0};
  hr_status st;
  all_events* p = (all_events*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  st = s->config_string(s->host, "out", path, sizeof path);
  if (st != HR_OK || path[0] == '\0') {
    free(p);
    return st != HR_OK ? st : s->config_error(s->host, "out", PLUGIN_NAME " needs `out`");
  }
  p->out = fopen(path, "a");
  if (!p->out) {
    free(p);
    s->set_error(s->host, PLUGIN_NAME ": cannot open `out`");
    return HR_ERROR;
  }
  fprintf(p->out, "%s CREATE abi=%u.%u\n", PLUGIN_NAME, (unsigned)HR_ABI_MAJOR(s->abi_version),
          (unsigned)HR_ABI_MINOR(s->abi_version));
  fflush(p->out);
#if PLUGIN_MINOR >= 8
  {
    int64_t events = -1;
    st = s->config_int(s->host, "set_events", &events);
    int32_t widen = 0; /* then asks for every event back: refused, the events stay narrowed */
    if (st == HR_OK) st = s->config_bool(s->host, "widen_after", &widen);
    if (st == HR_OK && events >= 0) {
      const hr_ext_step* step = (const hr_ext_step*)s->get_extension(s->host, HR_EXT_STEP);
      st = step->set_events(s->host, (uint64_t)events);
      if (st == HR_OK && widen) st = step->set_events(s->host, ~(uint64_t)0);
    }
    if (st != HR_OK) {
      fclose(p->out);
      free(p);
      return st;
    }
  }
#endif
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  all_events* p = (all_events*)instance;
  fclose(p->out);
  free(p);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = PLUGIN_NAME,
    .version = "1.0.0",
    .description = "test plugin: subscribes to every event bit",
    .events = ~(uint64_t)0,
    .roles = 0,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
