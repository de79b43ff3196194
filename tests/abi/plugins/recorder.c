/* Test plugin: records every event it receives, one line each, to the file named by `out`.
 *
 *   rec_a STEP_BEGIN step=1 micro=0 layer=-1 sum=...
 *
 * Built as several plugins (PLUGIN_NAME rec_a, rec_b) so that two of them appending to one file
 * show the order in which the host dispatches across plugins. Lines of STEP_BEGIN, OPTIMIZER_STEP
 * and STEP_END end with the sum of layer 1's parameters, so a test can see whether a step changed
 * them.
 *
 * Keys: out (string, required), alloc_events (bool: also record ALLOC / FREE / OOM; default false),
 * veto_step (int: veto that step at GRADS_READY), fail_event (string, an event name) and fail_step
 * (int, 0 = any): return HR_ERROR with "deliberate failure" at that event of that step; log
 * (string): a message to log at TRAIN_BEGIN, with level HR_LOG_WARN.
 *
 * With ranks (mpirun): BUCKET_LAUNCH and BUCKET_DONE lines end with bytes=; fail_rank (int, -1 =
 * every rank) limits fail_event to that rank; hog_rank and hog_bytes: at TRAIN_BEGIN that rank
 * allocates hog_bytes of device memory (workspace) and holds it to the end, so that under a
 * memory_limit the host's own next allocation on that rank alone runs out of memory. The rank is
 * the launcher's (OMPI_COMM_WORLD_RANK, PMIX_RANK), else the host's services->rank. per_rank
 * (bool): record to `out`.rank<r> instead, one file per rank. times (bool): end every line with
 * t=<milliseconds since create> (CLOCK_MONOTONIC), for a timeline. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef PLUGIN_NAME
#error "define PLUGIN_NAME"
#endif
#ifndef PLUGIN_VERSION
#define PLUGIN_VERSION "0.1.0"
#endif

#define NUM_EVENTS (HR_EVENT_BUCKET_DONE + 1)
static const char* const kEventNames[NUM_EVENTS] = {
    "TRAIN_BEGIN", "TRAIN_END",      "STEP_BEGIN",   "STEP_END",      "FORWARD_BEGIN",
    "FORWARD_END", "BACKWARD_BEGIN", "BACKWARD_END", "GRADS_READY",   "OPTIMIZER_STEP",
    "ALLOC",       "FREE",           "OOM",          "BUCKET_LAUNCH", "BUCKET_DONE"};

typedef struct recorder {
  const hr_host_services* services;
  FILE* out;
  int32_t alloc_events;
  int64_t veto_step;
  int32_t fail_event; /* -1: none */
  int64_t fail_step;
  int64_t fail_rank; /* -1: every rank */
  int64_t hog_rank;  /* -1: none */
  int64_t hog_bytes;
  void* hog;
  int rank;
  char log[256];
  int32_t times;
  double t0; /* now_ms() at create */
} recorder;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int launcher_rank(const hr_host_services* s) {
  const char* names[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK"};
  for (int i = 0; i < 2; ++i) {
    const char* v = getenv(names[i]);
    if (v && *v) return atoi(v);
  }
  return s->rank(s->host);
}

static int event_by_name(const char* name) {
  for (int i = 0; i < NUM_EVENTS; ++i) {
    if (strcmp(kEventNames[i], name) == 0) return i;
  }
  return -1;
}

/* The sum of every f32 element of layer 1's parameters, or a note why there is none. */
static void param_sum(const recorder* r, char* buf, size_t size) {
  const hr_host_services* s = r->services;
  const char* kind = s->device_kind(s->host);
  double sum = 0.0;
  if (!kind || strcmp(kind, "cpu") != 0 || s->num_layers(s->host) < 2) {
    snprintf(buf, size, "none");
    return;
  }
  const int32_t n = s->layer_num_params(s->host, 1);
  for (int32_t i = 0; i < n; ++i) {
    hr_tensor t;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    if (s->layer_param(s->host, 1, i, &t) != HR_OK || t.dtype != HR_DTYPE_F32 || !t.data) {
      snprintf(buf, size, "error");
      return;
    }
    for (uint64_t k = 0; k < t.numel; ++k)
      sum += ((const float*)t.data)[k];
  }
  snprintf(buf, size, "%.17g", sum);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  recorder* r = (recorder*)instance;
  const hr_host_services* s = r->services;
  const char* name;
  char sum[64];
  if (info->struct_size < sizeof(hr_event_info)) {
    s->set_error(s->host, PLUGIN_NAME ": hr_event_info smaller than ABI v1.0's");
    return HR_ERROR_INVALID;
  }
  if (info->event >= NUM_EVENTS) return HR_OK; /* a later version's event: not ours */
  name = kEventNames[info->event];
  if (!r->alloc_events && (info->event == HR_EVENT_ALLOC || info->event == HR_EVENT_FREE ||
                           info->event == HR_EVENT_OOM))
    return HR_OK;

  fprintf(r->out, "%s %s step=%lld micro=%d layer=%d", PLUGIN_NAME, name, (long long)info->step,
          (int)info->micro_step, (int)info->layer);
  if (info->event == HR_EVENT_STEP_BEGIN || info->event == HR_EVENT_OPTIMIZER_STEP ||
      info->event == HR_EVENT_STEP_END) {
    param_sum(r, sum, sizeof sum);
    fprintf(r->out, " sum=%s", sum);
  }
  if (info->event == HR_EVENT_ALLOC || info->event == HR_EVENT_FREE || info->event == HR_EVENT_OOM)
    fprintf(r->out, " bytes=%llu category=%u", (unsigned long long)info->bytes,
            (unsigned)info->category);
  if (info->event == HR_EVENT_BUCKET_LAUNCH || info->event == HR_EVENT_BUCKET_DONE)
    fprintf(r->out, " bytes=%llu", (unsigned long long)info->bytes);
  if (r->times) fprintf(r->out, " t=%.3f", now_ms() - r->t0);
  fprintf(r->out, "\n");
  fflush(r->out);

  if (info->event == HR_EVENT_TRAIN_BEGIN && r->log[0] != '\0')
    s->log(s->host, HR_LOG_WARN, r->log);
  if (info->event == HR_EVENT_TRAIN_BEGIN && r->hog_rank == r->rank && r->hog_bytes > 0) {
    r->hog = s->alloc(s->host, (uint64_t)r->hog_bytes, HR_MEM_WORKSPACE, PLUGIN_NAME " hog");
    if (!r->hog) {
      s->set_error(s->host, PLUGIN_NAME ": hog_bytes could not be allocated");
      return HR_ERROR;
    }
  }
  if (info->event == HR_EVENT_GRADS_READY && r->veto_step != 0 && info->step == r->veto_step)
    s->veto_step(s->host, PLUGIN_NAME " vetoes this step");
  if ((int)info->event == r->fail_event && (r->fail_step == 0 || info->step == r->fail_step) &&
      (r->fail_rank < 0 || r->fail_rank == r->rank)) {
    s->set_error(s->host, "deliberate failure");
    return HR_ERROR;
  }
  return HR_OK;
}

static hr_status create(const hr_host_services* s, void** instance) {
  recorder* r;
  char path[4096] = "";
  char fail_event[64] = "";
  int32_t per_rank = 0;
  hr_status st;
  if (s->struct_size < sizeof(hr_host_services) || HR_ABI_MAJOR(s->abi_version) != 1) {
    s->set_error(s->host, PLUGIN_NAME ": the host's services table is not ABI v1");
    return HR_ERROR_VERSION;
  }
  r = (recorder*)calloc(1, sizeof *r);
  if (!r) return HR_ERROR_OUT_OF_MEMORY;
  r->services = s;
  r->fail_event = -1;
  r->fail_rank = -1;
  r->hog_rank = -1;
  r->rank = launcher_rank(s);
  r->t0 = now_ms();

  if ((st = s->config_string(s->host, "out", path, sizeof path)) != HR_OK ||
      (st = s->config_bool(s->host, "alloc_events", &r->alloc_events)) != HR_OK ||
      (st = s->config_int(s->host, "veto_step", &r->veto_step)) != HR_OK ||
      (st = s->config_string(s->host, "fail_event", fail_event, sizeof fail_event)) != HR_OK ||
      (st = s->config_int(s->host, "fail_step", &r->fail_step)) != HR_OK ||
      (st = s->config_int(s->host, "fail_rank", &r->fail_rank)) != HR_OK ||
      (st = s->config_int(s->host, "hog_rank", &r->hog_rank)) != HR_OK ||
      (st = s->config_int(s->host, "hog_bytes", &r->hog_bytes)) != HR_OK ||
      (st = s->config_bool(s->host, "per_rank", &per_rank)) != HR_OK ||
      (st = s->config_bool(s->host, "times", &r->times)) != HR_OK ||
      (st = s->config_string(s->host, "log", r->log, sizeof r->log)) != HR_OK) {
    free(r);
    return st;
  }
  if (path[0] == '\0') {
    free(r);
    return s->config_error(s->host, "out", PLUGIN_NAME " needs `out`, the file to record to");
  }
  if (fail_event[0] != '\0' && (r->fail_event = event_by_name(fail_event)) < 0) {
    free(r);
    return s->config_error(s->host, "fail_event", "not an event name, e.g. \"STEP_END\"");
  }
  if (per_rank) {
    const size_t len = strlen(path);
    snprintf(path + len, sizeof path - len, ".rank%d", r->rank);
  }
  r->out = fopen(path, "a");
  if (!r->out) {
    free(r);
    s->set_error(s->host, PLUGIN_NAME ": cannot open the `out` file");
    return HR_ERROR;
  }
  fprintf(r->out, "%s CREATE\n", PLUGIN_NAME);
  fflush(r->out);
  *instance = r;
  return HR_OK;
}

static void destroy(void* instance) {
  recorder* r = (recorder*)instance;
  if (r->hog) r->services->free(r->services->host, r->hog);
  fprintf(r->out, "%s DESTROY\n", PLUGIN_NAME);
  fclose(r->out);
  free(r);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = PLUGIN_NAME,
    .version = PLUGIN_VERSION,
    .description = "test plugin: records every event to a file",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_TRAIN_END) |
              HR_EVENT_BIT(HR_EVENT_STEP_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
              HR_EVENT_BIT(HR_EVENT_FORWARD_BEGIN) | HR_EVENT_BIT(HR_EVENT_FORWARD_END) |
              HR_EVENT_BIT(HR_EVENT_BACKWARD_BEGIN) | HR_EVENT_BIT(HR_EVENT_BACKWARD_END) |
              HR_EVENT_BIT(HR_EVENT_GRADS_READY) | HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP) |
              HR_EVENT_BIT(HR_EVENT_ALLOC) | HR_EVENT_BIT(HR_EVENT_FREE) |
              HR_EVENT_BIT(HR_EVENT_OOM) | HR_EVENT_BIT(HR_EVENT_BUCKET_LAUNCH) |
              HR_EVENT_BIT(HR_EVENT_BUCKET_DONE),
    .roles = 0,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
