/* headroom.vm/1 — the backend's memory and virtual memory, for the allocator role (ABI 1.5).
 *
 * The same functions as the 1.4 table's raw_* and vm_* (see headroom/plugin.h for what each
 * does), now where they belong: with the role that may call them. Every function is for the
 * plugin that provides HR_ROLE_ALLOCATOR; any other plugin gets HR_ERROR_NOT_ALLOWED (NULL or 0
 * from the functions that return a pointer or a size) and a message saying so. Training thread,
 * from create() and the allocator hooks (never from ALLOC / FREE / OOM hooks). */
#ifndef HEADROOM_EXT_VM_H
#define HEADROOM_EXT_VM_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_VM "headroom.vm/1"

typedef struct hr_ext_vm {
  uint32_t struct_size;
  uint32_t reserved0;
  /* Memory not counted by the tracker, that the allocator builds its pools from; NULL when the
   * backend has none left. */
  void* (*raw_alloc)(hr_host* host, uint64_t bytes);
  void (*raw_free)(hr_host* host, void* ptr);
  /* Sizes and addresses below are multiples of it. */
  uint64_t (*granularity)(hr_host* host);
  /* An address range with no memory behind it (NULL on failure). */
  void* (*reserve)(hr_host* host, uint64_t bytes);
  /* Backs [addr, addr+bytes) with device memory; HR_ERROR_OUT_OF_MEMORY when there is not enough.
   */
  hr_status (*map)(hr_host* host, void* addr, uint64_t bytes);
  hr_status (*unmap)(hr_host* host, void* addr, uint64_t bytes);
  /* Returns the whole range, unmapping what is still mapped. */
  hr_status (*release)(hr_host* host, void* addr, uint64_t bytes);
} hr_ext_vm;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_VM_H */
