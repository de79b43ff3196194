// defrag_allocator: a caching allocator in the allocator role, after PyTorch's
// CUDACachingAllocator. Users run out of memory with gigabytes free because the free memory is in
// pieces; this allocator keeps the pieces few and, with expandable segments, makes them not matter.
//
//   [[plugins]]
//   name = "defrag_allocator"
//   page_size = "2MiB"        # expandable segments grow by this; a multiple of vm_granularity
//   max_split_size = "0"      # never split blocks this large for smaller requests; 0 = no limit
//   release_threshold = "0"   # at STEP_END, cached bytes above this go back; 0 = keep them
//   expandable = true         # segments that grow page by page in one reserved address range
//
// How a request is served:
//  1. Its size is rounded up to 512 bytes. Up to 1 MiB it goes to the small pool, above to the
//     large pool: small, short-lived buffers then never sit between large ones.
//  2. Best fit: the smallest cached free block of the same stream that holds it. A larger block is
//     split and the rest stays cached (thresholds below keep the splits from shredding memory).
//  3. No block fits: take memory from the device. With expandable segments, map pages at the end
//     of the pool's reserved address range: the new pages join the free block before them, so a
//     large request needs pages, not a contiguous hole in device memory. Without, allocate a new
//     segment (2 MiB for the small pool; 20 MiB for large requests under 10 MiB, else the request
//     rounded to 2 MiB) with raw_alloc.
//  4. The device is out: release every cached block (free fixed segments; the pages under free
//     blocks of expandable segments) and try step 3 once more, counted as a retry. Released pages
//     come back mapped at the end of the range: the physical memory moves, the pieces disappear.
//  5. Still out: NULL, and the host reports out of memory.
// A freed block merges with free neighbours at once, so free memory is always in the fewest pieces.
//
// Everything runs on the training thread (the host's allocator contract): no locking. Blocks keep
// the stream they were allocated on and are reused only on it; on the CPU the stream is NULL.
// Only hr_plugin_entry is exported; no C++ exception crosses the C ABI.
#include <headroom/ext/estimate.h>
#include <headroom/plugin.h>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "common/offer_reads.h"
#include "common/units.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;
constexpr uint64_t kMinBlockSize = 512;         // every size is a multiple of this (cudaMalloc's)
constexpr uint64_t kSmallSize = 1 * kMiB;       // requests up to this go to the small pool
constexpr uint64_t kSmallBuffer = 2 * kMiB;     // fixed segments of the small pool
constexpr uint64_t kMinLargeAlloc = 10 * kMiB;  // large requests below this share a segment of
constexpr uint64_t kLargeBuffer = 20 * kMiB;    //   this size
constexpr uint64_t kRoundLarge = 2 * kMiB;      // larger ones get their own, rounded to this
// Address space for one expandable segment when the device's size is unknown (no memory_limit):
// only address space, which a 64-bit process has plenty of; halved until the device grants it.
constexpr uint64_t kDefaultReserve = uint64_t(1) << 40;

uint64_t round_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}
uint64_t round_down(uint64_t x, uint64_t a) {
  return x / a * a;
}

struct Pool;
struct Segment;

// A piece of a segment: handed out, cached (free with memory behind it), or, in an expandable
// segment, address space with no pages mapped. The blocks of a segment tile it in address order.
struct Block {
  void* stream = nullptr;
  char* ptr = nullptr;
  uint64_t size = 0;       // a multiple of kMinBlockSize (of the page size when unmapped)
  uint64_t requested = 0;  // what allocate() was asked for, while allocated
  bool allocated = false;
  bool mapped = true;  // false: address space only (expandable segments)
  Block* prev = nullptr;
  Block* next = nullptr;
  Pool* pool = nullptr;
  Segment* segment = nullptr;
};

