/* Test plugin for ABI 1.5's host extensions: asks for each (and for ids the host lacks), calls
 * every function of headroom.tensors/1, step/1, precision/1 and recompute/1, and the vm services
 * without the allocator role, and records what it got, one line each, to `out`:
 *
 *   ids nope=0 vm2=0 null=0 vm=1 precision=1 recompute=1 tensors=1 step=1
 *   vm14 granularity=0 reserve=0 raw_alloc=0 map=7 unmap=7 release=7
 *   vm1 granularity=0 reserve=0 raw_alloc=0 map=7 unmap=7 release=7
 *   precision create dtype=0 scale=1
 *   precision TRAIN_BEGIN dtype=0 scale=1 set_dtype=7
 *   recompute TRAIN_BEGIN drop=7
 *   find layer=1 index=2 same=1 missing=5 null_name=5
 *   read ok=0 same=1 too_big=5
 *   reduce dtype=f32 op=0 got=<x> want=<x>            (ops 0..3, then dtype=bf16 the same)
 *   reduce nan max=nan max_abs=nan sum=nan
 *   reduce empty sum=0 max=-inf max_abs=-inf sum_squares=0
 *   act FORWARD_END layer=1 bytes=<b> views=<b>          (every layer)
 *   act BACKWARD_END layer=1 bytes=0
 *   state <EVENT> step= micro= lr= scale= loss= tokens= norm= clip= skipped= info_loss=
 *         info_tokens=                                   (STEP_BEGIN, BACKWARD_END, GRADS_READY,
 *                                                         OPTIMIZER_STEP, STEP_END)
 *
 * Numbers are %.17g. Keys: out (string, required); fail (string): "vm1" — create returns what
 * headroom.vm/1's map answered; "vm14" — create returns what the 1.4 table's vm_map answered;
 * dtype (string "bf16"): chooses the compute dtype through headroom.precision/1 in create;
 * veto_step (int): vetoes that step at GRADS_READY. The reductions need the CPU backend (the
 * plugin computes what they should give from the host pointers). */
#include <headroom/ext/precision.h>
#include <headroom/ext/recompute.h>
#include <headroom/ext/step.h>
#include <headroom/ext/tensors.h>
#include <headroom/ext/vm.h>
#include <headroom/plugin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char* const kEventNames[HR_EVENT_COUNT_V1] = {
    "TRAIN_BEGIN", "TRAIN_END",      "STEP_BEGIN",   "STEP_END",    "FORWARD_BEGIN",
    "FORWARD_END", "BACKWARD_BEGIN", "BACKWARD_END", "GRADS_READY", "OPTIMIZER_STEP",
    "ALLOC",       "FREE",           "OOM"};

typedef struct probe {
  const hr_host_services* s;
  const hr_ext_precision* precision;
  const hr_ext_recompute* recompute;
  const hr_ext_tensors* tensors;
  const hr_ext_step* step;
  FILE* out;
  int64_t veto_step;
} probe;

static uint64_t dtype_size(uint32_t dtype) {
  return dtype == HR_DTYPE_BF16 || dtype == HR_DTYPE_F16 ? 2 : dtype == HR_DTYPE_F64 ? 8 : 4;
}

