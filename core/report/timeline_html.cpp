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
    Category::kParameters, Category::kGradients,     Category::kOptimizer, Category::kPlugin,
    Category::kData,       Category::kCommunication, Category::kWorkspace, Category::kActivations,
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
    case Category::kPlugin:
      return "#b07aa1";
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
  // The overview: zoom and pan change the nested plot's viewBox (x in steps); the ticks follow.
  var O = D.overview;
  if (O && O.step.length) {
    var plot = document.getElementById('overview-plot');
    var osvg = document.getElementById('overview-chart');
    var ox = document.getElementById('overview-x');
    var ocur = document.getElementById('overview-cursor');
    var ostatus = document.getElementById('overview-status');
    var ohit = document.getElementById('overview-hit');
    var S = O.step.length, view = [0, S], NS = osvg.namespaceURI;
    function pageX(col) { return O.x0 + (O.x1 - O.x0) * (col - view[0]) / (view[1] - view[0]); }
    function colAt(evt) {
      var pt = osvg.createSVGPoint();
      pt.x = evt.clientX;
      pt.y = evt.clientY;
      var p = pt.matrixTransform(osvg.getScreenCTM().inverse());
      return view[0] + (p.x - O.x0) / (O.x1 - O.x0) * (view[1] - view[0]);
    }
    function niceStep(range) {
      var raw = range / 10, p = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-9))));
      var ms = [1, 2, 5, 10];
      for (var k = 0; k < ms.length; ++k) if (ms[k] * p >= raw) return Math.max(1, ms[k] * p);
      return Math.max(1, 10 * p);
    }
    function ticks() {
      while (ox.firstChild) ox.removeChild(ox.firstChild);
      var a = Math.max(0, Math.floor(view[0])), b = Math.min(S - 1, Math.ceil(view[1]) - 1);
      var st = niceStep(O.step[b] - O.step[a] + 1);
      for (var i = a; i <= b; ++i) {
        if (O.step[i] % st !== 0) continue;
        var x = pageX(i + 0.5);
        if (x < O.x0 || x > O.x1) continue;
        var t = document.createElementNS(NS, 'line');
        t.setAttribute('class', 'tick');
        t.setAttribute('x1', x); t.setAttribute('x2', x);
        t.setAttribute('y1', O.h + 46); t.setAttribute('y2', O.h + 51);
        ox.appendChild(t);
        var l = document.createElementNS(NS, 'text');
        l.setAttribute('x', x); l.setAttribute('y', O.h + 65);
        l.setAttribute('text-anchor', 'middle');
        l.textContent = 'step ' + O.step[i];
        ox.appendChild(l);
      }
    }
    function apply() {
      plot.setAttribute('viewBox', view[0] + ' 0 ' + (view[1] - view[0]) + ' ' + O.h);
      ticks();
      root.setAttribute('data-overview-view', view[0].toFixed(2) + ' ' + view[1].toFixed(2));
    }
    function zoom(f, at) {
      var w = Math.min(S, Math.max(Math.min(S, 4), (view[1] - view[0]) * f));
      var a = at - (at - view[0]) * w / (view[1] - view[0]);
      a = Math.max(0, Math.min(S - w, a));
      view = [a, a + w];
      apply();
    }
    function showStep(i) {
      var x = pageX(i + 0.5);
      ocur.setAttribute('x1', x); ocur.setAttribute('x2', x);
      ocur.setAttribute('visibility', 'visible');
      var parts = ['step ' + O.step[i] + ': highest ' + fmt(O.top[i]) + ' (' + O.phase[i] +
                   '), lowest ' + fmt(O.low[i])];
      for (var c = D.cats.length - 1; c >= 0; --c)
        if (O.peak[i][c] > 0)
          parts.push(D.cats[c] + ' ' + fmt(O.least[i][c]) + '\u2013' + fmt(O.peak[i][c]));
      ostatus.textContent = parts.join('; ');
    }
    var drag = null;
    ohit.addEventListener('wheel', function (evt) {
      evt.preventDefault();
      zoom(evt.deltaY < 0 ? 0.8 : 1.25, colAt(evt));
    }, {passive: false});
    ohit.addEventListener('mousedown', function (evt) { drag = {x: colAt(evt), view: view.slice()}; });
    window.addEventListener('mouseup', function () { drag = null; });
    ohit.addEventListener('mousemove', function (evt) {
      var col = colAt(evt);
      if (drag) {
        var w = drag.view[1] - drag.view[0];
        var a = Math.max(0, Math.min(S - w, drag.view[0] - (col - drag.x)));
        view = [a, a + w];
        apply();
        return;
      }
      showStep(Math.max(0, Math.min(S - 1, Math.floor(col))));
    });
    ohit.addEventListener('click', function (evt) {
      showStep(Math.max(0, Math.min(S - 1, Math.floor(colAt(evt)))));
    });
    document.getElementById('zoom-in').addEventListener('click', function () {
      zoom(0.5, (view[0] + view[1]) / 2);
    });
    document.getElementById('zoom-out').addEventListener('click', function () {
      zoom(2, (view[0] + view[1]) / 2);
    });
    document.getElementById('zoom-reset').addEventListener('click', function () {
      view = [0, S];
      apply();
    });
    // A link can open the overview zoomed: FILE.html#view=A,B shows columns A to B.
    var m = /view=([0-9.]+),([0-9.]+)/.exec(window.location.hash);
    if (m && +m[2] > +m[1]) view = [Math.max(0, +m[1]), Math.min(S, +m[2])];
    apply();
    showStep(O.detail);
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

