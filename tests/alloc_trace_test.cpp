// Allocation traces: the recorder's format, reading (and refusing) trace files, replay against the
// default allocator and an allocator plugin, and the committed variable-sequence-length trace
// that fragments the CPU arena.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdio>
#include <functional>
#include <set>
#include <sstream>
#include <string>

#include "core/alloc_trace.h"
#include "core/config.h"
#include "core/device.h"
#include "core/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

const std::string kSource = HEADROOM_SOURCE_DIR;
const std::string kVarlenTrace = kSource + "/tests/data/varlen.trace";
const std::string kVarlenDefrag = kSource + "/tests/data/varlen-defrag.toml";

// The ConfigError message parsing `text` as the trace "t.trace" gives; "" when it parses.
std::string parse_error(const std::string& text) {
  std::istringstream in(text);
  try {
    parse_alloc_trace(in, "t.trace");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const std::string kHeader =
    "headroom-alloc-trace 1 memory_limit=4096 device=cpu version=headroom 0\n";

// ---------------------------------------------------------------------------------------------
// The format

TEST(AllocTrace, RecorderWritesTheDocumentedFormat) {
  const std::string path = test::temp_dir() + "/small.trace";
  DeviceConfig dc;
  auto device = Device::create(dc);
  {
    AllocTraceRecorder recorder(path, *device, 12345);
    device->add_observer(&recorder);
    Phase p;
    p.kind = Phase::Kind::kForward;
    p.layer = 1;
    p.layer_name = "block 0";
    p.step = 2;
    p.micro_step = 1;
    device->tracker().set_phase(p);
    Buffer a(*device, 100, Category::kActivations, "a");
    { Buffer b(*device, 50, Category::kWorkspace, "b"); }
    p.kind = Phase::Kind::kBackward;
    device->tracker().set_phase(p);
    a.reset();
    device->remove_observer(&recorder);
  }
  EXPECT_EQ(test::read_file(path),
            "headroom-alloc-trace 1 memory_limit=12345 device=cpu version=headroom " +
                std::string(headroom_version()) +
                "\n"
                "P forward of layer 1 (block 0), step 2, micro-step 1\n"
                "A 0 1 100 activations 0\n"
                "A 1 2 50 workspace 0\n"
                "F 2 2 50 workspace 0\n"
                "P backward of layer 1 (block 0), step 2, micro-step 1\n"
                "F 3 1 100 activations 0\n"
                "E 4 2 2\n");

  const AllocTrace t = read_alloc_trace(path);
  EXPECT_EQ(t.memory_limit, 12345u);
  EXPECT_EQ(t.device, "cpu");
  EXPECT_EQ(t.version, "headroom " + std::string(headroom_version()));
  ASSERT_EQ(t.records.size(), 4u);
  EXPECT_EQ(t.num_allocs(), 2u);
  EXPECT_EQ(t.records[1].bytes, 50u);
  EXPECT_EQ(t.records[1].category, Category::kWorkspace);
  EXPECT_EQ(t.records[3].op, TraceRecord::Op::kFree);
  EXPECT_EQ(t.records[3].id, 1u);
  EXPECT_EQ(t.phases[t.records[3].phase], "backward of layer 1 (block 0), step 2, micro-step 1");
}

TEST(AllocTrace, MalformedFilesAreConfigErrorsNamingFileAndLine) {
  const std::string a = "A 0 1 100 activations 0\n";
  EXPECT_TRUE(parse_error(kHeader + a + "F 1 1 100 activations 0\nE 2 1 1\n").empty());

  struct Case {
    std::string text, want;
  };
  const Case cases[] = {
      {"", "t.trace:1: empty file"},
      {"hello\n", "t.trace:1: not an allocation trace"},
      {"headroom-alloc-trace 9 memory_limit=0\n", "t.trace:1: trace format '9'"},
      {"headroom-alloc-trace 1 memory_limit=lots\n", "t.trace:1: memory_limit 'lots'"},
      {kHeader + a + "X 1 2\n", "t.trace:3: unknown record type 'X'"},
      {kHeader + "A 0 1 ten activations 0\n", "t.trace:2: bad record 'A 0 1 ten activations 0'"},
      {kHeader + "A 0 1 10 weights 0\n", "t.trace:2: unknown category 'weights'"},
      {kHeader + "A 3 1 10 data 0\n", "t.trace:2: seq 3 out of order: expected 0"},
      {kHeader + a + "A 1 1 10 data 0\n", "t.trace:3: allocation id 1 is already live"},
      {kHeader + a + "F 1 7 100 activations 0\n", "t.trace:3: free of id 7, which is not live"},
      {kHeader + a + "F 1 1 64 activations 0\n",
       "t.trace:3: free of id 1 as 64 bytes of activations; it was allocated as 100 bytes"},
      {kHeader + a + "E 5 1 0\n", "t.trace:3: the end line counts 5 records"},
      {kHeader + a + "E 1 1 0\nA 1 2 10 data 0\n", "t.trace:4: a record after the end line"},
      // Truncated: cut at a line boundary (no E line), and in the middle of a line.
      {kHeader + a, "t.trace:2: truncated: no end line (E)"},
      {kHeader + a + "F 1 1 10", "t.trace:3: truncated: the last line has no newline"},
  };
  for (const Case& c : cases) {
    const std::string got = parse_error(c.text);
    EXPECT_TRUE(test::contains(got, c.want)) << "trace:\n" << c.text << "\nerror: " << got;
  }
}

TEST(AllocTrace, ReplayOfAMalformedFileExitsWithCode2NamingTheLine) {
  const std::string dir = test::temp_dir();
  const std::string path = test::write_file(
      dir, "bad.trace", kHeader + "A 0 1 100 activations 0\nF 1 9 100 activations 0\nE 2 1 1\n");
  const test::RunResult r = test::run_headroom("replay " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, path + ":3: free of id 9, which is not live")) << r.output;
  const test::RunResult missing = test::run_headroom("replay " + dir + "/none.trace");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
}

// ---------------------------------------------------------------------------------------------
// Record and replay

const char* kTinyRun =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 32\n"
    "[train]\nsteps = 3\nmicro_batch = 2\ngrad_accum = 2\n"
    "[device]\nmemory_limit = \"8MiB\"\n";

TEST(AllocTrace, RecordThenReplayReproducesTheTrackersPeakExactly) {
  const std::string path = test::temp_dir() + "/run.trace";
  const Config c = test::config_from(kTinyRun);
  uint64_t peak = 0, allocs = 0;
  {
    TrainOptions o;
    o.record_allocs_path = path;
    Trainer trainer(c, std::move(o));
    trainer.run();
    peak = trainer.device().tracker().peak_total();
    allocs = trainer.device().tracker().num_allocs();
  }
  const AllocTrace trace = read_alloc_trace(path);
  EXPECT_EQ(trace.memory_limit, c.device.memory_limit);
  EXPECT_EQ(trace.num_allocs(), allocs);
  // The trainer frees everything when it goes, so the trace ends with nothing live.
  EXPECT_EQ(trace.num_frees(), allocs);
  bool saw_phase = false;
  for (const std::string& p : trace.phases)
    saw_phase |= p == "backward of layer 2 (block 1), step 3, micro-step 2";
  EXPECT_TRUE(saw_phase);

  // Under the trace's own limit the arena places every block as the run did: nothing fails.
  const ReplayResult r = replay_alloc_trace(trace, Config{});
  std::printf("%s", r.str().c_str());
  EXPECT_FALSE(r.failed);
  EXPECT_EQ(r.peak_live, peak);
  EXPECT_EQ(r.allocations, allocs);
  EXPECT_EQ(r.frees, allocs);
  EXPECT_EQ(r.memory_limit, c.device.memory_limit);
  EXPECT_GE(r.peak_reserved, r.peak_live);
  EXPECT_GT(r.allocs_per_s, 0.0);

  // A limit below the peak cannot hold it: the replay stops at its first failure.
  Config small;
  small.device.memory_limit = peak / 2;
  const ReplayResult f = replay_alloc_trace(trace, small, ReplayOptions{false, 0});
  EXPECT_TRUE(f.failed);
  EXPECT_LT(f.allocations, allocs);
  EXPECT_EQ(f.failure.seq, trace.records[f.failure.seq].seq);
  EXPECT_EQ(trace.records[f.failure.seq].op, TraceRecord::Op::kAlloc);
}

TEST(AllocTrace, TrainRecordAllocsFlagAndReplayCommand) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(dir, "run.toml", kTinyRun);
  const test::RunResult t =
      test::run_headroom("train " + cfg + " -q --record-allocs " + dir + "/run.trace");
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const test::RunResult r = test::run_headroom("replay " + dir + "/run.trace");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* part : {"allocator              default", "memory_limit           8.00 MiB",
                           "peak live", "peak reserved", "fragmentation", "allocations/s"})
    EXPECT_TRUE(test::contains(r.output, part)) << part << "\n" << r.output;
  const test::RunResult small =
      test::run_headroom("replay " + dir + "/run.trace --memory-limit 64KiB");
  EXPECT_EQ(small.exit_code, 3) << small.output;
  EXPECT_TRUE(test::contains(small.output, "FAILED at seq")) << small.output;
  const test::RunResult bad =
      test::run_headroom("replay " + dir + "/run.trace --set train.steps=2");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
}

