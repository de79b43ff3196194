/* loss_spike_guard — an example headroom plugin (ABI 1.5), in plain C99.
 *
 * Skips the optimizer update of a step whose loss is far above its running mean: a batch of bad
 * data, or a step that blew up, then does not move the weights. At GRADS_READY it reads the
 * step's loss from the event info (ABI 1.5: hr_event_info.loss), compares it with an exponential
 * running mean of the losses of the steps it let through, and vetoes the step when
 *
 *     loss > factor * mean     (after warmup_steps steps; a NaN or infinite loss is vetoed too)
 *
 * A vetoed step's loss does not enter the mean. Each veto is logged with what headroom.step/1
 * says of the step (its learning rate and token count). The running mean, the count of steps it
 * has seen and the vetoes are its state in training snapshots, offered as the headroom.state/1
 * extension (not the descriptor's save_state / load_state), so a resumed run guards exactly as
 * the uninterrupted one.
 *
 *   [[plugins]]
 *   name = "loss_spike_guard"
 *   factor = 3.0         # optional: veto above factor x the running mean; > 1
 *   decay = 0.9          # optional: mean = decay * mean + (1 - decay) * loss; in [0, 1)
 *   warmup_steps = 10    # optional: steps that only feed the mean; >= 1
 *   file = "vetoes.txt"  # optional: one line per vetoed step, "step loss mean"
 *
 * Needs a 1.5 host (get_extension and the loss in the event info); an older one is refused at
 * load time. docs/plugin-guide.md, "Extensions", explains what it uses. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <headroom/ext/state.h>
#include <headroom/ext/step.h>
#include <headroom/plugin.h>

typedef struct guard {
  const hr_host_services* services;
  const hr_ext_step* step; /* NULL: the host has no headroom.step/1; the log says less */
  double factor, decay;
  int64_t warmup_steps;
  FILE* file; /* NULL: no file */
  /* The state in snapshots. */
  struct {
    double mean;
    int64_t seen; /* steps that fed the mean */
    int64_t vetoes;
  } state;
} guard;

static hr_status on_event(void* instance, const hr_event_info* info) {
  guard* g = (guard*)instance;
  const hr_host_services* s = g->services;
  char message[256];
  double loss;
  if (info->event != HR_EVENT_GRADS_READY) return HR_OK;
  if (!HR_HAS_FIELD(info, hr_event_info, loss)) {
    s->set_error(s->host, "loss_spike_guard: the event info has no loss (a host older than 1.5)");
    return HR_ERROR_VERSION;
  }
  loss = info->loss;
  if (g->state.seen >= g->warmup_steps && (!isfinite(loss) || loss > g->factor * g->state.mean)) {
    hr_step_state st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    if (!g->step || g->step->state(s->host, &st) != HR_OK) memset(&st, 0, sizeof st);
    ++g->state.vetoes;
    snprintf(message, sizeof message,
             "step %lld: loss %.4f is above %.2f x the running mean %.4f (lr %.3g, %llu tokens); "
             "update skipped (%lld so far)",
             (long long)info->step, loss, g->factor, g->state.mean, st.lr,
             (unsigned long long)st.tokens, (long long)g->state.vetoes);
    s->log(s->host, HR_LOG_WARN, message);
    s->veto_step(s->host, "loss spike");
    if (g->file) {
      fprintf(g->file, "%lld %.17g %.17g\n", (long long)info->step, loss, g->state.mean);
      fflush(g->file);
    }
    return HR_OK;
  }
  g->state.mean = g->state.seen == 0 ? loss : g->decay * g->state.mean + (1 - g->decay) * loss;
  ++g->state.seen;
  return HR_OK;
}

/* headroom.state/1: the running mean, the count and the vetoes, as they are in memory. */
static hr_status save(void* instance, const hr_state_writer* writer) {
  const guard* g = (const guard*)instance;
  return writer->write(writer->context, &g->state, sizeof g->state);
}

static hr_status load(void* instance, const void* data, uint64_t size) {
  guard* g = (guard*)instance;
  if (size != sizeof g->state) {
    g->services->set_error(g->services->host,
                           "loss_spike_guard: the snapshot's state is not this version's");
    return HR_ERROR_CONFIG;
  }
  memcpy(&g->state, data, sizeof g->state);
  return HR_OK;
}

static const hr_ext_state kState = {sizeof(hr_ext_state), 0, save, load};

static const void* get_extension(const char* id) {
  return id && strcmp(id, HR_EXT_STATE) == 0 ? &kState : NULL;
}

static hr_status create(const hr_host_services* s, void** instance) {
  char file[4096] = "";
  hr_status st;
  guard* g;
  if (!HR_HAS_FIELD(s, hr_host_services, get_extension)) {
    s->set_error(s->host, "loss_spike_guard needs a headroom with plugin ABI 1.5");
    return HR_ERROR_VERSION;
  }
  g = (guard*)calloc(1, sizeof *g);
  if (!g) return HR_ERROR_OUT_OF_MEMORY;
  g->services = s;
  g->factor = 3.0;
  g->decay = 0.9;
  g->warmup_steps = 10;
  if ((st = s->config_float(s->host, "factor", &g->factor)) != HR_OK ||
      (st = s->config_float(s->host, "decay", &g->decay)) != HR_OK ||
      (st = s->config_int(s->host, "warmup_steps", &g->warmup_steps)) != HR_OK ||
      (st = s->config_string(s->host, "file", file, sizeof file)) != HR_OK) {
    free(g);
    return st;
  }
  if (!(g->factor > 1.0) || !isfinite(g->factor)) {
    free(g);
    return s->config_error(s->host, "factor", "must be a finite number > 1");
  }
  if (!(g->decay >= 0.0 && g->decay < 1.0)) {
    free(g);
    return s->config_error(s->host, "decay", "must be in [0, 1)");
  }
  if (g->warmup_steps < 1) {
    free(g);
    return s->config_error(s->host, "warmup_steps", "must be >= 1");
  }
  if (file[0] != '\0' && !(g->file = fopen(file, "a"))) {
    free(g);
    return s->config_error(s->host, "file", "cannot open it for appending");
  }
  g->step = (const hr_ext_step*)s->get_extension(s->host, HR_EXT_STEP);
  *instance = g;
  return HR_OK;
}

static void destroy(void* instance) {
  guard* g = (guard*)instance;
  if (g->file) fclose(g->file);
  free(g);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "loss_spike_guard",
    .version = "1.0.0",
    .description = "skips the update of a step whose loss spikes above its running mean",
    .events = HR_EVENT_BIT(HR_EVENT_GRADS_READY),
    .roles = 0,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = NULL,
    .save_state = NULL,
    .load_state = NULL,
    .get_extension = get_extension};

/* ABI 1.5 or newer only: the loss in the event info and get_extension are 1.5's. */
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  if (args->host_abi_max < HR_ABI_MAKE_VERSION(1, 5)) {
    args->plugin_abi = HR_ABI_VERSION;
    if (args->error && args->error_size)
      snprintf(args->error, args->error_size, "loss_spike_guard needs plugin ABI 1.5 or newer");
    return HR_ERROR_VERSION;
  }
  return hr_negotiate(args, &kDescriptor);
}
