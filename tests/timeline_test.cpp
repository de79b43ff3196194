// The memory timeline HTML: downsampling that never loses a peak, a self-contained file with a
// series per category from a real run, the timeline of a run stopped out of memory, and the page
// rendered by headless Chromium (skipped, saying so, where chromium is not installed).
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "core/config/config.h"
#include "core/report/alloc_trace.h"
#include "core/report/timeline_html.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// A short real run: 3 steps of 2 micro-steps, AdamW, under a memory limit.
const char* kRun =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 32\nvocab_size = 64\n"
    "[train]\nsteps = 3\nmicro_batch = 2\ngrad_accum = 2\n"
    "[device]\nmemory_limit = \"16MiB\"\n";

struct RealRun {
  std::string html;
  ByCategory peak{};
  std::string path;
};

// The timeline of kRun, made once for the tests that read it.
const RealRun& real_run() {
  static const RealRun r = [] {
    RealRun out;
    out.path = test::process_temp_dir() + "/timeline.html";
    TrainOptions o;
    o.memory_timeline_path = out.path;
    Trainer trainer(test::config_from(kRun), std::move(o));
    trainer.run();
    out.peak = trainer.device().tracker().peak_by_category();
    out.html = test::read_file(out.path);
    return out;
  }();
  return r;
}

TEST(Timeline, DownsamplingKeepsEveryBucketsHighestSample) {
  std::mt19937 rng(7);
  std::vector<TimelineSample> s(10007);
  for (TimelineSample& x : s)
    x.live[static_cast<int>(Category::kActivations)] = rng() % 1000;
  const size_t spike = 4321;
  s[spike].live[static_cast<int>(Category::kWorkspace)] = 1000000;
  const std::vector<TimelineBucket> b = downsample_timeline(s, 2000);
  ASSERT_LE(b.size(), 2000u);
  ASSERT_GE(b.size(), 1000u);
  size_t next = 0;
  bool spike_drawn = false;
  for (const TimelineBucket& x : b) {
    EXPECT_EQ(x.first, next);  // the buckets tile the samples in order
    ASSERT_LE(x.first, x.last);
    next = x.last + 1;
    for (size_t i = x.first; i <= x.last; ++i) {
      EXPECT_LE(s[i].total(), s[x.top].total());
      EXPECT_GE(s[i].total(), s[x.low].total());
    }
    spike_drawn |= x.top == spike;
  }
  EXPECT_EQ(next, s.size());
  EXPECT_TRUE(spike_drawn);
  // Few samples are drawn one by one.
  const std::vector<TimelineBucket> all = downsample_timeline(std::vector<TimelineSample>(5), 2000);
  ASSERT_EQ(all.size(), 5u);
  EXPECT_EQ(all[3].first, 3u);
  EXPECT_EQ(all[3].last, 3u);
}

TEST(Timeline, HtmlOfARealRunIsSelfContainedWithASeriesPerCategory) {
  const RealRun& r = real_run();
  ASSERT_FALSE(r.html.empty());
  // Nothing fetched: no URL, no external script, style, font or image.
  for (const char* ref : {"http://", "https://", "<link", "src=", "@import", "url(http"})
    EXPECT_FALSE(test::contains(r.html, ref)) << ref;
  for (int i = 0; i < kNumCategories; ++i) {
    const std::string name = category_name(category_at(i));
    EXPECT_EQ(test::contains(r.html, "class=\"series series-" + name + "\""), r.peak[i] > 0)
        << name;
    EXPECT_EQ(test::contains(r.html, "class=\"legend-item legend-" + name + "\""), r.peak[i] > 0)
        << name;
  }
  EXPECT_GT(r.peak[static_cast<int>(Category::kOptimizer)], 0u);  // AdamW state is drawn too
  EXPECT_TRUE(test::contains(r.html, "id=\"limit-line\""));
  EXPECT_TRUE(test::contains(r.html, "memory_limit 16.00 MiB"));
  EXPECT_TRUE(test::contains(r.html, "id=\"peak-line\""));
  EXPECT_TRUE(test::contains(r.html, "class=\"step-label\""));
  for (int i = 0; i < kNumCategories; ++i) {
    const std::string name = category_name(category_at(i));
    EXPECT_EQ(test::contains(r.html, "class=\"overview-series overview-" + name + "\""),
              r.peak[i] > 0)
        << name;
  }
  EXPECT_TRUE(test::contains(r.html, "data-rendered=\"0\""));  // the script sets 1
  // The pointer's readout names every phase as the tracker does.
  EXPECT_TRUE(test::contains(r.html, "backward of layer 2 (block 1), step "));
  EXPECT_FALSE(test::contains(r.html, "id=\"bucket-low\""));  // short runs are drawn point by point
}

