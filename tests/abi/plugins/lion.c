/* Test plugin, optimizer role: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
 * Algorithms") on every parameter, in plain C99, one of three ways (`mode`):
 *   "ops"     on the device through headroom.ops/1 (lerp, sign, affine) and op_axpy, with one
 *             temporary buffer from services->alloc: no host wait;
 *   "staging" the same arithmetic on the host, each tensor read through headroom.tensors/1
 *             read() and written back with write(): many host waits a step;
 *   "adamw"   not Lion: headroom.ops/1's fused adamw with the moments in buffers of its own, for
 *             comparison with the built-in AdamW.
 * Per parameter p, gradient g, moment m (f32, zero at the start), lr from the host's schedule:
 *   c = lerp(g, m, beta1)        = g + beta1 (m - g)
 *   p = p * (1 - lr wd) + 0      (wd: weight_decay where the parameter has weight decay, else 0)
 *   p = p + (-lr) sign(c)
 *   m = lerp(g, m, beta2)
 * each f32 operation rounded as headroom/ext/ops.h says, so both modes give the same bits.
 * Keys: mode (string, "ops"), beta1 (0.9), beta2 (0.99), weight_decay (0), eps (1e-8, adamw),
 * bad (string, optional): at the first step make one call with a bad argument and return its
 * status when it is HR_ERROR_INVALID (else HR_ERROR, saying so): "binary_op", "unary_op", "dtype",
 * "null", "adamw_dtype", "adamw_step". */
#include <headroom/ext/ops.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TENSORS 1024
#define CHUNK ((uint64_t)1 << 16) /* elements a read() or write() moves (256 KiB of f32) */

typedef struct lion {
  const hr_host_services* s;
  const hr_ext_ops* ops;
  const hr_ext_tensors* tensors;
  char mode[16];
  char bad[32];
  double beta1, beta2, weight_decay, eps;
  int32_t count;        /* tensors with state */
  void* m[MAX_TENSORS]; /* device, f32 */
  void* v[MAX_TENSORS]; /* device, f32 (adamw) */
  void* c;              /* device, f32: the largest parameter's worth (ops) */
  float* host[4];       /* staging: p, g, m, c, CHUNK each */
} lion;

static hr_status fail(lion* p, hr_status st, const char* message) {
  p->s->set_error(p->s->host, message);
  return st;
}

static float sign_of(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
}

/* One parameter by staging: chunks read to the host, updated, written back. */
static hr_status staged(lion* p, const hr_tensor* t, void* m, double lr, double wd) {
  const hr_host_services* s = p->s;
  const float a = (float)(1.0 - lr * wd), neg_lr = (float)-lr;
  const float b1 = (float)p->beta1, b2 = (float)p->beta2;
  float *hp = p->host[0], *hg = p->host[1], *hm = p->host[2];
  uint64_t at;
  for (at = 0; at < t->numel; at += CHUNK) {
    const uint64_t k = t->numel - at < CHUNK ? t->numel - at : CHUNK;
    float* dp = (float*)t->data + at;
    const float* dg = (const float*)t->grad + at;
    float* dm = (float*)m + at;
    uint64_t i;
    hr_status st = p->tensors->read(s->host, hp, dp, k * 4);
    if (st == HR_OK) st = p->tensors->read(s->host, hg, dg, k * 4);
    if (st == HR_OK) st = p->tensors->read(s->host, hm, dm, k * 4);
    if (st != HR_OK) return st;
    for (i = 0; i < k; ++i) {
      const float g = hg[i], mo = hm[i];
      const float c = sign_of(g + b1 * (mo - g));
      const float q = a * hp[i] + 0.0f;
      hp[i] = q + neg_lr * c;
      hm[i] = g + b2 * (mo - g);
    }
    st = p->tensors->write(s->host, dp, hp, k * 4);
    if (st == HR_OK) st = p->tensors->write(s->host, dm, hm, k * 4);
    if (st != HR_OK) return st;
  }
  return HR_OK;
}

