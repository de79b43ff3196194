// The CPU backend's placement model: with [device] memory_limit set, the CPU device is one arena of
// that many bytes that hands out blocks first-fit and caches nothing, as a GPU driver's cudaMalloc
// does. So fragmentation exists on the CPU too: an allocation can fail with enough bytes free in
// total when no single hole is large enough, and an allocator plugin's cure for that can be tested
// on a machine with no GPU.
//
// The arena's memory is a memfd of `capacity` bytes, mapped shared. Pages become real only when
// touched, so a large limit costs nothing until it is used. Because the memory is a file, the
// virtual-memory services can alias its pages into a reserved address range with
// mmap(MAP_FIXED | MAP_SHARED, memfd, offset): the same design as cuMemCreate + cuMemMap, where
// physical pages taken from anywhere in the arena appear contiguous in the reserved range.
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>

namespace headroom {

// Reserves `bytes` of address space with nothing behind it (PROT_NONE), starting at a multiple of
// `alignment` (a power of two); nullptr on failure. Freed with munmap.
void* reserve_address_range(uint64_t bytes, uint64_t alignment);

class Arena {
 public:
  // Blocks start at multiples of 512 bytes and their sizes are rounded up to it, as cudaMalloc's
  // are: the padding is memory that is neither free nor live.
  static constexpr uint64_t kAlignment = 512;
  // What vm_map hands out: pages of 2 MiB at 2 MiB-aligned offsets (CUDA's usual granularity).
  static constexpr uint64_t kPageSize = uint64_t(2) << 20;

  // Throws std::runtime_error when the memfd cannot be created or mapped.
  explicit Arena(uint64_t capacity);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // The first hole (lowest address) that holds `bytes` rounded up to kAlignment; nullptr when
  // no hole does, however many bytes are free in total.
  void* allocate(uint64_t bytes);
  // Returns a block from allocate() to the free space, merged with its free neighbours. False (and
  // nothing changes) for a pointer allocate() did not return.
  bool free(void* ptr);

  // Virtual memory. Addresses and sizes are multiples of kPageSize. vm_reserve returns an address
  // range with nothing behind it; vm_map backs [addr, addr + bytes) with arena pages taken from
  // wherever a 2 MiB-aligned run is free (they need not be contiguous in the arena), all or none;
  // vm_unmap returns them (their contents are gone); vm_release unmaps and returns the range.
  void* vm_reserve(uint64_t bytes);
  bool vm_map(void* addr, uint64_t bytes);
  void vm_unmap(void* addr, uint64_t bytes);
  void vm_release(void* addr, uint64_t bytes);

  struct Stats {
    uint64_t capacity = 0;
    uint64_t used = 0;          // blocks (with their padding) and mapped pages
    uint64_t free = 0;          // capacity - used
    uint64_t largest_free = 0;  // the largest hole: the most one allocate() can get
  };
  Stats stats() const;

  // The arena's own view of its memory, and where a block or a mapped page lies in it (tests use
  // these to see aliasing). offset_of returns UINT64_MAX for an address the arena does not back.
  char* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t offset_of(const void* ptr) const;

 private:
  static constexpr uint64_t kNone = UINT64_MAX;
  // Carves `bytes` from the first hole holding them at an offset that is a multiple of `align`;
  // kNone when none does.
  uint64_t take(uint64_t bytes, uint64_t align);
  // Returns [offset, offset + bytes) to the holes, merging it with adjacent ones.
  void give_back(uint64_t offset, uint64_t bytes);
  // Whether [addr, addr + bytes) lies inside one range from vm_reserve.
  bool in_reserved_range(uintptr_t addr, uint64_t bytes) const;
  // Puts a page back to PROT_NONE anonymous memory (the reservation without backing) and its
  // arena offset back into the holes.
  void unmap_page(uintptr_t page, uint64_t offset);

  int fd_ = -1;
  char* base_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> holes_;             // offset -> bytes; no two adjacent
  std::unordered_map<uint64_t, uint64_t> blocks_;  // offset -> bytes of each allocate()
  std::map<uintptr_t, uint64_t> pages_;            // mapped page address -> arena offset
  std::map<uintptr_t, uint64_t> ranges_;           // reserved range start -> bytes
};

}  // namespace headroom