// ---------------------------------------------------------------------------------------------
// The committed trace: a run whose sequence length changes every step (bench/record_trace.cpp).
// Under its memory_limit, first-fit placement without a cache (the CPU arena, as cudaMalloc)
// fails with enough bytes free in pieces; defrag_allocator with expandable segments completes.

TEST(VarlenTrace, IsSmallAndWellFormed) {
  struct stat st {};
  ASSERT_EQ(stat(kVarlenTrace.c_str(), &st), 0) << kVarlenTrace;
  EXPECT_LT(st.st_size, 1000000);
  const AllocTrace trace = read_alloc_trace(kVarlenTrace);
  EXPECT_GT(trace.memory_limit, 0u);
  EXPECT_EQ(trace.num_allocs(), trace.num_frees());
  // Every sequence length of the recording shows in the sizes of the (T, T) attention buffers.
  std::set<uint64_t> att;
  for (const TraceRecord& r : trace.records)
    if (r.op == TraceRecord::Op::kAlloc && r.category == Category::kActivations)
      att.insert(r.bytes);
  for (uint64_t T : {64, 128, 256, 512, 640, 1024})
    EXPECT_TRUE(att.count(8 * T * T * 4)) << "no (B, NH, T, T) buffer for T = " << T;
}

TEST(VarlenTrace, DefaultAllocatorFailsWithEnoughBytesFreeInPieces) {
  const AllocTrace trace = read_alloc_trace(kVarlenTrace);
  const ReplayResult r = replay_alloc_trace(trace, Config{}, ReplayOptions{false, 0});
  std::printf("default allocator under %s:\n%s", format_bytes(trace.memory_limit).c_str(),
              r.str().c_str());
  ASSERT_TRUE(r.failed) << "the default allocator completed the trace (is the CPU arena there?)";
  const ReplayFailure& f = r.failure;
  std::printf(
      "fragmentation: %.4f at the peak; at the failure %.1f%% of the free bytes lie "
      "outside the largest free block\n",
      r.fragmentation, 100.0 * (1.0 - double(f.largest_free) / double(f.free)));
  EXPECT_GT(r.fragmentation, 0.0);
  EXPECT_LE(f.requested, f.free) << "not enough bytes free: that is not fragmentation";
  EXPECT_LT(f.largest_free, f.requested);
  EXPECT_LT(f.live + f.requested, trace.memory_limit);
  EXPECT_LT(r.allocations, trace.num_allocs());
}

