// Training snapshots: everything a run needs to continue exactly where it stopped — weights,
// optimizer state, step, data position, every plugin's state. (Not activation checkpointing.)
//
// One file per snapshot, DIR/step_<N>.hrsnap (N zero-padded to 12 digits), written through
// AtomicFile: a temporary beside it (DIR/.step_<N>.hrsnap.tmp), fsynced, renamed, the folder
// fsynced. A crash or a failed write at any moment leaves the previous complete snapshots as they
// were.
//
// File format 02 (all integers little-endian):
//
//   offset  size  field
//   0       8     magic "HRSNAP02"
//   8       8     manifest_len: bytes of the manifest
//   16      8     checksum: FNV-1a 64 of bytes [0, 16) followed by bytes [24, end of file) -- every
//                 byte of the file except the checksum itself
//   24      M     manifest: a JSON object of exactly these keys
//                   "step"           integer >= 1: the last completed optimizer step
//                   "skipped_steps"  integer, 0 <= skipped_steps <= step
//                   "data_state"     string
//                   "model"          non-empty string
//                   "optimizer"      non-empty string
//                   "tensors"        array of {"name": non-empty string, "offset": integer,
//                                     "bytes": integer}; names unique
//                   "plugins"        the same, for plugin states
//                   "payload_bytes"  integer: the size of the payload
//   24 + M  P     payload: the tensors' bytes and then the plugins' bytes, in manifest order, each
//                 entry starting where the one before ends (offset 0 first): no gaps, no overlaps,
//                 and the last one ends exactly at payload_bytes, which is exactly the rest of the
//                 file.
//
// A reader checks the checksum before it believes anything, then every key and value above; a
// duplicate or unknown key is refused as well. So nothing a resume reads can come from a damaged
// or hand-edited file. (FNV-1a catches damage and edits; it is not a signature: whoever can write
// the file can recompute it.)
//
// Format 01 (magic "HRSNAP01", headroom before this change) checked only the payload; it is
// refused with a message that says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
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
  // The lowest validation loss so far (train.eval_every), and the step it was measured at; step
  // 0: none yet (the manifest then has no "best_val_loss").
  double best_val_loss = 0.0;
  int64_t best_val_step = 0;
  // A run on a frozen base ([train] freeze, lora) writes its trainable parameters alone and names
  // its base instead (manifest "frozen_base"): where the base came from and a checksum of its
  // values (frozen_base_checksum), which a resume checks against its own base.
  struct FrozenBase {
    std::string init_from;  // train.init_from (a PEFT adapter folder's base); "" for train.seed's
    uint64_t seed = 0;      // train.seed, whose init is the base when init_from is ""
    uint64_t checksum = 0;
    uint64_t tensors = 0;  // the frozen parameters, none of them in `tensors`
  };
  std::optional<FrozenBase> frozen_base;
};

// FNV-1a (64 bits) of `n` bytes, continuing from `h` (the offset basis to start): the snapshot's
// own checksum and a frozen base's. It tells bases apart; it does not authenticate them.
constexpr uint64_t kChecksumBasis = 1469598103934665603ull;
uint64_t checksum_bytes(const uint8_t* p, size_t n, uint64_t h = kChecksumBasis);

// The size of the fixed header (magic, manifest_len, checksum).
constexpr size_t kSnapshotHeaderBytes = 24;

// Writes `data` as DIR/step_<step>.hrsnap (creating DIR), then deletes all but the newest `keep`
// and any temporaries a killed run left behind. Returns the file's path. Throws OutputError naming
// the file (or DIR) and the OS's reason when it cannot be written; the snapshots already there are
// then untouched and no temporary is left. std::invalid_argument for a step < 1 or a
// skipped_steps outside [0, step] (a bug of the caller: such a file would be refused).
std::string write_snapshot(const std::string& dir, const SnapshotData& data, int keep);

// The newest complete snapshot in `dir`, and its path in *path: one that reads back whole
// (read_snapshot) and, written by ranks, whose every rank part reads back whole too
// (read_rank_part). One that is not is skipped with a warning on stderr naming it and why (from
// rank 0, with ranks), and the one before it tried; leftover temporaries (.step_*.hrsnap.tmp) are
// ignored. Throws ConfigError when there is none.
SnapshotData read_newest_snapshot(const std::string& dir, std::string* path);

// Reads and verifies one snapshot (parse_snapshot), and that a file named step_<N>.hrsnap holds
// step N. Throws ConfigError "snapshot FILE: what is wrong".
SnapshotData read_snapshot(const std::string& file);

// Verifies and decodes a snapshot's bytes; `name` stands for the file in messages. Any bytes at
// all give either a SnapshotData that satisfies every rule above or a ConfigError
// "snapshot NAME: what is wrong".
SnapshotData parse_snapshot(const uint8_t* data, size_t size, const std::string& name);

