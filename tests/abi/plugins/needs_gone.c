/* Test plugin that links to a library the loader cannot find (gone_dependency.c, built without an
 * RPATH to it): dlopen fails, and the host's message must carry the loader's reason. */
#include <headroom/plugin.h>
#include <stddef.h>

int hr_test_gone_value(void);

static hr_status create(const hr_host_services* services, void** instance) {
  (void)services;
  *instance = NULL;
  return hr_test_gone_value() == 7 ? HR_OK : HR_ERROR;
}

static void destroy(void* instance) {
  (void)instance;
}

static const hr_plugin_descriptor kDescriptor = {.struct_size = sizeof(hr_plugin_descriptor),
                                                 .abi_version = HR_ABI_VERSION,
                                                 .name = "needs_gone",
                                                 .version = "1.0.0",
                                                 .description = "test plugin: a missing library",
                                                 .events = 0,
                                                 .roles = 0,
                                                 .create = create,
                                                 .destroy = destroy,
                                                 .on_event = NULL,
                                                 .allocator = NULL,
                                                 .optimizer = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
