/* Test plugin: an exponential moving average of the weights (ABI 1.7), the kind of plugin whose
 * memory is none of core's categories. At TRAIN_BEGIN it allocates one f32 shadow per parameter
 * in HR_MEM_PLUGIN and copies the weights in; after every step (STEP_END) shadow = decay * shadow
 * + (1 - decay) * weight, with op_scale and op_axpy on the compute stream. It offers
 * headroom.estimate/1: what it holds, as hr_mechanisms.plugin_bytes (4 bytes a parameter), so
 * `headroom plan` counts it. Appends to `out`:
 *
 *   weight_ema STATS step=<n> live_plugin=<n> peak_plugin=<n> live_optimizer=<n> live=<n>
 *   weight_ema TRAIN_END shadows=<n> bytes=<n> sum_squares=<%.17g>
 *
 * (STATS: memory_stats at each STEP_END, after its update.) Keys: out (string, required), decay
 * (float, default 0.9). */
#include <headroom/ext/estimate.h>
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct shadow {
  void* data; /* HR_MEM_PLUGIN, f32 */
  int32_t layer, index;
  uint64_t numel;
} shadow;

typedef struct weight_ema {
  const hr_host_services* s;
  char out[4096];
  double decay;
  shadow* shadows;
  int32_t count;
  uint64_t bytes;
} weight_ema;

static void append(weight_ema* w, const char* line) {
  FILE* f = fopen(w->out, "a");
  if (!f) return;
  fprintf(f, "weight_ema %s\n", line);
  fclose(f);
}

static hr_status fail(weight_ema* w, const char* message) {
  w->s->set_error(w->s->host, message);
  return HR_ERROR;
}

/* One shadow per parameter, the weights copied in. */
static hr_status begin(weight_ema* w) {
  const hr_host_services* s = w->s;
  int32_t layers = s->num_layers(s->host), l, i, total = 0;
  for (l = 0; l < layers; ++l)
    total += s->layer_num_params(s->host, l);
  w->shadows = (shadow*)calloc((size_t)total, sizeof(shadow));
  if (!w->shadows) return HR_ERROR_OUT_OF_MEMORY;
  for (l = 0; l < layers; ++l) {
    for (i = 0; i < s->layer_num_params(s->host, l); ++i) {
      hr_tensor t;
      shadow* sh = &w->shadows[w->count];
      memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      if (s->layer_param(s->host, l, i, &t) != HR_OK || !t.data || t.dtype != HR_DTYPE_F32)
        return fail(w, "weight_ema: needs every parameter's f32 weights on this rank");
      sh->data = s->alloc(s->host, 4 * t.numel, HR_MEM_PLUGIN, "EMA shadow");
      if (!sh->data) return HR_ERROR_OUT_OF_MEMORY; /* the host's message says why */
      sh->layer = l;
      sh->index = i;
      sh->numel = t.numel;
      ++w->count;
      w->bytes += 4 * t.numel;
      if (s->op_copy(s->host, sh->data, t.data, 4 * t.numel) != HR_OK)
        return fail(w, "weight_ema: op_copy failed");
    }
  }
  return HR_OK;
}

static hr_status update(weight_ema* w, int64_t step) {
  const hr_host_services* s = w->s;
  hr_memory_stats m;
  char line[256];
  int32_t k;
  for (k = 0; k < w->count; ++k) {
    shadow* sh = &w->shadows[k];
    hr_tensor t;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    if (s->layer_param(s->host, sh->layer, sh->index, &t) != HR_OK || t.numel != sh->numel)
      return fail(w, "weight_ema: a parameter changed its shape");
    if (s->op_scale(s->host, sh->data, HR_DTYPE_F32, sh->numel, w->decay) != HR_OK ||
        s->op_axpy(s->host, sh->data, t.data, HR_DTYPE_F32, sh->numel, 1.0 - w->decay) != HR_OK)
      return fail(w, "weight_ema: op_scale / op_axpy failed");
  }
  memset(&m, 0, sizeof m);
  m.struct_size = sizeof m;
  if (s->memory_stats(s->host, &m) != HR_OK) return fail(w, "weight_ema: memory_stats failed");
  snprintf(line, sizeof line,
           "STATS step=%lld live_plugin=%llu peak_plugin=%llu live_optimizer=%llu live=%llu",
           (long long)step, (unsigned long long)m.live_plugin, (unsigned long long)m.peak_plugin,
           (unsigned long long)m.live_by_category[HR_MEM_OPTIMIZER],
           (unsigned long long)m.live_bytes);
  append(w, line);
  return HR_OK;
}