// Ranks (world size W > 1). Rank 0 writes the replicated state as above, with data_state
// ranks_data_state(W) ("ranks W"); each rank r writes its own part beside it as
// DIR/step_<N>.rank<r>.data: its data position and the tensors that are its own (its shards of the
// optimizer state, when a zero plugin shards it), in format 02 (AtomicFile) with "model" saying
// whose part it is ("rank r of W") and "optimizer" "-". Every rank writes its part before rank 0
// writes step_<N>.hrsnap, so a snapshot file means every part is there (on a folder every rank
// shares); pruning a snapshot removes its parts. A resume at another world size or sharding reads
// every part (StateResharder, below): the data positions are global, the state ranges named.
std::string ranks_data_state(int world_size);
// The world size a snapshot was written at: W for ranks_data_state(W), else 1.
int snapshot_world_size(const std::string& data_state);
// DIR/step_<N>.hrsnap: the path write_snapshot gives step N.
std::string snapshot_file(const std::string& dir, int64_t step);
// Writes rank `rank`'s part of step N's snapshot. Throws OutputError.
void write_rank_part(const std::string& dir, int64_t step, int rank, int world_size,
                     const std::string& data_state,
                     const std::map<std::string, std::vector<uint8_t>>& tensors = {});
struct RankPart {
  std::string data_state;
  std::map<std::string, std::vector<uint8_t>> tensors;
};
// DIR/step_<N>.rank<r>.data: where rank r's part of step N is.
std::string rank_part_file(const std::string& dir, int64_t step, int rank);
// Reads it back. ConfigError when it is missing, damaged, or not rank `rank`'s of step N at world
// size `world_size`.
RankPart read_rank_part(const std::string& dir, int64_t step, int rank, int world_size);

// Resharding: resuming optimizer state written at one sharding (a world size, sharded or not) into
// another. What the optimizer's signature says (a snapshot's "optimizer"): "adamw", or "adamw
// sharded over 4 ranks" when the state is in the rank parts; `optimizer` is then "adamw" and
// `sharded_over` 4 (0 when not sharded).
struct OptimizerLayout {
  std::string optimizer;
  int sharded_over = 0;
};
OptimizerLayout optimizer_layout(const std::string& signature);

// The signature of the optimizer role's state: "plugin 'lion'", naming the plugin that took the
// role. Snapshots written before the name was recorded say "plugin" alone.
std::string plugin_optimizer_signature(const std::string& plugin);
// Whether a signature is the optimizer role's, and the plugin it names ("" for an old "plugin").
bool is_plugin_optimizer(const std::string& signature);
std::string optimizer_plugin_of(const std::string& signature);
// Whether snapshot optimizer signature `theirs` resumes into a run whose signature is `ours`: the
// same optimizer (its sharding may differ), an old unnamed "plugin" matching any plugin's.
bool same_optimizer(const std::string& theirs, const std::string& ours);

// Why snapshot `d` cannot resume a run whose optimizer signature is `ours`: "was made with
// optimizer adamw; this config's optimizer is plugin 'adafactor' ...". An optimizer plugin is
// named on either side: this run's (`our_plugin`, "" for none), and the snapshot's by its
// signature, or for an old snapshot whose signature says only "plugin", by the plugin states it
// holds that this run does not load (`loaded`: the config's plugin names).
std::string optimizer_mismatch(const SnapshotData& d, const std::string& ours,
                               const std::string& our_plugin,
                               const std::vector<std::string>& loaded);

// An optimizer state tensor's name, "<parameter>[ [a:b)] <kind>" (core/optim: the segment's name
// and the kind, "adamw m"; core/shard: a segment that is part of a parameter adds its element
// range [a:b)). `whole`: no range was given (the whole parameter). False when `name` is not of
// that form (a parameter's own name is not: it has no kind).
struct StateName {
  std::string param, kind;
  bool whole = true;
  uint64_t begin = 0, end = 0;  // with !whole
};
bool parse_state_name(const std::string& name, StateName* out);

// Builds this run's optimizer state tensors (float32) from a snapshot's, cut however they were
// cut: every snapshot tensor that overlaps a wanted one gives it the elements they share, at
// their place in the parameter. The snapshot's tensors may come one container at a time (the
// replicated file, each rank part), so only what this run wants is held.
class StateResharder {
 public:
  // `params`: each parameter's name and element count.
  explicit StateResharder(std::map<std::string, uint64_t> params);
  // A state tensor of this run, of `numel` elements. std::invalid_argument when its name is not
  // a state name of a parameter of `params` with that many elements (a bug of the caller).
  void want(const std::string& name, uint64_t numel);
  // A tensor of the snapshot, read from `file`. ConfigError "FILE: ..." when it is no state
  // tensor of a parameter (or a parameter's own tensor: those are not state), when its range lies
  // outside the parameter or its bytes are not its range's. Wanted tensors it does not overlap,
  // and wanted kinds it is not, ignore it.
  void take(const std::string& name, const std::vector<uint8_t>& bytes, const std::string& file);
  // ConfigError "WHAT has ..." naming the first wanted tensor whose elements were not all given, or
  // some given twice, and which.
  void check(const std::string& what) const;
  // A wanted tensor's bytes (numel * 4), once check() passed.
  const std::vector<uint8_t>& bytes(const std::string& name) const;

 private:
  struct Wanted {
    std::string name;
    StateName at;  // whole resolved: begin, end in the parameter
    std::vector<uint8_t> bytes;
    std::vector<std::pair<uint64_t, uint64_t>> given;  // element ranges in the parameter
  };
  std::map<std::string, uint64_t> params_;
  std::vector<Wanted> wanted_;
  std::map<std::pair<std::string, std::string>, std::vector<size_t>> by_param_kind_;
  std::map<std::string, size_t> by_name_;
};

// The checksum format 02 stores at offset 16, of a whole file's bytes (size >= 24). For tools and
// tests that build a file by hand.
uint64_t snapshot_checksum(const uint8_t* data, size_t size);

}  // namespace headroom
