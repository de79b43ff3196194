/* Test plugin: its entry point answers HR_ERROR_VERSION within the host's own major version, as a
 * plugin does that needs a newer minor than the host has, or that refuses for a reason of its own.
 * Built as:
 *   needs_newer       asks for ABI 1.<this header's minor + 5>, with a message
 *   refuses_version   names no version (plugin_abi = 0), with a message
 *   refuses_silently  names no version and gives no message */
#include <headroom/plugin.h>
#include <stdio.h>

/* MINORS_AHEAD: ask for this many minor versions past this header's; else name none. */
#ifdef MINORS_AHEAD
#define PLUGIN_ABI HR_ABI_MAKE_VERSION(HR_ABI_VERSION_MAJOR, HR_ABI_VERSION_MINOR + MINORS_AHEAD)
#else
#define PLUGIN_ABI 0
#endif

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  args->plugin_abi = PLUGIN_ABI;
#ifdef PLUGIN_MESSAGE
  if (args->error && args->error_size > 0)
    snprintf(args->error, args->error_size, "%s", PLUGIN_MESSAGE);
#endif
  return HR_ERROR_VERSION;
}
