// Fragmentation and its cure. The CPU arena (core/device/arena.h): first-fit placement, 512-byte
// blocks, a request that fails with enough bytes free, coalescing, and vm_map aliasing arena pages
// into a reserved range. The defrag_allocator plugin, loaded by the real plugin host onto a real
// Device: pools, best fit, splitting and coalescing, the release threshold, random alloc/free
// sequences that must never overlap and whose statistics must agree with the tracker, a fragmented
// device where the default allocator fails and expandable segments succeed, and training runs whose
// losses do not change.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/arena.h"
#include "core/device/device.h"
#include "core/events/events.h"
#include "core/plugin_host/plugin_host.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

constexpr uint64_t KiB = uint64_t(1) << 10;
constexpr uint64_t MiB = uint64_t(1) << 20;
constexpr uint64_t kPage = Arena::kPageSize;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// The arena

TEST(Arena, FirstFitTakesTheLowestHoleThatHolds) {
  Arena arena(16 * KiB);
  void* a = arena.allocate(4 * KiB);  // [0, 4K)
  void* b = arena.allocate(2 * KiB);  // [4K, 6K)
  void* c = arena.allocate(2 * KiB);  // [6K, 8K)
  void* d = arena.allocate(8 * KiB);  // [8K, 16K)
  ASSERT_TRUE(a && b && c && d);
  EXPECT_EQ(arena.offset_of(d), 8 * KiB);
  EXPECT_EQ(arena.allocate(1), nullptr) << "the arena is full";
  ASSERT_TRUE(arena.free(a));
  ASSERT_TRUE(arena.free(c));
  // Holes: 4K at 0 and 2K at 6K. Best fit would take the 2K one; first fit takes the lowest.
  void* e = arena.allocate(2 * KiB);
  EXPECT_EQ(e, a);
  void* f = arena.allocate(2 * KiB);
  EXPECT_EQ(arena.offset_of(f), 2 * KiB) << "the rest of the first hole";
  void* g = arena.allocate(2 * KiB);
  EXPECT_EQ(g, c);
}

TEST(Arena, BlocksAre512ByteAlignedAndRoundedUp) {
  Arena arena(64 * KiB);
  const Arena::Stats empty = arena.stats();
  EXPECT_EQ(empty.capacity, 64 * KiB);
  EXPECT_EQ(empty.used, 0u);
  EXPECT_EQ(empty.largest_free, 64 * KiB);
  void* a = arena.allocate(1);
  void* b = arena.allocate(100);
  void* c = arena.allocate(513);
  void* d = arena.allocate(0);
  ASSERT_TRUE(a && b && c && d);
  EXPECT_EQ(arena.offset_of(a), 0u);
  EXPECT_EQ(arena.offset_of(b), 512u);
  EXPECT_EQ(arena.offset_of(c), 1024u);
  EXPECT_EQ(arena.offset_of(d), 2048u) << "513 bytes take two 512-byte units";
  for (void* p : {a, b, c, d})
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % Arena::kAlignment, 0u);
  const Arena::Stats s = arena.stats();
  EXPECT_EQ(s.used, 512u + 512u + 1024u + 512u);
  EXPECT_EQ(s.free, 64 * KiB - s.used);
}

TEST(Arena, FailsWithEnoughFreeBytesWhenNoHoleIsLargeEnough) {
  Arena arena(8 * KiB);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i)
    blocks.push_back(arena.allocate(KiB));
  for (int i = 0; i < 8; i += 2)
    ASSERT_TRUE(arena.free(blocks[i]));
  const Arena::Stats s = arena.stats();
  EXPECT_EQ(s.free, 4 * KiB);
  EXPECT_EQ(s.largest_free, KiB);
  EXPECT_EQ(arena.allocate(2 * KiB), nullptr) << "4 KiB free, but in 1 KiB pieces";
  EXPECT_NE(arena.allocate(KiB), nullptr);
}

