/* Every extension header compiles on its own, warning-free, as C99, C11 and C++17.
 * tests/abi/CMakeLists.txt compiles this file once per header in plugin_api/include/headroom/ext,
 * with HR_EXT_HEADER naming it (<headroom/ext/batch.h>): a new extension's header is found there
 * in its folder, never listed here. */
#include HR_EXT_HEADER

int main(void) {
  return 0;
}
