#include "core/run/state_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/config/config.h"
#include "core/os/output_file.h"

namespace headroom {

namespace {

uint64_t round_up(uint64_t n, uint64_t to) {
  return (n + to - 1) / to * to;
}

std::string os_reason(int err) {
  return std::strerror(err);
}

// A tensor's range is at most kMaxRequests requests; a batch is a piece's writes and the next
// one's reads (up to kMaxTensors tensors each), one batch in flight at a time.
constexpr unsigned kMaxRequests = 32, kMaxTensors = 4;
constexpr unsigned kRingEntries = 2 * kMaxTensors * kMaxRequests;
// The smallest I/O: below it the per-request cost shows (fio's rates at 1 MiB blocks are the
// disk's).
constexpr uint64_t kMinChunk = uint64_t(1) << 20;

}  // namespace

StateFile::StateFile(Device& host, const std::string& dir, DirectIo mode, int rank,
                     const std::string& who, std::ostream* log)
    : host_(host),
      path_(tier_file_path(dir, mode, rank, "optstate", "optimizer state file", who, log,
                           &direct_)) {}

StateFile::~StateFile() {
  try {
    unmap();
  } catch (const std::exception&) {  // the file goes next: nothing of it is kept
  }
}

void StateFile::open(const std::vector<uint64_t>& numels, int tensors, Dtype dtype, bool chunked) {
  if (file_) throw std::logic_error("the optimizer state file is open already");
  if (tensors < 0 || tensors > int(kMaxTensors))
    throw std::logic_error("optimizer state: 0 to 4 tensors a segment");
  numels_ = numels;
  tensors_ = tensors;
  dtype_ = dtype;
  offsets_.clear();
  pieces_.clear();
  file_bytes_ = 0;
  for (size_t k = 0; k < numels.size(); ++k) {
    offsets_.push_back(file_bytes_);
    file_bytes_ += state_slot_bytes(numels[k], tensors, dtype);
    const uint64_t step = state_piece_numel(numels[k], chunked);
    for (uint64_t first = 0; first < numels[k]; first += step)
      pieces_.push_back({k, first, std::min(step, numels[k] - first)});
  }
  const uint64_t largest = state_file_host_bytes(numels, tensors, dtype, chunked) / 2;
  // At most kMaxRequests requests a tensor's range, none smaller than kMinChunk.
  const uint64_t range =
      largest > kStatePage ? (largest - kStatePage) / uint64_t(std::max(tensors, 1)) : 0;
  chunk_ = std::max(kMinChunk, round_up((range + kMaxRequests - 1) / kMaxRequests, kStatePage));
  // From here on the file is removed when the StateFile goes. Every block now: a disk that cannot
  // hold the state says so before step 1.
  file_ = std::make_unique<DirectFile>(path_, direct_, "optimizer state file", kRingEntries);
  file_->allocate(0, file_bytes_, host_.dry());
  for (int b = 0; b < 2 && largest > 0; ++b) {
    staging_[b] = Buffer(host_, largest, Category::kOptimizer,
                         "optimizer state staging " + std::to_string(b) + " (NVMe tier)");
    const uintptr_t p = reinterpret_cast<uintptr_t>(staging_[b].as<void>());
    aligned_[b] = reinterpret_cast<unsigned char*>(round_up(p, kStatePage));
  }
}

void StateFile::state_pointers(unsigned char* base, uint64_t numel, void** out) const {
  const uint64_t tensor = round_up(numel * dtype_size(dtype_), kStatePage);
  for (int j = 0; j < tensors_; ++j)
    out[j] = base + uint64_t(j) * tensor;
}

// Piece p's requests: of each tensor j, the range [first, first + n) of its slot in the file, to
// or from tensor j's place in the staging buffer; rounded up to whole pages (first is a multiple
// of kStateChunk, so a page too; the slot is padded to a page, so the last piece's rounding stays
// in it).
void StateFile::add_ops(DirectFile::Batch& batch, bool write, const Piece& p,
                        unsigned char* buffer) const {
  const uint64_t elem = dtype_size(dtype_);
  const uint64_t in_file = round_up(numels_[p.k] * elem, kStatePage);
  const uint64_t in_buffer = round_up(p.n * elem, kStatePage);
  for (int j = 0; j < tensors_; ++j) {
    const uint64_t file_at = offsets_[p.k] + uint64_t(j) * in_file + p.first * elem;
    unsigned char* data = buffer + uint64_t(j) * in_buffer;
    for (uint64_t at = 0; at < in_buffer; at += chunk_)
      batch.ops.push_back({write, data + at, std::min(chunk_, in_buffer - at), file_at + at});
  }
}

void StateFile::stream(const Update& update, Pass pass) {
  if (!file_) throw std::logic_error("the optimizer state file is not open");
  unmap();
  const size_t n = pieces_.size();
  const bool reads = pass != Pass::kWrite, writes = pass != Pass::kRead;
  if (reads && n > 0) {
    DirectFile::Batch first;
    add_ops(first, false, pieces_[0], aligned_[0]);
    file_->submit(first);
    file_->wait(first);
  }
  void* state[kMaxTensors];
  for (size_t p = 0; p < n; ++p) {
    unsigned char* other = aligned_[(p + 1) % 2];
    // In flight while piece p is updated: piece p-1's write-back from the other buffer, then
    // piece p+1's read into it.
    DirectFile::Batch batch;
    if (writes && p >= 1) add_ops(batch, true, pieces_[p - 1], other);
    if (reads && p + 1 < n) add_ops(batch, false, pieces_[p + 1], other);
    file_->submit(batch);
    const Piece& piece = pieces_[p];
    state_pointers(aligned_[p % 2], piece.n, state);
    try {
      update(piece.k, piece.first, piece.n, state);
    } catch (...) {
      // The kernel must be done with the buffers before anything frees them.
      try {
        file_->wait(batch);
      } catch (const std::exception&) {  // the update's error is the one to report
      }
      throw;
    }
    file_->wait(batch);
  }
  if (writes && n > 0) {
    DirectFile::Batch last;
    add_ops(last, true, pieces_[n - 1], aligned_[(n - 1) % 2]);
    file_->submit(last);
    file_->wait(last);
  }
}

std::vector<void*> StateFile::map() {
  if (!file_) throw std::logic_error("the optimizer state file is not open");
  if (!mapping_ && file_bytes_ > 0) {
    void* p = mmap(nullptr, file_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, file_->fd(), 0);
    if (p == MAP_FAILED)
      throw OutputError("optimizer state file " + path_ + ": mmap: " + os_reason(errno));
    mapping_ = p;
  }
  std::vector<void*> out(numels_.size() * size_t(tensors_));
  for (size_t k = 0; k < numels_.size(); ++k)
    state_pointers(static_cast<unsigned char*>(mapping_) + offsets_[k], numels_[k],
                   out.data() + k * size_t(tensors_));
  return out;
}

void StateFile::unmap() {
  if (!mapping_) return;
  // What a resume wrote into the mapping reaches the file before O_DIRECT reads it.
  const int r = msync(mapping_, file_bytes_, MS_SYNC);
  const int err = errno;
  munmap(mapping_, file_bytes_);
  mapping_ = nullptr;
  if (r != 0) throw OutputError("optimizer state file " + path_ + ": msync: " + os_reason(err));
}

}  // namespace headroom
