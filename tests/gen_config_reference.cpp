// Prints the config reference, rendered from the parser's key tables: what docs/config-reference.md
// must hold. scripts/gen-config-reference runs it; tests/config_reference_test.cpp compares.
#include <cstdio>

#include "core/config/config_reference.h"

int main() {
  std::fputs(headroom::config_reference_markdown().c_str(), stdout);
  return std::ferror(stdout) ? 1 : 0;
}