TEST(Arena, FreeCoalescesWithBothNeighbours) {
  Arena arena(12 * KiB);
  void* a = arena.allocate(4 * KiB);
  void* b = arena.allocate(4 * KiB);
  void* c = arena.allocate(4 * KiB);
  ASSERT_TRUE(arena.free(a));
  ASSERT_TRUE(arena.free(c));
  EXPECT_EQ(arena.stats().largest_free, 4 * KiB);
  ASSERT_TRUE(arena.free(b));  // merges with the hole before it and the one after
  EXPECT_EQ(arena.stats().largest_free, 12 * KiB);
  EXPECT_EQ(arena.stats().used, 0u);
  void* all = arena.allocate(12 * KiB);
  EXPECT_EQ(all, a);
}

TEST(Arena, FreeRefusesPointersItDidNotHandOut) {
  Arena arena(8 * KiB);
  void* a = arena.allocate(KiB);
  int on_the_stack = 0;
  EXPECT_FALSE(arena.free(&on_the_stack));
  EXPECT_FALSE(arena.free(static_cast<char*>(a) + 512)) << "inside a block, not its start";
  EXPECT_TRUE(arena.free(a));
  EXPECT_FALSE(arena.free(a)) << "twice";
  EXPECT_EQ(arena.stats().used, 0u);
}

// Pages from anywhere in the arena appear contiguous in the reserved range, and bytes written
// through the range are the arena's bytes: cuMemMap's design over a memfd.
TEST(Arena, VmMapAliasesScatteredArenaPagesIntoOneRange) {
  Arena arena(4 * kPage);
  void* p0 = arena.allocate(kPage);
  void* p1 = arena.allocate(kPage);
  void* p2 = arena.allocate(kPage);
  ASSERT_TRUE(p0 && p1 && p2);
  ASSERT_TRUE(arena.free(p1));  // free pages: 1 and 3, not contiguous

  char* range = static_cast<char*>(arena.vm_reserve(4 * kPage));
  ASSERT_NE(range, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(range) % kPage, 0u);
  EXPECT_FALSE(arena.vm_map(range, 3 * kPage)) << "only two pages are free";
  EXPECT_EQ(arena.stats().used, 2 * kPage) << "a failed vm_map takes nothing";
  ASSERT_TRUE(arena.vm_map(range, 2 * kPage));
  EXPECT_EQ(arena.stats().used, 4 * kPage);
  EXPECT_EQ(arena.offset_of(range), 1 * kPage);
  EXPECT_EQ(arena.offset_of(range + kPage), 3 * kPage);
  EXPECT_EQ(arena.offset_of(range + kPage + 100), 3 * kPage + 100);

  // Written through the range, read in the arena; and back.
  for (uint64_t i = 0; i < 2 * kPage; i += 4096)
    range[i] = char(i / 4096 + 1);
  EXPECT_EQ(arena.base()[1 * kPage], char(1));
  EXPECT_EQ(arena.base()[1 * kPage + 4096], char(2));
  EXPECT_EQ(arena.base()[3 * kPage], char(kPage / 4096 + 1));
  arena.base()[3 * kPage + 8] = 'x';
  EXPECT_EQ(range[kPage + 8], 'x');

  EXPECT_EQ(arena.allocate(1), nullptr) << "mapped pages are used memory";
  arena.vm_unmap(range + kPage, kPage);
  EXPECT_EQ(arena.stats().used, 3 * kPage);
  EXPECT_EQ(arena.offset_of(range + kPage), UINT64_MAX);
  void* q = arena.allocate(kPage);
  EXPECT_EQ(arena.offset_of(q), 3 * kPage) << "the unmapped page is free arena memory again";
  ASSERT_TRUE(arena.free(q));
  arena.vm_release(range, 4 * kPage);  // unmaps what is still mapped
  EXPECT_EQ(arena.stats().used, 2 * kPage);
}

TEST(Arena, VmMapNeedsWholeAlignedFreePages) {
  Arena arena(2 * kPage);
  void* small = arena.allocate(512);  // page 0 is no longer wholly free
  ASSERT_NE(small, nullptr);
  char* range = static_cast<char*>(arena.vm_reserve(2 * kPage));
  ASSERT_NE(range, nullptr);
  EXPECT_FALSE(arena.vm_map(range, 2 * kPage)) << "2 MiB - 512 free in page 0 is not a page";
  EXPECT_TRUE(arena.vm_map(range, kPage));
  EXPECT_EQ(arena.offset_of(range), kPage);
  EXPECT_FALSE(arena.vm_map(range, kPage)) << "already mapped";
  EXPECT_FALSE(arena.vm_map(range + 4096, kPage)) << "not page-aligned";
  int outside = 0;
  EXPECT_FALSE(arena.vm_map(&outside, kPage)) << "not a reserved range";
  arena.vm_release(range, 2 * kPage);
  EXPECT_EQ(arena.stats().used, 512u);
}