// The detail chart: every phase of `samples` (one step's), a stacked area by category on a
// phase axis, the peak, the limit and an out-of-memory request marked; `ymax` shared with the
// overview so the two read on one scale. Fills the pointer readout's data into `j`.
static std::string detail_svg(const std::vector<TimelineSample>& samples,
                              const TimelineHtmlOptions& options, const std::vector<Category>& cats,
                              double ymax, nlohmann::json& j) {
  const size_t n = samples.size();
  const std::vector<TimelineBucket> buckets = downsample_timeline(samples, options.max_points);

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
  auto X = [&](double phase_index) {
    return kX0 + (kX1 - kX0) * (n ? phase_index / double(n) : 0.0);
  };
  auto Y = [&](double bytes) { return kY1 - (kY1 - kY0) * bytes / ymax; };

  std::string svg;
  svg.reserve(64 * 1024 + buckets.size() * cats.size() * 32);
  // Inline SVG in HTML needs no xmlns: the file names no URL at all.
  svg += "<svg id=\"detail-chart\" viewBox=\"0 0 " + num(kWidth) + " " + num(kHeight) +
         "\" role=\"img\" aria-label=\"live memory by category over one step\">\n";
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
         "\" text-anchor=\"middle\">phase of the step (data, each layer's forward and backward, "
         "optimizer); micro-steps marked above</text></g>\n";

  // The micro-steps of the step, and its optimizer update, marked and labelled.
  svg += "<g id=\"steps\">";
  for (size_t i = 0; i < n; ++i) {
    const Phase& ph = samples[i].phase;
    const bool micro =
        ph.micro_step > 0 && (i == 0 || samples[i - 1].phase.micro_step != ph.micro_step);
    const bool opt = ph.kind == Phase::Kind::kOptimizer &&
                     (i == 0 || samples[i - 1].phase.kind != Phase::Kind::kOptimizer);
    if (!micro && !opt) continue;
    const std::string label =
        opt ? "optimizer"
            : "step " + std::to_string(ph.step) + ", micro-step " + std::to_string(ph.micro_step);
    svg += "<line class=\"step-line labelled\" x1=\"" + num(X(double(i))) + "\" x2=\"" +
           num(X(double(i))) + "\" y1=\"" + num(kY0 - 4) + "\" y2=\"" + num(kY1) +
           "\"/><text class=\"step-label\" x=\"" + num(X(double(i)) + 3) + "\" y=\"" +
           num(kY0 - 7) + "\">" + html_escape(label) + "</text>";
  }
  svg += "</g>\n";

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
  return svg;
}