// Blocks of one stream together. Best fit: the smallest size that holds a request, then the lowest
// address. std::less, since raw pointers of different objects have no built-in order.
struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return std::less<void*>()(a->stream, b->stream);
    if (a->size != b->size) return a->size < b->size;
    return std::less<char*>()(a->ptr, b->ptr);
  }
};
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return std::less<void*>()(a->stream, b->stream);
    return std::less<char*>()(a->ptr, b->ptr);
  }
};

struct Pool {
  bool small = false;
  std::set<Block*, BySize> free;         // cached blocks, by (stream, size, address)
  std::set<Block*, ByAddress> unmapped;  // address space without pages, by (stream, address)
};

struct Segment {
  char* base = nullptr;
  uint64_t size = 0;  // bytes of memory (fixed) or of reserved address space (expandable)
  bool expandable = false;
};

struct Options {
  uint64_t page_size = 2 * kMiB;
  uint64_t max_split_size = 0;  // 0: no limit
  uint64_t release_threshold = 0;
  bool expandable = true;
};

class DefragAllocator {
 public:
  DefragAllocator(const hr_host_services* services, const Options& options)
      : s_(services), opt_(options) {
    small_.small = true;
  }
  ~DefragAllocator() { release_everything(); }
  DefragAllocator(const DefragAllocator&) = delete;
  DefragAllocator& operator=(const DefragAllocator&) = delete;

  void* allocate(uint64_t bytes, void* stream) {
    if (bytes > UINT64_MAX - kMinBlockSize) return fail();
    const uint64_t size = round_up(std::max<uint64_t>(bytes, 1), kMinBlockSize);
    Pool& pool = size <= kSmallSize ? small_ : large_;
    Block* block = take_free_block(pool, stream, size);
    if (!block) block = grow(pool, stream, size);
    if (!block && release_cached(0) > 0) {
      block = grow(pool, stream, size);
      if (block) ++retries_;
    }
    if (!block) return fail();
    split(block, size);
    block->allocated = true;
    block->requested = bytes;
    active_.emplace(block->ptr, block);
    allocated_blocks_ += block->size;
    requested_ += bytes;
    return block->ptr;
  }

  void deallocate(void* ptr) {
    auto it = active_.find(ptr);
    if (it == active_.end()) {
      s_->log(s_->host, HR_LOG_ERROR, "deallocate: a pointer this allocator did not hand out");
      return;
    }
    Block* b = it->second;
    active_.erase(it);
    allocated_blocks_ -= b->size;
    requested_ -= b->requested;
    b->allocated = false;
    b->requested = 0;
    cache(b);
  }

  void stats(hr_allocator_stats* out) const {
    uint64_t largest = 0;
    for (const Pool* pool : {&small_, &large_})
      for (const Block* b : pool->free)
        largest = std::max(largest, b->size);
    // `allocated` is what was asked for, the tracker's count: rounding and the unused ends of
    // blocks count as reserved but unused. Fill only what the host's struct covers: an older
    // host has a shorter one.
    if (HR_HAS_FIELD(out, hr_allocator_stats, allocated)) out->allocated = requested_;
    if (HR_HAS_FIELD(out, hr_allocator_stats, reserved)) out->reserved = reserved_;
    if (HR_HAS_FIELD(out, hr_allocator_stats, largest_free_block))
      out->largest_free_block = largest;
    if (HR_HAS_FIELD(out, hr_allocator_stats, device_allocs)) out->device_allocs = device_allocs_;
    if (HR_HAS_FIELD(out, hr_allocator_stats, retries)) out->retries = retries_;
    if (HR_HAS_FIELD(out, hr_allocator_stats, ooms)) out->ooms = ooms_;
  }

  // STEP_END: the cache above release_threshold goes back to the device, so that memory a phase of
  // the run needed once does not stay out of reach of everything else.
  void on_step_end() {
    if (opt_.release_threshold > 0 && cached() > opt_.release_threshold)
      release_cached(opt_.release_threshold);
  }

 private:
  void* fail() {
    ++ooms_;
    return nullptr;
  }
  uint64_t cached() const { return reserved_ - allocated_blocks_; }

