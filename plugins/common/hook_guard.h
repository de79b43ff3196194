// For in-tree plugins written in C++: no exception may cross the C ABI. guarded() runs a hook's
// body and turns what it throws into a status, handing the host a message first.
#pragma once

#include <exception>
#include <new>
#include <string>

#include "headroom/plugin.h"

namespace headroom_plugin {

// `doing` completes "out of host memory while ..." / "failed while ...".
template <class F>
hr_status guarded(const hr_host_services* s, const char* doing, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    s->set_error(s->host, (std::string("out of host memory while ") + doing).c_str());
    return HR_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    s->set_error(s->host, (std::string("failed while ") + doing + ": " + e.what()).c_str());
    return HR_ERROR;
  } catch (...) {
    s->set_error(s->host, (std::string("failed while ") + doing).c_str());
    return HR_ERROR;
  }
}

}  // namespace headroom_plugin
