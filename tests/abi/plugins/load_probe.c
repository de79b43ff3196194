/* Test plugin: what of the model exists when load_state runs (docs/plugin-guide.md section 14,
 * headroom/ext/state.h). Its state is a fingerprint of the parameters, the sum of the squares of
 * every parameter's values, taken at the STEP_END of the snapshot's step; load_state takes the
 * fingerprint again, of the model as it is then, and writes both. Appends to `out`:
 *
 *   load_probe CREATE layers=<num_layers() in create>
 *   load_probe STEP_END step=<s> fp=<%.17g>
 *   load_probe LOAD layers=<n> params=<n> grads=<params whose grad is not NULL> fp=<%.17g>
 *              saved_fp=<%.17g> saved_step=<s> began=<1 once TRAIN_BEGIN was seen>
 *   load_probe TRAIN_BEGIN fp=<%.17g> loaded=<1 after a load_state>
 *
 * Keys: out (string, required). */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct load_probe {
  const hr_host_services* services;
  char out[4096];
  double last_fp;
  int64_t last_step;
  int began, loaded;
} load_probe;

static hr_status append(load_probe* p, const char* line) {
  FILE* f = fopen(p->out, "a");
  if (!f) {
    p->services->set_error(p->services->host, "load_probe: cannot open `out`");
    return HR_ERROR;
  }
  fprintf(f, "load_probe %s\n", line);
  fclose(f);
  return HR_OK;
}

/* The sum of squares of every parameter's values; *params and *grads count them. */
static hr_status fingerprint(load_probe* p, double* fp, int* params, int* grads) {
  const hr_host_services* s = p->services;
  int32_t l, i;
  *fp = 0.0;
  *params = *grads = 0;
  for (l = 0; l < s->num_layers(s->host); ++l) {
    for (i = 0; i < s->layer_num_params(s->host, l); ++i) {
      hr_tensor t;
      double sq = 0.0;
      hr_status st;
      memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      if ((st = s->layer_param(s->host, l, i, &t)) != HR_OK) return st;
      if (!t.data) {
        s->set_error(s->host, "load_probe: a parameter without data");
        return HR_ERROR;
      }
      if ((st = s->op_sum_squares(s->host, t.data, t.dtype, t.numel, &sq)) != HR_OK) return st;
      *fp += sq;
      ++*params;
      if (t.grad) ++*grads;
    }
  }
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  load_probe* p = (load_probe*)instance;
  char line[256];
  double fp;
  int params, grads;
  hr_status st = fingerprint(p, &fp, &params, &grads);
  if (st != HR_OK) return st;
  if (info->event == HR_EVENT_TRAIN_BEGIN) {
    p->began = 1;
    snprintf(line, sizeof line, "TRAIN_BEGIN fp=%.17g loaded=%d", fp, p->loaded);
  } else {
    p->last_fp = fp;
    p->last_step = info->step;
    snprintf(line, sizeof line, "STEP_END step=%lld fp=%.17g", (long long)info->step, fp);
  }
  return append(p, line);
}

static hr_status save_state(void* instance, const hr_state_writer* writer) {
  const load_probe* p = (const load_probe*)instance;
  unsigned char bytes[16];
  memcpy(bytes, &p->last_fp, 8);
  memcpy(bytes + 8, &p->last_step, 8);
  return writer->write(writer->context, bytes, sizeof bytes);
}

static hr_status load_state(void* instance, const void* data, uint64_t size) {
  load_probe* p = (load_probe*)instance;
  const hr_host_services* s = p->services;
  double fp, saved_fp;
  int64_t saved_step;
  int params, grads;
  char line[320];
  hr_status st;
  if (size != 16) {
    s->set_error(s->host, "load_probe: not the 16 bytes save_state wrote");
    return HR_ERROR_CONFIG;
  }
  memcpy(&saved_fp, data, 8);
  memcpy(&saved_step, (const unsigned char*)data + 8, 8);
  if ((st = fingerprint(p, &fp, &params, &grads)) != HR_OK) return st;
  p->loaded = 1;
  snprintf(line, sizeof line,
           "LOAD layers=%d params=%d grads=%d fp=%.17g saved_fp=%.17g saved_step=%lld began=%d",
           (int)s->num_layers(s->host), params, grads, fp, saved_fp, (long long)saved_step,
           p->began);
  return append(p, line);
}

static hr_status create(const hr_host_services* s, void** instance) {
  char line[64];
  hr_status st;
  load_probe* p = (load_probe*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  st = s->config_string(s->host, "out", p->out, sizeof p->out);
  if (st != HR_OK || p->out[0] == '\0') {
    free(p);
    return st != HR_OK ? st : s->config_error(s->host, "out", "load_probe needs `out`");
  }
  snprintf(line, sizeof line, "CREATE layers=%d", (int)s->num_layers(s->host));
  if ((st = append(p, line)) != HR_OK) {
    free(p);
    return st;
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "load_probe",
    .version = "1.0.0",
    .description = "test plugin: what of the model load_state sees",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END),
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .save_state = save_state,
    .load_state = load_state};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