  // ---------------------------------------------------------------------------------------------
  // Cached blocks

  // The best-fitting cached block of `stream` for `size`, out of the free set; nullptr when none.
  Block* take_free_block(Pool& pool, void* stream, uint64_t size) {
    Block key;
    key.stream = stream;
    key.size = size;
    auto it = pool.free.lower_bound(&key);
    if (it == pool.free.end() || (*it)->stream != stream) return nullptr;
    Block* b = *it;
    if (opt_.max_split_size > 0) {
      // A block of max_split_size or more is kept for requests as large: splitting it for a small
      // one is how large holes get shredded. A large request may take such a block only when
      // little of it would go unused.
      if (size < opt_.max_split_size && b->size >= opt_.max_split_size) return nullptr;
      if (size >= opt_.max_split_size && b->size >= size + kLargeBuffer) return nullptr;
    }
    pool.free.erase(it);
    return b;
  }

  bool should_split(const Block* b, uint64_t size) const {
    const uint64_t remaining = b->size - size;
    // Small blocks and expandable segments split whenever the rest is a block; fixed large
    // segments only when the rest is itself large and the block may be split at all: a sliver of a
    // large segment would pin the whole segment for a small buffer's lifetime.
    if (b->pool->small || b->segment->expandable) return remaining >= kMinBlockSize;
    const bool splittable = opt_.max_split_size == 0 || size < opt_.max_split_size;
    return splittable && remaining > kSmallSize;
  }

  // Cuts `b` (out of every set) to `size`; the rest becomes a cached block of its own.
  void split(Block* b, uint64_t size) {
    if (!should_split(b, size)) return;
    Block* rest = new Block(*b);
    rest->ptr = b->ptr + size;
    rest->size = b->size - size;
    rest->prev = b;
    if (rest->next) rest->next->prev = rest;
    b->next = rest;
    b->size = size;
    // b came out fully merged, so the rest has no free neighbour to merge with.
    b->pool->free.insert(rest);
  }

  // Merges `src` into its neighbour `dst` when `src` is not handed out and has the same backing
  // (mapped with mapped, unmapped with unmapped). `dst` must be out of every set: its key changes.
  bool try_merge(Block* dst, Block* src) {
    if (!src || src->allocated || src->mapped != dst->mapped) return false;
    if (src->mapped) {
      src->pool->free.erase(src);
    } else {
      src->pool->unmapped.erase(src);
    }
    if (dst->prev == src) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
    } else {
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    delete src;
    return true;
  }

  // A block out of every set goes back to its pool's cache, merged with its free neighbours.
  void cache(Block* b) {
    try_merge(b, b->prev);
    try_merge(b, b->next);
    b->pool->free.insert(b);
  }

  // ---------------------------------------------------------------------------------------------
  // Memory from the device

  Block* grow(Pool& pool, void* stream, uint64_t size) {
    return opt_.expandable ? grow_expandable(pool, stream, size) : new_segment(pool, stream, size);
  }

  // A fixed segment holding `size`: the block covering all of it, out of every set.
  Block* new_segment(Pool& pool, void* stream, uint64_t size) {
    uint64_t bytes = pool.small              ? kSmallBuffer
                     : size < kMinLargeAlloc ? kLargeBuffer
                                             : round_up(size, kRoundLarge);
    void* p = s_->raw_alloc(s_->host, bytes);
    if (!p && bytes > size) {
      // Under a tight memory limit a whole 2 or 20 MiB segment may not fit where the request
      // would: a segment of just the request beats failing.
      bytes = size;
      p = s_->raw_alloc(s_->host, bytes);
    }
    if (!p) return nullptr;
    ++device_allocs_;
    reserved_ += bytes;
    auto seg = std::make_unique<Segment>();
    seg->base = static_cast<char*>(p);
    seg->size = bytes;
    Block* b = new Block;
    b->stream = stream;
    b->ptr = seg->base;
    b->size = bytes;
    b->pool = &pool;
    b->segment = seg.get();
    segments_.push_back(std::move(seg));
    return b;
  }