TEST(Timeline, ALongRunIsDownsampledWithoutLosingItsPeak) {
  // 1000 steps' worth of phases: about 19 per step, as for a two-block model.
  std::vector<TimelineSample> s;
  for (int64_t step = 1; step <= 1000; ++step)
    for (int k = 0; k < 19; ++k) {
      TimelineSample x;
      x.phase.kind = k < 9 ? Phase::Kind::kForward : Phase::Kind::kBackward;
      x.phase.layer = k % 4;
      x.phase.layer_name = "block";
      x.phase.step = step;
      x.phase.micro_step = 1;
      x.live[static_cast<int>(Category::kParameters)] = 1 << 20;
      x.live[static_cast<int>(Category::kActivations)] = uint64_t(k < 9 ? k : 18 - k) << 20;
      s.push_back(x);
    }
  s[12345].live[static_cast<int>(Category::kActivations)] = uint64_t(100) << 20;
  TimelineHtmlOptions o;
  o.memory_limit = uint64_t(128) << 20;
  const std::string html = render_timeline_html(s, o);
  EXPECT_LT(html.size(), 2000000u);
  // The overview: one column per step (each step's lowest total dashed), x in steps.
  EXPECT_TRUE(test::contains(html, "id=\"overview-min\""));
  EXPECT_TRUE(test::contains(html, "viewBox=\"0 0 1000.0 "));  // 1000 steps in the plot
  EXPECT_TRUE(test::contains(html, ">step 500<"));
  // The peak's step (650: sample 12345 of 19 a step) drawn phase by phase, its peak named.
  EXPECT_TRUE(test::contains(html, "peak 101.00 MiB at backward"));
  EXPECT_TRUE(test::contains(html, "Step 650 at full detail (the step of the peak): 19 phases"));
  EXPECT_FALSE(test::contains(html, "id=\"bucket-low\""));  // one step needs no downsampling
  // Another step, asked for; one not in the run says so.
  o.detail_step = 3;
  EXPECT_TRUE(
      test::contains(render_timeline_html(s, o), "Step 3 at full detail (--timeline-step)"));
  o.detail_step = 5000;
  EXPECT_TRUE(test::contains(render_timeline_html(s, o), "(step 5000 is not in this run)"));
}

TEST(Timeline, WrittenUpToTheFailureWhenTheRunStopsOutOfMemory) {
  const std::string dir = test::temp_dir();
  const std::string cfg =
      test::write_file(dir, "oom.toml",
                       "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 64\n"
                       "vocab_size = 64\n[train]\nsteps = 2\nmicro_batch = 16\n"
                       "[device]\nmemory_limit = \"2MiB\"\n");
  const test::RunResult r = test::run_headroom("train " + cfg + " -q --memory-timeline " + dir +
                                               "/oom.html --record-allocs " + dir + "/oom.trace");
  ASSERT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "memory timeline up to the failure: " + dir + "/oom.html"));
  const std::string html = test::read_file(dir + "/oom.html");
  EXPECT_TRUE(test::contains(html, "id=\"oom-marker\""));
  EXPECT_TRUE(test::contains(html, "out of memory: requested"));
  EXPECT_TRUE(test::contains(html, "class=\"series series-activations\""));
  // The trace of the stopped run is complete (its end line written) and notes the failure.
  const std::string trace = test::read_file(dir + "/oom.trace");
  EXPECT_TRUE(test::contains(trace, "\n# out of memory: ")) << trace.substr(0, 500);
  EXPECT_NO_THROW(read_alloc_trace(dir + "/oom.trace"));
}

