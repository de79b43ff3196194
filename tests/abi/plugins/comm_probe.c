/* Test plugin for headroom.comm/1: calls every function of the extension on device buffers it
 * allocates with services->alloc (filled with op_fill, read back with headroom.tensors/1 read),
 * and records what it saw, one line each, to `<out>.rank<R>.txt` (R: its rank):
 *
 *   create ext=1 size=1 rank=R local_rank=L world=W
 *   info TRAIN_BEGIN rank=R local_rank=L world=W stream_null=1 same_stream=1
 *   all_reduce f32 sum <3 values>          every rank's buffer filled with rank + 1
 *   all_reduce f32 average <3 values>      (the two posted together, waited for in reverse)
 *   all_reduce bf16 sum <3 values>
 *   all_reduce f16 average <3 values>
 *   reduce_scatter sum <2 values>          send block b, element i: 10 b + i + rank
 *   reduce_scatter average <2 values>
 *   all_gather <W * 2 values>              send: rank + 1, 10 (rank + 1)
 *   broadcast root=<W-1> <3 values>        every rank's buffer filled with rank + 1
 *   barrier post=0 wait=0 wait_null=0
 *   invalid dtype=5 op=5 root=5 neg_root=5 out=5
 *   step_end step=S sum=<S * sum of (rank + 1)> barrier=0      (every STEP_END)
 *   alloc rank=R world=W all_reduce=7 reduce_scatter=7 all_gather=7 broadcast=7 barrier=7 wait=7
 *                                          (the first ALLOC event: collectives refused there)
 *
 * Values are %.9g. Any collective that fails (a status other than HR_OK where one is expected)
 * fails the hook with the host's status, after an "error <what> status=<s>" line. Keys: out
 * (string, required): a path prefix. Every read of a device buffer goes through read(), so the
 * plugin runs on either backend. */
#include <headroom/ext/comm.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct probe {
  const hr_host_services* s;
  const hr_ext_comm* comm;
  const hr_ext_tensors* tensors;
  FILE* out;
  int saw_alloc;
} probe;

