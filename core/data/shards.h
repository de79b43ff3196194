// llm.c-format token shards: a header of 256 int32 (magic 20240520, version 1, token count), then
// the tokens as uint16, all little-endian. The shard source memory-maps one shard at a time and
// cuts it into windows exactly as llm.c's DataLoader does; `headroom shard` writes text as such
// shards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/data.h"

namespace headroom {

// llm.c: a header of 256 int32 (magic, version 1, token count), then the uint16 tokens.
constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr size_t kShardHeaderBytes = 256 * sizeof(int32_t);
// headroom's addition, in an int llm.c leaves 0: header int 3 holds the vocab size of the
// tokenizer that wrote the shard (256 for bytes); 0 (llm.c's, tiktoken's shards) means unknown.
// A run whose model.vocab_size is smaller is refused before its first step.
constexpr int kShardVocabInt = 3;

// One validated shard: path and token count.
struct ShardInfo {
  std::string path;
  uint64_t tokens = 0;      // the file's
  uint32_t vocab_size = 0;  // header int 3: the writing tokenizer's vocab size; 0 = unknown
  // The part a source reads: tokens first .. first + count - 1 (all of them unless
  // data.val_fraction holds out the tail of the shards).
  uint64_t first = 0;
  uint64_t count = 0;
};

// Validates one shard file: magic, version == 1, file size == 1024 + 2*count, count >= min_tokens.
// Throws ConfigError("FILE: ...") saying what is wrong and what was expected.
ShardInfo validate_shard(const std::string& path, uint64_t min_tokens);

// Parses a header from memory (`size` bytes of it are readable; the whole file is `file_size`
// bytes): returns the token count or throws ConfigError naming `file`. The count is read as an
// unsigned 32-bit number.
uint64_t parse_shard_header(const uint8_t* data, size_t size, uint64_t file_size,
                            const std::string& file);

// `n` raw tokens of a shard starting at token `offset` (counted from the first token after the
// header), read with 64-bit file offsets. Does not check the header. Throws ConfigError naming the
// file when it cannot be opened or holds fewer tokens.
std::vector<uint16_t> read_tokens(const std::string& path, uint64_t offset, size_t n);

// The data source over glob(data.pattern): sorted; none matching is a ConfigError naming the
// pattern. Every shard is validated at start (at least micro_batch * seq_len * world + 1 tokens),
// then memory-mapped read-only one at a time. As llm.c's DataLoader: each shard is cut into
// floor((tokens - 1) / (world * B * T)) global batches; rank r reads B*T+1 tokens at
// batch * world * B*T + r * B*T; after the last batch of a shard comes the next shard, after the
// last shard the first again (a new epoch). With data.shuffle, the shard order of every epoch and
// the batch order within every shard are permutations derived from data.seed, the epoch and the
// shard (the same on every rank, so ranks stay disjoint). A token >= vocab_size is a ConfigError
// naming the shard and the token's offset, found when its batch is read. state() is the same on
// every rank; restore() checks it was taken over the same shards (count and token counts) with
// the same shuffle and seed. A state taken at another world size or micro_batch * seq_len moves
// to the same token position in its shard when that starts a global batch of this source (the
// position is a multiple of world * B*T); shuffled, only with the same world * B*T (the batch
// order is drawn over the shard's global batches). Otherwise a ConfigError says what would do.
//
// With data.val_fraction f, the shards' last floor(f · tokens) tokens (counted over the sorted
// shards, end to end) are held out: the training source reads the rest, and
// make_shard_validation_source the held-out tail. A piece too short for one global batch is
// dropped; none left on either side is a ConfigError naming val_fraction.
std::unique_ptr<DataSource> make_shard_source(const DataConfig& data, int B, int T, int vocab_size,
                                              int rank = 0, int world = 1);
// The validation data of train.eval_every: the shards of data.val_pattern, or the tail that
// data.val_fraction holds out of data.pattern's. Never shuffled.
std::unique_ptr<DataSource> make_shard_validation_source(const DataConfig& data, int B, int T,
                                                         int vocab_size, int rank = 0,
                                                         int world = 1);

// `headroom shard TEXTFILE OUTDIR [--tokenizer FILE]`: writes the bytes of a text file as tokens
// (vocab 256), or with a tokenizer its ids (the whole file read and encoded at once), into
// OUTDIR/shard_000000.bin, shard_000001.bin, ... of at most tokens_per_shard tokens each, each
// written to a temporary name and then renamed. Returns the paths. Bad input (unreadable or empty
// input, cannot create OUTDIR, tokens_per_shard outside 1..2^31-1) is a ConfigError; a failed
// write is an OutputError, and removes the shards this call wrote.
std::vector<std::string> write_text_shards(const std::string& text_file, const std::string& out_dir,
                                           uint64_t tokens_per_shard = 100000000,
                                           const Tokenizer* tokenizer = nullptr);

}  // namespace headroom