// ---------------------------------------------------------------------------------------------
// The device over the arena

std::string limit_toml(uint64_t limit) {
  return "[device]\nmemory_limit = " + std::to_string(limit) + "\n";
}

TEST(DeviceArena, WithoutALimitTheCpuIsPlainHostMemory) {
  auto device = Device::create(test::config_from("").device);
  const Device::BackendStats s = device->backend_stats();
  EXPECT_EQ(s.capacity, 0u);
  EXPECT_EQ(s.used, 0u);
  Buffer big(*device, 256 * MiB, Category::kWorkspace, "big");  // nothing touches it: no memory
  EXPECT_TRUE(big);
}

TEST(DeviceArena, BackendStatsCountBlocksWithTheirPadding) {
  auto device = Device::create(test::config_from(limit_toml(MiB)).device);
  Buffer a(*device, 1000, Category::kParameters, "a");
  const Device::BackendStats s = device->backend_stats();
  EXPECT_EQ(s.capacity, MiB);
  EXPECT_EQ(s.used, 1024u);
  EXPECT_EQ(s.largest_free, MiB - 1024);
  EXPECT_EQ(device->tracker().live_total(), 1000u);
}

// Small and large buffers interleaved fill a 64 MiB device (13 pairs of 256 KiB + 4 MiB); every
// other large one is freed. That leaves 36.75 MiB free: 28 MiB in 4 MiB holes and 12.75 MiB at the
// end. A 16 MiB request fits in the free bytes but in no hole.
constexpr uint64_t kFragLimit = 64 * MiB;
constexpr uint64_t kFragRequest = 16 * MiB;
struct Fragmented {
  std::vector<Buffer> small, large;
};
Fragmented fragment(Device& device) {
  Fragmented f;
  for (int i = 0; i < 13; ++i) {
    f.small.emplace_back(device, 256 * KiB, Category::kActivations, "small");
    f.large.emplace_back(device, 4 * MiB, Category::kActivations, "large");
  }
  for (size_t i = 0; i < f.large.size(); i += 2)
    f.large[i].reset();
  return f;
}

TEST(DeviceArena, FragmentationFailsARequestThatFitsTheFreeBytes) {
  auto device = Device::create(test::config_from(limit_toml(kFragLimit)).device);
  Fragmented f = fragment(*device);
  try {
    Buffer big(*device, kFragRequest, Category::kActivations, "big");
    FAIL() << "the request fit a fragmented device";
  } catch (const OutOfMemory& e) {
    const OomReport& r = e.report();
    EXPECT_EQ(r.requested, kFragRequest);
    EXPECT_EQ(r.live_total, 13 * 256 * KiB + 6 * 4 * MiB);
    EXPECT_EQ(r.reserved_unused, 0u) << "no allocator caches, and every size is 512-aligned";
    EXPECT_EQ(r.free_bytes(), 28 * MiB + 8 * MiB + 768 * KiB);
    EXPECT_EQ(r.largest_free, 12 * MiB + 768 * KiB);
    EXPECT_LT(r.largest_free, r.requested);
    EXPECT_LE(r.requested, r.free_bytes());
    const std::string s = r.str();
    EXPECT_TRUE(contains(s, "reserved-but-unused")) << s;
    EXPECT_TRUE(contains(s, "largest free block")) << s;
    EXPECT_TRUE(contains(s, "12.75 MiB")) << s;
  }
}

// ---------------------------------------------------------------------------------------------
// defrag_allocator through the real plugin host

std::string defrag_toml(uint64_t limit, const std::string& keys = "") {
  return (limit ? limit_toml(limit) : "") + "[[plugins]]\nname = \"defrag_allocator\"\n" + keys;
}

