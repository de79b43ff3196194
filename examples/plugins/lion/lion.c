/* lion: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as
 * a headroom plugin in plain C99, on the device through headroom.ops/1 (ABI 1.7): the update
 * never leaves the device and the host never waits for it.
 *
 *   [[plugins]]
 *   name = "lion"
 *   beta1 = 0.9          # the update's interpolation
 *   beta2 = 0.99         # the moment's
 *   weight_decay = 0.0   # decoupled, on the parameters that have weight decay (matrices,
 *                        # embeddings); [train] lr and its schedule are the step size
 *
 * Per parameter p, gradient g and moment m (f32, zero at the start), with lr the step's:
 *   c = sign(beta1 m + (1 - beta1) g)      lerp(g, m, beta1), then sign, into one temporary
 *   p = p (1 - lr wd) - lr c               affine, then op_axpy
 *   m = beta2 m + (1 - beta2) g            lerp(g, m, beta2)
 * The moments (4 bytes a parameter) and the temporary (the largest parameter's size) come from
 * services->alloc as optimizer memory: the tracker and the memory limit see them. f32 parameters
 * and gradients only (no amp). No saved state: a snapshot resumed restarts the moments. */
#include <headroom/ext/ops.h>
#include <headroom/plugin.h>
#include <stdlib.h>
#include <string.h>

typedef struct lion {
  const hr_host_services* s;
  const hr_ext_ops* ops;
  double beta1, beta2, weight_decay;
  int32_t count; /* parameters, in layer order */
  void** m;      /* device, f32, one a parameter */
  void* c;       /* device, f32: the update's temporary */
} lion;

static hr_status fail(lion* p, hr_status st, const char* message) {
  p->s->set_error(p->s->host, message);
  return st;
}

/* Fills t with parameter (l, i). */
static hr_status param(lion* p, int32_t l, int32_t i, hr_tensor* t) {
  memset(t, 0, sizeof *t);
  t->struct_size = sizeof *t;
  return p->s->layer_param(p->s->host, l, i, t);
}

/* The moments, zeroed, and the temporary: at the first step, once the model is there. */
static hr_status allocate(lion* p) {
  const hr_host_services* s = p->s;
  hr_host* h = s->host;
  const int32_t layers = s->num_layers(h);
  uint64_t largest = 0;
  int32_t l, i, total = 0;
  for (l = 0; l < layers; ++l)
    total += s->layer_num_params(h, l);
  p->m = (void**)calloc((size_t)total, sizeof(void*));
  if (!p->m) return HR_ERROR_OUT_OF_MEMORY;
  for (l = 0; l < layers; ++l) {
    for (i = 0; i < s->layer_num_params(h, l); ++i) {
      hr_tensor t;
      hr_status st = param(p, l, i, &t);
      if (st != HR_OK) return st;
      p->m[p->count] = s->alloc(h, t.numel * sizeof(float), HR_MEM_OPTIMIZER, "lion moment");
      if (!p->m[p->count]) return fail(p, HR_ERROR_OUT_OF_MEMORY, "lion: no memory for a moment");
      ++p->count;
      st = s->op_fill(h, p->m[p->count - 1], HR_DTYPE_F32, t.numel, 0.0);
      if (st != HR_OK) return st;
      if (t.numel > largest) largest = t.numel;
    }
  }
  p->c = s->alloc(h, largest * sizeof(float), HR_MEM_OPTIMIZER, "lion update");
  return p->c ? HR_OK : fail(p, HR_ERROR_OUT_OF_MEMORY, "lion: no memory for its temporary");
}

static hr_status step(void* instance, const hr_optimizer_step_info* info) {
  lion* p = (lion*)instance;
  const hr_host_services* s = p->s;
  const hr_ext_ops* o = p->ops;
  hr_host* h = s->host;
  int32_t l, i, k = 0;
  if (!p->m) {
    const hr_status st = allocate(p);
    if (st != HR_OK) return st;
  }
  for (l = 0; l < s->num_layers(h); ++l) {
    for (i = 0; i < s->layer_num_params(h, l); ++i, ++k) {
      hr_tensor t;
      double wd;
      uint64_t n;
      hr_status st = param(p, l, i, &t);
      if (st != HR_OK) return st;
      if (k >= p->count) return fail(p, HR_ERROR_UNSUPPORTED, "lion: the model grew parameters");
      if (t.dtype != HR_DTYPE_F32 || t.grad_dtype != HR_DTYPE_F32 || !t.data || !t.grad)
        return fail(p, HR_ERROR_UNSUPPORTED,
                    "lion: needs f32 parameters and gradients on this rank (no amp, no sharding)");
      n = t.numel;
      wd = t.weight_decay ? p->weight_decay : 0.0;
      st = o->lerp(h, p->c, t.grad, p->m[k], p->beta1, HR_DTYPE_F32, n);
      if (st == HR_OK) st = o->unary(h, HR_OP_SIGN, p->c, p->c, HR_DTYPE_F32, n);
      if (st == HR_OK && wd != 0.0)
        st = o->affine(h, t.data, t.data, 1.0 - info->lr * wd, 0.0, HR_DTYPE_F32, n);
      if (st == HR_OK) st = s->op_axpy(h, t.data, p->c, HR_DTYPE_F32, n, -info->lr);
      if (st == HR_OK) st = o->lerp(h, p->m[k], t.grad, p->m[k], p->beta2, HR_DTYPE_F32, n);
      if (st != HR_OK) return st;
    }
  }
  return HR_OK;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  (void)instance;
  (void)info;
  return HR_OK;
}

static void destroy(void* instance) {
  lion* p = (lion*)instance;
  int32_t k;
  for (k = 0; k < p->count; ++k)
    p->s->free(p->s->host, p->m[k]);
  if (p->c) p->s->free(p->s->host, p->c);
  free(p->m);
  free(p);
}

static hr_status create(const hr_host_services* s, void** instance) {
  lion* p = (lion*)calloc(1, sizeof *p);
  hr_status st;
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->s = s;
  p->beta1 = 0.9;
  p->beta2 = 0.99;
  st = s->config_float(s->host, "beta1", &p->beta1);
  if (st == HR_OK) st = s->config_float(s->host, "beta2", &p->beta2);
  if (st == HR_OK) st = s->config_float(s->host, "weight_decay", &p->weight_decay);
  if (st == HR_OK && !(p->beta1 >= 0.0 && p->beta1 < 1.0))
    st = s->config_error(s->host, "beta1", "must be in [0, 1)");
  if (st == HR_OK && !(p->beta2 >= 0.0 && p->beta2 < 1.0))
    st = s->config_error(s->host, "beta2", "must be in [0, 1)");
  if (st == HR_OK && !(p->weight_decay >= 0.0))
    st = s->config_error(s->host, "weight_decay", "must be >= 0");
  if (st == HR_OK) {
    p->ops = (const hr_ext_ops*)s->get_extension(s->host, HR_EXT_OPS);
    if (!p->ops) {
      s->set_error(s->host, "lion: this headroom lacks headroom.ops/1 (ABI 1.7)");
      st = HR_ERROR_UNSUPPORTED;
    }
  }
  if (st != HR_OK) {
    free(p);
    return st;
  }
  *instance = p;
  return HR_OK;
}

static const hr_optimizer_hooks kOptimizer = {sizeof(hr_optimizer_hooks), 0, step, NULL};

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "lion",
    .version = "1.0.0",
    .description = "the Lion optimizer on the device (headroom.ops/1)",
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
