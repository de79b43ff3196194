// The memory timeline as one self-contained HTML file, readable at any length: an overview of every
// step (x in steps: each step's highest total stacked by category, its lowest as a dashed line;
// zoom with the wheel or the buttons, pan by dragging, the step under the pointer's bytes by
// category, lowest to highest) above one step drawn phase by phase (the step asked for, else the
// peak's, else for a run stopped out of memory the last), a stacked area of live bytes by
// category with the memory limit, the step's peak and the phase under the pointer. Inline SVG and
// a little inline JavaScript; nothing is fetched, so the file can be mailed, attached to an issue
// or opened offline.
//
// Stable hooks for tests and for anyone styling the file:
//   <div id="headroom-timeline" data-rendered="1">   set by the script once it has run
//   <path class="series series-<category>">           one per category that was ever non-empty
//   <g class="legend-item legend-<category>">         its legend entry
//   <line id="limit-line">, <line id="peak-line">     the memory limit (when set) and the peak
//   <path id="bucket-low">                            when downsampled: each point's lowest total
//   <g id="oom-marker">                               the failed request, for a run stopped by OOM
//   <div id="status">                                 the phase and bytes under the pointer
//   <svg id="overview-chart">, <svg id="overview-plot"> the overview and its zoomed plot
//   <path class="overview-series overview-<category>"> the overview's stacked steps
//   <path id="overview-min">                           each step's lowest total
//   data-overview-view="A B" on #headroom-timeline     the columns in view, set by the script
#pragma once

#include <cstddef>
#include <cstdint>
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
  int64_t detail_step = 0;  // the step drawn phase by phase; 0: the peak's (a failed run: the last)
};

// Consecutive samples merged into one point: [first, last], drawn as the sample `top` of them
// with the highest total, so no peak is ever lost to downsampling; `low` is the one with the
// lowest total, drawn as a line so the range memory swings through stays visible.
struct TimelineBucket {
  size_t first = 0, last = 0, top = 0, low = 0;
};
std::vector<TimelineBucket> downsample_timeline(const std::vector<TimelineSample>& samples,
                                                size_t max_points);

// Where the host ledger's timeline goes beside the device's at `path`: "t.html" -> "t.host.html"
// (".host.html" appended when `path` does not end in ".html").
std::string host_timeline_path(const std::string& path);

// The HTML document.
std::string render_timeline_html(const std::vector<TimelineSample>& samples,
                                 const TimelineHtmlOptions& options);
// Writes it to `path`, whole or not at all; OutputError when the file cannot be written.
void write_timeline_html(const std::string& path, const std::vector<TimelineSample>& samples,
                         const TimelineHtmlOptions& options);

}  // namespace headroom
