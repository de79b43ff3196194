/* memory_csv — an example headroom plugin, written as a third party would write one.
 *
 * Writes one CSV row every `every` optimizer steps: how many device allocations and frees the
 * host made since the previous row, how many bytes they moved, and the memory tracker's live and
 * peak bytes with the live bytes of each category.
 *
 *   [[plugins]]
 *   name = "memory_csv"
 *   file = "memory.csv"   # required; relative paths are relative to the current directory
 *   every = 1             # optional; a row every `every` steps, >= 1
 *
 * Plain C99 against headroom/plugin.h only; exports hr_plugin_entry and nothing else. Every hook
 * runs on the training thread, one call at a time, so the plugin needs no locking. It issues no
 * device work, so the compute stream does not concern it. docs/plugin-guide.md walks through this
 * file section by section. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <headroom/plugin.h>

/* ---------------------------------------------------------------------------------------------
 * State: one instance per [[plugins]] entry, made by create(), freed by destroy(). */

typedef struct memory_csv {
  const hr_host_services* services; /* valid until destroy() returns */
  FILE* file;
  int64_t every;
  /* Since the previous row (the first row: since create()). */
  uint64_t allocs;
  uint64_t frees;
  uint64_t bytes_allocated;
  uint64_t bytes_freed;
} memory_csv;

/* The header names the live bytes of each category in hr_mem_category order. */
static const char kHeader[] =
    "step,allocs,frees,bytes_allocated,bytes_freed,live_bytes,peak_bytes,"
    "parameters,gradients,optimizer,activations,workspace,data,communication\n";

/* Hands the host a message about `path` and errno, for the failure the hook is about to return. */
static void set_file_error(const hr_host_services* s, const char* what, const char* path, int err) {
  char message[512];
  snprintf(message, sizeof message, "%s \"%s\": %s", what, path, strerror(err));
  s->set_error(s->host, message);
}

/* ---------------------------------------------------------------------------------------------
 * create: training thread, once, before TRAIN_BEGIN. Reads the config, opens the file, writes the
 * header. On failure it releases what it made, since destroy() is then not called. */

static hr_status memory_csv_create(const hr_host_services* s, void** instance) {
  char path[4096];
  int64_t every = 1; /* the default: a getter leaves *out untouched when the key is absent */
  hr_status status;
  memory_csv* self;

  /* Ask for every key first, so that a missing or wrong one is reported before anything else. */
  path[0] = '\0';
  status = s->config_string(s->host, "file", path, sizeof path);
  if (status == HR_ERROR_INVALID) {
    return s->config_error(s->host, "file", "is longer than 4095 bytes");
  }
  if (status != HR_OK) return status; /* wrong type: the host has the message */
  status = s->config_int(s->host, "every", &every);
  if (status != HR_OK) return status;

  if (path[0] == '\0') {
    return s->config_error(s->host, "file",
                           "is required: the path of the CSV file to write (relative to the "
                           "current directory)");
  }
  if (every < 1) {
    return s->config_error(s->host, "every", "must be >= 1 (a row every `every` steps)");
  }

  self = (memory_csv*)calloc(1, sizeof *self);
  if (self == NULL) {
    s->set_error(s->host, "out of host memory for the plugin's state");
    return HR_ERROR_OUT_OF_MEMORY;
  }
  self->services = s;
  self->every = every;

  errno = 0;
  self->file = fopen(path, "w");
  if (self->file == NULL) {
    set_file_error(s, "cannot open", path, errno);
    free(self);
    return HR_ERROR;
  }
  if (fputs(kHeader, self->file) == EOF || fflush(self->file) != 0) {
    set_file_error(s, "cannot write the header to", path, errno);
    fclose(self->file);
    free(self);
    return HR_ERROR;
  }

  *instance = self;
  return HR_OK;
}

/* ---------------------------------------------------------------------------------------------
 * destroy: training thread, once, after TRAIN_END or after a failed run. The services are still
 * valid here, so a failure to close can still be logged. */