static double bf16_value(uint16_t u) {
  const uint32_t bits = (uint32_t)u << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* IEEE half to double: enough for the small exact values this plugin uses (and the rest). */
static double f16_value(uint16_t u) {
  const int sign = (u >> 15) & 1, exponent = (u >> 10) & 0x1f, mantissa = u & 0x3ff;
  double v;
  if (exponent == 0) {
    v = mantissa / 1024.0 / 16384.0; /* subnormal: m * 2^-24 */
  } else if (exponent == 31) {
    v = mantissa ? NAN : INFINITY;
  } else {
    v = (1.0 + mantissa / 1024.0);
    if (exponent >= 15) {
      int e;
      for (e = 15; e < exponent; ++e)
        v *= 2.0;
    } else {
      int e;
      for (e = exponent; e < 15; ++e)
        v /= 2.0;
    }
  }
  return sign ? -v : v;
}

static uint64_t dtype_size(uint32_t dtype) {
  return dtype == HR_DTYPE_BF16 || dtype == HR_DTYPE_F16 ? 2 : 4;
}

static const char* dtype_name(uint32_t dtype) {
  return dtype == HR_DTYPE_BF16 ? "bf16" : dtype == HR_DTYPE_F16 ? "f16" : "f32";
}

static hr_status fail(probe* p, const char* what, hr_status st) {
  fprintf(p->out, "error %s status=%d\n", what, (int)st);
  fflush(p->out);
  return st == HR_OK ? HR_ERROR : st;
}

/* A device buffer of n elements of dtype, every element `value`. */
static void* filled(probe* p, uint32_t dtype, uint64_t n, double value, const char* what) {
  void* x = p->s->alloc(p->s->host, n * dtype_size(dtype), HR_MEM_WORKSPACE, what);
  if (x && p->s->op_fill(p->s->host, x, dtype, n, value) != HR_OK) {
    p->s->free(p->s->host, x);
    return NULL;
  }
  return x;
}

/* Sets element i of a device buffer. */
static hr_status set_element(probe* p, void* x, uint32_t dtype, uint64_t i, double value) {
  return p->s->op_fill(p->s->host, (unsigned char*)x + i * dtype_size(dtype), dtype, 1, value);
}

/* Writes " v0 v1 ..." of n elements of the device buffer x (read to the host first). */
static hr_status print_values(probe* p, const void* x, uint32_t dtype, uint64_t n) {
  unsigned char host[256];
  uint64_t i;
  hr_status st;
  if (n * dtype_size(dtype) > sizeof host) return HR_ERROR_INVALID;
  if ((st = p->tensors->read(p->s->host, host, x, n * dtype_size(dtype))) != HR_OK) return st;
  for (i = 0; i < n; ++i) {
    double v;
    if (dtype == HR_DTYPE_F32) {
      float f;
      memcpy(&f, host + 4 * i, 4);
      v = f;
    } else {
      uint16_t u;
      memcpy(&u, host + 2 * i, 2);
      v = dtype == HR_DTYPE_BF16 ? bf16_value(u) : f16_value(u);
    }
    fprintf(p->out, " %.9g", v);
  }
  fprintf(p->out, "\n");
  return HR_OK;
}

static hr_status check_all_reduce(probe* p, int32_t rank) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  hr_comm_request *sum_req = NULL, *avg_req = NULL;
  hr_status st = HR_OK;
  uint32_t dtypes[2];
  int k;
  void* sum = filled(p, HR_DTYPE_F32, 3, rank + 1, "comm_probe: all_reduce sum");
  void* avg = filled(p, HR_DTYPE_F32, 3, rank + 1, "comm_probe: all_reduce average");
  if (!sum || !avg) return fail(p, "alloc", HR_ERROR_OUT_OF_MEMORY);
  /* Two in flight at once, waited for in the reverse order. */
  if ((st = c->all_reduce(h, sum, 3, HR_DTYPE_F32, HR_COMM_SUM, &sum_req)) != HR_OK)
    return fail(p, "all_reduce sum", st);
  if ((st = c->all_reduce(h, avg, 3, HR_DTYPE_F32, HR_COMM_AVERAGE, &avg_req)) != HR_OK) {
    c->wait(h, sum_req);
    return fail(p, "all_reduce average", st);
  }
  if ((st = c->wait(h, avg_req)) != HR_OK) {
    c->wait(h, sum_req);
    return fail(p, "wait all_reduce average", st);
  }
  if ((st = c->wait(h, sum_req)) != HR_OK) return fail(p, "wait all_reduce sum", st);
  fprintf(p->out, "all_reduce f32 sum");
  if ((st = print_values(p, sum, HR_DTYPE_F32, 3)) != HR_OK) return fail(p, "read", st);
  fprintf(p->out, "all_reduce f32 average");
  if ((st = print_values(p, avg, HR_DTYPE_F32, 3)) != HR_OK) return fail(p, "read", st);
  p->s->free(h, sum);
  p->s->free(h, avg);

  /* The 2-byte dtypes: bf16 summed, f16 averaged. */
  dtypes[0] = HR_DTYPE_BF16;
  dtypes[1] = HR_DTYPE_F16;
  for (k = 0; k < 2; ++k) {
    const uint32_t op = k == 0 ? HR_COMM_SUM : HR_COMM_AVERAGE;
    hr_comm_request* req = NULL;
    void* x = filled(p, dtypes[k], 3, rank + 1, "comm_probe: all_reduce 2-byte");
    if (!x) return fail(p, "alloc", HR_ERROR_OUT_OF_MEMORY);
    if ((st = c->all_reduce(h, x, 3, dtypes[k], op, &req)) != HR_OK)
      return fail(p, "all_reduce 2-byte", st);
    if ((st = c->wait(h, req)) != HR_OK) return fail(p, "wait all_reduce 2-byte", st);
    fprintf(p->out, "all_reduce %s %s", dtype_name(dtypes[k]), k == 0 ? "sum" : "average");
    if ((st = print_values(p, x, dtypes[k], 3)) != HR_OK) return fail(p, "read", st);
    p->s->free(h, x);
  }
  return HR_OK;
}

static hr_status check_reduce_scatter(probe* p, int32_t rank, int32_t world) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  const uint64_t n = 2;
  hr_status st;
  uint32_t op;
  for (op = HR_COMM_SUM; op <= HR_COMM_AVERAGE; ++op) {
    hr_comm_request* req = NULL;
    void* send = filled(p, HR_DTYPE_F32, n * (uint64_t)world, 0, "comm_probe: reduce_scatter");
    void* recv = filled(p, HR_DTYPE_F32, n, -1, "comm_probe: reduce_scatter recv");
    int32_t b;
    uint64_t i;
    if (!send || !recv) return fail(p, "alloc", HR_ERROR_OUT_OF_MEMORY);
    for (b = 0; b < world; ++b)
      for (i = 0; i < n; ++i)
        if ((st = set_element(p, send, HR_DTYPE_F32, b * n + i, 10.0 * b + (double)i + rank)) !=
            HR_OK)
          return fail(p, "op_fill", st);
    if ((st = c->reduce_scatter(h, send, recv, n, HR_DTYPE_F32, op, &req)) != HR_OK)
      return fail(p, "reduce_scatter", st);
    if ((st = c->wait(h, req)) != HR_OK) return fail(p, "wait reduce_scatter", st);
    fprintf(p->out, "reduce_scatter %s", op == HR_COMM_SUM ? "sum" : "average");
    if ((st = print_values(p, recv, HR_DTYPE_F32, n)) != HR_OK) return fail(p, "read", st);
    p->s->free(h, send);
    p->s->free(h, recv);
  }
  return HR_OK;
}

