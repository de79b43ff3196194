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

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/os/output_file.h"
#include "core/report/alloc_trace.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// The default config, one object for the whole file (a temporary default_config() in each call
// trips GCC 12's -Wmaybe-uninitialized on its many strings).
const Config& default_config() {
  static const Config c;
  return c;
}

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
  }  // the destructor writes the E line when close() was not called
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
      {kHeader + a + "A 1 1 10 data 0\n", "t.trace:3: allocation id 1 out of order: expected 2"},
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

// Numbers no run can have written are refused at the line that holds them, not replayed.
TEST(AllocTrace, AbsurdNumbersAreRangeErrorsNamingTheLine) {
  struct Case {
    std::string text, want;
  };
  const std::string end = "E 1 1 0\n";
  const Case cases[] = {
      {kHeader + "A 0 1 18446744073709551615 data 0\n" + end,
       "t.trace:2: an allocation of 18446744073709551615 bytes is out of range: no device holds "
       "more than 281474976710656 bytes (256 TiB)"},
      {kHeader + "A 0 1 281474976710657 data 0\n" + end, "t.trace:2: an allocation of"},
      {kHeader + "A 0 1 18446744073709551616 data 0\n" + end, "t.trace:2: bad record"},
      {kHeader + "A 0 18446744073709551616 10 data 0\n" + end, "t.trace:2: bad record"},
      {kHeader + "A 18446744073709551616 1 10 data 0\n" + end, "t.trace:2: bad record"},
      {kHeader + "A 0 18446744073709551615 10 data 0\n" + end,
       "t.trace:2: allocation id 18446744073709551615 out of order: expected 1"},
      {kHeader + "A 0 1 10 data 4294967296\n" + end,
       "t.trace:2: stream 4294967296 is out of range"},
      {kHeader + "A 0 1 -10 data 0\n" + end, "t.trace:2: bad record"},
      {"headroom-alloc-trace 1 memory_limit=18446744073709551615\n" + end,
       "t.trace:1: memory_limit 18446744073709551615 is out of range"},
      {"headroom-alloc-trace 1 memory_limit=1 memory_limit=2\n" + end,
       "t.trace:1: header field 'memory_limit' appears twice"},
      {"headroom-alloc-trace 1 device=\n" + end, "t.trace:1: header field device= is empty"},
  };
  for (const Case& c : cases) {
    const std::string got = parse_error(c.text);
    EXPECT_TRUE(test::contains(got, c.want)) << "trace:\n" << c.text << "\nerror: " << got;
  }
  // The largest a device could hold, and nothing at all, are requests a replay can make.
  EXPECT_EQ(parse_error(kHeader + "A 0 1 281474976710656 data 0\n" + end), "");
  EXPECT_EQ(parse_error(kHeader + "A 0 1 0 data 0\nF 1 1 0 data 0\nE 2 1 1\n"), "");
  // The version is the rest of the line, even where another field holds "version=".
  std::istringstream in(
      "headroom-alloc-trace 1 device=aversion=b version=headroom 1 (x)\nE 0 0 0\n");
  const AllocTrace t = parse_alloc_trace(in, "t.trace");
  EXPECT_EQ(t.device, "aversion=b");
  EXPECT_EQ(t.version, "headroom 1 (x)");
}

// A request larger than the memory a replay has fails as out of memory, whatever the allocator
// would answer; one that no memory limit bounds goes to the device, which refuses it.
TEST(AllocTrace, ReplayFailsARequestLargerThanTheMemory) {
  std::istringstream in(kHeader + "A 0 1 100 activations 0\nA 1 2 8192 workspace 0\nE 2 2 0\n");
  const AllocTrace t = parse_alloc_trace(in, "t.trace");
  for (uint64_t limit : {uint64_t(0), uint64_t(4096), uint64_t(8191)}) {
    Config c;
    c.device.memory_limit = limit;  // 0: the trace's 4096
    const ReplayResult r = replay_alloc_trace(t, c, ReplayOptions{false, 0});
    EXPECT_TRUE(r.failed) << limit;
    EXPECT_EQ(r.allocations, 1u);
    EXPECT_EQ(r.failure.seq, 1u);
    EXPECT_EQ(r.failure.requested, 8192u);
  }
  std::istringstream huge(
      "headroom-alloc-trace 1 memory_limit=0\nA 0 1 281474976710656 data 0\nE 1 1 0\n");
  const ReplayResult r = replay_alloc_trace(parse_alloc_trace(huge, "t.trace"), default_config(),
                                            ReplayOptions{false, 0});
  EXPECT_TRUE(r.failed) << "256 TiB of host memory were handed out";
  EXPECT_EQ(r.allocations, 0u);
}