  // Free address space of `stream` in `pool` that holds `size`: an unmapped block, or the cached
  // block just before one, from which consecutive blocks not handed out add up to `size`. Reserves
  // a new segment's address space when no segment has room; nullptr when that fails.
  Block* find_expandable(Pool& pool, void* stream, uint64_t size) {
    Block key;
    key.stream = stream;
    for (auto it = pool.unmapped.lower_bound(&key);
         it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
      Block* c = *it;
      if (c->prev && !c->prev->allocated) c = c->prev;  // a cached block before it counts too
      uint64_t room = 0;
      for (const Block* b = c; b && !b->allocated && room < size; b = b->next)
        room += b->size;
      if (room >= size) return c;
    }
    // Room for the whole device, and then some: pages freed early in the range can come back at its
    // end, so the range must be able to hold more than the device (PyTorch reserves 9/8).
    hr_memory_stats ms;
    std::memset(&ms, 0, sizeof ms);
    ms.struct_size = sizeof ms;
    uint64_t want = kDefaultReserve;
    if (s_->memory_stats(s_->host, &ms) == HR_OK && ms.limit > 0) want = ms.limit / 8 * 9;
    want = round_up(std::max(want, size), opt_.page_size);
    void* base = nullptr;
    for (uint64_t bytes = want; bytes >= size && !base;
         bytes = round_up(bytes / 2, opt_.page_size)) {
      base = s_->vm_reserve(s_->host, bytes);
      if (base) want = bytes;
      if (bytes <= opt_.page_size) break;
    }
    if (!base) return nullptr;
    auto seg = std::make_unique<Segment>();
    seg->base = static_cast<char*>(base);
    seg->size = want;
    seg->expandable = true;
    Block* b = new Block;
    b->stream = stream;
    b->ptr = seg->base;
    b->size = want;
    b->mapped = false;
    b->pool = &pool;
    b->segment = seg.get();
    segments_.push_back(std::move(seg));
    pool.unmapped.insert(b);
    return b;
  }

  // Maps pages under the first `bytes` of the unmapped block `b` (rounded up to pages; at most all
  // of it). The mapped part becomes cached and merges with cached neighbours; returns that block,
  // or nullptr when the device has no pages.
  Block* map_pages(Block* b, uint64_t bytes) {
    const uint64_t n = std::min(round_up(bytes, opt_.page_size), b->size);
    if (s_->vm_map(s_->host, b->ptr, n) != HR_OK) return nullptr;
    ++device_allocs_;
    reserved_ += n;
    b->pool->unmapped.erase(b);
    if (n < b->size) {
      Block* rest = new Block(*b);
      rest->ptr = b->ptr + n;
      rest->size = b->size - n;
      rest->prev = b;
      if (rest->next) rest->next->prev = rest;
      b->next = rest;
      b->size = n;
      b->pool->unmapped.insert(rest);
    }
    b->mapped = true;
    try_merge(b, b->prev);
    try_merge(b, b->next);
    b->pool->free.insert(b);
    return b;
  }

  // Grows the pool's expandable segment by pages until one cached block holds `size`; that block,
  // out of every set. PyTorch's try_allocate_expandable_block.
  Block* grow_expandable(Pool& pool, void* stream, uint64_t size) {
    Block* c = find_expandable(pool, stream, size);
    if (!c) return nullptr;
    if (!c->mapped) {
      c = map_pages(c, size);
      if (!c) return nullptr;
    }
    // c is cached, and after it comes address space: map it until c holds the request.
    while (c->size < size) {
      Block* next = c->next;
      if (!next || next->allocated || next->mapped) return nullptr;  // find_expandable saw room
      c = map_pages(next, size - c->size);
      if (!c) return nullptr;
    }
    pool.free.erase(c);
    return c;
  }