static hr_status check_all_gather(probe* p, int32_t rank, int32_t world) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  hr_comm_request* req = NULL;
  hr_status st;
  void* send = filled(p, HR_DTYPE_F32, 2, rank + 1, "comm_probe: all_gather");
  void* recv = filled(p, HR_DTYPE_F32, 2 * (uint64_t)world, -1, "comm_probe: all_gather recv");
  if (!send || !recv) return fail(p, "alloc", HR_ERROR_OUT_OF_MEMORY);
  if ((st = set_element(p, send, HR_DTYPE_F32, 1, 10.0 * (rank + 1))) != HR_OK)
    return fail(p, "op_fill", st);
  if ((st = c->all_gather(h, send, recv, 2, HR_DTYPE_F32, &req)) != HR_OK)
    return fail(p, "all_gather", st);
  if ((st = c->wait(h, req)) != HR_OK) return fail(p, "wait all_gather", st);
  fprintf(p->out, "all_gather");
  if ((st = print_values(p, recv, HR_DTYPE_F32, 2 * (uint64_t)world)) != HR_OK)
    return fail(p, "read", st);
  p->s->free(h, send);
  p->s->free(h, recv);
  return HR_OK;
}

static hr_status check_broadcast_barrier(probe* p, int32_t rank, int32_t world) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  hr_comm_request *req = NULL, *bad = NULL;
  hr_status st, post, waited, wait_null, dtype, op, root, neg_root, out;
  void* x = filled(p, HR_DTYPE_F32, 3, rank + 1, "comm_probe: broadcast");
  if (!x) return fail(p, "alloc", HR_ERROR_OUT_OF_MEMORY);
  if ((st = c->broadcast(h, x, 3, HR_DTYPE_F32, world - 1, &req)) != HR_OK)
    return fail(p, "broadcast", st);
  if ((st = c->wait(h, req)) != HR_OK) return fail(p, "wait broadcast", st);
  fprintf(p->out, "broadcast root=%d", (int)(world - 1));
  if ((st = print_values(p, x, HR_DTYPE_F32, 3)) != HR_OK) return fail(p, "read", st);

  req = NULL;
  post = c->barrier(h, &req);
  waited = post == HR_OK ? c->wait(h, req) : HR_ERROR;
  wait_null = c->wait(h, NULL);
  fprintf(p->out, "barrier post=%d wait=%d wait_null=%d\n", (int)post, (int)waited, (int)wait_null);

  /* Arguments every rank refuses alike (no collective is posted): an integer dtype, an unknown
   * op, a root outside the ranks, no place for the request. */
  dtype = c->all_reduce(h, x, 3, HR_DTYPE_I32, HR_COMM_SUM, &bad);
  if (bad) c->wait(h, bad);
  bad = NULL;
  op = c->all_reduce(h, x, 3, HR_DTYPE_F32, 7, &bad);
  if (bad) c->wait(h, bad);
  bad = NULL;
  root = c->broadcast(h, x, 3, HR_DTYPE_F32, world, &bad);
  if (bad) c->wait(h, bad);
  bad = NULL;
  neg_root = c->broadcast(h, x, 3, HR_DTYPE_F32, -1, &bad);
  if (bad) c->wait(h, bad);
  out = c->barrier(h, NULL);
  fprintf(p->out, "invalid dtype=%d op=%d root=%d neg_root=%d out=%d\n", (int)dtype, (int)op,
          (int)root, (int)neg_root, (int)out);
  p->s->free(h, x);
  return HR_OK;
}

static hr_status train_begin(probe* p) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  const int32_t rank = c->rank(h), world = c->world_size(h);
  hr_status st;
  fprintf(p->out, "info TRAIN_BEGIN rank=%d local_rank=%d world=%d stream_null=%d same_stream=%d\n",
          (int)rank, (int)c->local_rank(h), (int)world, c->stream(h) == NULL,
          c->stream(h) == p->s->stream(h));
  fflush(p->out);
  if ((st = check_all_reduce(p, rank)) != HR_OK) return st;
  if ((st = check_reduce_scatter(p, rank, world)) != HR_OK) return st;
  if ((st = check_all_gather(p, rank, world)) != HR_OK) return st;
  return check_broadcast_barrier(p, rank, world);
}