/* One parameter on the device. */
static hr_status on_device(lion* p, const hr_tensor* t, void* m, double lr, double wd) {
  const hr_host_services* s = p->s;
  const hr_ext_ops* o = p->ops;
  hr_host* h = s->host;
  const uint64_t n = t->numel;
  hr_status st = o->lerp(h, p->c, t->grad, m, p->beta1, HR_DTYPE_F32, n);
  if (st == HR_OK) st = o->unary(h, HR_OP_SIGN, p->c, p->c, HR_DTYPE_F32, n);
  if (st == HR_OK) st = o->affine(h, t->data, t->data, 1.0 - lr * wd, 0.0, HR_DTYPE_F32, n);
  if (st == HR_OK) st = s->op_axpy(h, t->data, p->c, HR_DTYPE_F32, n, -lr);
  if (st == HR_OK) st = o->lerp(h, m, t->grad, m, p->beta2, HR_DTYPE_F32, n);
  return st;
}

/* The call `bad` names, with its one bad argument. */
static hr_status bad_call(lion* p, const hr_tensor* t) {
  const hr_ext_ops* o = p->ops;
  hr_host* h = p->s->host;
  if (strcmp(p->bad, "binary_op") == 0)
    return o->binary(h, 99, t->data, t->data, t->data, HR_DTYPE_F32, t->numel);
  if (strcmp(p->bad, "unary_op") == 0)
    return o->unary(h, 17, t->data, t->data, HR_DTYPE_F32, t->numel);
  if (strcmp(p->bad, "dtype") == 0)
    return o->lerp(h, t->data, t->data, t->data, 0.5, HR_DTYPE_I32, t->numel);
  if (strcmp(p->bad, "null") == 0)
    return o->affine(h, NULL, t->data, 1.0, 0.0, HR_DTYPE_F32, t->numel);
  if (strcmp(p->bad, "adamw_dtype") == 0)
    return o->adamw(h, t->data, t->grad, p->m[0], p->v[0], t->numel, HR_DTYPE_F16, HR_DTYPE_F32,
                    HR_DTYPE_F32, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0);
  if (strcmp(p->bad, "adamw_step") == 0)
    return o->adamw(h, t->data, t->grad, p->m[0], p->v[0], t->numel, HR_DTYPE_F32, HR_DTYPE_F32,
                    HR_DTYPE_F32, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0);
  return fail(p, HR_ERROR_CONFIG, "lion: unknown `bad` case");
}

/* State for every parameter, zeroed, at the first step. */
static hr_status allocate(lion* p) {
  const hr_host_services* s = p->s;
  const int32_t layers = s->num_layers(s->host);
  uint64_t largest = 0;
  int32_t l, i;
  for (l = 0; l < layers; ++l) {
    const int32_t n = s->layer_num_params(s->host, l);
    for (i = 0; i < n; ++i) {
      hr_tensor t;
      hr_status st;
      memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      st = s->layer_param(s->host, l, i, &t);
      if (st != HR_OK) return st;
      if (p->count == MAX_TENSORS) return fail(p, HR_ERROR_UNSUPPORTED, "lion: too many tensors");
      p->m[p->count] = s->alloc(s->host, t.numel * 4, HR_MEM_OPTIMIZER, "lion m");
      if (!p->m[p->count]) return fail(p, HR_ERROR_OUT_OF_MEMORY, "lion: no memory for m");
      st = s->op_fill(s->host, p->m[p->count], HR_DTYPE_F32, t.numel, 0.0);
      if (st != HR_OK) return st;
      if (strcmp(p->mode, "adamw") == 0) {
        p->v[p->count] = s->alloc(s->host, t.numel * 4, HR_MEM_OPTIMIZER, "adamw v");
        if (!p->v[p->count]) return fail(p, HR_ERROR_OUT_OF_MEMORY, "lion: no memory for v");
        st = s->op_fill(s->host, p->v[p->count], HR_DTYPE_F32, t.numel, 0.0);
        if (st != HR_OK) return st;
      }
      if (t.numel > largest) largest = t.numel;
      ++p->count;
    }
  }
  if (strcmp(p->mode, "ops") == 0) {
    p->c = s->alloc(s->host, largest * 4, HR_MEM_OPTIMIZER, "lion update");
    if (!p->c) return fail(p, HR_ERROR_OUT_OF_MEMORY, "lion: no memory for its temporary");
  }
  return HR_OK;
}