static double bf16_value(uint16_t u) {
  const uint32_t bits = (uint32_t)u << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* What reduce should give for n elements at host pointer x (f32 or bf16). */
static double host_reduce(const void* x, uint32_t dtype, uint64_t n, uint32_t op) {
  double acc = op == HR_REDUCE_MAX || op == HR_REDUCE_MAX_ABS ? -INFINITY : 0.0;
  uint64_t i;
  for (i = 0; i < n; ++i) {
    double v;
    if (dtype == HR_DTYPE_BF16) {
      uint16_t u;
      memcpy(&u, (const unsigned char*)x + 2 * i, 2);
      v = bf16_value(u);
    } else {
      v = ((const float*)x)[i];
    }
    if (op == HR_REDUCE_SUM) acc += v;
    if (op == HR_REDUCE_SUM_SQUARES) acc += v * v;
    if (op == HR_REDUCE_MAX && v > acc) acc = v;
    if (op == HR_REDUCE_MAX_ABS && fabs(v) > acc) acc = fabs(v);
  }
  return acc;
}

static hr_status check_vm(probe* p, const char* fail) {
  const hr_host_services* s = p->s;
  const hr_ext_vm* vm = (const hr_ext_vm*)s->get_extension(s->host, HR_EXT_VM);
  char buf[64];
  hr_status map14, map1;
  /* The refusal a failing create returns, with the host's message for it (the last one set). */
  if (fail && strcmp(fail, "vm14") == 0) return s->vm_map(s->host, buf, 64);
  if (fail && strcmp(fail, "vm1") == 0) return vm ? vm->map(s->host, buf, 64) : HR_ERROR;
  map14 = s->vm_map(s->host, buf, 64);
  fprintf(p->out, "vm14 granularity=%llu reserve=%d raw_alloc=%d map=%d unmap=%d release=%d\n",
          (unsigned long long)s->vm_granularity(s->host), s->vm_reserve(s->host, 1 << 21) != NULL,
          s->raw_alloc(s->host, 64) != NULL, (int)map14, (int)s->vm_unmap(s->host, buf, 64),
          (int)s->vm_release(s->host, buf, 64));
  s->raw_free(s->host, buf); /* refused: must not touch `buf` */
  if (!vm) return HR_ERROR;
  map1 = vm->map(s->host, buf, 64);
  fprintf(p->out, "vm1 granularity=%llu reserve=%d raw_alloc=%d map=%d unmap=%d release=%d\n",
          (unsigned long long)vm->granularity(s->host), vm->reserve(s->host, 1 << 21) != NULL,
          vm->raw_alloc(s->host, 64) != NULL, (int)map1, (int)vm->unmap(s->host, buf, 64),
          (int)vm->release(s->host, buf, 64));
  vm->raw_free(s->host, buf);
  return HR_OK;
}

static hr_status check_tensors(probe* p) {
  const hr_host_services* s = p->s;
  const hr_ext_tensors* t = p->tensors;
  hr_tensor a, b;
  int32_t layer = -1, index = -1;
  hr_status st, missing, null_name;
  float head[4], too_big = 0;
  void* bf16;
  uint32_t op;
  double got, max, max_abs, sum, sum_squares;
  float nan_buf[3];
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  a.struct_size = b.struct_size = sizeof a;
  st = t->find_param(s->host, "h.0.attn.c_attn.weight", &a, &layer, &index);
  if (st != HR_OK) return st;
  if (s->layer_param(s->host, layer, index, &b) != HR_OK) return HR_ERROR;
  missing = t->find_param(s->host, "h.99.nope", &b, NULL, NULL);
  null_name = t->find_param(s->host, NULL, &b, NULL, NULL);
  fprintf(p->out, "find layer=%d index=%d same=%d missing=%d null_name=%d\n", (int)layer,
          (int)index, a.data == b.data && strcmp(a.name, b.name) == 0, (int)missing,
          (int)null_name);
  st = t->read(s->host, head, a.data, sizeof head);
  fprintf(p->out, "read ok=%d same=%d too_big=%d\n", (int)st,
          memcmp(head, a.data, sizeof head) == 0,
          (int)t->read(s->host, &too_big, a.data, HR_READ_MAX_BYTES + 1));
  for (op = 0; op <= HR_REDUCE_SUM_SQUARES; ++op) {
    if ((st = t->reduce(s->host, a.data, HR_DTYPE_F32, a.numel, op, &got)) != HR_OK) return st;
    fprintf(p->out, "reduce dtype=f32 op=%u got=%.17g want=%.17g\n", (unsigned)op, got,
            host_reduce(a.data, HR_DTYPE_F32, a.numel, op));
  }
  bf16 = s->alloc(s->host, a.numel * 2, HR_MEM_WORKSPACE, "ext_probe: bf16 copy");
  if (!bf16) return HR_ERROR_OUT_OF_MEMORY;
  if ((st = s->op_cast(s->host, bf16, HR_DTYPE_BF16, a.data, HR_DTYPE_F32, a.numel)) != HR_OK)
    return st;
  for (op = 0; op <= HR_REDUCE_SUM_SQUARES; ++op) {
    if ((st = t->reduce(s->host, bf16, HR_DTYPE_BF16, a.numel, op, &got)) != HR_OK) return st;
    fprintf(p->out, "reduce dtype=bf16 op=%u got=%.17g want=%.17g\n", (unsigned)op, got,
            host_reduce(bf16, HR_DTYPE_BF16, a.numel, op));
  }
  s->free(s->host, bf16);
  nan_buf[0] = 1.0f;
  nan_buf[1] = (float)NAN;
  nan_buf[2] = -5.0f;
  t->reduce(s->host, nan_buf, HR_DTYPE_F32, 3, HR_REDUCE_MAX, &max);
  t->reduce(s->host, nan_buf, HR_DTYPE_F32, 3, HR_REDUCE_MAX_ABS, &max_abs);
  t->reduce(s->host, nan_buf, HR_DTYPE_F32, 3, HR_REDUCE_SUM, &sum);
  fprintf(p->out, "reduce nan max=%g max_abs=%g sum=%g\n", max, max_abs, sum);
  t->reduce(s->host, NULL, HR_DTYPE_F32, 0, HR_REDUCE_SUM, &sum);
  t->reduce(s->host, NULL, HR_DTYPE_F32, 0, HR_REDUCE_MAX, &max);
  t->reduce(s->host, NULL, HR_DTYPE_F32, 0, HR_REDUCE_MAX_ABS, &max_abs);
  t->reduce(s->host, NULL, HR_DTYPE_F32, 0, HR_REDUCE_SUM_SQUARES, &sum_squares);
  fprintf(p->out, "reduce empty sum=%g max=%g max_abs=%g sum_squares=%g\n", sum, max, max_abs,
          sum_squares);
  return HR_OK;
}

static void record_state(probe* p, const hr_event_info* info) {
  hr_step_state st;
  memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  if (p->step->state(p->s->host, &st) != HR_OK) return;
  fprintf(p->out,
          "state %s step=%lld micro=%d lr=%.17g scale=%.17g loss=%.17g tokens=%llu norm=%.17g "
          "clip=%.17g skipped=%d info_loss=%.17g info_tokens=%llu\n",
          kEventNames[info->event], (long long)st.step, (int)st.micro_step, st.lr, st.loss_scale,
          st.loss, (unsigned long long)st.tokens, st.grad_norm, st.clip_coef, (int)st.skipped,
          info->loss, (unsigned long long)info->tokens);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  probe* p = (probe*)instance;
  const hr_host_services* s = p->s;
  hr_status st = HR_OK;
  if (!HR_HAS_FIELD(info, hr_event_info, tokens)) {
    s->set_error(s->host, "ext_probe: a 1.5 host's event info has no loss and tokens");
    return HR_ERROR;
  }
  switch (info->event) {
    case HR_EVENT_TRAIN_BEGIN:
      fprintf(p->out, "precision TRAIN_BEGIN dtype=%u scale=%.17g set_dtype=%d\n",
              (unsigned)p->precision->compute_dtype(s->host), p->precision->loss_scale(s->host),
              (int)p->precision->set_compute_dtype(s->host, HR_DTYPE_BF16));
      fprintf(p->out, "recompute TRAIN_BEGIN drop=%d\n",
              (int)p->recompute->drop_activations(s->host, 1, HR_DROP_ALL));
      st = check_tensors(p);
      break;
    case HR_EVENT_FORWARD_END: {
      uint64_t views = 0;
      int32_t i, n = s->layer_num_activations(s->host, info->layer);
      for (i = 0; i < n; ++i) {
        hr_tensor a;
        memset(&a, 0, sizeof a);
        a.struct_size = sizeof a;
        if (s->layer_activation(s->host, info->layer, i, &a) == HR_OK)
          views += a.numel * dtype_size(a.dtype);
      }
      if (info->step == 1 && info->micro_step == 1)
        fprintf(p->out, "act FORWARD_END layer=%d bytes=%llu views=%llu\n", (int)info->layer,
                (unsigned long long)p->recompute->layer_activation_bytes(s->host, info->layer),
                (unsigned long long)views);
      break;
    }
    case HR_EVENT_BACKWARD_END:
      if (info->step == 1 && info->micro_step == 1)
        fprintf(p->out, "act BACKWARD_END layer=%d bytes=%llu\n", (int)info->layer,
                (unsigned long long)p->recompute->layer_activation_bytes(s->host, info->layer));
      if (info->layer == 0) record_state(p, info);
      break;
    case HR_EVENT_GRADS_READY:
      if (info->step == p->veto_step) s->veto_step(s->host, "ext_probe: veto_step");
      record_state(p, info);
      break;
    case HR_EVENT_STEP_BEGIN:
    case HR_EVENT_OPTIMIZER_STEP:
    case HR_EVENT_STEP_END:
      record_state(p, info);
      break;
    default:
      break;
  }
  fflush(p->out);
  return st;
}

static hr_status create(const hr_host_services* s, void** instance) {
  char out[4096] = "", fail[32] = "", dtype[16] = "";
  hr_status st;
  probe* p = (probe*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->s = s;
  if ((st = s->config_string(s->host, "out", out, sizeof out)) != HR_OK ||
      (st = s->config_string(s->host, "fail", fail, sizeof fail)) != HR_OK ||
      (st = s->config_string(s->host, "dtype", dtype, sizeof dtype)) != HR_OK ||
      (st = s->config_int(s->host, "veto_step", &p->veto_step)) != HR_OK) {
    free(p);
    return st;
  }
  if (!HR_HAS_FIELD(s, hr_host_services, get_extension)) {
    free(p);
    s->set_error(s->host, "ext_probe: the host has no get_extension (ABI 1.5)");
    return HR_ERROR_VERSION;
  }
  p->out = fopen(out, "a");
  if (!p->out) {
    free(p);
    return s->config_error(s->host, "out", "cannot open it");
  }
  p->precision = (const hr_ext_precision*)s->get_extension(s->host, HR_EXT_PRECISION);
  p->recompute = (const hr_ext_recompute*)s->get_extension(s->host, HR_EXT_RECOMPUTE);
  p->tensors = (const hr_ext_tensors*)s->get_extension(s->host, HR_EXT_TENSORS);
  p->step = (const hr_ext_step*)s->get_extension(s->host, HR_EXT_STEP);
  fprintf(p->out, "ids nope=%d vm2=%d null=%d vm=%d precision=%d recompute=%d tensors=%d step=%d\n",
          s->get_extension(s->host, "headroom.nope/1") != NULL,
          s->get_extension(s->host, "headroom.vm/2") != NULL,
          s->get_extension(s->host, NULL) != NULL, s->get_extension(s->host, HR_EXT_VM) != NULL,
          p->precision != NULL, p->recompute != NULL, p->tensors != NULL, p->step != NULL);
  st = (p->precision && p->recompute && p->tensors && p->step) ? check_vm(p, fail) : HR_ERROR;
  if (st == HR_OK) {
    fprintf(p->out, "precision create dtype=%u scale=%.17g\n",
            (unsigned)p->precision->compute_dtype(s->host), p->precision->loss_scale(s->host));
    if (strcmp(dtype, "bf16") == 0) st = p->precision->set_compute_dtype(s->host, HR_DTYPE_BF16);
  }
  fflush(p->out);
  if (st != HR_OK) {
    fclose(p->out);
    free(p);
    return st;
  }
  *instance = p;
  return HR_OK;
}

static void destroy(void* instance) {
  probe* p = (probe*)instance;
  fclose(p->out);
  free(p);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "ext_probe",
    .version = "1.5.0",
    .description = "test plugin: the host's ABI 1.5 extensions",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_BEGIN) |
              HR_EVENT_BIT(HR_EVENT_FORWARD_END) | HR_EVENT_BIT(HR_EVENT_BACKWARD_END) |
              HR_EVENT_BIT(HR_EVENT_GRADS_READY) | HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP) |
              HR_EVENT_BIT(HR_EVENT_STEP_END),
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .get_extension = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