// A device with defrag_allocator installed, as a training run has it. Members go in reverse: the
// plugin host (and the allocator) before the device.
struct Defrag {
  Config config;
  std::unique_ptr<Device> dev;
  PluginHost host;
  explicit Defrag(const std::string& toml)
      : config(test::config_from(toml)), dev(Device::create(config.device)), host(config) {
    host.create(modeless_run(*dev));
  }
  Device& device() { return *dev; }
  AllocatorStats stats() {
    AllocatorStats s;
    EXPECT_TRUE(device().allocator_stats(&s));
    return s;
  }
  void step_end() {
    EventInfo e;
    e.event = Event::kStepEnd;
    host.on_event(e);
  }
};

TEST(DefragAllocator, ReusesAFreedBlockWithoutTheDevice) {
  Defrag d(defrag_toml(64 * MiB));
  void* first;
  {
    Buffer a(d.device(), 3 * MiB, Category::kActivations, "a");
    first = a.as<void>();
    EXPECT_EQ(d.stats().allocated, 3 * MiB);
    EXPECT_EQ(d.stats().reserved, 4 * MiB) << "two 2 MiB pages";
  }
  const AllocatorStats freed = d.stats();
  EXPECT_EQ(freed.allocated, 0u);
  EXPECT_EQ(freed.reserved, 4 * MiB) << "cached, not returned";
  EXPECT_EQ(freed.largest_free_block, 4 * MiB);
  Buffer b(d.device(), 3 * MiB, Category::kActivations, "b");
  EXPECT_EQ(b.as<void>(), first);
  EXPECT_EQ(d.stats().device_allocs, freed.device_allocs);
}

// A freed block may still be read by work queued on its stream, so it is reused at once only on
// that stream; another stream gets other memory. The device passes its compute stream (NULL on the
// CPU), so this calls the allocator role directly with two stand-in handles: the plugin only
// compares them.
TEST(DefragAllocator, ReusesABlockOnlyOnTheStreamItWasAllocatedOn) {
  for (const char* extra : {"", "expandable = false\n"}) {
    SCOPED_TRACE(*extra ? "fixed segments" : "expandable segments");
    Defrag d(defrag_toml(64 * MiB, extra));
    DeviceAllocator* allocator = d.device().allocator();
    ASSERT_NE(allocator, nullptr);
    int stream_a = 0, stream_b = 0;
    void* a1 = allocator->allocate(3 * MiB, Category::kActivations, &stream_a);
    ASSERT_NE(a1, nullptr);
    allocator->deallocate(a1, 3 * MiB, &stream_a);
    const AllocatorStats cached = d.stats();
    EXPECT_EQ(cached.allocated, 0u);

    void* b1 = allocator->allocate(3 * MiB, Category::kActivations, &stream_b);
    ASSERT_NE(b1, nullptr);
    EXPECT_NE(b1, a1) << "stream B got the block stream A freed";
    EXPECT_GT(d.stats().device_allocs, cached.device_allocs) << "B's memory came from the cache";
    EXPECT_GE(d.stats().reserved, cached.reserved + 3 * MiB);

    const uint64_t before_a2 = d.stats().device_allocs;
    void* a2 = allocator->allocate(3 * MiB, Category::kActivations, &stream_a);
    EXPECT_EQ(a2, a1) << "stream A did not get its own cached block back";
    EXPECT_EQ(d.stats().device_allocs, before_a2);

    // Freed, B's block serves B again, and neither is merged into the other's.
    allocator->deallocate(b1, 3 * MiB, &stream_b);
    void* b2 = allocator->allocate(3 * MiB, Category::kActivations, &stream_b);
    EXPECT_EQ(b2, b1);
    allocator->deallocate(a2, 3 * MiB, &stream_a);
    allocator->deallocate(b2, 3 * MiB, &stream_b);
    EXPECT_EQ(d.stats().allocated, 0u);
  }
}

