/* Test plugin, optimizer role: plain SGD, p -= lr * g for every parameter, through
 * services->layer_param and services->op_axpy. With `out` (string, optional) it appends one line
 * per step: "plain_sgd step=<step> lr=<lr> params=<tensors updated>". */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct plain_sgd {
  const hr_host_services* services;
  char out[4096];
} plain_sgd;

static hr_status step(void* instance, const hr_optimizer_step_info* info) {
  plain_sgd* p = (plain_sgd*)instance;
  const hr_host_services* s = p->services;
  int64_t updated = 0;
  if (info->struct_size < sizeof(hr_optimizer_step_info)) {
    s->set_error(s->host, "plain_sgd: malformed hr_optimizer_step_info");
    return HR_ERROR_INVALID;
  }
  const int32_t layers = s->num_layers(s->host);
  for (int32_t l = 0; l < layers; ++l) {
    const int32_t n = s->layer_num_params(s->host, l);
    for (int32_t i = 0; i < n; ++i) {
      hr_tensor t = {0};
      t.struct_size = sizeof t;
      hr_status st = s->layer_param(s->host, l, i, &t);
      if (st != HR_OK) return st;
      if (t.dtype != HR_DTYPE_F32 || !t.grad) {
        s->set_error(s->host, "plain_sgd: expected f32 parameters with gradients");
        return HR_ERROR_UNSUPPORTED;
      }
      st = s->op_axpy(s->host, t.data, t.grad, HR_DTYPE_F32, t.numel, -info->lr);
      if (st != HR_OK) return st;
      ++updated;
    }
  }
  if (p->out[0] != '\0') {
    FILE* f = fopen(p->out, "a");
    if (!f) {
      s->set_error(s->host, "plain_sgd: cannot open the `out` file");
      return HR_ERROR;
    }
    fprintf(f, "plain_sgd step=%lld lr=%.9g params=%lld\n", (long long)info->step, info->lr,
            (long long)updated);
    fclose(f);
  }
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  (void)instance;
  (void)info;
  return HR_OK;
}

static hr_status create(const hr_host_services* s, void** instance) {
  plain_sgd* p = (plain_sgd*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  const hr_status st = s->config_string(s->host, "out", p->out, sizeof p->out);
  if (st != HR_OK) {
    free(p);
    return st;
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const hr_optimizer_hooks kOptimizer = {.struct_size = sizeof(hr_optimizer_hooks),
                                              .step = step};

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "plain_sgd",
    .version = "1.4.0",
    .description = "test plugin: SGD without momentum or weight decay",
    .events = 0,
    .roles = HR_ROLE_OPTIMIZER,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = NULL,
    .optimizer = &kOptimizer};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