TEST(AllocTrace, ReplayOfAFolderOrAHugeAllocationSaysWhatIsWrong) {
  const std::string dir = test::temp_dir();
  const test::RunResult folder = test::run_headroom("replay " + dir);
  EXPECT_EQ(folder.exit_code, 2) << folder.output;
  EXPECT_TRUE(test::contains(folder.output, dir + ": is a folder, not an allocation trace file"))
      << folder.output;
  EXPECT_FALSE(test::contains(folder.output, "empty")) << folder.output;
  const std::string path =
      test::write_file(dir, "huge.trace", kHeader + "A 0 1 18446744073709551615 data 0\nE 1 1 0\n");
  const test::RunResult huge = test::run_headroom("replay " + path);
  EXPECT_EQ(huge.exit_code, 2) << huge.output;
  EXPECT_TRUE(test::contains(huge.output, path + ":2: an allocation of 18446744073709551615 bytes "
                                                 "is out of range"))
      << huge.output;
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

TEST(AllocTrace, CloseWritesTheEndLineAndLaterRecordsAreDropped) {
  const std::string path = test::temp_dir() + "/closed.trace";
  DeviceConfig dc;
  auto device = Device::create(dc);
  AllocTraceRecorder recorder(path, *device, 0);
  device->add_observer(&recorder);
  Buffer a(*device, 100, Category::kActivations, "a");
  recorder.comment("two\nlines");
  recorder.flush();
  recorder.close();
  recorder.close();  // a second close does nothing
  a.reset();         // after close: not recorded
  Buffer b(*device, 10, Category::kWorkspace, "b");
  recorder.flush();  // nothing to do
  device->remove_observer(&recorder);
  const std::string text = test::read_file(path);
  EXPECT_TRUE(test::contains(text, "A 0 1 100 activations 0\n# two\n# lines\nE 1 1 0\n")) << text;
  EXPECT_EQ(recorder.records(), 1u);
  EXPECT_EQ(read_alloc_trace(path).records.size(), 1u);
}

// A full disk (/dev/full: ENOSPC, for root too) is an OutputError naming --record-allocs PATH and
// the OS's reason, from flush() and close(); the allocations and frees that hit it do not throw.
TEST(AllocTrace, WriteFailuresAreOutputErrorsFromFlushAndClose) {
  DeviceConfig dc;
  auto device = Device::create(dc);
  const std::string want = "--record-allocs /dev/full: write failed: No space left on device";
  {
    AllocTraceRecorder recorder("/dev/full", *device, 0);
    device->add_observer(&recorder);
    // Enough records to fill the write buffer, so that a free's write is the one that fails.
    for (int i = 0; i < 5000; ++i)
      EXPECT_NO_THROW({ Buffer x(*device, 64, Category::kWorkspace, "x"); });
    try {
      recorder.flush();
      ADD_FAILURE() << "flush() reported nothing";
    } catch (const OutputError& e) {
      EXPECT_EQ(std::string(e.what()), want);
    }
    try {
      recorder.close();
      ADD_FAILURE() << "close() reported nothing";
    } catch (const OutputError& e) {
      EXPECT_EQ(std::string(e.what()), want);
    }
    device->remove_observer(&recorder);
  }
  {
    // A failure only close() sees; the destructor of an unclosed one stays silent.
    AllocTraceRecorder recorder("/dev/full", *device, 0);
    try {
      recorder.close();
      ADD_FAILURE() << "close() reported nothing";
    } catch (const OutputError& e) {
      EXPECT_EQ(std::string(e.what()), want);
    }
    AllocTraceRecorder unclosed("/dev/full", *device, 0);
  }
  // A path in a folder that does not exist: a ConfigError before anything is written.
  const std::string missing = test::temp_dir() + "/no/such/x.trace";
  const std::string e = test::error_of([&] { AllocTraceRecorder r(missing, *device, 0); });
  EXPECT_TRUE(test::starts_with(e, "--record-allocs " + missing + ": its folder")) << e;
}

TEST(AllocTrace, TrainingWithATraceOnAFullDiskExits4) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(
      dir, "run.toml",
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 8\nvocab_size = 32\n"
      "[train]\nsteps = 2\nmicro_batch = 2\n");
  const test::RunResult r = test::run_headroom("train " + cfg + " -q --record-allocs /dev/full");
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_TRUE(test::contains(r.output, "--record-allocs /dev/full: write failed: No space left"))
      << r.output;
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
  // The trace ends where run() closes it: the activations are freed by then, the parameters and
  // optimizer state are still live (no F record).
  EXPECT_GT(trace.num_frees(), 0u);
  EXPECT_LT(trace.num_frees(), allocs);
  bool saw_phase = false;
  for (const std::string& p : trace.phases)
    saw_phase |= p == "backward of layer 2 (block 1), step 3, micro-step 2";
  EXPECT_TRUE(saw_phase);

  // Under the trace's own limit the arena places every block as the run did: nothing fails.
  const ReplayResult r = replay_alloc_trace(trace, default_config());
  std::printf("%s", r.str().c_str());
  EXPECT_FALSE(r.failed);
  EXPECT_EQ(r.peak_live, peak);
  EXPECT_EQ(r.allocations, allocs);
  EXPECT_EQ(r.frees, trace.num_frees());
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
  const ReplayResult r = replay_alloc_trace(trace, default_config(), ReplayOptions{false, 0});
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