static hr_status step_end(probe* p, int64_t step) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  hr_comm_request* req = NULL;
  hr_status st, barrier;
  float sum;
  void* x = filled(p, HR_DTYPE_F32, 1, (double)step * (c->rank(h) + 1), "comm_probe: step_end");
  if (!x) return fail(p, "alloc", HR_ERROR_OUT_OF_MEMORY);
  if ((st = c->all_reduce(h, x, 1, HR_DTYPE_F32, HR_COMM_SUM, &req)) != HR_OK)
    return fail(p, "all_reduce step_end", st);
  if ((st = c->wait(h, req)) != HR_OK) return fail(p, "wait all_reduce step_end", st);
  if ((st = p->tensors->read(h, &sum, x, sizeof sum)) != HR_OK) return fail(p, "read", st);
  p->s->free(h, x);
  req = NULL;
  barrier = c->barrier(h, &req);
  if (barrier == HR_OK) barrier = c->wait(h, req);
  fprintf(p->out, "step_end step=%lld sum=%.9g barrier=%d\n", (long long)step, sum, (int)barrier);
  return barrier;
}

/* From inside an ALLOC hook: rank and world size answer, every collective and wait is refused
 * (HR_ERROR_NOT_ALLOWED) before it reaches the communicator. */
static void in_alloc(probe* p) {
  const hr_ext_comm* c = p->comm;
  hr_host* h = p->s->host;
  hr_comm_request* req = NULL;
  float buf[2] = {0, 0}, recv[64];
  hr_status all_reduce, reduce_scatter, all_gather, broadcast, barrier, wait;
  all_reduce = c->all_reduce(h, buf, 1, HR_DTYPE_F32, HR_COMM_SUM, &req);
  if (req) c->wait(h, req);
  req = NULL;
  reduce_scatter = c->reduce_scatter(h, buf, recv, 1, HR_DTYPE_F32, HR_COMM_SUM, &req);
  if (req) c->wait(h, req);
  req = NULL;
  all_gather = c->all_gather(h, buf, recv, 1, HR_DTYPE_F32, &req);
  if (req) c->wait(h, req);
  req = NULL;
  broadcast = c->broadcast(h, buf, 1, HR_DTYPE_F32, 0, &req);
  if (req) c->wait(h, req);
  req = NULL;
  barrier = c->barrier(h, &req);
  if (req) c->wait(h, req);
  wait = c->wait(h, NULL);
  fprintf(p->out,
          "alloc rank=%d world=%d all_reduce=%d reduce_scatter=%d all_gather=%d broadcast=%d "
          "barrier=%d wait=%d\n",
          (int)c->rank(h), (int)c->world_size(h), (int)all_reduce, (int)reduce_scatter,
          (int)all_gather, (int)broadcast, (int)barrier, (int)wait);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  probe* p = (probe*)instance;
  hr_status st = HR_OK;
  switch (info->event) {
    case HR_EVENT_TRAIN_BEGIN:
      st = train_begin(p);
      break;
    case HR_EVENT_STEP_END:
      st = step_end(p, info->step);
      break;
    case HR_EVENT_ALLOC:
      if (!p->saw_alloc) {
        p->saw_alloc = 1;
        in_alloc(p);
      }
      break;
    default:
      break;
  }
  fflush(p->out);
  return st;
}

static hr_status create(const hr_host_services* s, void** instance) {
  char out[4000] = "", path[4096];
  hr_status st;
  probe* p;
  if (!HR_HAS_FIELD(s, hr_host_services, get_extension)) {
    s->set_error(s->host, "comm_probe: the host has no get_extension (ABI 1.5)");
    return HR_ERROR_VERSION;
  }
  if ((st = s->config_string(s->host, "out", out, sizeof out)) != HR_OK) return st;
  if (out[0] == '\0') return s->config_error(s->host, "out", "is required");
  p = (probe*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->s = s;
  p->comm = (const hr_ext_comm*)s->get_extension(s->host, HR_EXT_COMM);
  p->tensors = (const hr_ext_tensors*)s->get_extension(s->host, HR_EXT_TENSORS);
  if (!p->comm || !p->tensors) {
    free(p);
    s->set_error(s->host, "comm_probe: the host lacks headroom.comm/1 or headroom.tensors/1");
    return HR_ERROR_VERSION;
  }
  snprintf(path, sizeof path, "%s.rank%d.txt", out, (int)p->comm->rank(s->host));
  p->out = fopen(path, "w");
  if (!p->out) {
    free(p);
    return s->config_error(s->host, "out", "cannot open <out>.rank<R>.txt");
  }
  fprintf(p->out, "create ext=1 size=%d rank=%d local_rank=%d world=%d\n",
          p->comm->struct_size >= sizeof(hr_ext_comm), (int)p->comm->rank(s->host),
          (int)p->comm->local_rank(s->host), (int)p->comm->world_size(s->host));
  fflush(p->out);
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
    .name = "comm_probe",
    .version = "1.5.0",
    .description = "test plugin: headroom.comm/1, every function",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
              HR_EVENT_BIT(HR_EVENT_ALLOC),
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .get_extension = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
