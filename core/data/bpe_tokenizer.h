// Tokenizers: text <-> token ids. Bytes (vocab 256: a token is a byte, what data.kind = "text"
// trains on) and byte-level BPE (GPT-2's, Llama 3's, Qwen2's) read from a Hugging Face
// `tokenizer.json`, or from GPT-2's `vocab.json` + `merges.txt`. `headroom shard --tokenizer`
// encodes with it, `headroom sample` decodes with it; the ids equal those of Hugging Face's
// `tokenizers` (tests/bpe_tokenizer_test).
//
// Byte-level BPE, as GPT-2 (Radford et al. 2019) and Hugging Face's ByteLevel pre-tokenizer do it:
//   1. added tokens ("<|endoftext|>") are cut out of the text first, longest match first;
//   2. each remaining piece gets a leading space when add_prefix_space is set and it has none;
//   3. the piece is split by GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      or, where the tokenizer.json's pre_tokenizer is a Split before a ByteLevel without its own
//      pattern, by Llama 3's (Qwen2's: \p{N} for \p{N}{1,3})
// clang-format off
//        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// clang-format on
//      each implemented by hand on code points decoded from UTF-8 (letters and numbers from the
//      Unicode tables in unicode_tables.inc, whitespace as Oniguruma's \s); a byte that is not
//      valid UTF-8 counts as one code point of neither class;
//   4. each word's bytes map to GPT-2's printable alphabet (bytes_to_unicode), and the merges
//      apply lowest rank first, leftmost first among equal ranks, until none applies.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace headroom {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  // The bytes of one token (an id outside the vocabulary gives "").
  virtual std::string token_bytes(int32_t id) const = 0;
  // The concatenated bytes of the tokens: the text back, byte for byte.
  virtual std::string decode(const std::vector<int32_t>& ids) const;
  // One more than the largest id it can produce.
  virtual int vocab_size() const = 0;
  // One line for logs: "bytes (vocab 256)", "byte-level BPE 'tok.json' (vocab 50257, ...)".
  virtual std::string describe() const = 0;
};

// Bytes: token i is byte i, vocab 256.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// A byte-level BPE from `path`: a Hugging Face tokenizer.json (model.type "BPE", pre_tokenizer
// ByteLevel or a Sequence of a Split by one of the patterns above and a ByteLevel, no
// normalizer), a GPT-2 vocab.json with merges.txt in the same folder, or a folder
// holding either. Anything else, a malformed file or a tokenizer of another kind is a ConfigError
// naming the file and what would be valid.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// The pre-tokenization patterns headroom implements by hand (their regexes need \p{L}, \p{N} and a
// lookahead): none (the whole text is one word), GPT-2's (ByteLevel's own), Llama 3's and Qwen2's
// (a Split before a ByteLevel without its pattern; they differ in digits: up to 3 a word, or 1).
enum class Pattern { kNone, kGpt2, kLlama3, kQwen2 };

// The regexes as tokenizer.json writes them.
extern const char* const kLlama3Regex;
extern const char* const kQwen2Regex;

// The pattern of a Split's regex; kNone for one headroom does not implement.
Pattern pattern_of(const std::string& regex);

// The pre-tokenization (step 3 above) of `text` by `pattern`: the words, as byte strings, in
// order; their concatenation is `text`. Exposed for tests.
std::vector<std::string> pretokenize(const std::string& text, Pattern pattern);
std::vector<std::string> gpt2_pretokenize(const std::string& text);

}  // namespace headroom
