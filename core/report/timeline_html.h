// The memory timeline as one self-contained HTML file: a stacked area of live bytes by category
// over the run (one point per loop phase), the memory limit and the peak marked, and the phase
// under the pointer. Inline SVG and a little inline JavaScript; nothing is fetched, so the file
// can be mailed, attached to an issue or opened offline.
//
// Stable hooks for tests and for anyone styling the file:
//   <div id="headroom-timeline" data-rendered="1">   set by the script once it has run
//   <path class="series series-<category>">           one per category that was ever non-empty
//   <g class="legend-item legend-<category>">         its legend entry
//   <line id="limit-line">, <line id="peak-line">     the memory limit (when set) and the peak
//   <path id="bucket-low">                            when downsampled: each point's lowest total
//   <g id="oom-marker">                               the failed request, for a run stopped by OOM
//   <div id="status">                                 the phase and bytes under the pointer
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/device/memory.h"

namespace headroom {

struct TimelineHtmlOptions {
  std::string title;          // what the run was, e.g. the config file
  uint64_t memory_limit = 0;  // 0 = none drawn
  const OomReport* oom =
      nullptr;               // a run stopped by OOM: the request that failed, drawn at the end
  size_t max_points = 2000;  // more samples than this are merged, keeping each bucket's highest
};

// Consecutive samples merged into one point: [first, last], drawn as the sample `top` of them
// with the highest total, so no peak is ever lost to downsampling; `low` is the one with the
// lowest total, drawn as a line so the range memory swings through stays visible.
struct TimelineBucket {
  size_t first = 0, last = 0, top = 0, low = 0;
};
std::vector<TimelineBucket> downsample_timeline(const std::vector<TimelineSample>& samples,
                                                size_t max_points);

// The HTML document.
std::string render_timeline_html(const std::vector<TimelineSample>& samples,
                                 const TimelineHtmlOptions& options);
// Writes it to `path`, whole or not at all; OutputError when the file cannot be written.
void write_timeline_html(const std::string& path, const std::vector<TimelineSample>& samples,
                         const TimelineHtmlOptions& options);

}  // namespace headroom
