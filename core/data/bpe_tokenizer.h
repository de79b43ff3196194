// Tokenizers: text <-> token ids. Bytes (vocab 256: a token is a byte, what data.kind = "text"
// trains on) and BPE read from a Hugging Face `tokenizer.json` (byte-level as GPT-2's, Llama 3's
// and Qwen2's; SentencePiece-style over text as Llama 2's and TinyLlama's), or from GPT-2's
// `vocab.json` + `merges.txt`. `headroom shard --tokenizer` encodes with it, `headroom sample`
// decodes with it; the ids equal those of Hugging Face's `tokenizers` (tests/bpe_tokenizer_test).
//
// encode() follows Hugging Face's pipeline:
//   1. added tokens ("<|endoftext|>", "<s>") are cut out of the text first, longest match first
//      (those marked "normalized" from the normalized pieces, their content normalized too);
//   2. each remaining piece goes through the normalizer: Prepend and Replace (of a string), in
//      order, as Llama 2's "▁" before the text and for each space;
//   3. the pre-tokenizer makes words of it:
//      - ByteLevel: a leading space when add_prefix_space is set and it has none, then a split
//        by GPT-2's pattern
//          's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//        or, where the pre_tokenizer is a Split before a ByteLevel without its own pattern, by
//        Llama 3's (Qwen2's: \p{N} for \p{N}{1,3})
// clang-format off
//          (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// clang-format on
//        each implemented by hand on code points decoded from UTF-8 (letters and numbers from
//        the Unicode tables in unicode_tables.inc, whitespace as Oniguruma's \s); a byte that is
//        not valid UTF-8 counts as one code point of neither class; each word's bytes then map
//        to GPT-2's printable alphabet (bytes_to_unicode);
//      - Metaspace: spaces become its replacement ("▁"), which goes before the piece too
//        (prepend_scheme "always", or "first": the piece that starts the text), and with split
//        each word starts at one;
//      - none (Llama 2's): the normalized piece is one word;
//   4. a word's symbols are its bytes' characters (byte-level) or its characters, a character
//      without a token spelt by the "<0xHH>" tokens of its UTF-8 bytes (byte_fallback), else
//      unk_token (a run of them one, with fuse_unk); the merges apply lowest rank first,
//      leftmost first among equal ranks, until none applies;
//   5. the post_processor's template ("<s> $A", "<|begin_of_text|> $A") puts its special tokens
//      around the ids.
// decode() is the decoder's: byte-level, the tokens' bytes; over text, the tokens' strings
// through its Replace, ByteFallback, Fuse, Strip or Metaspace steps, special tokens kept as their
// text (Hugging Face's decode with skip_special_tokens=False).
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
  // The bytes of one token (an id outside the vocabulary gives ""); over text, its string with
  // the replacement character "▁" a space and "<0xHH>" its byte.
  virtual std::string token_bytes(int32_t id) const = 0;
  // The text of the tokens (Tokenizer's: their bytes concatenated; for a byte-level BPE the text
  // back, byte for byte).
  virtual std::string decode(const std::vector<int32_t>& ids) const;
  // Whether the id is a byte-fallback token ("<0xHH>"), which decodes together with the run of
  // them it is in.
  virtual bool is_byte_fallback(int32_t /*id*/) const { return false; }
  // One more than the largest id it can produce.
  virtual int vocab_size() const = 0;
  // One line for logs: "bytes (vocab 256)", "byte-level BPE 'tok.json' (vocab 50257, ...)".
  virtual std::string describe() const = 0;
};

// decode(context + ids) as the ids come, for `headroom sample`: next(id) is the text that id adds,
// less a tail a later id may still change (a run of byte-fallback tokens, which decodes as a
// whole, until a token of another kind ends it; an incomplete UTF-8 character), finish() the
// rest; together, decode(context + ids) past decode(context) where that is a prefix (a run that
// goes on from the context's last tokens rewrites their text: the stream goes on from the first
// byte that differs). Each id decodes the whole sequence again: a cost linear in its length,
// small beside the model's step.
class DecodeStream {
 public:
  DecodeStream(const Tokenizer& tokenizer, std::vector<int32_t> context);
  std::string next(int32_t id);
  std::string finish();

 private:
  const Tokenizer& tokenizer_;
  std::vector<int32_t> ids_;
  std::string shown_;  // the text given so far, the context's included
};

// Bytes: token i is byte i, vocab 256.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// A BPE from `path`: a Hugging Face tokenizer.json (model.type "BPE"; pre_tokenizer ByteLevel or
// a Sequence of a Split by one of the patterns above and a ByteLevel, without a normalizer; or
// Metaspace, or none with a normalizer, over text), a GPT-2 vocab.json with merges.txt in the
// same folder, or a folder holding either. Anything else, a malformed file, a stage of a type
// headroom does not implement or a tokenizer of another kind is a ConfigError naming the file,
// the key and what would be valid.
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