// Small buffers come from their own pool, so they never sit between large ones: the large ones
// are contiguous and coalesce into one block when freed.
TEST(DefragAllocator, SmallAndLargePoolsKeepLargeBlocksTogether) {
  for (const char* keys : {"", "expandable = false\n"}) {
    SCOPED_TRACE(keys);
    Defrag d(defrag_toml(64 * MiB, keys));
    std::vector<Buffer> small, large;
    for (int i = 0; i < 4; ++i) {
      small.emplace_back(d.device(), 100 * KiB, Category::kActivations, "small");
      large.emplace_back(d.device(), 2 * MiB, Category::kActivations, "large");
    }
    for (int i = 1; i < 4; ++i)
      EXPECT_EQ(large[i].as<char>(), large[i - 1].as<char>() + 2 * MiB);
    for (int i = 1; i < 4; ++i)
      EXPECT_EQ(small[i].as<char>(), small[i - 1].as<char>() + 100 * KiB);
    const uint64_t allocs = d.stats().device_allocs;
    char* base = large[0].as<char>();
    large.clear();  // frees in order: each merges with the free block before it
    Buffer whole(d.device(), 8 * MiB, Category::kActivations, "whole");
    EXPECT_EQ(whole.as<char>(), base) << "the four freed blocks coalesced";
    EXPECT_EQ(d.stats().device_allocs, allocs);
  }
}

TEST(DefragAllocator, BestFitTakesTheSmallestCachedBlockThatHolds) {
  Defrag d(defrag_toml(64 * MiB));
  Buffer a(d.device(), 6 * MiB, Category::kActivations, "a");
  Buffer sep1(d.device(), 2 * MiB, Category::kActivations, "sep1");
  Buffer b(d.device(), 4 * MiB, Category::kActivations, "b");
  Buffer sep2(d.device(), 2 * MiB, Category::kActivations, "sep2");
  char* pa = a.as<char>();
  char* pb = b.as<char>();
  a.reset();
  b.reset();
  // First fit would take a (lower); best fit takes b, leaving the 6 MiB hole whole.
  Buffer c(d.device(), 3 * MiB, Category::kActivations, "c");
  EXPECT_EQ(c.as<char>(), pb);
  Buffer e(d.device(), 5 * MiB, Category::kActivations, "e");
  EXPECT_EQ(e.as<char>(), pa);
  // b's rest (1 MiB) was split off and is cached.
  Buffer f(d.device(), 1 * MiB + 512, Category::kActivations, "f");  // large pool, needs > 1 MiB
  EXPECT_NE(f.as<char>(), pb + 3 * MiB);
  Buffer g(d.device(), 1 * MiB, Category::kActivations, "g");  // small pool
  EXPECT_NE(g.as<char>(), pb + 3 * MiB) << "the pools do not share blocks";
}

TEST(DefragAllocator, FixedSegmentsSplitOnlyWhenTheRestIsLarge) {
  Defrag d(defrag_toml(0, "expandable = false\n"));
  Buffer a(d.device(), 4 * MiB, Category::kActivations, "a");
  EXPECT_EQ(d.stats().reserved, 20 * MiB) << "large requests under 10 MiB share 20 MiB segments";
  Buffer b(d.device(), 4 * MiB, Category::kActivations, "b");
  EXPECT_EQ(b.as<char>(), a.as<char>() + 4 * MiB);
  EXPECT_EQ(d.stats().device_allocs, 1u);
  // The 12 MiB left of the segment stay whole for a request that needs them...
  Buffer c(d.device(), 11 * MiB + 512, Category::kActivations, "c");
  EXPECT_EQ(c.as<char>(), b.as<char>() + 4 * MiB);
  EXPECT_EQ(d.stats().reserved, 20 * MiB);
  // ... and a large request that does not fit gets its own segment, rounded to 2 MiB.
  Buffer e(d.device(), 13 * MiB, Category::kActivations, "e");
  EXPECT_EQ(d.stats().reserved, 20 * MiB + 14 * MiB);
  Buffer s(d.device(), 1000, Category::kActivations, "s");
  EXPECT_EQ(d.stats().reserved, 36 * MiB) << "the small pool's 2 MiB segment";
  EXPECT_EQ(d.stats().device_allocs, 3u);
}

