// Training snapshots: everything a run needs to continue exactly where it stopped — weights,
// optimizer state, step, data position, every plugin's state. (Not activation checkpointing.)
//
// One file per snapshot, DIR/step_<N>.hrsnap: written to a temporary name, fsynced, renamed, and
// the folder fsynced, so a crash at any moment leaves the previous complete snapshot usable.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace headroom {

struct SnapshotData {
  int64_t step = 0;  // the last completed optimizer step
  int64_t skipped_steps = 0;
  std::string data_state;  // DataLoader::state(): the batch to read next
  std::string model;       // the model shape, to refuse a snapshot of another model
  std::string optimizer;
  std::map<std::string, std::vector<uint8_t>> tensors;  // parameters and optimizer state
  std::map<std::string, std::vector<uint8_t>> plugins;  // each plugin's saved state
};

// Writes `data` as DIR/step_<step>.hrsnap (creating DIR), then deletes all but the newest `keep`.
// Returns the file's path. Throws std::runtime_error when the file cannot be written.
std::string write_snapshot(const std::string& dir, const SnapshotData& data, int keep);

// The newest snapshot in `dir` that reads back whole (magic, manifest, checksum), and its path in
// *path; files that do not are skipped with a warning on stderr. Throws ConfigError when there is
// none.
SnapshotData read_newest_snapshot(const std::string& dir, std::string* path);

// Reads and verifies one snapshot. Throws ConfigError naming the file and what is wrong.
SnapshotData read_snapshot(const std::string& file);

}  // namespace headroom