  // ---------------------------------------------------------------------------------------------
  // Giving memory back

  // Returns cached memory to the device, largest first, until at most `keep` bytes stay cached.
  // Fixed segments go back when wholly free; in expandable segments, every page that lies wholly
  // under a cached block. Returns the bytes released.
  uint64_t release_cached(uint64_t keep) {
    std::vector<Block*> candidates;
    for (Pool* pool : {&small_, &large_})
      for (Block* b : pool->free)
        if (releasable(b) > 0) candidates.push_back(b);
    std::sort(candidates.begin(), candidates.end(), [this](const Block* a, const Block* b) {
      const uint64_t ra = releasable(a), rb = releasable(b);
      return ra != rb ? ra > rb : std::less<char*>()(a->ptr, b->ptr);
    });
    uint64_t released = 0;
    for (Block* b : candidates) {
      if (cached() <= keep) break;
      released += b->segment->expandable ? unmap_pages(b) : free_segment(b);
    }
    return released;
  }

  // What releasing the cached block `b` gives back.
  uint64_t releasable(const Block* b) const {
    if (!b->segment->expandable) return b->prev || b->next ? 0 : b->size;
    const char* base = b->segment->base;
    const uint64_t lo = round_up(uint64_t(b->ptr - base), opt_.page_size);
    const uint64_t hi = round_down(uint64_t(b->ptr - base) + b->size, opt_.page_size);
    return hi > lo ? hi - lo : 0;
  }

  uint64_t free_segment(Block* b) {
    b->pool->free.erase(b);
    const uint64_t bytes = b->size;
    s_->raw_free(s_->host, b->ptr);
    reserved_ -= bytes;
    Segment* seg = b->segment;
    delete b;
    segments_.erase(
        std::find_if(segments_.begin(), segments_.end(),
                     [seg](const std::unique_ptr<Segment>& p) { return p.get() == seg; }));
    return bytes;
  }

  // Unmaps the pages wholly under the cached block `b`; what stays mapped of it (the parts that
  // share a page with a neighbour) stays cached. The unmapped pages merge with unmapped neighbours,
  // so that they can be mapped again in one piece at the end of the range.
  uint64_t unmap_pages(Block* b) {
    Pool& pool = *b->pool;
    const uint64_t off = uint64_t(b->ptr - b->segment->base);
    const uint64_t lo = round_up(off, opt_.page_size) - off;
    const uint64_t hi = round_down(off + b->size, opt_.page_size) - off;
    if (s_->vm_unmap(s_->host, b->ptr + lo, hi - lo) != HR_OK) return 0;
    reserved_ -= hi - lo;
    pool.free.erase(b);
    // Cut b into [0, lo) cached, [lo, hi) unmapped, [hi, size) cached.
    if (hi < b->size) {
      Block* tail = new Block(*b);
      tail->ptr = b->ptr + hi;
      tail->size = b->size - hi;
      tail->prev = b;
      if (tail->next) tail->next->prev = tail;
      b->next = tail;
      b->size = hi;
      pool.free.insert(tail);
    }
    if (lo > 0) {
      Block* head = new Block(*b);
      head->size = lo;
      head->next = b;
      if (head->prev) head->prev->next = head;
      b->prev = head;
      b->ptr += lo;
      b->size -= lo;
      pool.free.insert(head);
    }
    b->mapped = false;
    try_merge(b, b->prev);
    try_merge(b, b->next);
    pool.unmapped.insert(b);
    return hi - lo;
  }