TEST(DefragAllocator, MaxSplitSizeKeepsLargeBlocksForLargeRequests) {
  Defrag d(defrag_toml(0, "expandable = false\nmax_split_size = \"16MiB\"\n"));
  char* big_ptr;
  {
    Buffer big(d.device(), 30 * MiB, Category::kActivations, "big");
    big_ptr = big.as<char>();
  }
  // A 4 MiB request does not take the cached 30 MiB block: it gets a segment of its own.
  Buffer small(d.device(), 4 * MiB, Category::kActivations, "small");
  EXPECT_NE(small.as<char>(), big_ptr);
  Buffer again(d.device(), 29 * MiB, Category::kActivations, "again");
  EXPECT_EQ(again.as<char>(), big_ptr) << "a large request may take it";
}

TEST(DefragAllocator, ReleaseThresholdReturnsTheCacheAtStepEnd) {
  for (const char* mode : {"", "expandable = false\n"}) {
    SCOPED_TRACE(mode);
    Defrag keep(defrag_toml(64 * MiB, mode));
    Defrag release(defrag_toml(64 * MiB, std::string(mode) + "release_threshold = \"4MiB\"\n"));
    for (Defrag* d : {&keep, &release}) {
      Buffer a(d->device(), 16 * MiB, Category::kActivations, "a");
      Buffer b(d->device(), 8 * MiB, Category::kActivations, "b");
    }
    const uint64_t cached = keep.stats().reserved;
    EXPECT_GE(cached, 24 * MiB);
    keep.step_end();
    EXPECT_EQ(keep.stats().reserved, cached) << "release_threshold = 0 keeps the cache";
    release.step_end();
    EXPECT_LE(release.stats().reserved, 4 * MiB);
    EXPECT_EQ(release.device().backend_stats().used, release.stats().reserved);
  }
}

// The fragmented device again, now with defrag_allocator. Its pools keep the small buffers out of
// the large ones' way, and when the 16 MiB request finds the device out of pages, it unmaps the
// cached 4 MiB holes and maps their pages again at the end of its address range: a retry that
// succeeds. Fixed segments cannot do that: the holes are inside segments that are still in use.
TEST(DefragAllocator, ExpandableSegmentsServeWhatFragmentationDenies) {
  {
    Defrag d(defrag_toml(kFragLimit));  // expandable = true is the default
    Fragmented f = fragment(d.device());
    const AllocatorStats before = d.stats();
    EXPECT_EQ(before.retries, 0u);
    Buffer big(d.device(), kFragRequest, Category::kActivations, "big");
    EXPECT_TRUE(big);
    const AllocatorStats after = d.stats();
    EXPECT_EQ(after.retries, 1u);
    EXPECT_EQ(after.ooms, 0u);
    EXPECT_EQ(after.allocated, d.device().tracker().live_total());
    EXPECT_EQ(after.reserved, d.device().backend_stats().used);
    std::memset(big.as<char>(), 1, kFragRequest);  // every byte of it is there
  }
  {
    Defrag d(defrag_toml(kFragLimit, "expandable = false\n"));
    Fragmented f = fragment(d.device());
    try {
      Buffer big(d.device(), kFragRequest, Category::kActivations, "big");
      FAIL() << "fixed segments served the request";
    } catch (const OutOfMemory& e) {
      const OomReport& r = e.report();
      // The device is full of segments; the largest cached block is the freed last large buffer
      // and the rest of its segment.
      EXPECT_EQ(d.device().backend_stats().largest_free, 0u);
      EXPECT_EQ(r.largest_free, 12 * MiB) << "the allocator's largest cached block";
      EXPECT_EQ(r.reserved_unused, kFragLimit - r.live_total) << "the cache holds the rest";
      EXPECT_EQ(d.stats().ooms, 1u);
    }
  }
}

// Random sequences of mixed sizes, through the device and the plugin: blocks never overlap (and
// what is written into one is never overwritten through another), the plugin's allocated bytes
// are the tracker's live bytes, reserved covers them and is exactly what the arena handed out,
// and after everything is freed a request the device cannot hold releases every cached byte:
// freed memory went back to the pool, coalesced.
struct PropertyCase {
  uint64_t limit;
  bool expandable;
  uint64_t seed;
};

class DefragProperty : public ::testing::TestWithParam<PropertyCase> {};

