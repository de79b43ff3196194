/* Test plugin built against the frozen ABI v1.4 header (tests/abi/v1.4): a loss-spike guard's
 * reading of the head's per-token losses, as 1.4 offered them. At FORWARD_END and BACKWARD_BEGIN
 * of the last layer (the head) it finds the activation named "losses (B, T)" and appends the
 * mean of its values to `out`:
 *
 *   frozen_v1_4_losses FORWARD_END step=<s> micro=<m> mean=<%.17g> n=<numel> dtype=<dtype>
 *   frozen_v1_4_losses BACKWARD_BEGIN step=<s> micro=<m> mean=<%.17g> n=<numel> dtype=<dtype>
 *
 * or "... missing" when the head offers no such activation. It reads the device memory directly,
 * so it runs on the CPU backend only (create fails elsewhere). From 1.5 on the chunked loss
 * computes the losses in the head's backward; the host must still hand this plugin the real ones.
 */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if HR_ABI_VERSION_MAJOR != 1 || HR_ABI_VERSION_MINOR != 4
#error "frozen_v1_4_losses must be built against the v1.4 header in tests/abi/v1.4"
#endif

typedef struct guard {
  const hr_host_services* services;
  char out[4096];
} guard;

static hr_status append(guard* g, const char* line) {
  FILE* file = fopen(g->out, "a");
  if (!file) {
    g->services->set_error(g->services->host, "frozen_v1_4_losses: cannot open the `out` file");
    return HR_ERROR;
  }
  fprintf(file, "frozen_v1_4_losses %s\n", line);
  fclose(file);
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  guard* g = (guard*)instance;
  const hr_host_services* s = g->services;
  const int32_t head = s->num_layers(s->host) - 1;
  const char* name = info->event == HR_EVENT_FORWARD_END ? "FORWARD_END" : "BACKWARD_BEGIN";
  char line[256];
  int32_t i, n;
  if (info->layer != head) return HR_OK;
  n = s->layer_num_activations(s->host, head);
  for (i = 0; i < n; ++i) {
    hr_tensor t;
    hr_status st;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    st = s->layer_activation(s->host, head, i, &t);
    if (st != HR_OK) return st;
    if (strcmp(t.name, "losses (B, T)") == 0) {
      double sum = 0.0;
      uint64_t k;
      if (t.dtype != HR_DTYPE_F32) {
        s->set_error(s->host, "frozen_v1_4_losses: the losses are not f32");
        return HR_ERROR;
      }
      for (k = 0; k < t.numel; ++k)
        sum += ((const float*)t.data)[k];
      snprintf(line, sizeof line, "%s step=%lld micro=%d mean=%.17g n=%llu dtype=%u", name,
               (long long)info->step, (int)info->micro_step, sum / (double)t.numel,
               (unsigned long long)t.numel, (unsigned)t.dtype);
      return append(g, line);
    }
  }
  snprintf(line, sizeof line, "%s step=%lld micro=%d missing", name, (long long)info->step,
           (int)info->micro_step);
  return append(g, line);
}

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  guard* g = (guard*)calloc(1, sizeof *g);
  if (!g) return HR_ERROR_OUT_OF_MEMORY;
  g->services = s;
  st = s->config_string(s->host, "out", g->out, sizeof g->out);
  if (st != HR_OK || g->out[0] == '\0') {
    free(g);
    return st != HR_OK ? st : s->config_error(s->host, "out", "frozen_v1_4_losses needs `out`");
  }
  if (strcmp(s->device_kind(s->host), "cpu") != 0) {
    free(g);
    s->set_error(s->host, "frozen_v1_4_losses reads device memory directly: CPU backend only");
    return HR_ERROR_UNSUPPORTED;
  }
  *instance = g;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "frozen_v1_4_losses",
    .version = "1.4.0",
    .description = "test plugin: reads the head's per-token losses through the frozen v1.4 header",
    .events = HR_EVENT_BIT(HR_EVENT_FORWARD_END) | HR_EVENT_BIT(HR_EVENT_BACKWARD_BEGIN),
    .roles = 0,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = NULL,
    .save_state = NULL,
    .load_state = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
