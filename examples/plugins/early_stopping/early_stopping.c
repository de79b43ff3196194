/* early_stopping — an example headroom plugin (ABI 1.6), in plain C99.
 *
 * Stops training when the validation loss stops improving. headroom evaluates the validation loss
 * every [train] eval_every steps and fires EVAL_END (ABI 1.6) with it in hr_event_info.loss: the
 * same number the metrics report as val_loss. The plugin keeps the best loss so far; an
 * evaluation that does not beat it by more than min_delta counts against the patience, and after
 * `patience` such evaluations in a row it asks headroom to stop (headroom.step/1's stop_run,
 * appended in 1.6). headroom then finishes the step, writes a snapshot of it (with [snapshot] on),
 * closes its outputs and exits with code 7, printing
 *
 *   stopped by plugin 'early_stopping' after step 30 of 100: the validation loss has not
 *   improved on 2.7131 (step 20) for 3 evaluations; snapshot ... written (resume with ...)
 *
 * The best loss, its step and the count are its state in snapshots (headroom.state/1), so a
 * resumed run counts on where the stopped one was.
 *
 *   [[plugins]]
 *   name = "early_stopping"
 *   patience = 3         # optional: evaluations without improvement before stopping; >= 1
 *   min_delta = 0.0      # optional: an improvement must be larger than this; >= 0
 *   file = "evals.txt"   # optional: one line per evaluation, "step loss best bad"
 *
 * Needs a 1.6 host; an older one is refused at load time. docs/plugin-guide.md section 9.7
 * explains stop_run, section 8 EVAL_END. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <headroom/ext/state.h>
#include <headroom/ext/step.h>
#include <headroom/plugin.h>

typedef struct early_stopping {
  const hr_host_services* services;
  const hr_ext_step* step;
  int64_t patience;
  double min_delta;
  FILE* file; /* NULL: no file */
  /* The state in snapshots: fixed-width fields. */
  struct {
    int64_t best_step; /* 0: no evaluation yet */
    double best;
    int64_t bad; /* evaluations in a row that did not improve on best */
  } state;
} early_stopping;

static hr_status on_event(void* instance, const hr_event_info* info) {
  early_stopping* p = (early_stopping*)instance;
  const double loss = info->loss;
  if (info->event != HR_EVENT_EVAL_END) return HR_OK; /* an event of a later version */
  if (p->state.best_step == 0 || loss < p->state.best - p->min_delta) {
    p->state.best = loss;
    p->state.best_step = info->step;
    p->state.bad = 0;
  } else {
    ++p->state.bad; /* a NaN loss never improves */
  }
  if (p->file) {
    fprintf(p->file, "%lld %.17g %.17g %lld\n", (long long)info->step, loss, p->state.best,
            (long long)p->state.bad);
    fflush(p->file);
  }
  if (p->state.bad >= p->patience) {
    char reason[200];
    snprintf(reason, sizeof reason,
             "the validation loss has not improved on %.6g (step %lld) for %lld evaluations",
             p->state.best, (long long)p->state.best_step, (long long)p->state.bad);
    return p->step->stop_run(p->services->host, reason);
  }
  return HR_OK;
}

/* headroom.state/1. */
static hr_status save(void* instance, const hr_state_writer* writer) {
  const early_stopping* p = (const early_stopping*)instance;
  return writer->write(writer->context, &p->state, sizeof p->state);
}

static hr_status load(void* instance, const void* data, uint64_t size) {
  early_stopping* p = (early_stopping*)instance;
  if (size != sizeof p->state) {
    p->services->set_error(p->services->host,
                           "early_stopping: the snapshot's state is not this version's");
    return HR_ERROR_CONFIG;
  }
  memcpy(&p->state, data, sizeof p->state);
  return HR_OK;
}

static const hr_ext_state kState = {sizeof(hr_ext_state), 0, save, load};

static const void* get_extension(const char* id) {
  return id && strcmp(id, HR_EXT_STATE) == 0 ? &kState : NULL;
}

static hr_status create(const hr_host_services* s, void** instance) {
  char file[4096] = "";
  hr_status st;
  early_stopping* p;
  const hr_ext_step* step = HR_HAS_FIELD(s, hr_host_services, get_extension)
                                ? (const hr_ext_step*)s->get_extension(s->host, HR_EXT_STEP)
                                : NULL;
  if (!step || !HR_HAS_FIELD(step, hr_ext_step, stop_run)) {
    s->set_error(s->host, "early_stopping needs a headroom with plugin ABI 1.6 (stop_run)");
    return HR_ERROR_VERSION;
  }
  p = (early_stopping*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  p->step = step;
  p->patience = 3;
  if ((st = s->config_int(s->host, "patience", &p->patience)) != HR_OK ||
      (st = s->config_float(s->host, "min_delta", &p->min_delta)) != HR_OK ||
      (st = s->config_string(s->host, "file", file, sizeof file)) != HR_OK) {
    free(p);
    return st;
  }
  if (p->patience < 1) {
    free(p);
    return s->config_error(s->host, "patience", "must be >= 1");
  }
  if (!(p->min_delta >= 0.0) || !isfinite(p->min_delta)) {
    free(p);
    return s->config_error(s->host, "min_delta", "must be a finite number >= 0");
  }
  if (file[0] != '\0' && !(p->file = fopen(file, "a"))) {
    free(p);
    return s->config_error(s->host, "file", "cannot open it for appending");
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  early_stopping* p = (early_stopping*)instance;
  if (p->file) fclose(p->file);
  free(p);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "early_stopping",
    .version = "1.0.0",
    .description = "stops the run when the validation loss stops improving",
    .events = HR_EVENT_BIT(HR_EVENT_EVAL_END),
    .roles = 0,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = NULL,
    .save_state = NULL,
    .load_state = NULL,
    .get_extension = get_extension};

/* ABI 1.6 or newer only: EVAL_END and stop_run are 1.6's. */
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  if (args->host_abi_max < HR_ABI_MAKE_VERSION(1, 6)) {
    args->plugin_abi = HR_ABI_VERSION;
    if (args->error && args->error_size)
      snprintf(args->error, args->error_size, "early_stopping needs plugin ABI 1.6 or newer");
    return HR_ERROR_VERSION;
  }
  return hr_negotiate(args, &kDescriptor);
}