namespace {

// The steps of a run: consecutive samples of one phase.step (0: the setup before step 1).
struct StepSpan {
  int64_t step = 0;
  size_t first = 0, last = 0;  // samples [first, last]
  size_t top = 0, low = 0;     // the samples of the highest and the lowest total
  ByCategory peak{}, least{};  // each category's highest and lowest bytes within the step
};

std::vector<StepSpan> step_spans(const std::vector<TimelineSample>& samples) {
  std::vector<StepSpan> spans;
  for (size_t i = 0; i < samples.size(); ++i) {
    const TimelineSample& s = samples[i];
    if (spans.empty() || spans.back().step != s.phase.step) {
      StepSpan sp;
      sp.step = s.phase.step;
      sp.first = sp.last = sp.top = sp.low = i;
      sp.peak = sp.least = s.live;
      spans.push_back(sp);
      continue;
    }
    StepSpan& sp = spans.back();
    sp.last = i;
    if (s.total() > samples[sp.top].total()) sp.top = i;
    if (s.total() < samples[sp.low].total()) sp.low = i;
    for (int c = 0; c < kNumCategories; ++c) {
      sp.peak[size_t(c)] = std::max(sp.peak[size_t(c)], s.live[size_t(c)]);
      sp.least[size_t(c)] = std::min(sp.least[size_t(c)], s.live[size_t(c)]);
    }
  }
  return spans;
}

// The overview's geometry: the plot area in the page's units; inside it a nested <svg> whose
// x unit is one step (column i: [i, i+1)) and whose y unit is the page's, so zooming and panning
// change only its viewBox.
constexpr double kOHeight = 330, kOY0 = 46, kOY1 = 262;

std::string overview_svg(const std::vector<TimelineSample>& samples,
                         const std::vector<StepSpan>& spans, const std::vector<Category>& cats,
                         double ymax, uint64_t memory_limit, size_t detail, nlohmann::json& j) {
  const double S = double(spans.size());
  const double H = kOY1 - kOY0;
  auto Yp = [&](double bytes) { return H - H * bytes / ymax; };  // inside the plot
  auto Y = [&](double bytes) { return kOY0 + Yp(bytes); };       // on the page
  std::string svg;
  svg += "<svg id=\"overview-chart\" viewBox=\"0 0 " + num(kWidth) + " " + num(kOHeight) +
         "\" role=\"img\" aria-label=\"each step's highest and lowest memory, over the run\">\n";
  // Legend.
  {
    double x = kX0;
    svg += "<g id=\"overview-legend\">";
    for (Category c : cats) {
      const std::string name = category_name(c);
      svg += "<g class=\"legend-item legend-" + name + "\"><rect x=\"" + num(x) +
             "\" y=\"12\" width=\"14\" height=\"14\" fill=\"" + colour(c) + "\"/><text x=\"" +
             num(x + 19) + "\" y=\"24\">" + name + "</text></g>";
      x += 19 + 8.0 * double(name.size()) + 22;
    }
    svg += "<g class=\"legend-item legend-low\"><line x1=\"" + num(x) + "\" x2=\"" + num(x + 22) +
           "\" y1=\"19\" y2=\"19\" class=\"low-swatch\"/><text x=\"" + num(x + 27) +
           "\" y=\"24\">the step's lowest total</text></g></g>\n";
  }
  const Unit unit = axis_unit(ymax);
  const double ystep = nice_step(ymax / unit.bytes, 5);
  svg += "<g class=\"axis\">";
  for (double v = 0; v * unit.bytes <= ymax; v += ystep) {
    const double y = Y(v * unit.bytes);
    svg += "<line class=\"grid\" x1=\"" + num(kX0) + "\" x2=\"" + num(kX1) + "\" y1=\"" + num(y) +
           "\" y2=\"" + num(y) + "\"/><text x=\"" + num(kX0 - 6) + "\" y=\"" + num(y + 4) +
           "\" text-anchor=\"end\">" + tick_label(v) + " " + unit.name + "</text>";
  }
  svg += "</g>\n";
  // The plot: per step, the sample of its highest total stacked by category, and its lowest
  // total as a dashed line.
  svg += "<svg id=\"overview-plot\" x=\"" + num(kX0) + "\" y=\"" + num(kOY0) + "\" width=\"" +
         num(kX1 - kX0) + "\" height=\"" + num(H) + "\" viewBox=\"0 0 " + num(S) + " " + num(H) +
         "\" preserveAspectRatio=\"none\">";
  svg += "<rect id=\"overview-selected\" x=\"" + num(double(detail)) +
         "\" y=\"0\" width=\"1\" height=\"" + num(H) + "\"/>";
  std::vector<uint64_t> below(spans.size(), 0);
  for (Category c : cats) {
    const std::string name = category_name(c);
    std::string d;
    for (size_t i = 0; i < spans.size(); ++i) {
      const uint64_t top = below[i] + samples[spans[i].top].live[static_cast<int>(c)];
      d += (i ? "V" : "M0 ") + num(Yp(double(top))) + "H" + std::to_string(i + 1);
    }
    for (size_t i = spans.size(); i-- > 0;)
      d += "V" + num(Yp(double(below[i]))) + "H" + std::to_string(i);
    d += "Z";
    svg += "<path class=\"overview-series overview-" + name + "\" fill=\"" + colour(c) + "\" d=\"" +
           d + "\"/>";
    for (size_t i = 0; i < spans.size(); ++i)
      below[i] += samples[spans[i].top].live[static_cast<int>(c)];
  }
  std::string low;
  for (size_t i = 0; i < spans.size(); ++i)
    low += (i ? "V" : "M0 ") + num(Yp(double(samples[spans[i].low].total()))) + "H" +
           std::to_string(i + 1);
  svg += "<path id=\"overview-min\" vector-effect=\"non-scaling-stroke\" d=\"" + low + "\"/>";
  svg += "</svg>\n";
  svg += "<rect class=\"frame\" x=\"" + num(kX0) + "\" y=\"" + num(kOY0) + "\" width=\"" +
         num(kX1 - kX0) + "\" height=\"" + num(H) + "\"/>\n";
  if (memory_limit) {
    const double y = Y(double(memory_limit));
    svg += "<line id=\"overview-limit\" x1=\"" + num(kX0) + "\" x2=\"" + num(kX1) + "\" y1=\"" +
           num(y) + "\" y2=\"" + num(y) + "\"/>";
  }
  // The x axis in steps: ticks the script redraws for the part in view (these are the whole
  // run's, for a page read without scripts).
  svg += "<g id=\"overview-x\" class=\"axis\">";
  const int64_t s0 = spans.front().step, s1 = spans.back().step;
  const double xstep = std::max(1.0, nice_step(double(s1 - s0 + 1), 10));
  for (size_t i = 0; i < spans.size(); ++i) {
    if (std::fmod(double(spans[i].step), xstep) != 0) continue;
    const double x = kX0 + (kX1 - kX0) * (double(i) + 0.5) / S;
    svg += "<line class=\"tick\" x1=\"" + num(x) + "\" x2=\"" + num(x) + "\" y1=\"" + num(kOY1) +
           "\" y2=\"" + num(kOY1 + 5) + "\"/><text x=\"" + num(x) + "\" y=\"" + num(kOY1 + 19) +
           "\" text-anchor=\"middle\">step " + std::to_string(spans[i].step) + "</text>";
  }
  svg += "</g><text class=\"axis-title\" x=\"" + num((kX0 + kX1) / 2) + "\" y=\"" + num(kOY1 + 44) +
         "\" text-anchor=\"middle\">optimizer step (step 0: setup) \xe2\x80\x94 wheel or "
         "+/\xe2\x88\x92 "
         "to zoom, drag to pan, click a step for its numbers</text>\n";
  svg += "<line id=\"overview-cursor\" x1=\"0\" x2=\"0\" y1=\"" + num(kOY0) + "\" y2=\"" +
         num(kOY1) + "\" visibility=\"hidden\"/>\n";
  svg += "<rect id=\"overview-hit\" x=\"" + num(kX0) + "\" y=\"" + num(kOY0) + "\" width=\"" +
         num(kX1 - kX0) + "\" height=\"" + num(H) + "\" fill=\"transparent\"/>\n";
  svg += "</svg>\n";

  j["x0"] = kX0;
  j["x1"] = kX1;
  j["h"] = H;
  j["detail"] = detail;
  nlohmann::json step = nlohmann::json::array(), top = nlohmann::json::array(),
                 lo = nlohmann::json::array(), peak = nlohmann::json::array(),
                 least = nlohmann::json::array(), phase = nlohmann::json::array();
  for (const StepSpan& sp : spans) {
    step.push_back(sp.step);
    top.push_back(samples[sp.top].total());
    lo.push_back(samples[sp.low].total());
    phase.push_back(samples[sp.top].phase.str());
    nlohmann::json p = nlohmann::json::array(), l = nlohmann::json::array();
    for (Category c : cats) {
      p.push_back(sp.peak[static_cast<size_t>(c)]);
      l.push_back(sp.least[static_cast<size_t>(c)]);
    }
    peak.push_back(p);
    least.push_back(l);
  }
  j["step"] = step;
  j["top"] = top;
  j["low"] = lo;
  j["phase"] = phase;
  j["peak"] = peak;
  j["least"] = least;
  return svg;
}

}  // namespace

