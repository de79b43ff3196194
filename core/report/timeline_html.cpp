#include "core/report/timeline_html.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/os/output_file.h"

namespace headroom {

namespace {

// Bottom to top: what lives the whole run first, so the part that moves — activations and
// workspace — is the top of the stack and its shape reads directly.
constexpr Category kStackOrder[] = {
    Category::kParameters,    Category::kGradients, Category::kOptimizer,   Category::kData,
    Category::kCommunication, Category::kWorkspace, Category::kActivations,
};
static_assert(sizeof kStackOrder / sizeof kStackOrder[0] == kNumCategories, "every category");

const char* colour(Category c) {
  switch (c) {
    case Category::kParameters:
      return "#4e79a7";
    case Category::kGradients:
      return "#f28e2b";
    case Category::kOptimizer:
      return "#59a14f";
    case Category::kActivations:
      return "#76b7b2";
    case Category::kWorkspace:
      return "#edc948";
    case Category::kData:
      return "#9c755f";
    case Category::kCommunication:
      return "#ff9da7";
  }
  return "#bab0ac";
}

// The chart's geometry in SVG user units; the SVG scales to the window.
constexpr double kWidth = 1200, kHeight = 580;
constexpr double kX0 = 84, kX1 = 1176;  // plot area
constexpr double kY0 = 58, kY1 = 516;

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

std::string html_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

// 1, 2 or 5 times a power of ten: the smallest such step that gives at most `max_ticks` ticks.
double nice_step(double range, int max_ticks) {
  if (range <= 0) return 1;
  const double raw = range / max_ticks;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

struct Unit {
  double bytes;
  const char* name;
};
Unit axis_unit(double max_bytes) {
  if (max_bytes >= 2.0 * (1ull << 30)) return {double(1ull << 30), "GiB"};
  if (max_bytes >= 2.0 * (1ull << 20)) return {double(1ull << 20), "MiB"};
  if (max_bytes >= 2.0 * 1024) return {1024.0, "KiB"};
  return {1.0, "B"};
}

std::string tick_label(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", std::round(v * 1000) / 1000);
  return b;
}

const char* kScript = R"JS(
(function () {
  var D = JSON.parse(document.getElementById('timeline-data').textContent);
  var root = document.getElementById('headroom-timeline');
  var svg = root.querySelector('svg');
  var cursor = document.getElementById('cursor');
  var status = document.getElementById('status');
  function fmt(b) {
    if (b < 1024) return b + ' B';
    if (b < 1048576) return (b / 1024).toFixed(2) + ' KiB';
    if (b < 1073741824) return (b / 1048576).toFixed(2) + ' MiB';
    return (b / 1073741824).toFixed(2) + ' GiB';
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  // The bucket holding phase index i: the last whose first phase is <= i.
  function bucketAt(i) {
    var lo = 0, hi = D.first.length - 1;
    while (lo < hi) {
      var mid = (lo + hi + 1) >> 1;
      if (D.first[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
  function show(b) {
    var x0 = D.x0 + (D.x1 - D.x0) * D.first[b] / D.n;
    var x1 = D.x0 + (D.x1 - D.x0) * (D.last[b] + 1) / D.n;
    var xm = ((x0 + x1) / 2).toFixed(1);
    cursor.setAttribute('x1', xm);
    cursor.setAttribute('x2', xm);
    cursor.setAttribute('visibility', 'visible');
    while (status.firstChild) status.removeChild(status.firstChild);
    var head = D.first[b] === D.last[b]
        ? 'phase ' + D.top[b] + ' of ' + D.n + ': '
        : 'phases ' + D.first[b] + '\u2013' + D.last[b] + ' of ' + D.n + ' (lowest total ' +
          fmt(D.low[b]) + '), highest at ' + D.top[b] + ': ';
    var line = el('div', 'phase');
    line.appendChild(el('span', 'where', head));
    line.appendChild(el('b', 'phase-name', D.phase[b]));
    status.appendChild(line);
    var bytes = el('div', 'bytes');
    var total = 0;
    for (var c = D.cats.length - 1; c >= 0; --c) {
      var v = D.bytes[b][c];
      total += v;
      var item = el('span', 'status-item status-' + D.cats[c]);
      var sw = el('span', 'swatch');
      sw.style.background = D.colors[c];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(D.cats[c] + ' ' + fmt(v)));
      bytes.appendChild(item);
    }
    bytes.insertBefore(el('span', 'status-total', 'total ' + fmt(total)), bytes.firstChild);
    status.appendChild(bytes);
  }
  if (D.n > 0) {
    var hit = document.getElementById('hit');
    hit.addEventListener('mousemove', function (evt) {
      var pt = svg.createSVGPoint();
      pt.x = evt.clientX;
      pt.y = evt.clientY;
      var p = pt.matrixTransform(svg.getScreenCTM().inverse());
      var i = Math.floor((p.x - D.x0) / (D.x1 - D.x0) * D.n);
      show(bucketAt(Math.max(0, Math.min(D.n - 1, i))));
    });
    // Until the pointer moves: the peak, the phase a reader wants first.
    show(D.peak_bucket);
  }
  root.setAttribute('data-rendered', '1');
})();
)JS";

}  // namespace

std::vector<TimelineBucket> downsample_timeline(const std::vector<TimelineSample>& samples,
                                                size_t max_points) {
  std::vector<TimelineBucket> out;
  const size_t n = samples.size();
  if (n == 0) return out;
  const size_t per = std::max<size_t>(
      1, (n + std::max<size_t>(1, max_points) - 1) / std::max<size_t>(1, max_points));
  for (size_t first = 0; first < n; first += per) {
    TimelineBucket b;
    b.first = b.top = b.low = first;
    b.last = std::min(n, first + per) - 1;
    uint64_t best = samples[first].total(), least = best;
    for (size_t i = first + 1; i <= b.last; ++i) {
      const uint64_t t = samples[i].total();
      if (t > best) {
        best = t;
        b.top = i;
      }
      if (t < least) {
        least = t;
        b.low = i;
      }
    }
    out.push_back(b);
  }
  return out;
}

std::string render_timeline_html(const std::vector<TimelineSample>& samples,
                                 const TimelineHtmlOptions& options) {
  const size_t n = samples.size();
  const std::vector<TimelineBucket> buckets = downsample_timeline(samples, options.max_points);

  // The categories that ever held a byte, in stack order.
  std::vector<Category> cats;
  for (Category c : kStackOrder)
    for (const TimelineSample& s : samples)
      if (s.live[static_cast<int>(c)] > 0) {
        cats.push_back(c);
        break;
      }

  size_t peak_index = 0;
  uint64_t peak = 0;
  for (size_t i = 0; i < n; ++i)
    if (samples[i].total() > peak) {
      peak = samples[i].total();
      peak_index = i;
    }
  size_t peak_bucket = 0;
  for (size_t b = 0; b < buckets.size(); ++b)
    if (buckets[b].first <= peak_index && peak_index <= buckets[b].last) peak_bucket = b;
  const uint64_t last_total = n ? samples.back().total() : 0;
  const uint64_t oom_top = options.oom ? last_total + options.oom->requested : 0;
  const double ymax =
      std::max({1.0, double(peak), double(options.memory_limit), double(oom_top)}) * 1.08;
  auto X = [&](double phase_index) {
    return kX0 + (kX1 - kX0) * (n ? phase_index / double(n) : 0.0);
  };
  auto Y = [&](double bytes) { return kY1 - (kY1 - kY0) * bytes / ymax; };

  std::string svg;
  svg.reserve(64 * 1024 + buckets.size() * cats.size() * 32);
  // Inline SVG in HTML needs no xmlns: the file names no URL at all.
  svg += "<svg viewBox=\"0 0 " + num(kWidth) + " " + num(kHeight) +
         "\" role=\"img\" aria-label=\"live memory by category over the run\">\n";
  // The hatching of a failed request.
  svg +=
      "<defs><pattern id=\"oom-hatch\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
      "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#fde0e0\"/>"
      "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#d62728\" stroke-width=\"2\"/>"
      "</pattern></defs>\n";

  // Legend.
  {
    double x = kX0;
    svg += "<g id=\"legend\">";
    for (Category c : cats) {
      const std::string name = category_name(c);
      svg += "<g class=\"legend-item legend-" + name + "\"><rect x=\"" + num(x) +
             "\" y=\"14\" width=\"14\" height=\"14\" fill=\"" + colour(c) + "\"/><text x=\"" +
             num(x + 19) + "\" y=\"26\">" + name + "</text></g>";
      x += 19 + 8.0 * double(name.size()) + 22;
    }
    if (buckets.size() < n)
      svg += "<g class=\"legend-item legend-low\"><line x1=\"" + num(x) + "\" x2=\"" + num(x + 22) +
             "\" y1=\"21\" y2=\"21\" class=\"low-swatch\"/><text x=\"" + num(x + 27) +
             "\" y=\"26\">lowest total within each point</text></g>";
    svg += "</g>\n";
  }

  // Y grid and axis, in the unit that suits the scale.
  const Unit unit = axis_unit(ymax);
  const double ystep = nice_step(ymax / unit.bytes, 8);
  svg += "<g id=\"y-axis\" class=\"axis\">";
  for (double v = 0; v * unit.bytes <= ymax; v += ystep) {
    const double y = Y(v * unit.bytes);
    svg += "<line class=\"grid\" x1=\"" + num(kX0) + "\" x2=\"" + num(kX1) + "\" y1=\"" + num(y) +
           "\" y2=\"" + num(y) + "\"/><text x=\"" + num(kX0 - 6) + "\" y=\"" + num(y + 4) +
           "\" text-anchor=\"end\">" + tick_label(v) + " " + unit.name + "</text>";
  }
  svg += "<text class=\"axis-title\" transform=\"translate(16 " + num((kY0 + kY1) / 2) +
         ") rotate(-90)\" text-anchor=\"middle\">live bytes</text></g>\n";

  // X axis: phase index, and the first phase of each optimizer step.
  svg += "<g id=\"x-axis\" class=\"axis\">";
  if (n) {
    const double xstep = std::max(1.0, nice_step(double(n), 10));
    for (double v = 0; v <= double(n); v += xstep) {
      svg += "<line class=\"tick\" x1=\"" + num(X(v)) + "\" x2=\"" + num(X(v)) + "\" y1=\"" +
             num(kY1) + "\" y2=\"" + num(kY1 + 5) + "\"/><text x=\"" + num(X(v)) + "\" y=\"" +
             num(kY1 + 19) + "\" text-anchor=\"middle\">" + tick_label(v) + "</text>";
    }
  }
  svg += "<text class=\"axis-title\" x=\"" + num((kX0 + kX1) / 2) + "\" y=\"" + num(kY1 + 44) +
         "\" text-anchor=\"middle\">phase index (data, each layer's forward and backward, "
         "optimizer); optimizer steps marked above</text></g>\n";

  std::vector<std::pair<size_t, int64_t>> steps;  // (first phase index, step)
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = samples[i].phase.step;
    if (s > 0 && (i == 0 || samples[i - 1].phase.step != s)) steps.push_back({i, s});
  }
  if (!steps.empty()) {
    // Label every m-th step so labels stay at least ~60 units apart; draw every step's line
    // while they are at least a few units apart.
    const double px_per_step =
        (kX1 - kX0) * double(n - steps.front().first) / double(n) / double(steps.size());
    int64_t m = 1;
    for (int k = 0; px_per_step * double(m) < 60; ++k)
      m = m * (k % 3 == 1 ? 5 : 2) / (k % 3 == 1 ? 2 : 1);  // 1, 2, 5, 10, 20, 50, ...
    svg += "<g id=\"steps\">";
    for (const auto& [i, s] : steps) {
      const bool labelled = s % m == 0 || (m > 1 && s == 1);
      if (!labelled && px_per_step < 5) continue;
      svg += "<line class=\"step-line" + std::string(labelled ? " labelled" : "") + "\" x1=\"" +
             num(X(double(i))) + "\" x2=\"" + num(X(double(i))) + "\" y1=\"" + num(kY0 - 4) +
             "\" y2=\"" + num(kY1) + "\"/>";
      if (labelled && X(double(i)) < kX1 - 60)
        svg += "<text class=\"step-label\" x=\"" + num(X(double(i)) + 3) + "\" y=\"" +
               num(kY0 - 7) + "\">step " + std::to_string(s) + "</text>";
    }
    svg += "</g>\n";
  }

  // The stacked areas: each category from the top of the ones below it to its own top, a step
  // per bucket, since a phase's bytes hold for the whole phase.
  svg += "<g id=\"series\">";
  std::vector<uint64_t> below(buckets.size(), 0);
  for (Category c : cats) {
    const std::string name = category_name(c);
    std::vector<uint64_t> top(buckets.size());
    for (size_t b = 0; b < buckets.size(); ++b)
      top[b] = below[b] + samples[buckets[b].top].live[static_cast<int>(c)];
    std::string d = "M" + num(X(double(buckets[0].first))) + " " + num(Y(double(top[0])));
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (b) d += "V" + num(Y(double(top[b])));
      d += "H" + num(X(double(buckets[b].last + 1)));
    }
    for (size_t b = buckets.size(); b-- > 0;) {
      d += "V" + num(Y(double(below[b])));
      d += "H" + num(X(double(buckets[b].first)));
    }
    d += "Z";
    svg += "<path id=\"series-" + name + "\" class=\"series series-" + name +
           "\" data-category=\"" + name + "\" fill=\"" + colour(c) + "\" d=\"" + d + "\"/>";
    below = std::move(top);
  }
  svg += "</g>\n";
  const bool downsampled = buckets.size() < n;
  if (downsampled) {
    // Each point is the highest of its phases; this line is the lowest, so a long run still shows
    // how far memory falls between its peaks.
    std::string d;
    for (size_t b = 0; b < buckets.size(); ++b) {
      const double y = Y(double(samples[buckets[b].low].total()));
      d += (b ? "V" : "M" + num(X(double(buckets[b].first))) + " ") + num(y);
      d += "H" + num(X(double(buckets[b].last + 1)));
    }
    svg += "<path id=\"bucket-low\" d=\"" + d + "\"/>\n";
  }
  svg += "<rect class=\"frame\" x=\"" + num(kX0) + "\" y=\"" + num(kY0) + "\" width=\"" +
         num(kX1 - kX0) + "\" height=\"" + num(kY1 - kY0) + "\"/>\n";

  // The memory limit and the peak: lines with labels (the peak's label left, the limit's right,
  // and the peak's below its line when the two would touch).
  const double y_peak = Y(double(peak));
  if (options.memory_limit) {
    const double y = Y(double(options.memory_limit));
    svg += "<g id=\"limit\"><line id=\"limit-line\" x1=\"" + num(kX0) + "\" x2=\"" + num(kX1) +
           "\" y1=\"" + num(y) + "\" y2=\"" + num(y) + "\"/><text id=\"limit-label\" x=\"" +
           num(kX1 - 4) + "\" y=\"" + num(y - 6) + "\" text-anchor=\"end\">memory_limit " +
           format_bytes(options.memory_limit) + "</text></g>\n";
  }
  if (n) {
    const bool close =
        options.memory_limit && std::abs(Y(double(options.memory_limit)) - y_peak) < 18;
    const TimelineBucket& pb = buckets[peak_bucket];
    const double xp = (X(double(pb.first)) + X(double(pb.last + 1))) / 2;
    svg += "<g id=\"peak\"><line id=\"peak-line\" x1=\"" + num(kX0) + "\" x2=\"" + num(kX1) +
           "\" y1=\"" + num(y_peak) + "\" y2=\"" + num(y_peak) +
           "\"/><circle id=\"peak-marker\" cx=\"" + num(xp) + "\" cy=\"" + num(y_peak) +
           "\" r=\"4\"/><text id=\"peak-label\" x=\"" + num(kX0 + 6) + "\" y=\"" +
           num(close ? y_peak + 16 : y_peak - 6) + "\">peak " + format_bytes(peak) + " at " +
           html_escape(samples[peak_index].phase.str()) + "</text></g>\n";
  }
  if (options.oom && n) {
    const OomReport& r = *options.oom;
    const double x1 = kX1, x0 = std::min(X(double(buckets.back().first)), kX1 - 8);
    const double ylo = Y(double(last_total)), yhi = Y(double(oom_top));
    svg += "<g id=\"oom-marker\"><rect x=\"" + num(x0) + "\" y=\"" + num(yhi) + "\" width=\"" +
           num(x1 - x0) + "\" height=\"" + num(std::max(1.0, ylo - yhi)) +
           "\" fill=\"url(#oom-hatch)\" stroke=\"#d62728\"/><text x=\"" + num(x0 - 6) + "\" y=\"" +
           num(std::max(kY0 + 12, yhi + 12)) + "\" text-anchor=\"end\">out of memory: requested " +
           format_bytes(r.requested) + " (" + category_name(r.category) + ")</text></g>\n";
  }
  // The pointer's phase: a cursor line and an invisible surface that takes the mouse.
  svg += "<line id=\"cursor\" x1=\"0\" x2=\"0\" y1=\"" + num(kY0) + "\" y2=\"" + num(kY1) +
         "\" visibility=\"hidden\"/>\n";
  svg += "<rect id=\"hit\" x=\"" + num(kX0) + "\" y=\"" + num(kY0) + "\" width=\"" +
         num(kX1 - kX0) + "\" height=\"" + num(kY1 - kY0) + "\" fill=\"transparent\"/>\n";
  svg += "</svg>\n";

  // The data behind the pointer readout: one entry per bucket.
  nlohmann::json j;
  j["n"] = n;
  j["x0"] = kX0;
  j["x1"] = kX1;
  j["peak_bucket"] = peak_bucket;
  nlohmann::json jc = nlohmann::json::array(), jcol = nlohmann::json::array();
  for (Category c : cats) {
    jc.push_back(category_name(c));
    jcol.push_back(colour(c));
  }
  j["cats"] = jc;
  j["colors"] = jcol;
  nlohmann::json first = nlohmann::json::array(), last = nlohmann::json::array(),
                 topi = nlohmann::json::array(), low = nlohmann::json::array(),
                 phase = nlohmann::json::array(), bytes = nlohmann::json::array();
  for (const TimelineBucket& b : buckets) {
    first.push_back(b.first);
    last.push_back(b.last);
    topi.push_back(b.top);
    low.push_back(samples[b.low].total());
    phase.push_back(samples[b.top].phase.str());
    nlohmann::json row = nlohmann::json::array();
    for (Category c : cats)
      row.push_back(samples[b.top].live[static_cast<int>(c)]);
    bytes.push_back(row);
  }
  j["first"] = first;
  j["last"] = last;
  j["top"] = topi;
  j["low"] = low;
  j["phase"] = phase;
  j["bytes"] = bytes;
  std::string data = j.dump();
  // Inside <script>, "</" could end the element early.
  for (size_t p = 0; (p = data.find("</", p)) != std::string::npos; p += 3)
    data.replace(p, 2, "<\\/");

  int64_t num_steps = steps.empty() ? 0 : steps.back().second;
  std::string summary = std::to_string(n) + " phases, " + std::to_string(num_steps) +
                        " optimizer steps; peak " + format_bytes(peak);
  if (options.memory_limit) summary += " of memory_limit " + format_bytes(options.memory_limit);
  if (buckets.size() < n)
    summary +=
        "; drawn as " + std::to_string(buckets.size()) + " points, each the highest of its phases";
  if (options.oom)
    summary += "; stopped: out of memory requesting " + format_bytes(options.oom->requested) +
               " of " + category_name(options.oom->category) + " in " + options.oom->phase.str();

  std::string html;
  html.reserve(svg.size() + data.size() + 8192);
  html +=
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
      "<title>headroom memory timeline" +
      (options.title.empty() ? "" : " \xe2\x80\x94 " + html_escape(options.title)) +
      "</title>\n<style>\n"
      "body { font-family: sans-serif; margin: 16px 24px; color: #222; background: #fff; }\n"
      "h1 { font-size: 20px; margin: 0 0 4px; }\n"
      ".summary { font-size: 14px; color: #555; margin: 0 0 6px; }\n"
      "svg { width: 100%; max-width: 1200px; height: auto; display: block; }\n"
      "svg text { font-family: sans-serif; font-size: 13px; fill: #333; }\n"
      ".grid { stroke: #e4e4e4; stroke-width: 1; }\n"
      ".tick { stroke: #999; }\n"
      ".axis-title { font-size: 13px; fill: #555; }\n"
      ".frame { fill: none; stroke: #999; }\n"
      "#bucket-low, .low-swatch { fill: none; stroke: #222; stroke-width: 1.3; "
      "stroke-dasharray: 5 3; }\n"
      ".series { stroke: none; }\n"
      ".step-line { stroke: #000; stroke-opacity: 0.12; }\n"
      ".step-line.labelled { stroke-opacity: 0.35; }\n"
      ".step-label { font-size: 11px; fill: #666; }\n"
      "#limit-line { stroke: #d62728; stroke-width: 2; stroke-dasharray: 8 5; }\n"
      "#limit-label { fill: #d62728; font-weight: bold; }\n"
      "#peak-line { stroke: #222; stroke-width: 1.2; stroke-dasharray: 2 3; }\n"
      "#peak-marker { fill: #222; }\n"
      "#peak-label, #limit-label, #oom-marker text { paint-order: stroke; stroke: #fff; "
      "stroke-width: 4px; stroke-linejoin: round; }\n"
      "#oom-marker text { fill: #d62728; font-weight: bold; }\n"
      "#cursor { stroke: #000; stroke-width: 1; pointer-events: none; }\n"
      "#status { font-size: 14px; min-height: 44px; max-width: 1184px; padding: 6px 8px; "
      "border: 1px solid #ddd; border-radius: 4px; background: #fafafa; margin-bottom: 4px; }\n"
      "#status .bytes { margin-top: 4px; display: flex; flex-wrap: wrap; gap: 4px 16px; }\n"
      ".swatch { display: inline-block; width: 11px; height: 11px; margin-right: 5px; "
      "vertical-align: -1px; }\n"
      ".status-total { font-weight: bold; }\n"
      "</style>\n</head>\n<body>\n<div id=\"headroom-timeline\" data-rendered=\"0\">\n"
      "<h1>headroom memory timeline" +
      (options.title.empty() ? "" : ": " + html_escape(options.title)) +
      "</h1>\n<p class=\"summary\">" + html_escape(summary) + "</p>\n" +
      // Above the chart: it stays in view while the pointer moves over it.
      "<div id=\"status\">Point at the chart to see the phase and its bytes by category.</div>\n" +
      svg + "</div>\n<script type=\"application/json\" id=\"timeline-data\">" + data +
      "</script>\n<script>" + kScript + "</script>\n</body>\n</html>\n";
  return html;
}

void write_timeline_html(const std::string& path, const std::vector<TimelineSample>& samples,
                         const TimelineHtmlOptions& options) {
  AtomicFile out(path, "--memory-timeline");
  out.write(render_timeline_html(samples, options));
  out.commit();
}

}  // namespace headroom
