/* headroom.config/1 — the plugin's own [[plugins]] table beyond the 1.4 services' scalar getters.
 *
 * Arrays of strings (a list of module names, of parameter patterns): how many, and each. A single
 * string reads as an array of one. Like the services' getters: the key is marked as asked for (so
 * that it is no unknown key), a wrong type is HR_ERROR_CONFIG with a message naming the key's
 * file:line:column (an element's own position for a wrong element), an absent key is HR_OK with
 * *count = 0.
 *
 * Any plugin, training thread, from create() only. */
#ifndef HEADROOM_EXT_CONFIG_H
#define HEADROOM_EXT_CONFIG_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_CONFIG "headroom.config/1"

typedef struct hr_ext_config {
  uint32_t struct_size;
  uint32_t reserved0;
  /* The number of strings key holds: 0 when absent, 1 for a string, an array's length. */
  hr_status (*string_count)(hr_host* host, const char* key, uint32_t* count);
  /* Copies string `index` of key, NUL-terminated, into out[0..size): HR_ERROR_INVALID (with a
   * message) when it does not fit or index is past the end. */
  hr_status (*string_at)(hr_host* host, const char* key, uint32_t index, char* out, size_t size);
} hr_ext_config;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_CONFIG_H */
