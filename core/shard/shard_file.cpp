#include "core/shard/shard_file.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "core/config/config.h"

namespace headroom {

namespace {

// Requests of at most kChunk bytes (the kernel splits larger ones anyway), kRing in flight.
constexpr uint64_t kChunk = uint64_t(16) << 20;
constexpr unsigned kRing = 64;

}  // namespace

uint64_t shard_file_staging_bytes(const std::vector<uint64_t>& parts) {
  uint64_t bytes = 0;
  for (uint64_t p : parts)
    bytes += round_to_pages(p);
  return bytes > 0 ? bytes + kDirectPage : 0;
}

ShardFile::ShardFile(Device& host, const std::string& dir, DirectIo mode, int rank,
                     const std::string& who, std::ostream* log)
    : host_(host), dir_(dir) {
  const std::string problem = check_state_dir(dir, mode, &direct_);
  if (!problem.empty()) throw ConfigError(who + problem);
  if (mode == DirectIo::kAuto && !direct_ && log)
    *log << "offload: the parameter file in " << dir
         << " is read and written buffered: " << file_system_name(dir) << " refuses O_DIRECT\n";
  // The pid and a count of this process's files: two runs may share the folder, and one process
  // may hold two trainers (tests do).
  static std::atomic<int> made{0};
  path_ = dir + "/headroom-" + std::to_string(getpid()) + "-" + std::to_string(made++) + "-rank" +
          std::to_string(rank) + ".params";
}

ShardFile::~ShardFile() = default;

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
  const uint64_t staging = shard_file_staging_bytes(parts);
  if (staging > staging_bytes_) {
    // Nothing staged survives between calls: the old buffer goes before the new one comes, so
    // the ledger's peak is the largest slot's staging alone.
    staging_ = Buffer();
    staging_ = Buffer(host_, staging, Category::kParameters, "parameter staging (NVMe tier)");
    staging_bytes_ = staging;
    const uintptr_t p = reinterpret_cast<uintptr_t>(staging_.as<void>());
    aligned_ = reinterpret_cast<unsigned char*>((p + kDirectPage - 1) / kDirectPage * kDirectPage);
  }
  slots_.push_back(std::move(s));
  return slots_.size() - 1;
}

void* ShardFile::staged(size_t slot, size_t part) {
  const Slot& s = slots_.at(slot);
  return aligned_ + s.at.at(part);
}

void ShardFile::read(size_t slot, size_t first, size_t last) {
  move(false, slot, first, last);
}

void ShardFile::write(size_t slot, size_t first, size_t last) {
  move(true, slot, first, last);
}

void ShardFile::move(bool write, size_t slot, size_t first, size_t last) {
  const Slot& s = slots_.at(slot);
  if (first > last || last >= s.parts.size())
    throw std::logic_error("parameter file: parts " + std::to_string(first) + ".." +
                           std::to_string(last) + " of a slot of " +
                           std::to_string(s.parts.size()));
  if (host_.dry()) return;  // a dry run moves no values
  // The parts' pages, in requests of at most kChunk, kRing a batch.
  std::vector<DirectFile::Op> ops;
  for (size_t p = first; p <= last; ++p) {
    const uint64_t bytes = round_to_pages(s.parts[p]);
    for (uint64_t at = 0; at < bytes; at += kChunk)
      ops.push_back(
          {write, aligned_ + s.at[p] + at, std::min(kChunk, bytes - at), s.offset + s.at[p] + at});
  }
  for (size_t i = 0; i < ops.size(); i += kRing) {
    DirectFile::Batch batch;
    batch.ops.assign(ops.begin() + std::ptrdiff_t(i),
                     ops.begin() + std::ptrdiff_t(std::min(ops.size(), i + kRing)));
    file_->submit(batch);
    file_->wait(batch);
  }
}

}  // namespace headroom
