/* Test plugin: a descriptor that lacks what it must have. One source, built with one of:
 *   NO_CREATE_DESTROY   create and destroy are NULL
 *   NO_ON_EVENT         subscribes to STEP_END with on_event NULL
 *   NO_DEALLOCATE       the allocator role, its hooks without deallocate
 *   NO_OPTIMIZER_HOOKS  the optimizer role, descriptor->optimizer NULL
 *   NULL_DESCRIPTOR     the entry point returns HR_OK without a descriptor */
#include <headroom/plugin.h>
#include <stddef.h>

#ifndef PLUGIN_NAME
#error "define PLUGIN_NAME"
#endif

static hr_status create(const hr_host_services* services, void** instance) {
  (void)services;
  *instance = NULL;
  return HR_OK;
}

static void destroy(void* instance) {
  (void)instance;
}

static void* allocate(void* instance, uint64_t bytes, uint32_t category, void* stream) {
  (void)instance;
  (void)bytes;
  (void)category;
  (void)stream;
  return NULL;
}

static const hr_allocator_hooks kAllocator = {.struct_size = sizeof(hr_allocator_hooks),
                                              .reserved0 = 0,
                                              .allocate = allocate,
                                              .deallocate = NULL,
                                              .stats = NULL};

static const hr_plugin_descriptor kDescriptor = {
    .struct_size = sizeof(hr_plugin_descriptor),
    .abi_version = HR_ABI_VERSION,
    .name = PLUGIN_NAME,
    .version = "0.0.1",
    .description = "test plugin: an incomplete descriptor",
#ifdef NO_ON_EVENT
    .events = HR_EVENT_BIT(HR_EVENT_STEP_END),
#else
    .events = 0,
#endif
#if defined(NO_DEALLOCATE)
    .roles = HR_ROLE_ALLOCATOR,
    .allocator = &kAllocator,
#elif defined(NO_OPTIMIZER_HOOKS)
    .roles = HR_ROLE_OPTIMIZER,
    .allocator = NULL,
#else
    .roles = 0,
    .allocator = NULL,
#endif
#ifdef NO_CREATE_DESTROY
    .create = NULL,
    .destroy = NULL,
#else
    .create = create,
    .destroy = destroy,
#endif
    .on_event = NULL,
    .optimizer = NULL};

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  (void)create; /* used or not, by variant */
  (void)destroy;
  (void)kAllocator;
#ifdef NULL_DESCRIPTOR
  (void)kDescriptor;
  args->plugin_abi = HR_ABI_VERSION;
  return HR_OK;
#else
  return hr_negotiate(args, &kDescriptor);
#endif
}