std::string render_timeline_html(const std::vector<TimelineSample>& samples,
                                 const TimelineHtmlOptions& options) {
  const size_t n = samples.size();
  // The categories that ever held a byte, in stack order.
  std::vector<Category> cats;
  for (Category c : kStackOrder)
    for (const TimelineSample& s : samples)
      if (s.live[static_cast<int>(c)] > 0) {
        cats.push_back(c);
        break;
      }
  uint64_t peak = 0;
  size_t peak_index = 0;
  for (size_t i = 0; i < n; ++i)
    if (samples[i].total() > peak) {
      peak = samples[i].total();
      peak_index = i;
    }
  const uint64_t oom_top = options.oom && n ? samples.back().total() + options.oom->requested : 0;
  const double ymax =
      std::max({1.0, double(peak), double(options.memory_limit), double(oom_top)}) * 1.08;

  // The step drawn in full: the one asked for, else the failed one (out of memory), else the
  // peak's.
  const std::vector<StepSpan> spans = step_spans(samples);
  size_t detail = 0;
  std::string detail_note;
  for (size_t i = 0; i < spans.size(); ++i)
    if (spans[i].first <= peak_index && peak_index <= spans[i].last) detail = i;
  if (options.oom && !spans.empty()) detail = spans.size() - 1;
  if (options.detail_step > 0) {
    bool found = false;
    for (size_t i = 0; i < spans.size(); ++i)
      if (spans[i].step == options.detail_step) detail = i, found = true;
    if (!found)
      detail_note = " (step " + std::to_string(options.detail_step) + " is not in this run)";
  }
  std::vector<TimelineSample> step_samples;
  if (!spans.empty())
    step_samples.assign(samples.begin() + std::ptrdiff_t(spans[detail].first),
                        samples.begin() + std::ptrdiff_t(spans[detail].last) + 1);
  TimelineHtmlOptions detail_options = options;
  if (detail + 1 != spans.size()) detail_options.oom = nullptr;  // the failure is the last step's

  nlohmann::json j, jo;
  const std::string overview =
      spans.empty() ? std::string()
                    : overview_svg(samples, spans, cats, ymax, options.memory_limit, detail, jo);
  const std::string svg = detail_svg(step_samples, detail_options, cats, ymax, j);
  j["overview"] = jo;
  std::string data = j.dump();
  // Inside <script>, "</" could end the element early.
  for (size_t p = 0; (p = data.find("</", p)) != std::string::npos; p += 3)
    data.replace(p, 2, "<\\/");

  const int64_t num_steps = spans.empty() ? 0 : spans.back().step;
  std::string summary = std::to_string(n) + " phases, " + std::to_string(num_steps) +
                        " optimizer steps; peak " + format_bytes(peak);
  if (n) summary += " at " + samples[peak_index].phase.str();
  if (options.memory_limit) summary += " of memory_limit " + format_bytes(options.memory_limit);
  if (options.oom)
    summary += "; stopped: out of memory requesting " + format_bytes(options.oom->requested) +
               " of " + category_name(options.oom->category) + " in " + options.oom->phase.str();
  const std::string detail_title =
      spans.empty() ? std::string("no phases recorded")
                    : "Step " + std::to_string(spans[detail].step) + " at full detail" +
                          (options.detail_step > 0 && detail_note.empty() ? " (--timeline-step)"
                           : options.oom ? " (the step that ran out of memory)"
                                         : " (the step of the peak)") +
                          detail_note + ": " + std::to_string(step_samples.size()) +
                          " phases; another step: train --timeline-step N";

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
      "h2 { font-size: 16px; margin: 10px 0 4px; }\n"
      "#overview-controls { font-size: 13px; margin: 2px 0; display: flex; gap: 6px; "
      "align-items: center; max-width: 1200px; }\n"
      "#overview-controls button { font-size: 13px; min-width: 28px; }\n"
      "#overview-status { margin-left: 10px; color: #333; }\n"
      "#overview-min { fill: none; stroke: #222; stroke-width: 1.3; stroke-dasharray: 5 3; }\n"
      "#overview-selected { fill: #000; fill-opacity: 0.08; }\n"
      "#overview-limit { stroke: #d62728; stroke-width: 2; stroke-dasharray: 8 5; }\n"
      "#overview-cursor { stroke: #000; stroke-width: 1; pointer-events: none; }\n"
      "#overview-hit { cursor: grab; }\n"
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
      "<h2>All steps</h2>\n<div id=\"overview-controls\"><button id=\"zoom-in\" "
      "type=\"button\">+</button><button id=\"zoom-out\" type=\"button\">\xe2\x88\x92</button>"
      "<button id=\"zoom-reset\" type=\"button\">whole run</button>"
      "<span id=\"overview-status\">Point at a step to see its highest and lowest bytes by "
      "category.</span></div>\n" +
      overview + "<h2 id=\"detail-title\">" + html_escape(detail_title) + "</h2>\n" +
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

std::string host_timeline_path(const std::string& path) {
  const std::string ext = ".html";
  if (path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0)
    return path.substr(0, path.size() - ext.size()) + ".host.html";
  return path + ".host.html";
}

}  // namespace headroom
