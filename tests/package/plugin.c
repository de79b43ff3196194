/* Builds against the installed C ABI header only. */
#include <headroom/plugin.h>

int consumer_event_count(void) {
  return HR_EVENT_COUNT_V1;
}
