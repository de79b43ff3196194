/* Test plugin, allocator role: serves every device allocation with services->raw_alloc and counts
 * them. At TRAIN_END it appends to `out` (string, required):
 *
 *   alloc_a allocs=<allocate calls> frees=<deallocate calls> host=<memory_stats num_allocs>
 *
 * With fail_after = N (int, default 0 = never) every allocation after the first N fails (NULL).
 * With nested_alloc = true, the first allocate also asks services->alloc for 64 bytes — a call the
 * host must refuse from inside an allocator hook — and the line ends with nested=refused (NULL)
 * or nested=granted.
 * Built as alloc_a and alloc_b (two plugins in one role are a config error). */
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef PLUGIN_NAME
#error "define PLUGIN_NAME"
#endif

typedef struct counting_alloc {
  const hr_host_services* services;
  char out[4096];
  uint64_t allocs;
  uint64_t frees;
  uint64_t bad_frees; /* deallocate of a NULL pointer */
  int64_t fail_after;
  int32_t nested_alloc;
  const char* nested; /* "refused" / "granted" once tried */
} counting_alloc;

static void* allocate(void* instance, uint64_t bytes, uint32_t category, void* stream) {
  counting_alloc* a = (counting_alloc*)instance;
  (void)category;
  (void)stream;
  if (a->fail_after > 0 && a->allocs >= (uint64_t)a->fail_after) return NULL;
  if (a->nested_alloc && !a->nested) {
    a->nested = "trying";
    a->nested = a->services->alloc(a->services->host, 64, HR_MEM_WORKSPACE, "nested") ? "granted"
                                                                                      : "refused";
  }
  ++a->allocs;
  return a->services->raw_alloc(a->services->host, bytes);
}

static void deallocate(void* instance, void* ptr, uint64_t bytes, void* stream) {
  counting_alloc* a = (counting_alloc*)instance;
  (void)bytes;
  (void)stream;
  if (!ptr) {
    ++a->bad_frees;
    return;
  }
  ++a->frees;
  a->services->raw_free(a->services->host, ptr);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  counting_alloc* a = (counting_alloc*)instance;
  const hr_host_services* s = a->services;
  if (info->event != HR_EVENT_TRAIN_END) return HR_OK;
  hr_memory_stats stats = {0};
  stats.struct_size = sizeof stats;
  if (s->memory_stats(s->host, &stats) != HR_OK) {
    s->set_error(s->host, PLUGIN_NAME ": memory_stats failed");
    return HR_ERROR;
  }
  FILE* f = fopen(a->out, "a");
  if (!f) {
    s->set_error(s->host, PLUGIN_NAME ": cannot open the `out` file");
    return HR_ERROR;
  }
  fprintf(f, "%s allocs=%llu frees=%llu bad_frees=%llu host=%llu%s%s\n", PLUGIN_NAME,
          (unsigned long long)a->allocs, (unsigned long long)a->frees,
          (unsigned long long)a->bad_frees, (unsigned long long)stats.num_allocs,
          a->nested ? " nested=" : "", a->nested ? a->nested : "");
  fclose(f);
  return HR_OK;
}

static hr_status create(const hr_host_services* s, void** instance) {
  counting_alloc* a = (counting_alloc*)calloc(1, sizeof *a);
  if (!a) return HR_ERROR_OUT_OF_MEMORY;
  a->services = s;
  hr_status st = s->config_string(s->host, "out", a->out, sizeof a->out);
  if (st == HR_OK) st = s->config_int(s->host, "fail_after", &a->fail_after);
  if (st == HR_OK) st = s->config_bool(s->host, "nested_alloc", &a->nested_alloc);
  if (st != HR_OK) {
    free(a);
    return st;
  }
  if (a->out[0] == '\0') {
    free(a);
    return s->config_error(s->host, "out", PLUGIN_NAME " needs `out`, the file to write to");
  }
  *instance = a;
  return HR_OK;
}

static void destroy(void* instance) {
  free(instance);
}

static const hr_allocator_hooks kAllocator = {
    .struct_size = sizeof(hr_allocator_hooks), .allocate = allocate, .deallocate = deallocate};

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = PLUGIN_NAME,
    .version = "2.0.1",
    .description = "test plugin: an allocator that counts",
    .events = HR_EVENT_BIT(HR_EVENT_TRAIN_END),
    .roles = HR_ROLE_ALLOCATOR,
    .create = create,
    .destroy = destroy,
    .on_event = on_event,
    .allocator = &kAllocator,
    .optimizer = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