static hr_status end(weight_ema* w) {
  const hr_host_services* s = w->s;
  double total = 0;
  char line[256];
  int32_t k;
  for (k = 0; k < w->count; ++k) {
    double sq = 0;
    if (s->op_sum_squares(s->host, w->shadows[k].data, HR_DTYPE_F32, w->shadows[k].numel, &sq) !=
        HR_OK)
      return fail(w, "weight_ema: op_sum_squares failed");
    total += sq;
  }
  snprintf(line, sizeof line, "TRAIN_END shadows=%d bytes=%llu sum_squares=%.17g", (int)w->count,
           (unsigned long long)w->bytes, total);
  append(w, line);
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  weight_ema* w = (weight_ema*)instance;
  switch (info->event) {
    case HR_EVENT_TRAIN_BEGIN:
      return begin(w);
    case HR_EVENT_STEP_END:
      return update(w, info->step);
    case HR_EVENT_TRAIN_END:
      return end(w);
    default:
      return HR_OK;
  }
}

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  weight_ema* w = (weight_ema*)calloc(1, sizeof *w);
  if (!w) return HR_ERROR_OUT_OF_MEMORY;
  w->s = s;
  w->decay = 0.9;
  if ((st = s->config_string(s->host, "out", w->out, sizeof w->out)) != HR_OK ||
      (st = s->config_float(s->host, "decay", &w->decay)) != HR_OK) {
    free(w);
    return st;
  }
  if (w->out[0] == '\0') {
    free(w);
    return s->config_error(s->host, "out", "weight_ema needs `out`");
  }
  if (!(w->decay >= 0 && w->decay <= 1)) {
    free(w);
    return s->config_error(s->host, "decay", "must be from 0 to 1");
  }
  *instance = w;
  return HR_OK;
}

static void destroy(void* instance) {
  weight_ema* w = (weight_ema*)instance;
  int32_t k;
  for (k = 0; k < w->count; ++k)
    w->s->free(w->s->host, w->shadows[k].data);
  free(w->shadows);
  free(w);
}

/* headroom.estimate/1: a shadow of every parameter, f32, for the whole run. Only as configured:
 * it proposes nothing (an EMA saves no memory). */
static hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  uint64_t bytes = 0;
  int32_t k;
  if (!instance) return HR_ERROR_UNSUPPORTED;
  if (!HR_HAS_FIELD(q->model, hr_estimate_model, param_tensors) ||
      !HR_HAS_FIELD(r->after, hr_mechanisms, plugin_bytes))
    return HR_ERROR_UNSUPPORTED;
  for (k = 0; k < q->model->num_param_tensors; ++k)
    bytes += 4 * q->model->param_tensors[k].numel;
  r->after->plugin_bytes += bytes;
  snprintf(r->what, sizeof r->what, "weight EMA: an f32 shadow of every parameter");
  return q->peak(q->context, r->after, r->bytes);
}

static const hr_ext_estimate kEstimate = {sizeof(hr_ext_estimate), 0, estimate, 0, 0, NULL};

static const void* get_extension(const char* id) {
  return strcmp(id, HR_EXT_ESTIMATE) == 0 ? &kEstimate : NULL;
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "weight_ema",
    .version = "1.0.0",
    .description = "test plugin: an EMA of the weights in its own memory (HR_MEM_PLUGIN)",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
              HR_EVENT_BIT(HR_EVENT_TRAIN_END),
    .roles = 0,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = NULL,
    .save_state = NULL,
    .load_state = NULL,
    .get_extension = get_extension};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
