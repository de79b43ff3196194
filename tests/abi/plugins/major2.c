/* Test plugin from a future ABI major version 2: it picks version 2.0 whatever the host offers
 * and returns a descriptor claiming 2.0. Built as major2 (returns HR_OK, as a plugin that does not
 * check would) and major2_refuses (returns HR_ERROR_VERSION). Either way the host must refuse it.
 */
#include <headroom/plugin.h>
#include <stddef.h>

#ifndef PLUGIN_NAME
#error "define PLUGIN_NAME"
#endif
#ifndef PLUGIN_STATUS
#error "define PLUGIN_STATUS"
#endif

static hr_status create(const hr_host_services* services, void** instance) {
  (void)services;
  *instance = NULL;
  return HR_OK;
}

static void destroy(void* instance) {
  (void)instance;
}

static hr_status on_event(void* instance, const hr_event_info* info) {
  (void)instance;
  (void)info;
  return HR_OK;
}

static const hr_plugin_descriptor kDescriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                                                 .abi_version = HR_ABI_MAKE_VERSION(2, 0),
                                                 .name = PLUGIN_NAME,
                                                 .version = "9.0.0",
                                                 .description = "test plugin: speaks ABI 2.0 only",
                                                 .events = HR_EVENT_BIT(HR_EVENT_STEP_END),
                                                 .roles = 0,
                                                 .create = create,
                                                 .destroy = destroy,
                                                 .on_event = on_event,
                                                 .allocator = NULL,
                                                 .optimizer = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  args->plugin_abi = HR_ABI_MAKE_VERSION(2, 0);
  args->descriptor = &kDescriptor;
  return PLUGIN_STATUS;
}