TEST(VarlenTrace, DefragAllocatorWithExpandableSegmentsCompletes) {
  const AllocTrace trace = read_alloc_trace(kVarlenTrace);
  const Config defrag = load_config(kVarlenDefrag);
  const ReplayResult r = replay_alloc_trace(trace, defrag, ReplayOptions{false, 0});
  std::printf("defrag_allocator under %s:\n%s", format_bytes(trace.memory_limit).c_str(),
              r.str().c_str());
  EXPECT_FALSE(r.failed);
  EXPECT_EQ(r.allocator, "defrag_allocator");
  EXPECT_EQ(r.allocations, trace.num_allocs());
  EXPECT_GE(r.peak_reserved, r.peak_live);
  EXPECT_LE(r.peak_reserved, trace.memory_limit);
  EXPECT_GE(r.fragmentation, 0.0);
  EXPECT_LT(r.fragmentation, 1.0);

  // The trace's own peak, whatever the allocator: what a replay without a wall measures.
  Config unlimited;
  unlimited.device.memory_limit = uint64_t(1) << 40;
  EXPECT_EQ(replay_alloc_trace(trace, unlimited, ReplayOptions{false, 0}).peak_live, r.peak_live);
}

TEST(VarlenTrace, ReplayCommandExitCodes) {
  const test::RunResult plain = test::run_headroom("replay " + kVarlenTrace);
  EXPECT_EQ(plain.exit_code, 3) << plain.output;
  EXPECT_TRUE(test::contains(plain.output, "enough bytes were free, but in pieces"))
      << plain.output;
  const test::RunResult defrag =
      test::run_headroom("replay " + kVarlenTrace + " --config " + kVarlenDefrag);
  EXPECT_EQ(defrag.exit_code, 0) << defrag.output;
  EXPECT_TRUE(test::contains(defrag.output, "allocator              defrag_allocator"))
      << defrag.output;
}

}  // namespace
}  // namespace headroom
