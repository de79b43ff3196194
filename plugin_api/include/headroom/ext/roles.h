/* headroom.allocator/1 and headroom.optimizer/1 — offered by a plugin: its role hooks (ABI 1.5).
 *
 * A plugin whose descriptor sets HR_ROLE_ALLOCATOR (HR_ROLE_OPTIMIZER) in roles and leaves
 * descriptor->allocator (->optimizer) NULL returns its hr_allocator_hooks (hr_optimizer_hooks)
 * from get_extension(HR_EXT_ALLOCATOR) (HR_EXT_OPTIMIZER). The hooks are headroom/plugin.h's. */
#ifndef HEADROOM_EXT_ROLES_H
#define HEADROOM_EXT_ROLES_H

#include "headroom/plugin.h"

#define HR_EXT_ALLOCATOR "headroom.allocator/1" /* returns const hr_allocator_hooks* */
#define HR_EXT_OPTIMIZER "headroom.optimizer/1" /* returns const hr_optimizer_hooks* */

#endif /* HEADROOM_EXT_ROLES_H */