static hr_status step(void* instance, const hr_optimizer_step_info* info) {
  lion* p = (lion*)instance;
  const hr_host_services* s = p->s;
  int32_t l, i, k = 0;
  if (p->count == 0) {
    const hr_status st = allocate(p);
    if (st != HR_OK) return st;
  }
  for (l = 0; l < s->num_layers(s->host); ++l) {
    const int32_t n = s->layer_num_params(s->host, l);
    for (i = 0; i < n; ++i, ++k) {
      hr_tensor t;
      hr_status st;
      double wd;
      memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      st = s->layer_param(s->host, l, i, &t);
      if (st != HR_OK) return st;
      if (t.dtype != HR_DTYPE_F32 || t.grad_dtype != HR_DTYPE_F32 || !t.grad)
        return fail(p, HR_ERROR_UNSUPPORTED, "lion: expected f32 parameters and gradients");
      if (p->bad[0] != '\0') {
        /* The host's message stands when the status is the documented one. */
        st = bad_call(p, &t);
        return st == HR_ERROR_INVALID
                   ? st
                   : fail(p, HR_ERROR, "lion: the bad call did not return HR_ERROR_INVALID");
      }
      wd = t.weight_decay ? p->weight_decay : 0.0;
      if (strcmp(p->mode, "adamw") == 0)
        st = p->ops->adamw(s->host, t.data, t.grad, p->m[k], p->v[k], t.numel, HR_DTYPE_F32,
                           HR_DTYPE_F32, HR_DTYPE_F32, info->lr, p->beta1, p->beta2, p->eps, wd,
                           info->step, 0);
      else if (strcmp(p->mode, "staging") == 0)
        st = staged(p, &t, p->m[k], info->lr, wd);
      else
        st = on_device(p, &t, p->m[k], info->lr, wd);
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
  for (k = 0; k < p->count; ++k) {
    p->s->free(p->s->host, p->m[k]);
    if (p->v[k]) p->s->free(p->s->host, p->v[k]);
  }
  if (p->c) p->s->free(p->s->host, p->c);
  for (k = 0; k < 4; ++k)
    free(p->host[k]);
  free(p);
}

static hr_status create(const hr_host_services* s, void** instance) {
  lion* p = (lion*)calloc(1, sizeof *p);
  hr_status st;
  int k;
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->s = s;
  strcpy(p->mode, "ops");
  p->beta1 = 0.9;
  p->beta2 = 0.99;
  p->weight_decay = 0.0;
  p->eps = 1e-8;
  st = s->config_string(s->host, "mode", p->mode, sizeof p->mode);
  if (st == HR_OK) st = s->config_string(s->host, "bad", p->bad, sizeof p->bad);
  if (st == HR_OK) st = s->config_float(s->host, "beta1", &p->beta1);
  if (st == HR_OK) st = s->config_float(s->host, "beta2", &p->beta2);
  if (st == HR_OK) st = s->config_float(s->host, "weight_decay", &p->weight_decay);
  if (st == HR_OK) st = s->config_float(s->host, "eps", &p->eps);
  if (st == HR_OK && strcmp(p->mode, "ops") != 0 && strcmp(p->mode, "staging") != 0 &&
      strcmp(p->mode, "adamw") != 0)
    st = s->config_error(s->host, "mode", "must be \"ops\", \"staging\" or \"adamw\"");
  p->ops = (const hr_ext_ops*)s->get_extension(s->host, HR_EXT_OPS);
  p->tensors = (const hr_ext_tensors*)s->get_extension(s->host, HR_EXT_TENSORS);
  if (st == HR_OK && (!p->ops || !p->tensors)) {
    s->set_error(s->host, "lion: the host lacks headroom.ops/1 or headroom.tensors/1");
    st = HR_ERROR_UNSUPPORTED;
  }
  for (k = 0; st == HR_OK && k < 4; ++k)
    if (!(p->host[k] = (float*)malloc(CHUNK * 4))) st = HR_ERROR_OUT_OF_MEMORY;
  if (st != HR_OK) {
    destroy(p);
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
    .description = "test plugin: Lion on the device (headroom.ops/1) or staged through the host",
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
