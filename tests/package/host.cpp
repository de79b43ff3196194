// Links the installed runtime library and uses it.
#include <core/config/config.h>

#include <cstdio>

int main() {
  std::printf("%s\n", headroom::format_bytes(headroom::parse_size("64MiB", "test")).c_str());
  return 0;
}