TEST(Timeline, UnwritablePathIsAConfigErrorBeforeTheRun) {
  const test::RunResult r =
      test::run_headroom("train " + test::write_file(test::temp_dir(), "c.toml", kRun) +
                         " -q --memory-timeline /nonexistent-dir/t.html");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output,
                             "--memory-timeline /nonexistent-dir/t.html: its folder "
                             "/nonexistent-dir does not exist"))
      << r.output;
  EXPECT_FALSE(test::contains(r.output, "step ")) << "before step 1: " << r.output;
}

// The page as a browser shows it: the script ran, every series is in the rendered DOM, the status
// line names the peak's phase; and a screenshot.
TEST(Timeline, RendersInHeadlessChromium) {
  const std::string chromium =
      test::run_command("command -v chromium || command -v chromium-browser").output;
  if (chromium.empty())
    GTEST_SKIP() << "chromium is not installed (Debian package 'chromium'; scripts/setup installs "
                    "it): the rendering check is skipped";
  const std::string exe = chromium.substr(0, chromium.find('\n'));
  const RealRun& r = real_run();
  const std::string dir = test::temp_dir();
  const std::string flags =
      " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage "
      "--user-data-dir=" +
      dir + "/profile ";
  // The DOM is stdout alone: chromium's stderr is discarded inside the subshell.
  const test::RunResult dump = test::run_command("(timeout 120 " + exe + flags +
                                                 "--dump-dom file://" + r.path + " 2>/dev/null)");
  ASSERT_EQ(dump.exit_code, 0) << "chromium --dump-dom failed";
  const std::string& dom = dump.output;
  EXPECT_TRUE(test::contains(dom, "data-rendered=\"1\"")) << "the page's script did not run";
  for (int i = 0; i < kNumCategories; ++i) {
    const std::string name = category_name(category_at(i));
    EXPECT_EQ(test::contains(dom, "class=\"series series-" + name + "\""), r.peak[i] > 0) << name;
    if (r.peak[i] > 0) {
      EXPECT_TRUE(test::contains(dom, "status-item status-" + name)) << name;
    }
  }
  EXPECT_TRUE(test::contains(dom, "class=\"phase-name\""));
  // The overview's script ran: the whole run in view, its ticks drawn, the peak's step described.
  EXPECT_TRUE(test::contains(dom, "data-overview-view=\"0.00 ")) << "the overview's script";
  EXPECT_TRUE(test::contains(dom, "highest ")) << "the overview's readout";
  EXPECT_TRUE(test::contains(dom, "visibility=\"visible\""));  // the cursor at the peak

  // Zoomed (the page's own zoom, opened through its #view=A,B link): the plot shows those columns.
  const test::RunResult zoomed = test::run_command(
      "(timeout 120 " + exe + flags + "--dump-dom 'file://" + r.path + "#view=1,3' 2>/dev/null)");
  ASSERT_EQ(zoomed.exit_code, 0);
  EXPECT_TRUE(test::contains(zoomed.output, "data-overview-view=\"1.00 3.00\""));
  EXPECT_TRUE(test::contains(zoomed.output, "viewBox=\"1 0 2 ")) << "the plot's viewBox";

  const std::string png = dir + "/timeline.png";
  const test::RunResult shot =
      test::run_command("(timeout 120 " + exe + flags + "--screenshot=" + png +
                        " --window-size=1200,700 file://" + r.path + " >/dev/null 2>&1)");
  ASSERT_EQ(shot.exit_code, 0) << "chromium --screenshot failed";
  const std::string image = test::read_file(png);
  ASSERT_GT(image.size(), 10000u);
  EXPECT_EQ(image.substr(1, 3), "PNG");
  std::printf("screenshot: %s\n", png.c_str());
}

}  // namespace
}  // namespace headroom