  // destroy(): everything back to the device, handed out or not (the host frees every buffer
  // before it destroys the allocator; after a failed run some may be left).
  void release_everything() {
    std::vector<Block*> blocks;
    for (Pool* pool : {&small_, &large_}) {
      blocks.insert(blocks.end(), pool->free.begin(), pool->free.end());
      blocks.insert(blocks.end(), pool->unmapped.begin(), pool->unmapped.end());
    }
    for (const auto& [ptr, b] : active_)
      blocks.push_back(b);
    // Expandable segments: unmap every page under a mapped block (pages shared by two blocks once),
    // then the address space.
    std::sort(blocks.begin(), blocks.end(),
              [](const Block* a, const Block* b) { return std::less<char*>()(a->ptr, b->ptr); });
    char* unmapped_to = nullptr;  // pages below this are unmapped already
    for (const Block* b : blocks) {
      if (!b->segment->expandable || !b->mapped) continue;
      const Segment& seg = *b->segment;
      char* lo = seg.base + round_down(uint64_t(b->ptr - seg.base), opt_.page_size);
      char* hi = seg.base + round_up(uint64_t(b->ptr - seg.base) + b->size, opt_.page_size);
      if (unmapped_to && std::less<char*>()(lo, unmapped_to)) lo = unmapped_to;
      if (std::less<char*>()(lo, hi)) s_->vm_unmap(s_->host, lo, uint64_t(hi - lo));
      unmapped_to = hi;
    }
    for (const auto& seg : segments_) {
      if (seg->expandable) {
        s_->vm_release(s_->host, seg->base, seg->size);
      } else {
        s_->raw_free(s_->host, seg->base);
      }
    }
    for (Block* b : blocks)
      delete b;
    segments_.clear();
    small_.free.clear();
    small_.unmapped.clear();
    large_.free.clear();
    large_.unmapped.clear();
    active_.clear();
    reserved_ = allocated_blocks_ = requested_ = 0;
  }

  const hr_host_services* s_;
  Options opt_;
  Pool small_, large_;
  std::vector<std::unique_ptr<Segment>> segments_;
  std::unordered_map<void*, Block*> active_;  // handed-out blocks by address

