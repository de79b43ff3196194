/* Test plugin: early stopping on the validation loss (ABI 1.6). At each EVAL_END it compares the
 * validation loss with the best so far; when `patience` evaluations in a row have not improved on
 * it by more than `min_delta`, it asks the host to stop the run (headroom.step/1 stop_run). Its
 * best loss and count are its snapshot state (headroom.state/1), so a resumed run goes on counting.
 *
 * Keys: out (string, required), patience (int >= 1, default 3), min_delta (float >= 0, default 0),
 * stop_at_train_begin (bool: ask at TRAIN_BEGIN instead, default false), stop_at_step (int: ask
 * at that step's STEP_END instead, default 0: never), only_rank (int: ask only on that rank,
 * default -1: every rank). Appends to `out`:
 *
 *   early_stop EVAL_END step=<step> loss=<%.17g> tokens=<n> best=<%.17g> bad=<n>
 *   early_stop STOP step=<step>                 when it asked the host to stop
 *   early_stop LOAD best=<%.17g> best_step=<s> bad=<n>
 *   early_stop TRAIN_END step=<step> */
#include <headroom/ext/state.h>
#include <headroom/ext/step.h>
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct early_stop {
  const hr_host_services* services;
  const hr_ext_step* step;
  char out[4096];
  int64_t patience;
  double min_delta;
  int32_t stop_at_train_begin;
  int64_t stop_at_step, only_rank;
  /* the state */
  int64_t best_step; /* 0: no evaluation yet */
  double best;
  int64_t bad;
} early_stop;

static hr_status append(early_stop* p, const char* line) {
  FILE* f = fopen(p->out, "a");
  if (!f) {
    p->services->set_error(p->services->host, "early_stop: cannot open `out`");
    return HR_ERROR;
  }
  fprintf(f, "early_stop %s\n", line);
  fclose(f);
  return HR_OK;
}

static hr_status stop(early_stop* p, int64_t step, const char* reason) {
  char line[64];
  hr_status st = p->step->stop_run(p->services->host, reason);
  if (st != HR_OK) return st;
  snprintf(line, sizeof line, "STOP step=%lld", (long long)step);
  return append(p, line);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  early_stop* p = (early_stop*)instance;
  char line[256];
  hr_status st;
  const int asks = p->only_rank < 0 || p->services->rank(p->services->host) == p->only_rank;
  if (info->event == HR_EVENT_TRAIN_BEGIN)
    return asks && p->stop_at_train_begin ? stop(p, 0, "asked at TRAIN_BEGIN") : HR_OK;
  if (info->event == HR_EVENT_STEP_END)
    return asks && p->stop_at_step > 0 && info->step == p->stop_at_step
               ? stop(p, info->step, "asked at the STEP_END of stop_at_step")
               : HR_OK;
  if (info->event == HR_EVENT_TRAIN_END) {
    snprintf(line, sizeof line, "TRAIN_END step=%lld", (long long)info->step);
    return append(p, line);
  }
  if (info->event != HR_EVENT_EVAL_END) return HR_OK;
  if (p->best_step == 0 || info->loss < p->best - p->min_delta) {
    p->best = info->loss;
    p->best_step = info->step;
    p->bad = 0;
  } else {
    ++p->bad;
  }
  snprintf(line, sizeof line, "EVAL_END step=%lld loss=%.17g tokens=%llu best=%.17g bad=%lld",
           (long long)info->step, info->loss, (unsigned long long)info->tokens, p->best,
           (long long)p->bad);
  if ((st = append(p, line)) != HR_OK) return st;
  if (p->bad >= p->patience) {
    char reason[200];
    snprintf(reason, sizeof reason,
             "the validation loss has not improved on %.6g (step %lld) for %lld evaluations",
             p->best, (long long)p->best_step, (long long)p->bad);
    return stop(p, info->step, reason);
  }
  return HR_OK;
}

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  early_stop* p = (early_stop*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  p->patience = 3;
  p->only_rank = -1;
  if ((st = s->config_string(s->host, "out", p->out, sizeof p->out)) != HR_OK ||
      (st = s->config_int(s->host, "patience", &p->patience)) != HR_OK ||
      (st = s->config_float(s->host, "min_delta", &p->min_delta)) != HR_OK ||
      (st = s->config_bool(s->host, "stop_at_train_begin", &p->stop_at_train_begin)) != HR_OK ||
      (st = s->config_int(s->host, "stop_at_step", &p->stop_at_step)) != HR_OK ||
      (st = s->config_int(s->host, "only_rank", &p->only_rank)) != HR_OK) {
    free(p);
    return st;
  }
  if (p->out[0] == '\0')
    st = s->config_error(s->host, "out", "early_stop needs `out`");
  else if (p->patience < 1)
    st = s->config_error(s->host, "patience", "must be at least 1");
  else if (p->min_delta < 0)
    st = s->config_error(s->host, "min_delta", "must be at least 0");
  if (st != HR_OK) {
    free(p);
    return st;
  }
  p->step = HR_HAS_FIELD(s, hr_host_services, get_extension)
                ? (const hr_ext_step*)s->get_extension(s->host, HR_EXT_STEP)
                : NULL;
  if (!p->step || !HR_HAS_FIELD(p->step, hr_ext_step, stop_run)) {
    s->set_error(s->host, "early_stop: this host has no headroom.step/1 stop_run (ABI 1.6)");
    free(p);
    return HR_ERROR;
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

/* The state: best_step, best, bad, as fixed-width little-endian-as-the-machine fields. */
static hr_status save(void* instance, const hr_state_writer* writer) {
  const early_stop* p = (const early_stop*)instance;
  unsigned char bytes[24];
  memcpy(bytes, &p->best_step, 8);
  memcpy(bytes + 8, &p->best, 8);
  memcpy(bytes + 16, &p->bad, 8);
  return writer->write(writer->context, bytes, sizeof bytes);
}

static hr_status load(void* instance, const void* data, uint64_t size) {
  early_stop* p = (early_stop*)instance;
  const unsigned char* bytes = (const unsigned char*)data;
  char line[160];
  if (size != 24) {
    p->services->set_error(p->services->host, "early_stop: not the 24 bytes its save wrote");
    return HR_ERROR_CONFIG;
  }
  memcpy(&p->best_step, bytes, 8);
  memcpy(&p->best, bytes + 8, 8);
  memcpy(&p->bad, bytes + 16, 8);
  snprintf(line, sizeof line, "LOAD best=%.17g best_step=%lld bad=%lld", p->best,
           (long long)p->best_step, (long long)p->bad);
  return append(p, line);
}

static const hr_ext_state kState = {sizeof(hr_ext_state), 0, save, load};

static const void* get_extension(const char* id) {
  return strcmp(id, HR_EXT_STATE) == 0 ? &kState : NULL;
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "early_stop",
    .version = "1.0.0",
    .description = "test plugin: stops the run when the validation loss stops improving",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
              HR_EVENT_BIT(HR_EVENT_EVAL_END) | HR_EVENT_BIT(HR_EVENT_TRAIN_END),
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .get_extension = get_extension};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