TEST_P(DefragProperty, RandomAllocFreeNeverOverlapsAndStatsAgree) {
  const PropertyCase pc = GetParam();
  Defrag d(defrag_toml(pc.limit, pc.expandable ? "" : "expandable = false\n"));
  Device& device = d.device();
  std::mt19937_64 rng(pc.seed);
  auto random_size = [&]() -> uint64_t {
    const uint64_t kind = rng() % 10;
    if (kind < 6) return 1 + rng() % (64 * KiB);        // small pool
    if (kind < 9) return 64 * KiB + rng() % (4 * MiB);  // across the small/large boundary
    return 4 * MiB + rng() % (24 * MiB);                // large
  };
  auto tag = [&](uintptr_t a) { return uint64_t(a) * 0x9E3779B97F4A7C15ull ^ pc.seed; };
  std::map<uintptr_t, uint64_t> live;  // start -> bytes
  uint64_t failures = 0;

  auto check = [&](int i) {
    const AllocatorStats s = d.stats();
    ASSERT_EQ(s.allocated, device.tracker().live_total()) << "op " << i;
    ASSERT_GE(s.reserved, s.allocated) << "op " << i;
    ASSERT_EQ(s.ooms, failures) << "op " << i;
    if (pc.limit) {
      ASSERT_EQ(device.backend_stats().used, s.reserved) << "op " << i;
    }
  };
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 100 < 50) {
      const uint64_t bytes = random_size();
      void* p = device.try_allocate(bytes, Category::kActivations, "random");
      if (!p) {
        ++failures;
        ASSERT_NE(pc.limit, 0u) << "only a limited device runs out";
        check(i);
        continue;
      }
      const uintptr_t a = reinterpret_cast<uintptr_t>(p);
      auto next = live.lower_bound(a);
      if (next != live.end()) {
        ASSERT_LE(a + bytes, next->first) << "overlaps the next block";
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, a) << "overlaps the previous block";
      }
      live.emplace(a, bytes);
      // Tags at both ends: an overlap that the address check missed would overwrite one.
      const uint64_t t = tag(a);
      std::memcpy(p, &t, std::min<uint64_t>(bytes, 8));
      std::memcpy(static_cast<char*>(p) + bytes - std::min<uint64_t>(bytes, 8), &t,
                  std::min<uint64_t>(bytes, 8));
    } else {
      auto it = live.begin();
      std::advance(it, long(rng() % live.size()));
      const uint64_t t = tag(it->first), n = std::min<uint64_t>(it->second, 8);
      char* p = reinterpret_cast<char*>(it->first);
      ASSERT_EQ(std::memcmp(p, &t, n), 0) << "block at " << it->first << " was overwritten";
      ASSERT_EQ(std::memcmp(p + it->second - n, &t, n), 0) << "block end was overwritten";
      device.free(p);
      live.erase(it);
    }
    check(i);
  }
  for (const auto& [a, bytes] : live)
    device.free(reinterpret_cast<void*>(a));
  check(-1);
  const AllocatorStats freed = d.stats();
  EXPECT_EQ(freed.allocated, 0u);
  EXPECT_EQ(device.tracker().live_total(), 0u);
  EXPECT_GT(freed.reserved, 0u) << "freed memory stays cached";
  EXPECT_GT(freed.largest_free_block, 0u);

  // More than any device holds: the allocator releases its whole cache before it gives up.
  const uint64_t impossible = pc.limit ? pc.limit + 1 : uint64_t(1) << 52;
  EXPECT_EQ(device.try_allocate(impossible, Category::kActivations, "impossible"), nullptr);
  const AllocatorStats released = d.stats();
  EXPECT_EQ(released.reserved, 0u) << "a cached block was not coalesced or not released";
  EXPECT_EQ(released.largest_free_block, 0u);
  EXPECT_EQ(released.ooms, failures + 1);
  if (pc.limit) {
    EXPECT_EQ(device.backend_stats().used, 0u);
    EXPECT_GT(failures, 0u) << "the sequence never reached the limit";
  }
  if (pc.limit && pc.expandable) {
    EXPECT_GT(freed.retries, 0u) << "never released and retried";
  }
}

