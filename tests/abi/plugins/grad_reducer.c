/* Test plugin, gradient-reduction role (ABI 1.5): reduces the gradients across ranks itself, as a
 * ZeRO plugin will, so that core's data-parallel bucket all-reduce is off. At GRADS_READY it
 * averages every parameter's gradient over the ranks through headroom.comm/1 — every all-reduce
 * posted first, in layer and parameter order (the same on every rank), then each waited for. The
 * result is what core's buckets compute, so a run with it trains as a run without it.
 * No keys. */
#include <headroom/ext/comm.h>
#include <headroom/plugin.h>
#include <stdlib.h>

#define MAX_REQUESTS 4096

typedef struct reducer {
  const hr_host_services* s;
  const hr_ext_comm* comm;
  hr_comm_request* pending[MAX_REQUESTS];
} reducer;

static hr_status on_event(void* instance, const hr_event_info* info) {
  reducer* r = (reducer*)instance;
  const hr_host_services* s = r->s;
  int32_t layer, i, n = 0, k;
  hr_status st = HR_OK, wst;
  if (info->event != HR_EVENT_GRADS_READY) return HR_OK;
  for (layer = 0; layer < s->num_layers(s->host) && st == HR_OK; ++layer) {
    for (i = 0; i < s->layer_num_params(s->host, layer) && st == HR_OK; ++i) {
      hr_tensor t = {0};
      t.struct_size = sizeof t;
      if ((st = s->layer_param(s->host, layer, i, &t)) != HR_OK) break;
      if (n == MAX_REQUESTS) {
        s->set_error(s->host, "grad_reducer: more parameters than it has room for");
        st = HR_ERROR;
        break;
      }
      st = r->comm->all_reduce(s->host, t.grad, t.numel, t.dtype, HR_COMM_AVERAGE, &r->pending[n]);
      if (st == HR_OK) ++n;
    }
  }
  /* Every posted request is waited for (and freed), also after a failure. */
  for (k = 0; k < n; ++k)
    if ((wst = r->comm->wait(s->host, r->pending[k])) != HR_OK && st == HR_OK) st = wst;
  return st;
}

static hr_status create(const hr_host_services* s, void** instance) {
  reducer* r;
  const hr_ext_comm* comm = NULL;
  if (HR_HAS_FIELD(s, hr_host_services, get_extension))
    comm = (const hr_ext_comm*)s->get_extension(s->host, HR_EXT_COMM);
  if (!comm) {
    s->set_error(s->host, "grad_reducer needs headroom.comm/1 (a 1.5 host with ranks)");
    return HR_ERROR_VERSION;
  }
  r = (reducer*)calloc(1, sizeof *r);
  if (!r) return HR_ERROR_OUT_OF_MEMORY;
  r->s = s;
  r->comm = comm;
  *instance = r;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "grad_reducer",
    .version = "1.0.0",
    .description = "test plugin: averages the gradients over the ranks itself",
    .events = HR_EVENT_BIT(HR_EVENT_GRADS_READY),
    .roles = HR_ROLE_GRADIENT_REDUCTION,
    .create = create,
    .destroy = destroy,
    .on_event = on_event};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
