// Allocator benchmark: replays allocation traces against the default allocator (the backend's
// first-fit arena, no caching) and defrag_allocator, side by side in one run.
//
//   build/bin/bench_replay_alloc TRACE... [--min-seconds S]
//
// For each trace: under its recorded memory_limit and under a limit far above its peak (so that
// every allocator completes and the speeds compare the same work). Prints allocations per second,
// the ratio to the default allocator, peak reserved, fragmentation and whether the replay
// completed.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "core/report/alloc_trace.h"

namespace {

using namespace headroom;

struct Variant {
  const char* name;
  const char* plugins;  // TOML
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"allocations per second: default allocator against defrag_allocator"};
  std::vector<std::string> traces;
  double min_seconds = 1.0;
  app.add_option("traces", traces, "allocation traces (headroom train --record-allocs)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--min-seconds", min_seconds, "timed replay per measurement")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  const Variant variants[] = {
      {"default (first fit)", ""},
      {"defrag_allocator", "[[plugins]]\nname = \"defrag_allocator\"\nexpandable = true\n"},
      {"defrag, no expandable", "[[plugins]]\nname = \"defrag_allocator\"\nexpandable = false\n"},
  };
  try {
    for (const std::string& file : traces) {
      const AllocTrace trace = read_alloc_trace(file);
      for (const bool own_limit : {true, false}) {
        // "none" is not an option for the arena-free comparison: 0 would mean the trace's limit.
        const std::string limit = own_limit ? "0" : "\"64GiB\"";
        std::printf("\n%s, memory_limit %s\n", file.c_str(),
                    own_limit ? format_bytes(trace.memory_limit).c_str() : "64 GiB (no pressure)");
        std::printf("  %-24s %9s %14s %8s %14s %8s\n", "allocator", "completed", "allocs/s",
                    "ratio", "peak reserved", "frag");
        double base = 0.0;
        for (const Variant& v : variants) {
          const Config c = parse_config(
              std::string("[device]\nmemory_limit = ") + limit + "\n" + v.plugins, "bench");
          ReplayOptions o;
          o.min_timed_seconds = min_seconds;
          const ReplayResult r = replay_alloc_trace(trace, c, o);
          if (base == 0.0) base = r.allocs_per_s;
          std::printf("  %-24s %9s %14.0f %7.2fx %14s %7.2f%%\n", v.name, r.failed ? "no" : "yes",
                      r.allocs_per_s, r.allocs_per_s / base, format_bytes(r.peak_reserved).c_str(),
                      100.0 * r.fragmentation);
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_replay_alloc: %s\n", e.what());
    return 2;
  }
  return 0;
}