std::vector<PropertyCase> property_cases() {
  std::vector<PropertyCase> cases;
  for (uint64_t limit : {uint64_t(0), 128 * MiB})
    for (bool expandable : {true, false})
      for (uint64_t seed : {1, 2, 3})
        cases.push_back({limit, expandable, seed});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Seeds, DefragProperty, ::testing::ValuesIn(property_cases()),
                         [](const ::testing::TestParamInfo<PropertyCase>& info) {
                           const PropertyCase& c = info.param;
                           return std::string(c.limit ? "Limit128MiB" : "NoLimit") +
                                  (c.expandable ? "Expandable" : "Fixed") + "Seed" +
                                  std::to_string(c.seed);
                         });

// ---------------------------------------------------------------------------------------------
// Training runs with the plugin, through the host binary

const std::string kModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n";
const std::string kTrain = "[train]\nsteps = 4\nmicro_batch = 4\ngrad_accum = 2\n";

std::vector<double> losses(const std::string& metrics_path) {
  std::vector<double> out;
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

struct DefragTraining : ::testing::Test {
  std::string dir = test::temp_dir();
  test::RunResult train(const std::string& name, const std::string& toml) {
    const std::string cfg = test::write_file(dir, name + ".toml", toml);
    return test::run_headroom("train " + cfg + " -q --metrics " + dir + "/" + name + ".jsonl");
  }
  std::vector<double> losses_of(const std::string& name) {
    return losses(dir + "/" + name + ".jsonl");
  }
};

TEST_F(DefragTraining, LossesEqualTheRunWithoutIt) {
  const std::string limit = "[device]\nmemory_limit = \"64MiB\"\n";
  const std::string plugin = "[[plugins]]\nname = \"defrag_allocator\"\n";
  const auto plain = train("plain", kModel + kTrain + limit);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const std::vector<double> expected = losses_of("plain");
  ASSERT_EQ(expected.size(), 4u);
  for (const auto& [name, toml] : std::vector<std::pair<std::string, std::string>>{
           {"expandable", kModel + kTrain + limit + plugin},
           {"fixed", kModel + kTrain + limit + plugin + "expandable = false\n"},
           {"nolimit", kModel + kTrain + plugin + "release_threshold = \"1MiB\"\n"}}) {
    const auto r = train(name, toml);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    EXPECT_EQ(losses_of(name), expected) << name;
  }
}

TEST_F(DefragTraining, OutOfMemoryReportShowsTheCacheAndTheLargestFreeBlock) {
  // The CLI test's run that does not fit: the report now says what the allocator holds.
  const auto r = train("oom", kModel + "[train]\nsteps = 2\nmicro_batch = 16\n" +
                                  "[device]\nmemory_limit = \"1536KiB\"\n"
                                  "[[plugins]]\nname = \"defrag_allocator\"\n"
                                  "expandable = false\n");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (const char* field : {"out of memory", "reserved-but-unused", "largest free block"})
    EXPECT_TRUE(contains(r.output, field)) << field << "\n" << r.output;
}

TEST_F(DefragTraining, BadKeysExit2NamingTheKey) {
  const std::string base = kModel + kTrain + "[[plugins]]\nname = \"defrag_allocator\"\n";
  struct Bad {
    std::string keys, expect;
  };
  for (const Bad& bad : std::vector<Bad>{{"page_size = \"3MiB\"\n", "page_size"},
                                         {"page_size = 0\n", "page_size"},
                                         {"max_split_size = \"512KiB\"\n", "max_split_size"},
                                         {"expandable = \"yes\"\n", "expandable"},
                                         {"release_threshold = -1\n", "release_threshold"},
                                         {"page_sise = \"2MiB\"\n", "unknown key 'page_sise'"}}) {
    const auto r = train("bad", base + bad.keys);
    EXPECT_EQ(r.exit_code, 2) << bad.keys << r.output;
    EXPECT_TRUE(contains(r.output, bad.expect)) << bad.keys << r.output;
    EXPECT_TRUE(contains(r.output, "bad.toml:")) << "names the file: " << r.output;
  }
  const auto ok = train("ok", base + "page_size = \"4MiB\"\nmax_split_size = \"32MiB\"\n");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

}  // namespace
}  // namespace headroom
