/* Compiled with -fsyntax-only as C99, C11 and C++17 under -Wall -Wextra -pedantic -Werror: the
 * plugin header must stay warning-free in each. */
#include <headroom/plugin.h>

static hr_status check_entry(hr_entry_args* args) {
  static hr_plugin_descriptor descriptor;
  hr_event_info info;
  info.struct_size = (uint32_t)sizeof info;
  if (!HR_HAS_FIELD(&info, hr_event_info, category)) return HR_ERROR;
  if (HR_ABI_MAJOR(HR_ABI_VERSION) != HR_ABI_VERSION_MAJOR) return HR_ERROR;
  if (HR_EVENT_BIT(HR_EVENT_OOM) == 0) return HR_ERROR;
  descriptor.struct_size = (uint32_t)sizeof descriptor;
  return hr_negotiate(args, &descriptor);
}

hr_status hr_plugin_entry(hr_entry_args* args) {
  return check_entry(args);
}
