// Every rank of a run must run the same run. Ranks that resolved different configs (one given
// --set train.steps=3, another 5; another n_embd; another lr) hung, aborted inside MPI, or trained
// on with weights from both: so at start the ranks compare a digest of everything they resolved,
// and on a mismatch every rank stops with a ConfigError (exit 2) naming the first key that differs
// and what each rank has for it.
//
// What is compared: every key of the resolved config (format_config: the TOML `check` prints,
// which reads back as the same Config), [[plugins]] tables and their keys included, and the flags
// that change what the ranks do together (--resume: every rank resumes; --save-weights: every
// rank gathers the weights). Left out, as what may differ between ranks without changing the run:
// device.index (each GPU rank takes its own), device.threads, data.workers and data.prefetch (how
// a rank computes and reads, not what), and the per-rank output paths, which are not config keys.
// Paths compare as resolved (absolute): every rank must see the same files at the same paths.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"

namespace headroom {

// One compared item: "train.steps" -> "3", "plugins.amp.dtype" -> "'bf16'", "--resume" -> "yes".
using AgreementItem = std::pair<std::string, std::string>;

// The items of `flags` (name -> value), then those of `config` in the order format_config writes
// them.
std::vector<AgreementItem> agreement_items(const Config& config,
                                           const std::vector<AgreementItem>& flags);

// A collective: every rank calls it at the same point. Nothing at world size 1. One all-gather
// of a 64-bit digest when the ranks agree; otherwise a few more to find the first item that
// differs and each rank's value of it, then ConfigError on every rank:
//   "the ranks disagree: rank 1 resolved another config than rank 0: the first key that differs
//    is train.steps: rank 0 has 3, rank 1 has 5 (every rank must run ...)".
void check_ranks_agree(const std::vector<AgreementItem>& items, Communicator& comm);

}  // namespace headroom
