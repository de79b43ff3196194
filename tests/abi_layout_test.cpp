// The plugin ABI's binary layout, pinned: the size and offset of every field of every struct in
// headroom/plugin.h, the type of every function pointer, and every enum and constant value, for
// x86-64 (LP64). A change here breaks every plugin already built. Fields may only be appended (the
// struct's size grows, no offset moves) and enum values only added.
// An extension added after headroom.resize/1 pins its structs in its own test,
// tests/ext_<name>_test.cpp, beside the probe plugin that calls it (tests/abi/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "headroom/ext/batch.h"
#include "headroom/ext/comm.h"
#include "headroom/ext/estimate.h"
#include "headroom/ext/ops.h"
#include "headroom/ext/precision.h"
#include "headroom/ext/recompute.h"
#include "headroom/ext/resize.h"
#include "headroom/ext/roles.h"
#include "headroom/ext/shard.h"
#include "headroom/ext/state.h"
#include "headroom/ext/step.h"
#include "headroom/ext/tensors.h"
#include "headroom/ext/vm.h"
#include "headroom/plugin.h"

// offsetof and size of one field.
#define PIN(type, field, offset, size)                                         \
  static_assert(offsetof(type, field) == (offset), #type "." #field " moved"); \
  static_assert(sizeof(type::field) == (size), #type "." #field " changed size")
// The exact type of one field (function pointers: the whole signature).
#define PIN_TYPE(type, field, ...) \
  static_assert(std::is_same_v<decltype(type::field), __VA_ARGS__>, #type "." #field " type")

#if defined(__x86_64__) && defined(__LP64__)

// --- Versions, status codes, constants ----------------------------------------------------------
static_assert(HR_ABI_VERSION_MAJOR == 1);
// A new minor version appends fields: pin them in this file (offsets of what exists never move;
// sizes are exact for the current minor version), then raise this bound.
static_assert(HR_ABI_VERSION_MINOR <= 8, "pin the new minor version's layout in this file");
static_assert(HR_ABI_MAKE_VERSION(1, 0) == 0x00010000u);
static_assert(HR_ABI_MAKE_VERSION(2, 3) == 0x00020003u);
static_assert(HR_ABI_MAJOR(0x00020003u) == 2 && HR_ABI_MINOR(0x00020003u) == 3);
static_assert(HR_ABI_VERSION == HR_ABI_MAKE_VERSION(HR_ABI_VERSION_MAJOR, HR_ABI_VERSION_MINOR));
static_assert(std::is_same_v<hr_status, int32_t>);
static_assert(HR_OK == 0 && HR_ERROR == 1 && HR_ERROR_CONFIG == 2 && HR_ERROR_OUT_OF_MEMORY == 3 &&
              HR_ERROR_UNSUPPORTED == 4 && HR_ERROR_INVALID == 5 && HR_ERROR_VERSION == 6 &&
              HR_ERROR_NOT_ALLOWED == 7);
static_assert(HR_ROLE_ALLOCATOR == 1u && HR_ROLE_OPTIMIZER == 2u);
static_assert(HR_LOG_DEBUG == 0 && HR_LOG_INFO == 1 && HR_LOG_WARN == 2 && HR_LOG_ERROR == 3);
static_assert(HR_MAX_DIMS == 8);
static_assert(HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) == 1u && HR_EVENT_BIT(HR_EVENT_OOM) == 0x1000u);
static_assert(std::is_same_v<decltype(HR_EVENT_BIT(HR_EVENT_OOM)), uint64_t>);

// --- Enums: values are never renumbered -------------------------------------------------------
static_assert(HR_EVENT_TRAIN_BEGIN == 0 && HR_EVENT_TRAIN_END == 1 && HR_EVENT_STEP_BEGIN == 2 &&
              HR_EVENT_STEP_END == 3 && HR_EVENT_FORWARD_BEGIN == 4 && HR_EVENT_FORWARD_END == 5 &&
              HR_EVENT_BACKWARD_BEGIN == 6 && HR_EVENT_BACKWARD_END == 7 &&
              HR_EVENT_GRADS_READY == 8 && HR_EVENT_OPTIMIZER_STEP == 9 && HR_EVENT_ALLOC == 10 &&
              HR_EVENT_FREE == 11 && HR_EVENT_OOM == 12 && HR_EVENT_COUNT_V1 == 13);
static_assert(HR_EVENT_BUCKET_LAUNCH == 13 && HR_EVENT_BUCKET_DONE == 14);  // 1.5
static_assert(HR_EVENT_EVAL_END == 15);                                     // 1.6
static_assert(HR_MEM_PARAMETERS == 0 && HR_MEM_GRADIENTS == 1 && HR_MEM_OPTIMIZER == 2 &&
              HR_MEM_ACTIVATIONS == 3 && HR_MEM_WORKSPACE == 4 && HR_MEM_DATA == 5 &&
              HR_MEM_COMMUNICATION == 6 && HR_MEM_CATEGORY_COUNT_V1 == 7);
static_assert(HR_MEM_PLUGIN == 7 && HR_MEM_CATEGORY_COUNT == 8);  // 1.7
static_assert(HR_DTYPE_F32 == 0 && HR_DTYPE_BF16 == 1 && HR_DTYPE_F16 == 2 && HR_DTYPE_F64 == 3 &&
              HR_DTYPE_I32 == 4);

// --- hr_event_info ----------------------------------------------------------------------------
// ABI 1.0 ended at reserved0 (48 bytes); 1.5 appended loss and tokens.
static_assert(sizeof(hr_event_info) == 64 && alignof(hr_event_info) == 8);
PIN(hr_event_info, loss, 48, 8);
PIN(hr_event_info, tokens, 56, 8);
PIN_TYPE(hr_event_info, loss, double);
PIN_TYPE(hr_event_info, tokens, uint64_t);
PIN(hr_event_info, struct_size, 0, 4);
PIN(hr_event_info, event, 4, 4);
PIN(hr_event_info, step, 8, 8);
PIN(hr_event_info, micro_step, 16, 4);
PIN(hr_event_info, layer, 20, 4);
PIN(hr_event_info, ptr, 24, 8);
PIN(hr_event_info, bytes, 32, 8);
PIN(hr_event_info, category, 40, 4);
PIN(hr_event_info, reserved0, 44, 4);
PIN(hr_event_info, loss, 48, 8);
PIN(hr_event_info, tokens, 56, 8);
PIN_TYPE(hr_event_info, loss, double);
PIN_TYPE(hr_event_info, tokens, uint64_t);
PIN_TYPE(hr_event_info, step, int64_t);
PIN_TYPE(hr_event_info, micro_step, int32_t);
PIN_TYPE(hr_event_info, layer, int32_t);
PIN_TYPE(hr_event_info, ptr, const void*);
PIN_TYPE(hr_event_info, bytes, uint64_t);

// --- hr_tensor --------------------------------------------------------------------------------
static_assert(sizeof(hr_tensor) == 128 && alignof(hr_tensor) == 8);
PIN(hr_tensor, struct_size, 0, 4);
PIN(hr_tensor, dtype, 4, 4);
PIN(hr_tensor, name, 8, 8);
PIN(hr_tensor, ndim, 16, 4);
PIN(hr_tensor, reserved0, 20, 4);
PIN(hr_tensor, shape, 24, 64);
PIN(hr_tensor, numel, 88, 8);
PIN(hr_tensor, data, 96, 8);
PIN(hr_tensor, grad, 104, 8);
PIN(hr_tensor, weight_decay, 112, 4);
PIN(hr_tensor, frozen, 116, 4);  // reserved1 (zero) before
PIN(hr_tensor, grad_dtype, 120, 4);
PIN(hr_tensor, reserved2, 124, 4);
PIN_TYPE(hr_tensor, name, const char*);
PIN_TYPE(hr_tensor, ndim, int32_t);
PIN_TYPE(hr_tensor, shape, int64_t[8]);
PIN_TYPE(hr_tensor, numel, uint64_t);
PIN_TYPE(hr_tensor, data, void*);
PIN_TYPE(hr_tensor, grad, void*);

// --- hr_memory_stats --------------------------------------------------------------------------
static_assert(sizeof(hr_memory_stats) == 168 && alignof(hr_memory_stats) == 8);
PIN(hr_memory_stats, struct_size, 0, 4);
PIN(hr_memory_stats, reserved0, 4, 4);
PIN(hr_memory_stats, limit, 8, 8);
PIN(hr_memory_stats, live_bytes, 16, 8);
PIN(hr_memory_stats, peak_bytes, 24, 8);
PIN(hr_memory_stats, live_by_category, 32, 56);
PIN(hr_memory_stats, peak_by_category, 88, 56);
PIN(hr_memory_stats, num_allocs, 144, 8);
PIN(hr_memory_stats, live_plugin, 152, 8);  // 1.7
PIN(hr_memory_stats, peak_plugin, 160, 8);
PIN_TYPE(hr_memory_stats, live_by_category, uint64_t[7]);
PIN_TYPE(hr_memory_stats, peak_by_category, uint64_t[7]);

// --- hr_optimizer_step_info -------------------------------------------------------------------
static_assert(sizeof(hr_optimizer_step_info) == 24 && alignof(hr_optimizer_step_info) == 8);
PIN(hr_optimizer_step_info, struct_size, 0, 4);
PIN(hr_optimizer_step_info, reserved0, 4, 4);
PIN(hr_optimizer_step_info, step, 8, 8);
PIN(hr_optimizer_step_info, lr, 16, 8);
PIN_TYPE(hr_optimizer_step_info, step, int64_t);
PIN_TYPE(hr_optimizer_step_info, lr, double);

// --- hr_host_services: every function pointer's offset and signature --------------------------
// ABI 1.0 ended at request_retry (280 bytes); 1.2 appended the virtual-memory services (to 320);
// 1.3 appended drop_activations (to 328); 1.4 set_compute_dtype and set_loss_scale (to 344); 1.5
// get_extension, after which the table is frozen (every later service is an extension).
static_assert(sizeof(hr_host_services) == 352 && alignof(hr_host_services) == 8);
PIN(hr_host_services, get_extension, 344, 8);
PIN_TYPE(hr_host_services, get_extension, const void* (*)(hr_host*, const char*));
PIN(hr_host_services, struct_size, 0, 4);
PIN(hr_host_services, abi_version, 4, 4);
PIN(hr_host_services, host, 8, 8);
PIN_TYPE(hr_host_services, host, hr_host*);
PIN(hr_host_services, log, 16, 8);
PIN_TYPE(hr_host_services, log, void (*)(hr_host*, int32_t, const char*));
PIN(hr_host_services, set_error, 24, 8);
PIN_TYPE(hr_host_services, set_error, void (*)(hr_host*, const char*));
PIN(hr_host_services, config_int, 32, 8);
PIN_TYPE(hr_host_services, config_int, hr_status (*)(hr_host*, const char*, int64_t*));
PIN(hr_host_services, config_float, 40, 8);
PIN_TYPE(hr_host_services, config_float, hr_status (*)(hr_host*, const char*, double*));
PIN(hr_host_services, config_bool, 48, 8);
PIN_TYPE(hr_host_services, config_bool, hr_status (*)(hr_host*, const char*, int32_t*));
PIN(hr_host_services, config_string, 56, 8);
PIN_TYPE(hr_host_services, config_string, hr_status (*)(hr_host*, const char*, char*, size_t));
PIN(hr_host_services, config_size, 64, 8);
PIN_TYPE(hr_host_services, config_size, hr_status (*)(hr_host*, const char*, uint64_t*));
PIN(hr_host_services, config_error, 72, 8);
PIN_TYPE(hr_host_services, config_error, hr_status (*)(hr_host*, const char*, const char*));
PIN(hr_host_services, alloc, 80, 8);
PIN_TYPE(hr_host_services, alloc, void* (*)(hr_host*, uint64_t, uint32_t, const char*));
PIN(hr_host_services, free, 88, 8);
PIN_TYPE(hr_host_services, free, void (*)(hr_host*, void*));
PIN(hr_host_services, raw_alloc, 96, 8);
PIN_TYPE(hr_host_services, raw_alloc, void* (*)(hr_host*, uint64_t));
PIN(hr_host_services, raw_free, 104, 8);
PIN_TYPE(hr_host_services, raw_free, void (*)(hr_host*, void*));
PIN(hr_host_services, memory_stats, 112, 8);
PIN_TYPE(hr_host_services, memory_stats, hr_status (*)(hr_host*, hr_memory_stats*));
PIN(hr_host_services, num_layers, 120, 8);
PIN_TYPE(hr_host_services, num_layers, int32_t (*)(hr_host*));
PIN(hr_host_services, layer_name, 128, 8);
PIN_TYPE(hr_host_services, layer_name, hr_status (*)(hr_host*, int32_t, char*, size_t));
PIN(hr_host_services, layer_num_params, 136, 8);
PIN_TYPE(hr_host_services, layer_num_params, int32_t (*)(hr_host*, int32_t));
PIN(hr_host_services, layer_param, 144, 8);
PIN_TYPE(hr_host_services, layer_param, hr_status (*)(hr_host*, int32_t, int32_t, hr_tensor*));
PIN(hr_host_services, layer_num_activations, 152, 8);
PIN_TYPE(hr_host_services, layer_num_activations, int32_t (*)(hr_host*, int32_t));
PIN(hr_host_services, layer_activation, 160, 8);
PIN_TYPE(hr_host_services, layer_activation, hr_status (*)(hr_host*, int32_t, int32_t, hr_tensor*));
PIN(hr_host_services, op_fill, 168, 8);
PIN_TYPE(hr_host_services, op_fill, hr_status (*)(hr_host*, void*, uint32_t, uint64_t, double));
PIN(hr_host_services, op_copy, 176, 8);
PIN_TYPE(hr_host_services, op_copy, hr_status (*)(hr_host*, void*, const void*, uint64_t));
PIN(hr_host_services, op_cast, 184, 8);
PIN_TYPE(hr_host_services, op_cast,
         hr_status (*)(hr_host*, void*, uint32_t, const void*, uint32_t, uint64_t));
PIN(hr_host_services, op_scale, 192, 8);
PIN_TYPE(hr_host_services, op_scale, hr_status (*)(hr_host*, void*, uint32_t, uint64_t, double));
PIN(hr_host_services, op_axpy, 200, 8);
PIN_TYPE(hr_host_services, op_axpy,
         hr_status (*)(hr_host*, void*, const void*, uint32_t, uint64_t, double));
PIN(hr_host_services, op_sum_squares, 208, 8);
PIN_TYPE(hr_host_services, op_sum_squares,
         hr_status (*)(hr_host*, const void*, uint32_t, uint64_t, double*));
PIN(hr_host_services, op_nonfinite, 216, 8);
PIN_TYPE(hr_host_services, op_nonfinite,
         hr_status (*)(hr_host*, const void*, uint32_t, uint64_t, int32_t*));
PIN(hr_host_services, device_kind, 224, 8);
PIN_TYPE(hr_host_services, device_kind, const char* (*)(hr_host*));
PIN(hr_host_services, device_index, 232, 8);
PIN_TYPE(hr_host_services, device_index, int32_t (*)(hr_host*));
PIN(hr_host_services, stream, 240, 8);
PIN_TYPE(hr_host_services, stream, void* (*)(hr_host*));
PIN(hr_host_services, rank, 248, 8);
PIN_TYPE(hr_host_services, rank, int32_t (*)(hr_host*));
PIN(hr_host_services, world_size, 256, 8);
PIN_TYPE(hr_host_services, world_size, int32_t (*)(hr_host*));
PIN(hr_host_services, veto_step, 264, 8);
PIN_TYPE(hr_host_services, veto_step, void (*)(hr_host*, const char*));
PIN(hr_host_services, request_retry, 272, 8);
PIN_TYPE(hr_host_services, request_retry, void (*)(hr_host*, const char*));
PIN(hr_host_services, vm_granularity, 280, 8);
PIN_TYPE(hr_host_services, vm_granularity, uint64_t (*)(hr_host*));
PIN(hr_host_services, vm_reserve, 288, 8);
PIN_TYPE(hr_host_services, vm_reserve, void* (*)(hr_host*, uint64_t));
PIN(hr_host_services, vm_map, 296, 8);
PIN_TYPE(hr_host_services, vm_map, hr_status (*)(hr_host*, void*, uint64_t));
PIN(hr_host_services, vm_unmap, 304, 8);
PIN_TYPE(hr_host_services, vm_unmap, hr_status (*)(hr_host*, void*, uint64_t));
PIN(hr_host_services, vm_release, 312, 8);
PIN_TYPE(hr_host_services, vm_release, hr_status (*)(hr_host*, void*, uint64_t));
PIN(hr_host_services, drop_activations, 320, 8);
PIN_TYPE(hr_host_services, drop_activations, hr_status (*)(hr_host*, int32_t, uint32_t));
PIN(hr_host_services, set_compute_dtype, 328, 8);
PIN_TYPE(hr_host_services, set_compute_dtype, hr_status (*)(hr_host*, uint32_t));
PIN(hr_host_services, set_loss_scale, 336, 8);
PIN_TYPE(hr_host_services, set_loss_scale, hr_status (*)(hr_host*, double));
PIN(hr_host_services, get_extension, 344, 8);
PIN_TYPE(hr_host_services, get_extension, const void* (*)(hr_host*, const char*));
static_assert(HR_DROP_ALL == 0 && HR_DROP_CHEAP == 1);

// --- hr_allocator_hooks, hr_optimizer_hooks ---------------------------------------------------
// ABI 1.0 ended at deallocate (24 bytes); 1.2 appended stats.
static_assert(sizeof(hr_allocator_hooks) == 32 && alignof(hr_allocator_hooks) == 8);
PIN(hr_allocator_hooks, struct_size, 0, 4);
PIN(hr_allocator_hooks, reserved0, 4, 4);
PIN(hr_allocator_hooks, allocate, 8, 8);
PIN_TYPE(hr_allocator_hooks, allocate, void* (*)(void*, uint64_t, uint32_t, void*));
PIN(hr_allocator_hooks, deallocate, 16, 8);
PIN_TYPE(hr_allocator_hooks, deallocate, void (*)(void*, void*, uint64_t, void*));
PIN(hr_allocator_hooks, stats, 24, 8);
PIN_TYPE(hr_allocator_hooks, stats, hr_status (*)(void*, hr_allocator_stats*));

// --- hr_allocator_stats (1.2) -------------------------------------------------------------------
static_assert(sizeof(hr_allocator_stats) == 56 && alignof(hr_allocator_stats) == 8);
PIN(hr_allocator_stats, struct_size, 0, 4);
PIN(hr_allocator_stats, reserved0, 4, 4);
PIN(hr_allocator_stats, allocated, 8, 8);
PIN(hr_allocator_stats, reserved, 16, 8);
PIN(hr_allocator_stats, largest_free_block, 24, 8);
PIN(hr_allocator_stats, device_allocs, 32, 8);
PIN(hr_allocator_stats, retries, 40, 8);
PIN(hr_allocator_stats, ooms, 48, 8);

// resize appended (ABI 1.5, pruning): a plugin's older 16-byte struct has none.
static_assert(sizeof(hr_optimizer_hooks) == 24 && alignof(hr_optimizer_hooks) == 8);
PIN(hr_optimizer_hooks, struct_size, 0, 4);
PIN(hr_optimizer_hooks, reserved0, 4, 4);
PIN(hr_optimizer_hooks, step, 8, 8);
PIN_TYPE(hr_optimizer_hooks, step, hr_status (*)(void*, const hr_optimizer_step_info*));
PIN(hr_optimizer_hooks, resize, 16, 8);
PIN_TYPE(hr_optimizer_hooks, resize, hr_status (*)(void*, const hr_resize_info*));

// --- hr_plugin_descriptor ---------------------------------------------------------------------
static_assert(alignof(hr_plugin_descriptor) == 8);
PIN(hr_plugin_descriptor, struct_size, 0, 4);
PIN(hr_plugin_descriptor, abi_version, 4, 4);
PIN(hr_plugin_descriptor, name, 8, 8);
PIN(hr_plugin_descriptor, version, 16, 8);
PIN(hr_plugin_descriptor, description, 24, 8);
PIN(hr_plugin_descriptor, events, 32, 8);
PIN(hr_plugin_descriptor, roles, 40, 4);
PIN(hr_plugin_descriptor, reserved0, 44, 4);
PIN(hr_plugin_descriptor, create, 48, 8);
PIN(hr_plugin_descriptor, destroy, 56, 8);
PIN(hr_plugin_descriptor, on_event, 64, 8);
PIN(hr_plugin_descriptor, allocator, 72, 8);
PIN(hr_plugin_descriptor, optimizer, 80, 8);
PIN_TYPE(hr_plugin_descriptor, name, const char*);
PIN_TYPE(hr_plugin_descriptor, events, uint64_t);
PIN_TYPE(hr_plugin_descriptor, roles, uint32_t);
PIN_TYPE(hr_plugin_descriptor, create, hr_status (*)(const hr_host_services*, void**));
PIN_TYPE(hr_plugin_descriptor, destroy, void (*)(void*));
PIN_TYPE(hr_plugin_descriptor, on_event, hr_status (*)(void*, const hr_event_info*));
PIN_TYPE(hr_plugin_descriptor, allocator, const hr_allocator_hooks*);
PIN_TYPE(hr_plugin_descriptor, optimizer, const hr_optimizer_hooks*);
#if HR_ABI_VERSION_MINOR == 0
static_assert(sizeof(hr_plugin_descriptor) == 88);
#else
// ABI 1.0 ended at `optimizer` (88 bytes); 1.1 appended save_state and load_state (to 104); 1.5
// get_extension.
static_assert(sizeof(hr_plugin_descriptor) == 112);
PIN(hr_plugin_descriptor, get_extension, 104, 8);
PIN_TYPE(hr_plugin_descriptor, get_extension, const void* (*)(const char*));
PIN(hr_plugin_descriptor, save_state, 88, 8);
PIN_TYPE(hr_plugin_descriptor, save_state, hr_status (*)(void*, const hr_state_writer*));
PIN(hr_plugin_descriptor, load_state, 96, 8);
PIN_TYPE(hr_plugin_descriptor, load_state, hr_status (*)(void*, const void*, uint64_t));

// --- hr_state_writer (1.1) ---------------------------------------------------------------------
static_assert(sizeof(hr_state_writer) == 24 && alignof(hr_state_writer) == 8);
PIN(hr_state_writer, struct_size, 0, 4);
PIN(hr_state_writer, reserved0, 4, 4);
PIN(hr_state_writer, context, 8, 8);
PIN(hr_state_writer, write, 16, 8);
PIN_TYPE(hr_state_writer, context, void*);
PIN_TYPE(hr_state_writer, write, hr_status (*)(void*, const void*, uint64_t));
#endif

// --- hr_entry_args and the entry point --------------------------------------------------------
static_assert(sizeof(hr_entry_args) == 40 && alignof(hr_entry_args) == 8);
PIN(hr_entry_args, struct_size, 0, 4);
PIN(hr_entry_args, host_abi_min, 4, 4);
PIN(hr_entry_args, host_abi_max, 8, 4);
PIN(hr_entry_args, plugin_abi, 12, 4);
PIN(hr_entry_args, descriptor, 16, 8);
PIN(hr_entry_args, error, 24, 8);
PIN(hr_entry_args, error_size, 32, 8);
PIN_TYPE(hr_entry_args, descriptor, const hr_plugin_descriptor*);
PIN_TYPE(hr_entry_args, error, char*);
PIN_TYPE(hr_entry_args, error_size, size_t);
static_assert(std::is_same_v<hr_plugin_entry_fn, hr_status (*)(hr_entry_args*)>);
static_assert(std::is_same_v<decltype(&hr_plugin_entry), hr_plugin_entry_fn>);

// --- The extensions (1.5): ids, constants, and every table's layout ---------------------------
#define PIN_ID(macro, id) static_assert(std::string_view(macro) == id, #macro " changed")
PIN_ID(HR_EXT_VM, "headroom.vm/1");
PIN_ID(HR_EXT_PRECISION, "headroom.precision/1");
PIN_ID(HR_EXT_RECOMPUTE, "headroom.recompute/1");
PIN_ID(HR_EXT_RESIZE, "headroom.resize/1");
PIN_ID(HR_EXT_TENSORS, "headroom.tensors/1");
PIN_ID(HR_EXT_OPS, "headroom.ops/1");
PIN_ID(HR_EXT_STEP, "headroom.step/1");
PIN_ID(HR_EXT_COMM, "headroom.comm/1");
PIN_ID(HR_EXT_STATE, "headroom.state/1");
PIN_ID(HR_EXT_ALLOCATOR, "headroom.allocator/1");
PIN_ID(HR_EXT_OPTIMIZER, "headroom.optimizer/1");
PIN_ID(HR_EXT_ESTIMATE, "headroom.estimate/1");
static_assert(HR_OP_ADD == 0 && HR_OP_SUB == 1 && HR_OP_MUL == 2 && HR_OP_DIV == 3 &&
              HR_OP_MAX == 4 && HR_OP_MIN == 5);
static_assert(HR_OP_SIGN == 0 && HR_OP_SQRT == 1 && HR_OP_ABS == 2 && HR_OP_NEG == 3 &&
              HR_OP_RECIPROCAL == 4);
static_assert(HR_REDUCE_SUM == 0 && HR_REDUCE_MAX == 1 && HR_REDUCE_MAX_ABS == 2 &&
              HR_REDUCE_SUM_SQUARES == 3);
static_assert(HR_READ_MAX_BYTES == (uint64_t(1) << 20));
static_assert(HR_KEEP_ACTIVATIONS == 0xFFu);
static_assert(HR_GRAD_REDUCE_AFTER_BACKWARD == 1u && HR_GRAD_REDUCE_LAST_MICRO_STEP == 2u);
static_assert(sizeof(hr_ext_vm) == 64 && alignof(hr_ext_vm) == 8);
PIN(hr_ext_vm, struct_size, 0, 4);
PIN(hr_ext_vm, reserved0, 4, 4);
PIN(hr_ext_vm, raw_alloc, 8, 8);
PIN(hr_ext_vm, raw_free, 16, 8);
PIN(hr_ext_vm, granularity, 24, 8);
PIN(hr_ext_vm, reserve, 32, 8);
PIN(hr_ext_vm, map, 40, 8);
PIN(hr_ext_vm, unmap, 48, 8);
PIN(hr_ext_vm, release, 56, 8);
static_assert(sizeof(hr_ext_precision) == 96 && alignof(hr_ext_precision) == 8);
PIN(hr_ext_precision, struct_size, 0, 4);
PIN(hr_ext_precision, reserved0, 4, 4);
PIN(hr_ext_precision, set_compute_dtype, 8, 8);
PIN(hr_ext_precision, set_loss_scale, 16, 8);
PIN(hr_ext_precision, compute_dtype, 24, 8);
PIN(hr_ext_precision, loss_scale, 32, 8);
PIN(hr_ext_precision, set_grad_dtype, 40, 8);
PIN(hr_ext_precision, set_master_weights, 48, 8);
PIN(hr_ext_precision, set_state_dtype, 56, 8);
PIN(hr_ext_precision, grad_dtype, 64, 8);
PIN(hr_ext_precision, master_weights, 72, 8);
PIN(hr_ext_precision, state_dtype, 80, 8);
PIN(hr_ext_precision, nonfinite_many, 88, 8);
static_assert(sizeof(hr_ext_recompute) == 24 && alignof(hr_ext_recompute) == 8);
PIN(hr_ext_recompute, struct_size, 0, 4);
PIN(hr_ext_recompute, reserved0, 4, 4);
PIN(hr_ext_recompute, drop_activations, 8, 8);
PIN(hr_ext_recompute, layer_activation_bytes, 16, 8);
static_assert(sizeof(hr_ext_resize) == 40 && alignof(hr_ext_resize) == 8);
PIN(hr_ext_resize, struct_size, 0, 4);
PIN(hr_ext_resize, reserved0, 4, 4);
PIN(hr_ext_resize, mlp_width, 8, 8);
PIN(hr_ext_resize, keep_mlp_units, 16, 8);
PIN(hr_ext_resize, attn_heads, 24, 8);
PIN(hr_ext_resize, keep_attn_heads, 32, 8);
PIN_TYPE(hr_ext_resize, attn_heads, int32_t (*)(hr_host*, int32_t));
PIN_TYPE(hr_ext_resize, keep_attn_heads,
         hr_status (*)(hr_host*, int32_t, const uint32_t*, uint32_t));
PIN_TYPE(hr_ext_resize, mlp_width, int32_t (*)(hr_host*, int32_t));
PIN_TYPE(hr_ext_resize, keep_mlp_units,
         hr_status (*)(hr_host*, int32_t, const uint32_t*, uint32_t));
static_assert(sizeof(hr_resize_info) == 168 && alignof(hr_resize_info) == 8);
PIN(hr_resize_info, struct_size, 0, 4);
PIN(hr_resize_info, layer, 4, 4);
PIN(hr_resize_info, index, 8, 4);
PIN(hr_resize_info, axis, 12, 4);
PIN(hr_resize_info, ndim, 16, 4);
PIN(hr_resize_info, num_keep, 20, 4);
PIN(hr_resize_info, name, 24, 8);
PIN(hr_resize_info, old_shape, 32, 64);
PIN(hr_resize_info, new_shape, 96, 64);
PIN(hr_resize_info, keep, 160, 8);
static_assert(sizeof(hr_ext_tensors) == 40 && alignof(hr_ext_tensors) == 8);
PIN(hr_ext_tensors, struct_size, 0, 4);
PIN(hr_ext_tensors, reserved0, 4, 4);
PIN(hr_ext_tensors, find_param, 8, 8);
PIN(hr_ext_tensors, read, 16, 8);
PIN(hr_ext_tensors, reduce, 24, 8);
PIN(hr_ext_tensors, write, 32, 8);
static_assert(sizeof(hr_ext_ops) == 48 && alignof(hr_ext_ops) == 8);
PIN(hr_ext_ops, struct_size, 0, 4);
PIN(hr_ext_ops, reserved0, 4, 4);
PIN(hr_ext_ops, binary, 8, 8);
PIN(hr_ext_ops, unary, 16, 8);
PIN(hr_ext_ops, lerp, 24, 8);
PIN(hr_ext_ops, affine, 32, 8);
PIN(hr_ext_ops, adamw, 40, 8);
static_assert(sizeof(hr_step_state) == 88 && alignof(hr_step_state) == 8);
PIN(hr_step_state, struct_size, 0, 4);
PIN(hr_step_state, micro_step, 4, 4);
PIN(hr_step_state, step, 8, 8);
PIN(hr_step_state, lr, 16, 8);
PIN(hr_step_state, loss_scale, 24, 8);
PIN(hr_step_state, loss, 32, 8);
PIN(hr_step_state, tokens, 40, 8);
PIN(hr_step_state, grad_norm, 48, 8);
PIN(hr_step_state, clip_coef, 56, 8);
PIN(hr_step_state, skipped, 64, 4);
PIN(hr_step_state, reserved0, 68, 4);
PIN(hr_step_state, micro_steps, 72, 4);  // appended after 1.5's first release
PIN(hr_step_state, reserved1, 76, 4);
PIN(hr_step_state, dry, 80, 4);  // 1.7
PIN(hr_step_state, reserved2, 84, 4);
// 1.6 appended stop_run.
static_assert(sizeof(hr_ext_step) == 32 && alignof(hr_ext_step) == 8);
PIN(hr_ext_step, struct_size, 0, 4);
PIN(hr_ext_step, reserved0, 4, 4);
PIN(hr_ext_step, state, 8, 8);
PIN(hr_ext_step, stop_run, 16, 8);
PIN(hr_ext_step, set_events, 24, 8);
// headroom.batch/1
static_assert(sizeof(hr_batch_state) == 48 && alignof(hr_batch_state) == 8);
PIN(hr_batch_state, struct_size, 0, 4);
PIN(hr_batch_state, configured_micro_batch, 4, 4);
PIN(hr_batch_state, configured_grad_accum, 8, 4);
PIN(hr_batch_state, micro_batch, 12, 4);
PIN(hr_batch_state, grad_accum, 16, 4);
PIN(hr_batch_state, restarts, 20, 4);
PIN(hr_batch_state, memory_limit, 24, 8);
PIN(hr_batch_state, attempt_start_bytes, 32, 8);
PIN(hr_batch_state, attempt_peak_bytes, 40, 8);
static_assert(sizeof(hr_ext_batch) == 32 && alignof(hr_ext_batch) == 8);
PIN(hr_ext_batch, struct_size, 0, 4);
PIN(hr_ext_batch, reserved0, 4, 4);
PIN(hr_ext_batch, state, 8, 8);
PIN(hr_ext_batch, restart_step, 16, 8);
PIN(hr_ext_batch, set_micro_batch, 24, 8);
static_assert(sizeof(hr_ext_comm) == 88 && alignof(hr_ext_comm) == 8);
PIN(hr_ext_comm, struct_size, 0, 4);
PIN(hr_ext_comm, reserved0, 4, 4);
PIN(hr_ext_comm, rank, 8, 8);
PIN(hr_ext_comm, local_rank, 16, 8);
PIN(hr_ext_comm, world_size, 24, 8);
PIN(hr_ext_comm, all_reduce, 32, 8);
PIN(hr_ext_comm, reduce_scatter, 40, 8);
PIN(hr_ext_comm, all_gather, 48, 8);
PIN(hr_ext_comm, broadcast, 56, 8);
PIN(hr_ext_comm, barrier, 64, 8);
PIN(hr_ext_comm, wait, 72, 8);
PIN(hr_ext_comm, stream, 80, 8);
static_assert(HR_COMM_SUM == 0 && HR_COMM_AVERAGE == 1);
static_assert(sizeof(hr_shard_layout) == 56 && alignof(hr_shard_layout) == 8);
PIN(hr_shard_layout, struct_size, 0, 4);
PIN(hr_shard_layout, what, 4, 4);
PIN(hr_shard_layout, rank, 8, 4);
PIN(hr_shard_layout, world_size, 12, 4);
PIN(hr_shard_layout, numel, 16, 8);
PIN(hr_shard_layout, padded, 24, 8);
PIN(hr_shard_layout, shard, 32, 8);
PIN(hr_shard_layout, begin, 40, 8);
PIN(hr_shard_layout, whole, 48, 4);
PIN(hr_shard_layout, tied, 52, 4);
static_assert(sizeof(hr_ext_shard) == 72 && alignof(hr_ext_shard) == 8);
PIN(hr_ext_shard, struct_size, 0, 4);
PIN(hr_ext_shard, reserved0, 4, 4);
PIN(hr_ext_shard, partition, 8, 8);
PIN(hr_ext_shard, layout, 16, 8);
PIN(hr_ext_shard, reduce_gradients, 24, 8);
PIN(hr_ext_shard, gather_parameters, 32, 8);
PIN(hr_ext_shard, wait, 40, 8);
PIN(hr_ext_shard, gradient_range, 48, 8);
PIN(hr_ext_shard, persist_below, 56, 8);
PIN(hr_ext_shard, release_parameters, 64, 8);
static_assert(HR_SHARD_OPTIMIZER == 1 && HR_SHARD_GRADIENTS == 2);
static_assert(sizeof(hr_ext_state) == 24 && alignof(hr_ext_state) == 8);
PIN(hr_ext_state, struct_size, 0, 4);
PIN(hr_ext_state, reserved0, 4, 4);
PIN(hr_ext_state, save, 8, 8);
PIN(hr_ext_state, load, 16, 8);
static_assert(sizeof(hr_estimate_model) == 72 && alignof(hr_estimate_model) == 8);
PIN(hr_estimate_model, struct_size, 0, 4);
PIN(hr_estimate_model, n_layer, 4, 4);
PIN(hr_estimate_model, n_head, 8, 4);
PIN(hr_estimate_model, n_embd, 12, 4);
PIN(hr_estimate_model, seq_len, 16, 4);
PIN(hr_estimate_model, vocab_size, 20, 4);
PIN(hr_estimate_model, num_params, 24, 8);
PIN(hr_estimate_model, memory_limit, 32, 8);
PIN(hr_estimate_model, device_kind, 40, 8);
PIN(hr_estimate_model, num_param_tensors, 48, 4);
PIN(hr_estimate_model, reserved0, 52, 4);
PIN(hr_estimate_model, param_tensors, 56, 8);
PIN(hr_estimate_model, init_from, 64, 8);  // 1.8, appended
static_assert(sizeof(hr_estimate_param) == 96 && alignof(hr_estimate_param) == 8);
PIN(hr_estimate_param, struct_size, 0, 4);
PIN(hr_estimate_param, layer, 4, 4);
PIN(hr_estimate_param, name, 8, 8);
PIN(hr_estimate_param, ndim, 16, 4);
PIN(hr_estimate_param, weight_decay, 20, 4);
PIN(hr_estimate_param, shape, 24, 64);
PIN(hr_estimate_param, numel, 88, 8);
static_assert(sizeof(hr_mechanisms) == 120 && alignof(hr_mechanisms) == 8);
PIN(hr_mechanisms, struct_size, 0, 4);
PIN(hr_mechanisms, compute_dtype, 4, 4);
PIN(hr_mechanisms, micro_batch, 8, 4);
PIN(hr_mechanisms, grad_accum, 12, 4);
PIN(hr_mechanisms, num_layers, 16, 4);
PIN(hr_mechanisms, reserved0, 20, 4);
PIN(hr_mechanisms, drop, 24, 8);
PIN(hr_mechanisms, world_size, 32, 4);
PIN(hr_mechanisms, shard, 36, 4);
PIN(hr_mechanisms, grad_reduce, 40, 4);
PIN(hr_mechanisms, prefetch_layers, 44, 4);
PIN(hr_mechanisms, param_persistence_threshold, 48, 8);
PIN(hr_mechanisms, grad_dtype, 56, 4);
PIN(hr_mechanisms, master_weights, 60, 4);
PIN(hr_mechanisms, state_dtype, 64, 4);
PIN(hr_mechanisms, parameter_place, 68, 4);
PIN(hr_mechanisms, optimizer_bytes, 72, 8);
PIN(hr_mechanisms, plugin_bytes, 80, 8);      // 1.7
PIN(hr_mechanisms, optimizer_place, 88, 4);   // 1.8
PIN(hr_mechanisms, activation_place, 92, 4);  // was reserved2
PIN(hr_mechanisms, num_adapters, 96, 4);      // 1.8, appended
PIN(hr_mechanisms, base_double_quant, 100, 4);
PIN(hr_mechanisms, adapters, 104, 8);
PIN(hr_mechanisms, base_dtype, 112, 8);
static_assert(sizeof(hr_estimate_query) == 120 && alignof(hr_estimate_query) == 8);
PIN(hr_estimate_query, struct_size, 0, 4);
PIN(hr_estimate_query, reserved0, 4, 4);
PIN(hr_estimate_query, model, 8, 8);
PIN(hr_estimate_query, before, 16, 8);
PIN(hr_estimate_query, baseline, 24, 56);
PIN(hr_estimate_query, context, 80, 8);
PIN(hr_estimate_query, peak, 88, 8);
PIN(hr_estimate_query, oom_requested, 96, 8);
PIN(hr_estimate_query, oom_free_bytes, 104, 8);
PIN(hr_estimate_query, oom_largest_free, 112, 8);
static_assert(sizeof(hr_estimate_result) == 760 && alignof(hr_estimate_result) == 8);
PIN(hr_estimate_result, struct_size, 0, 4);
PIN(hr_estimate_result, reserved0, 4, 4);
PIN(hr_estimate_result, after, 8, 8);
PIN(hr_estimate_result, bytes, 16, 56);
PIN(hr_estimate_result, makes_usable, 72, 8);
PIN(hr_estimate_result, step_time_factor, 80, 8);
PIN(hr_estimate_result, what, 88, 160);
PIN(hr_estimate_result, toml, 248, 512);
static_assert(sizeof(hr_ext_estimate) == 32 && alignof(hr_ext_estimate) == 8);
PIN(hr_ext_estimate, struct_size, 0, 4);
PIN(hr_ext_estimate, reserved0, 4, 4);
PIN(hr_ext_estimate, estimate, 8, 8);
PIN(hr_ext_estimate, num_modes, 16, 4);
PIN(hr_ext_estimate, reserved1, 20, 4);
PIN(hr_ext_estimate, modes, 24, 8);
static_assert(sizeof(hr_estimate_mode) == 24 && alignof(hr_estimate_mode) == 8);
PIN(hr_estimate_mode, struct_size, 0, 4);
PIN(hr_estimate_mode, reserved0, 4, 4);
PIN(hr_estimate_mode, what, 8, 8);
PIN(hr_estimate_mode, toml, 16, 8);

PIN_TYPE(hr_ext_vm, raw_alloc, void* (*)(hr_host*, uint64_t));
PIN_TYPE(hr_ext_vm, raw_free, void (*)(hr_host*, void*));
PIN_TYPE(hr_ext_vm, granularity, uint64_t (*)(hr_host*));
PIN_TYPE(hr_ext_vm, reserve, void* (*)(hr_host*, uint64_t));
PIN_TYPE(hr_ext_vm, map, hr_status (*)(hr_host*, void*, uint64_t));
PIN_TYPE(hr_ext_vm, unmap, hr_status (*)(hr_host*, void*, uint64_t));
PIN_TYPE(hr_ext_vm, release, hr_status (*)(hr_host*, void*, uint64_t));
PIN_TYPE(hr_ext_precision, set_compute_dtype, hr_status (*)(hr_host*, uint32_t));
PIN_TYPE(hr_ext_precision, set_loss_scale, hr_status (*)(hr_host*, double));
PIN_TYPE(hr_ext_precision, compute_dtype, uint32_t (*)(hr_host*));
PIN_TYPE(hr_ext_precision, loss_scale, double (*)(hr_host*));
PIN_TYPE(hr_ext_precision, set_grad_dtype, hr_status (*)(hr_host*, uint32_t));
PIN_TYPE(hr_ext_precision, set_master_weights, hr_status (*)(hr_host*, int32_t));
PIN_TYPE(hr_ext_precision, set_state_dtype, hr_status (*)(hr_host*, uint32_t));
PIN_TYPE(hr_ext_precision, grad_dtype, uint32_t (*)(hr_host*));
PIN_TYPE(hr_ext_precision, master_weights, int32_t (*)(hr_host*));
PIN_TYPE(hr_ext_precision, state_dtype, uint32_t (*)(hr_host*));
PIN_TYPE(hr_ext_precision, nonfinite_many,
         hr_status (*)(hr_host*, uint64_t, const void* const*, const uint32_t*, const uint64_t*,
                       int32_t*));
PIN_TYPE(hr_ext_recompute, drop_activations, hr_status (*)(hr_host*, int32_t, uint32_t));
PIN_TYPE(hr_ext_recompute, layer_activation_bytes, uint64_t (*)(hr_host*, int32_t));
PIN_TYPE(hr_ext_tensors, find_param,
         hr_status (*)(hr_host*, const char*, hr_tensor*, int32_t*, int32_t*));
PIN_TYPE(hr_ext_tensors, read, hr_status (*)(hr_host*, void*, const void*, uint64_t));
PIN_TYPE(hr_ext_tensors, reduce,
         hr_status (*)(hr_host*, const void*, uint32_t, uint64_t, uint32_t, double*));
PIN_TYPE(hr_ext_tensors, write, hr_status (*)(hr_host*, void*, const void*, uint64_t));
PIN_TYPE(hr_ext_ops, binary,
         hr_status (*)(hr_host*, uint32_t, void*, const void*, const void*, uint32_t, uint64_t));
PIN_TYPE(hr_ext_ops, unary,
         hr_status (*)(hr_host*, uint32_t, void*, const void*, uint32_t, uint64_t));
PIN_TYPE(hr_ext_ops, lerp,
         hr_status (*)(hr_host*, void*, const void*, const void*, double, uint32_t, uint64_t));
PIN_TYPE(hr_ext_ops, affine,
         hr_status (*)(hr_host*, void*, const void*, double, double, uint32_t, uint64_t));
PIN_TYPE(hr_ext_ops, adamw,
         hr_status (*)(hr_host*, void*, const void*, void*, void*, uint64_t, uint32_t, uint32_t,
                       uint32_t, double, double, double, double, double, int64_t, uint32_t));
PIN_TYPE(hr_ext_step, state, hr_status (*)(hr_host*, hr_step_state*));
PIN_TYPE(hr_ext_step, stop_run, hr_status (*)(hr_host*, const char*));
PIN_TYPE(hr_ext_step, set_events, hr_status (*)(hr_host*, uint64_t));
PIN_TYPE(hr_ext_batch, state, hr_status (*)(hr_host*, hr_batch_state*));
PIN_TYPE(hr_ext_batch, restart_step, hr_status (*)(hr_host*, int32_t, const char*));
PIN_TYPE(hr_ext_batch, set_micro_batch, hr_status (*)(hr_host*, int32_t, const char*));
PIN_TYPE(hr_ext_comm, rank, int32_t (*)(hr_host*));
PIN_TYPE(hr_ext_comm, local_rank, int32_t (*)(hr_host*));
PIN_TYPE(hr_ext_comm, world_size, int32_t (*)(hr_host*));
PIN_TYPE(hr_ext_comm, all_reduce,
         hr_status (*)(hr_host*, void*, uint64_t, uint32_t, uint32_t, hr_comm_request**));
PIN_TYPE(hr_ext_comm, reduce_scatter,
         hr_status (*)(hr_host*, const void*, void*, uint64_t, uint32_t, uint32_t,
                       hr_comm_request**));
PIN_TYPE(hr_ext_comm, all_gather,
         hr_status (*)(hr_host*, const void*, void*, uint64_t, uint32_t, hr_comm_request**));
PIN_TYPE(hr_ext_comm, broadcast,
         hr_status (*)(hr_host*, void*, uint64_t, uint32_t, int32_t, hr_comm_request**));
PIN_TYPE(hr_ext_comm, barrier, hr_status (*)(hr_host*, hr_comm_request**));
PIN_TYPE(hr_ext_comm, wait, hr_status (*)(hr_host*, hr_comm_request*));
PIN_TYPE(hr_ext_comm, stream, void* (*)(hr_host*));
PIN_TYPE(hr_ext_state, save, hr_status (*)(void*, const hr_state_writer*));
PIN_TYPE(hr_ext_state, load, hr_status (*)(void*, const void*, uint64_t));
PIN_TYPE(hr_estimate_query, peak, hr_status (*)(void*, const hr_mechanisms*, uint64_t*));
PIN_TYPE(hr_ext_estimate, estimate,
         hr_status (*)(void*, const hr_estimate_query*, hr_estimate_result*));

#endif  // x86-64 LP64

namespace headroom {
namespace {

TEST(PluginAbiLayout, PinnedForThisPlatform) {
#if defined(__x86_64__) && defined(__LP64__)
  // Everything above is checked at compile time; this test only records that it was.
  EXPECT_STREQ(HR_PLUGIN_ENTRY_SYMBOL, "hr_plugin_entry");
#else
  GTEST_SKIP() << "the layout is pinned for x86-64 (LP64) only";
#endif
}

// HR_HAS_FIELD: a reader sees a field only when the writer's struct_size covers all of it.
TEST(PluginAbiLayout, HasFieldFollowsStructSize) {
  hr_event_info info{};
  info.struct_size = offsetof(hr_event_info, category);
  EXPECT_TRUE(HR_HAS_FIELD(&info, hr_event_info, bytes));
  EXPECT_FALSE(HR_HAS_FIELD(&info, hr_event_info, category));
  info.struct_size = sizeof info;
  EXPECT_TRUE(HR_HAS_FIELD(&info, hr_event_info, reserved0));
}

// hr_negotiate accepts a host range that includes major 1 and refuses one that does not.
TEST(PluginAbiLayout, NegotiateByMajorVersion) {
  static const hr_plugin_descriptor descriptor{};
  hr_entry_args args{};
  args.struct_size = sizeof args;
  args.host_abi_min = HR_ABI_MAKE_VERSION(1, 0);
  args.host_abi_max = HR_ABI_MAKE_VERSION(1, 8);
  EXPECT_EQ(hr_negotiate(&args, &descriptor), HR_OK);
  EXPECT_EQ(args.plugin_abi, HR_ABI_VERSION);
  EXPECT_EQ(args.descriptor, &descriptor);

  hr_entry_args newer{};
  newer.host_abi_min = HR_ABI_MAKE_VERSION(2, 0);
  newer.host_abi_max = HR_ABI_MAKE_VERSION(2, 1);
  EXPECT_EQ(hr_negotiate(&newer, &descriptor), HR_ERROR_VERSION);
  EXPECT_EQ(newer.descriptor, nullptr);

  hr_entry_args older{};
  older.host_abi_min = HR_ABI_MAKE_VERSION(0, 1);
  older.host_abi_max = HR_ABI_MAKE_VERSION(0, 9);
  EXPECT_EQ(hr_negotiate(&older, &descriptor), HR_ERROR_VERSION);
}

}  // namespace
}  // namespace headroom