static void memory_csv_destroy(void* instance) {
  memory_csv* self = (memory_csv*)instance;
  if (self == NULL) return;
  if (fclose(self->file) != 0) {
    char message[256];
    snprintf(message, sizeof message, "closing the CSV file failed: %s", strerror(errno));
    self->services->log(self->services->host, HR_LOG_WARN, message);
  }
  free(self);
}

/* ---------------------------------------------------------------------------------------------
 * on_event: training thread, only for the subscribed events. ALLOC and FREE fire inside the
 * host's allocator, so they only count: no services->alloc here (it would fire ALLOC again). */

static hr_status write_row(memory_csv* self, int64_t step) {
  const hr_host_services* s = self->services;
  FILE* f = self->file;
  hr_memory_stats stats;
  hr_status status;
  int ok, c;

  memset(&stats, 0, sizeof stats);
  stats.struct_size = (uint32_t)sizeof stats;
  status = s->memory_stats(s->host, &stats);
  if (status != HR_OK) return status; /* the host's own failure: it has the message */

  errno = 0;
  ok = fprintf(f, "%" PRId64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64, step, self->allocs,
               self->frees, self->bytes_allocated, self->bytes_freed) >= 0;
  ok = ok && fprintf(f, ",%" PRIu64 ",%" PRIu64, stats.live_bytes, stats.peak_bytes) >= 0;
  /* The live bytes of each category, in hr_mem_category order, as the header names them. */
  for (c = 0; ok && c < HR_MEM_CATEGORY_COUNT_V1; ++c) {
    ok = fprintf(f, ",%" PRIu64, stats.live_by_category[c]) >= 0;
  }
  /* Flushed row by row, so that a run that stops later (out of memory, a failing hook) keeps
   * every row written so far. */
  ok = ok && fputc('\n', f) != EOF && fflush(f) == 0;
  if (!ok) {
    char message[256];
    snprintf(message, sizeof message, "writing the row of step %" PRId64 " failed: %s", step,
             strerror(errno));
    s->set_error(s->host, message);
    return HR_ERROR;
  }

  self->allocs = 0;
  self->frees = 0;
  self->bytes_allocated = 0;
  self->bytes_freed = 0;
  return HR_OK;
}

static hr_status memory_csv_on_event(void* instance, const hr_event_info* info) {
  memory_csv* self = (memory_csv*)instance;
  switch (info->event) {
    case HR_EVENT_ALLOC:
      self->allocs += 1;
      self->bytes_allocated += info->bytes;
      return HR_OK;
    case HR_EVENT_FREE:
      self->frees += 1;
      self->bytes_freed += info->bytes;
      return HR_OK;
    case HR_EVENT_STEP_END:
      if (info->step % self->every != 0) return HR_OK;
      return write_row(self, info->step);
    default:
      return HR_OK; /* not subscribed; a newer host's event: ignore it */
  }
}

/* ---------------------------------------------------------------------------------------------
 * The descriptor and the entry point: the only exported symbol. */

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = (uint32_t)sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = "memory_csv",
    .version = "1.0.0",
    .description = "a CSV row of allocation counts and live memory by category every `every` steps",
    .events = HR_EVENT_BIT(HR_EVENT_STEP_END) | HR_EVENT_BIT(HR_EVENT_ALLOC) |
              HR_EVENT_BIT(HR_EVENT_FREE),
    .roles = 0,
    .create = memory_csv_create,
    .destroy = memory_csv_destroy,
    .on_event = memory_csv_on_event,
    .allocator = NULL,
    .optimizer = NULL,
};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  hr_status status;
  if (args == NULL) return HR_ERROR_INVALID;
  status = hr_negotiate(args, &kDescriptor);
  if (status != HR_OK && args->error != NULL && args->error_size > 0) {
    snprintf(args->error, args->error_size,
             "memory_csv speaks plugin ABI %u.x; the host speaks %u.%u to %u.%u",
             (unsigned)HR_ABI_VERSION_MAJOR, (unsigned)HR_ABI_MAJOR(args->host_abi_min),
             (unsigned)HR_ABI_MINOR(args->host_abi_min), (unsigned)HR_ABI_MAJOR(args->host_abi_max),
             (unsigned)HR_ABI_MINOR(args->host_abi_max));
  }
  return status;
}
