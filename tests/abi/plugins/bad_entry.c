/* Test plugin: its entry point refuses to load, with a message. */
#include <headroom/plugin.h>
#include <stdio.h>

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  if (args->error && args->error_size > 0)
    snprintf(args->error, args->error_size, "this plugin refuses to load");
  return HR_ERROR;
}
