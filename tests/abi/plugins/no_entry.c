/* Test plugin that is not one: a shared library exporting a function, but not hr_plugin_entry.
 * The one test plugin that exports something else (the nm test knows). */
#include <headroom/plugin.h>

HR_PLUGIN_EXPORT int hr_plugin_entry_point_misspelled(void);

HR_PLUGIN_EXPORT int hr_plugin_entry_point_misspelled(void) {
  return 42;
}
