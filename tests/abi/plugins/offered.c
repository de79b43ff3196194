/* Test plugin offering its role hooks and its state as ABI 1.5 extensions, with every matching
 * descriptor field NULL: headroom.allocator/1 (each request from headroom.vm/1's raw_alloc, which
 * the allocator role may call), headroom.optimizer/1 (plain SGD: p -= lr * g, through op_axpy) and
 * headroom.state/1 (the number of optimizer steps it took). Appends to `out`:
 *
 *   offered STEP step=<n> lr=<lr> steps=<steps taken, loaded ones included>
 *   offered LOAD steps=<n>
 *   offered DESTROY allocations=<n> live=<n>
 *
 * Keys: out (string, required). */
#include <headroom/ext/roles.h>
#include <headroom/ext/state.h>
#include <headroom/ext/vm.h>
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct offered {
  const hr_host_services* s;
  const hr_ext_vm* vm;
  char out[4096];
  int64_t steps;
  uint64_t allocations, live;
} offered;

static void append(offered* o, const char* line) {
  FILE* f = fopen(o->out, "a");
  if (!f) return;
  fprintf(f, "offered %s\n", line);
  fclose(f);
}

static void* allocate(void* instance, uint64_t bytes, uint32_t category, void* stream) {
  offered* o = (offered*)instance;
  void* p;
  (void)category;
  (void)stream;
  p = o->vm->raw_alloc(o->s->host, bytes ? bytes : 1);
  if (p) {
    ++o->allocations;
    ++o->live;
  }
  return p;
}

static void deallocate(void* instance, void* ptr, uint64_t bytes, void* stream) {
  offered* o = (offered*)instance;
  (void)bytes;
  (void)stream;
  o->vm->raw_free(o->s->host, ptr);
  --o->live;
}

static hr_status step(void* instance, const hr_optimizer_step_info* info) {
  offered* o = (offered*)instance;
  const hr_host_services* s = o->s;
  char line[128];
  int32_t l, i, layers = s->num_layers(s->host);
  for (l = 0; l < layers; ++l) {
    for (i = 0; i < s->layer_num_params(s->host, l); ++i) {
      hr_tensor t;
      hr_status st;
      memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      if ((st = s->layer_param(s->host, l, i, &t)) != HR_OK) return st;
      if ((st = s->op_axpy(s->host, t.data, t.grad, HR_DTYPE_F32, t.numel, -info->lr)) != HR_OK)
        return st;
    }
  }
  ++o->steps;
  snprintf(line, sizeof line, "STEP step=%lld lr=%g steps=%lld", (long long)info->step, info->lr,
           (long long)o->steps);
  append(o, line);
  return HR_OK;
}

static hr_status save(void* instance, const hr_state_writer* writer) {
  const offered* o = (const offered*)instance;
  return writer->write(writer->context, &o->steps, sizeof o->steps);
}

static hr_status load(void* instance, const void* data, uint64_t size) {
  offered* o = (offered*)instance;
  char line[64];
  if (size != sizeof o->steps) {
    o->s->set_error(o->s->host, "offered: not the bytes save wrote");
    return HR_ERROR_CONFIG;
  }
  memcpy(&o->steps, data, sizeof o->steps);
  snprintf(line, sizeof line, "LOAD steps=%lld", (long long)o->steps);
  append(o, line);
  return HR_OK;
}

static const hr_allocator_hooks kAllocator = {sizeof(hr_allocator_hooks), 0, allocate, deallocate,
                                              NULL};
static const hr_optimizer_hooks kOptimizer = {sizeof(hr_optimizer_hooks), 0, step, NULL};
static const hr_ext_state kState = {sizeof(hr_ext_state), 0, save, load};

static const void* get_extension(const char* id) {
  if (!id) return NULL;
  if (strcmp(id, HR_EXT_ALLOCATOR) == 0) return &kAllocator;
  if (strcmp(id, HR_EXT_OPTIMIZER) == 0) return &kOptimizer;
  if (strcmp(id, HR_EXT_STATE) == 0) return &kState;
  return NULL;
}

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  offered* o = (offered*)calloc(1, sizeof *o);
  if (!o) return HR_ERROR_OUT_OF_MEMORY;
  o->s = s;
  o->vm = (const hr_ext_vm*)s->get_extension(s->host, HR_EXT_VM);
  st = s->config_string(s->host, "out", o->out, sizeof o->out);
  if (st != HR_OK || o->out[0] == '\0' || !o->vm) {
    free(o);
    return st != HR_OK ? st : s->config_error(s->host, "out", "offered needs `out`");
  }
  *instance = o;
  return HR_OK;
}

static void destroy(void* instance) {
  offered* o = (offered*)instance;
  char line[96];
  snprintf(line, sizeof line, "DESTROY allocations=%llu live=%llu",
           (unsigned long long)o->allocations, (unsigned long long)o->live);
  append(o, line);
  free(o);
}

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "offered",
    .version = "1.5.0",
    .description = "test plugin: roles and state as extensions",
    .events = 0,
    .roles = HR_ROLE_ALLOCATOR | HR_ROLE_OPTIMIZER,
    .create = create,
    .destroy = destroy,
    .on_event = NULL,
    .allocator = NULL,
    .optimizer = NULL,
    .save_state = NULL,
    .load_state = NULL,
    .get_extension = get_extension};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
