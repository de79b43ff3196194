/* Test plugin: memory pressure from outside the model, for dynamic_batch's tests. At STEP_BEGIN
 * of step `at_step` it takes `bytes` of device memory through the host's alloc (so they count
 * against the memory wall, as workspace), at STEP_BEGIN of step at_step + 1 another `more_bytes`,
 * and at STEP_BEGIN of step `release_at` it gives both back (0: keeps them to the end).
 *
 * Keys: at_step, bytes, more_bytes, release_at (integers; default 0: no pressure); probe (bool):
 * it also calls headroom.batch/1 where the rules allow it and where they do not, and logs what
 * each call answered ("batch probe ..." lines, at warning level so that they are printed):
 *
 *   batch probe TRAIN_BEGIN configured=8x2 now=8x2 restart=7 set3=5
 *   batch probe STEP_BEGIN set4=0 now=4x4
 *   batch probe FORWARD_BEGIN set2=7 */
#include <headroom/ext/batch.h>
#include <headroom/plugin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct pressure {
  const hr_host_services* services;
  int64_t at_step, bytes, more_bytes, release_at;
  int32_t probe;
  int probed_forward;
  const hr_ext_batch* batch;
  void* taken[2];
} pressure;

static hr_status create(const hr_host_services* s, void** instance) {
  hr_status st;
  pressure* p = (pressure*)calloc(1, sizeof *p);
  if (!p) return HR_ERROR_OUT_OF_MEMORY;
  p->services = s;
  if ((st = s->config_int(s->host, "at_step", &p->at_step)) != HR_OK ||
      (st = s->config_int(s->host, "bytes", &p->bytes)) != HR_OK ||
      (st = s->config_int(s->host, "more_bytes", &p->more_bytes)) != HR_OK ||
      (st = s->config_int(s->host, "release_at", &p->release_at)) != HR_OK ||
      (st = s->config_bool(s->host, "probe", &p->probe)) != HR_OK) {
    free(p);
    return st;
  }
  p->batch = (const hr_ext_batch*)s->get_extension(s->host, HR_EXT_BATCH);
  if (p->probe && !p->batch) {
    s->set_error(s->host, "pressure: no headroom.batch/1");
    free(p);
    return HR_ERROR_UNSUPPORTED;
  }
  *instance = p;
  return HR_OK;
}

static void give_back(pressure* p) {
  int i;
  for (i = 0; i < 2; ++i) {
    if (p->taken[i]) p->services->free(p->services->host, p->taken[i]);
    p->taken[i] = NULL;
  }
}

static void destroy(void* instance) {
  give_back((pressure*)instance);
  free(instance);
}

static hr_status take(pressure* p, int slot, int64_t bytes) {
  const hr_host_services* s = p->services;
  if (bytes <= 0) return HR_OK;
  p->taken[slot] = s->alloc(s->host, (uint64_t)bytes, HR_MEM_WORKSPACE, "pressure (test plugin)");
  if (!p->taken[slot]) {
    s->set_error(s->host, "pressure: could not take its bytes");
    return HR_ERROR_OUT_OF_MEMORY;
  }
  return HR_OK;
}

static hr_batch_state batch_state(pressure* p) {
  hr_batch_state b;
  memset(&b, 0, sizeof b);
  b.struct_size = sizeof b;
  p->batch->state(p->services->host, &b);
  return b;
}

/* What each headroom.batch/1 call answers, where the rules allow it and where they do not. */
static void probe(pressure* p, const hr_event_info* info) {
  const hr_host_services* s = p->services;
  char line[256];
  line[0] = '\0';
  if (info->event == HR_EVENT_TRAIN_BEGIN) {
    const hr_batch_state b = batch_state(p);
    const int restart = (int)p->batch->restart_step(s->host, 1, "not from OOM");
    const int set3 = (int)p->batch->set_micro_batch(s->host, 3, "no divisor");
    snprintf(line, sizeof line,
             "batch probe TRAIN_BEGIN configured=%dx%d now=%dx%d restart=%d set3=%d",
             (int)b.configured_micro_batch, (int)b.configured_grad_accum, (int)b.micro_batch,
             (int)b.grad_accum, restart, set3);
  } else if (info->event == HR_EVENT_STEP_BEGIN && info->step == 1) {
    const int set4 = (int)p->batch->set_micro_batch(s->host, 4, "probe: this step at 4");
    const hr_batch_state b = batch_state(p);
    snprintf(line, sizeof line, "batch probe STEP_BEGIN set4=%d now=%dx%d", set4,
             (int)b.micro_batch, (int)b.grad_accum);
  } else if (info->event == HR_EVENT_FORWARD_BEGIN && !p->probed_forward) {
    p->probed_forward = 1;
    snprintf(line, sizeof line, "batch probe FORWARD_BEGIN set2=%d",
             (int)p->batch->set_micro_batch(s->host, 2, "not between steps"));
  }
  if (line[0]) s->log(s->host, HR_LOG_WARN, line);
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  pressure* p = (pressure*)instance;
  if (p->probe) probe(p, info);
  if (info->event != HR_EVENT_STEP_BEGIN || p->at_step <= 0) return HR_OK;
  if (p->release_at > 0 && info->step == p->release_at) give_back(p);
  if (info->step == p->at_step) return take(p, 0, p->bytes);
  if (info->step == p->at_step + 1) return take(p, 1, p->more_bytes);
  return HR_OK;
}

static const hr_plugin_descriptor kDescriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                                                 .abi_version = HR_ABI_VERSION,
                                                 .name = "pressure",
                                                 .version = "1.0.0",
                                                 .description = "test plugin: memory pressure",
                                                 .events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) |
                                                           HR_EVENT_BIT(HR_EVENT_STEP_BEGIN) |
                                                           HR_EVENT_BIT(HR_EVENT_FORWARD_BEGIN),
                                                 .roles = 0,
                                                 .create = create,
                                                 .destroy = destroy,
                                                 .on_event = on_event};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
