#include "core/shard/shard_file.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "core/config/config.h"

namespace headroom {

namespace {

// A batch is at most kBatch requests, none under kMinFileChunk (the kernel splits larger ones
// anyway); the ring holds both stagings' batches at once.
constexpr uint64_t kMinFileChunk = uint64_t(16) << 20;
constexpr unsigned kBatch = 32;
constexpr unsigned kRing = kBatch * ShardFile::kStagings;

// One staging for slots of these parts: each rounded up to a page, and a page for the alignment.
uint64_t one_staging_bytes(const std::vector<uint64_t>& parts) {
  uint64_t bytes = 0;
  for (uint64_t p : parts)
    bytes += round_to_pages(p);
  return bytes > 0 ? bytes + kDirectPage : 0;
}

}  // namespace

uint64_t shard_file_staging_bytes(const std::vector<uint64_t>& parts) {
  return ShardFile::kStagings * one_staging_bytes(parts);
}

ShardFile::ShardFile(Device& host, const std::string& dir, DirectIo mode, int rank,
                     const std::string& who, std::ostream* log)
    : host_(host),
      path_(tier_file_path(dir, mode, rank, "params", "parameter file", who, log, &direct_)) {}

ShardFile::~ShardFile() {
  // The kernel must be done with the buffers before they go.
  for (int b = 0; b < kStagings; ++b) {
    try {
      if (in_flight_[b]) file_->wait(io_[b]);
    } catch (const std::exception&) {  // the file goes next: what it read does not matter
    }
  }
}

size_t ShardFile::add_slot(const std::vector<uint64_t>& parts) {
  if (!file_) file_ = std::make_unique<DirectFile>(path_, direct_, "parameter file", kRing);
  Slot s;
  s.offset = file_bytes_;
  uint64_t bytes = 0;
  for (uint64_t p : parts) {
    s.parts.push_back(p);
    s.at.push_back(bytes);
    bytes += round_to_pages(p);
  }
  // Its blocks now: a disk that cannot hold the shards says so while the model is built.
  file_->allocate(s.offset, bytes, host_.dry());
  file_bytes_ += bytes;
  const uint64_t staging = one_staging_bytes(parts);
  if (staging > staging_bytes_) {
    // Nothing staged survives between slots being added (the model is being built): the old
    // buffers go before the new ones come, so the ledger's peak is the largest slot's stagings.
    for (int b = 0; b < kStagings; ++b) {
      if (in_flight_[b]) throw std::logic_error("parameter file: a slot added during a read");
      staging_[b] = Buffer();
    }
    for (int b = 0; b < kStagings; ++b) {
      staging_[b] = Buffer(host_, staging, Category::kParameters,
                           "parameter staging " + std::to_string(b) + " (NVMe tier)");
      const uintptr_t p = reinterpret_cast<uintptr_t>(staging_[b].as<void>());
      aligned_[b] =
          reinterpret_cast<unsigned char*>((p + kDirectPage - 1) / kDirectPage * kDirectPage);
    }
    staging_bytes_ = staging;
  }
  slots_.push_back(std::move(s));
  return slots_.size() - 1;
}

void* ShardFile::staged(int b, size_t slot, size_t part) {
  const Slot& s = slots_.at(slot);
  return aligned_[b] + s.at.at(part);
}

void ShardFile::add_ops(DirectFile::Batch& batch, bool write, int b, size_t slot, size_t first,
                        size_t last) const {
  const Slot& s = slots_.at(slot);
  if (first > last || last >= s.parts.size())
    throw std::logic_error("parameter file: parts " + std::to_string(first) + ".." +
                           std::to_string(last) + " of a slot of " +
                           std::to_string(s.parts.size()));
  uint64_t bytes = 0;
  for (size_t p = first; p <= last; ++p)
    bytes += round_to_pages(s.parts[p]);
  // At most kBatch requests (one more a part for the rounding).
  const uint64_t chunk = std::max(kMinFileChunk, round_to_pages((bytes + kBatch - 1) / kBatch));
  for (size_t p = first; p <= last; ++p) {
    const uint64_t n = round_to_pages(s.parts[p]);
    for (uint64_t at = 0; at < n; at += chunk)
      batch.ops.push_back(
          {write, aligned_[b] + s.at[p] + at, std::min(chunk, n - at), s.offset + s.at[p] + at});
  }
}

void ShardFile::start(int b, bool write, size_t slot, size_t first, size_t last) {
  if (in_flight_[b])
    throw std::logic_error("parameter file: staging " + std::to_string(b) + " is in use already");
  io_[b] = DirectFile::Batch();
  if (host_.dry()) return;  // a dry run moves no values
  add_ops(io_[b], write, b, slot, first, last);
  file_->submit(io_[b]);
  in_flight_[b] = true;
}

void ShardFile::start_read(int b, size_t slot) {
  start(b, false, slot, 0, slots_.at(slot).parts.size() - 1);
}

void ShardFile::start_read(int b, size_t slot, size_t part) {
  start(b, false, slot, part, part);
}

void ShardFile::start_write(int b, size_t slot, size_t part) {
  start(b, true, slot, part, part);
}

void ShardFile::wait(int b) {
  if (!in_flight_[b]) return;
  in_flight_[b] = false;
  file_->wait(io_[b]);
}

}  // namespace headroom
