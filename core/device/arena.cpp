#include "core/device/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace headroom {

namespace {

uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

// PROT_NONE anonymous memory: address space that faults when touched and costs no memory.
constexpr int kReserveFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

}  // namespace

void* reserve_address_range(uint64_t bytes, uint64_t alignment) {
  if (bytes == 0) return nullptr;
  // mmap only promises page alignment: take `alignment` more and trim both ends.
  const uint64_t span = bytes + alignment;
  void* p = mmap(nullptr, span, PROT_NONE, kReserveFlags, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = align_up(start, alignment);
  if (aligned > start) munmap(p, aligned - start);
  const uintptr_t end = aligned + bytes;
  if (start + span > end) munmap(reinterpret_cast<void*>(end), start + span - end);
  return reinterpret_cast<void*>(aligned);
}

Arena::Arena(uint64_t capacity) : capacity_(capacity) {
  fd_ = memfd_create("headroom-arena", MFD_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error(std::string("memfd_create: ") + std::strerror(errno));
  // The file is sparse: ftruncate allocates nothing, a page is real once something touches it.
  const uint64_t file_bytes = align_up(capacity, uint64_t(sysconf(_SC_PAGESIZE)));
  if (ftruncate(fd_, off_t(file_bytes)) != 0) {
    const std::string err = std::strerror(errno);
    close(fd_);
    throw std::runtime_error("arena of " + std::to_string(capacity) + " bytes: ftruncate: " + err);
  }
  void* p = mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
  if (p == MAP_FAILED) {
    const std::string err = std::strerror(errno);
    close(fd_);
    throw std::runtime_error("arena of " + std::to_string(capacity) + " bytes: mmap: " + err);
  }
  base_ = static_cast<char*>(p);
  holes_.emplace(0, capacity);
}

Arena::~Arena() {
  // Ranges the allocator did not release: their mappings go with them.
  for (const auto& [start, bytes] : ranges_)
    munmap(reinterpret_cast<void*>(start), bytes);
  munmap(base_, align_up(capacity_, uint64_t(sysconf(_SC_PAGESIZE))));
  close(fd_);
}

uint64_t Arena::take(uint64_t bytes, uint64_t align) {
  for (auto it = holes_.begin(); it != holes_.end(); ++it) {
    const uint64_t off = it->first, size = it->second;
    const uint64_t start = align_up(off, align);
    if (start - off > size || bytes > off + size - start) continue;  // no wrap-around
    holes_.erase(it);
    if (start > off) holes_.emplace(off, start - off);
    if (start + bytes < off + size) holes_.emplace(start + bytes, off + size - start - bytes);
    used_ += bytes;
    return start;
  }
  return kNone;
}

void Arena::give_back(uint64_t offset, uint64_t bytes) {
  used_ -= bytes;
  auto next = holes_.lower_bound(offset);
  // Merge with the hole that ends where this one starts, and with the one that starts where it
  // ends: holes never touch, so the largest hole is the largest block allocate() can give.
  if (next != holes_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      bytes += prev->second;
      holes_.erase(prev);
    }
  }
  if (next != holes_.end() && offset + bytes == next->first) {
    bytes += next->second;
    holes_.erase(next);
  }
  holes_.emplace(offset, bytes);
}

void* Arena::allocate(uint64_t bytes) {
  const uint64_t size = align_up(std::max<uint64_t>(bytes, 1), kAlignment);
  if (size < bytes) return nullptr;  // wrapped around: no arena holds that
  const uint64_t off = take(size, kAlignment);
  if (off == kNone) return nullptr;
  blocks_.emplace(off, size);
  return base_ + off;
}

bool Arena::free(void* ptr) {
  const char* p = static_cast<const char*>(ptr);
  if (p < base_ || p >= base_ + capacity_) return false;
  auto it = blocks_.find(uint64_t(p - base_));
  if (it == blocks_.end()) return false;
  give_back(it->first, it->second);
  blocks_.erase(it);
  return true;
}

void* Arena::vm_reserve(uint64_t bytes) {
  if (bytes == 0 || bytes % kPageSize != 0) return nullptr;
  void* p = reserve_address_range(bytes, kPageSize);
  if (p) ranges_.emplace(reinterpret_cast<uintptr_t>(p), bytes);
  return p;
}

bool Arena::in_reserved_range(uintptr_t addr, uint64_t bytes) const {
  auto it = ranges_.upper_bound(addr);
  if (it == ranges_.begin()) return false;
  --it;
  return addr >= it->first && addr + bytes <= it->first + it->second;
}

void Arena::unmap_page(uintptr_t page, uint64_t offset) {
  // Mapping fresh PROT_NONE memory over the page drops the alias to the arena in one call and
  // keeps the address reserved, as cuMemUnmap leaves the range reserved.
  mmap(reinterpret_cast<void*>(page), kPageSize, PROT_NONE, kReserveFlags | MAP_FIXED, -1, 0);
  give_back(offset, kPageSize);
}

bool Arena::vm_map(void* addr, uint64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  if (bytes == 0 || start % kPageSize != 0 || bytes % kPageSize != 0) return false;
  if (!in_reserved_range(start, bytes)) return false;
  for (uintptr_t page = start; page < start + bytes; page += kPageSize)
    if (pages_.count(page)) return false;  // already backed: mapping twice is the caller's bug

  // All or nothing: on the first page that cannot be backed, undo the ones that were.
  for (uintptr_t page = start; page < start + bytes; page += kPageSize) {
    const uint64_t off = take(kPageSize, kPageSize);
    void* p = off == kNone ? MAP_FAILED
                           : mmap(reinterpret_cast<void*>(page), kPageSize, PROT_READ | PROT_WRITE,
                                  MAP_SHARED | MAP_FIXED, fd_, off_t(off));
    if (p == MAP_FAILED) {
      if (off != kNone) give_back(off, kPageSize);
      for (uintptr_t q = start; q < page; q += kPageSize) {
        unmap_page(q, pages_.at(q));
        pages_.erase(q);
      }
      return false;
    }
    pages_.emplace(page, off);
  }
  return true;
}

void Arena::vm_unmap(void* addr, uint64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  auto it = pages_.lower_bound(start);
  while (it != pages_.end() && it->first < start + bytes) {
    unmap_page(it->first, it->second);
    it = pages_.erase(it);
  }
}

void Arena::vm_release(void* addr, uint64_t bytes) {
  // The whole range goes, whatever `bytes` says, as with cuMemAddressFree of its start.
  (void)bytes;
  auto it = ranges_.find(reinterpret_cast<uintptr_t>(addr));
  if (it == ranges_.end()) return;
  vm_unmap(addr, it->second);
  munmap(addr, it->second);
  ranges_.erase(it);
}

Arena::Stats Arena::stats() const {
  Stats s;
  s.capacity = capacity_;
  s.used = used_;
  s.free = capacity_ - used_;
  for (const auto& [off, size] : holes_)
    s.largest_free = std::max(s.largest_free, size);
  return s;
}

uint64_t Arena::offset_of(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  if (p >= base_ && p < base_ + capacity_) return uint64_t(p - base_);
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  auto it = pages_.upper_bound(a);
  if (it == pages_.begin()) return kNone;
  --it;
  if (a >= it->first + kPageSize) return kNone;
  return it->second + (a - it->first);
}

}  // namespace headroom