  uint64_t reserved_ = 0;          // fixed segments and mapped pages
  uint64_t allocated_blocks_ = 0;  // bytes of handed-out blocks (rounded, with split leftovers)
  uint64_t requested_ = 0;         // bytes the handed-out blocks were asked for
  uint64_t device_allocs_ = 0;
  uint64_t retries_ = 0;
  uint64_t ooms_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The C ABI. No exception may leave a hook: a failed allocation of the allocator's own
// bookkeeping is an out-of-memory answer, like any other.

void* hook_allocate(void* instance, uint64_t bytes, uint32_t category, void* stream) {
  (void)category;
  try {
    return static_cast<DefragAllocator*>(instance)->allocate(bytes, stream);
  } catch (...) {
    return nullptr;
  }
}

void hook_deallocate(void* instance, void* ptr, uint64_t bytes, void* stream) {
  (void)bytes;
  (void)stream;  // a block goes back to the pool of the stream it was allocated on
  try {
    static_cast<DefragAllocator*>(instance)->deallocate(ptr);
  } catch (...) {
  }
}

hr_status hook_stats(void* instance, hr_allocator_stats* out) {
  if (!out) return HR_ERROR_INVALID;
  static_cast<const DefragAllocator*>(instance)->stats(out);
  return HR_OK;
}

hr_status on_event(void* instance, const hr_event_info* info) {
  if (info->event != HR_EVENT_STEP_END) return HR_OK;
  try {
    static_cast<DefragAllocator*>(instance)->on_step_end();
  } catch (...) {
    // Releasing only shrinks bookkeeping; a failure leaves memory cached, which is harmless.
  }
  return HR_OK;
}

using headroom_units::format_bytes_exact;

hr_status create(const hr_host_services* s, void** instance) {
  Options o;
  int32_t expandable = -1;  // -1: not in the table
  hr_status st = s->config_size(s->host, "page_size", &o.page_size);
  if (st == HR_OK) st = s->config_size(s->host, "max_split_size", &o.max_split_size);
  if (st == HR_OK) st = s->config_size(s->host, "release_threshold", &o.release_threshold);
  if (st == HR_OK) st = s->config_bool(s->host, "expandable", &expandable);
  if (st != HR_OK) return st;

  // Expandable segments need the virtual-memory services of ABI 1.2. By default they are used
  // where the host has them; asked for explicitly on an older host, they are an error.
  const bool has_vm = HR_HAS_FIELD(s, hr_host_services, vm_release) && s->vm_granularity &&
                      s->vm_reserve && s->vm_map && s->vm_unmap && s->vm_release;
  if (expandable == 1 && !has_vm)
    return s->config_error(s->host, "expandable",
                           "expandable segments need plugin ABI 1.2 (virtual memory); this host "
                           "speaks an older version: set expandable = false");
  o.expandable = expandable != 0 && has_vm;
  if (has_vm) {
    const uint64_t g = s->vm_granularity(s->host);
    if (o.page_size == 0 || g == 0 || o.page_size % g != 0)
      return s->config_error(
          s->host, "page_size",
          ("must be a positive multiple of the device's virtual-memory granularity, " +
           format_bytes_exact(g) + "; got " + format_bytes_exact(o.page_size))
              .c_str());
  }
  if (o.max_split_size != 0 && o.max_split_size <= kSmallSize)
    return s->config_error(s->host, "max_split_size",
                           ("must be 0 (no limit) or above 1MiB, the largest request of the small "
                            "pool; got " +
                            format_bytes_exact(o.max_split_size))
                               .c_str());
  *instance = new DefragAllocator(s, o);
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<DefragAllocator*>(instance);
}

// headroom.estimate/1. An allocator changes no tracked byte: the peak is the one before it. What
// it changes is which free bytes a request can use: at an out-of-memory failure whose request
// fits the free bytes but not the largest free block (fragmentation), expandable segments map
// pages wherever they are free, so the free bytes in holes too small become usable. Not in the
// config, it proposes itself only then.
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!q || !r || !r->after || !q->peak) return HR_ERROR_INVALID;
  const bool fragmented = q->oom_requested > 0 && q->oom_requested <= q->oom_free_bytes &&
                          q->oom_largest_free < q->oom_requested;
  if (!instance && !fragmented) return HR_ERROR_UNSUPPORTED;
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  r->makes_usable = fragmented ? q->oom_free_bytes - q->oom_largest_free : 0;
  // Step time over no plugins: docs/results/plugins.md, "Results", row "defrag_allocator" (0.967,
  // within the noise of 1).
  r->step_time_factor = 1.0;
  std::snprintf(r->what, sizeof r->what,
                "caching allocator with expandable segments: free memory in pieces becomes usable");
  r->toml[0] = '\0';  // its defaults
  return HR_OK;
}

// Aggregates in the headers' field order: constant-initialized, so loading the library runs no
// code before hr_plugin_entry.
const hr_allocator_hooks kAllocator = {
    sizeof(hr_allocator_hooks), 0, hook_allocate, hook_deallocate, hook_stats,
};

// The segment kinds `plan --measure --search` tries.
constexpr hr_estimate_mode kModes[] = {
    headroom_plugin::mode("expandable segments", ""),
    headroom_plugin::mode("fixed segments", "expandable = false"),
};

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "defrag_allocator",
    "1.0.0",
    "caching allocator: size pools, best fit, split and coalesce, expandable segments",
    HR_EVENT_BIT(HR_EVENT_STEP_END),  // events: release_threshold
    HR_ROLE_ALLOCATOR,
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    &kAllocator,
    nullptr,  // optimizer
    nullptr,  // save_state: the cache is rebuilt by the run, nothing to carry over
    nullptr,  // load_state
    // STEP_END releases cached memory: no hook touches the gradients.
    headroom_plugin::offer_all<headroom_plugin::offer_estimate_modes<estimate, kModes>,
                               headroom_plugin::offer_reads<0>>,
};

}  // namespace

// hr_negotiate refuses another major version; the host's message names both versions.
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
