// The CPU kernels' thread count for one scope of a test (the kernels' bits may not depend on it).
#pragma once

#include "kernels/cpu/parallel.h"

namespace headroom::test {

class CpuThreads {
 public:
  explicit CpuThreads(int n) : old_(cpu::threads_setting()) { cpu::set_threads(n); }
  ~CpuThreads() { cpu::set_threads(old_); }
  CpuThreads(const CpuThreads&) = delete;
  CpuThreads& operator=(const CpuThreads&) = delete;

 private:
  int old_;
};

}  // namespace headroom::test
