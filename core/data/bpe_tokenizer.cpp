#include "core/data/bpe_tokenizer.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/config/config.h"

namespace headroom {

namespace {

#include "core/data/unicode_nfc.inc"
#include "core/data/unicode_tables.inc"

bool in_ranges(const uint32_t (*ranges)[2], size_t n, uint32_t cp) {
  // The last range starting at or before cp.
  size_t lo = 0, hi = n;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (ranges[mid][0] <= cp)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo > 0 && cp <= ranges[lo - 1][1];
}

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(kLetterRanges, sizeof kLetterRanges / sizeof kLetterRanges[0], cp);
}
bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(kNumberRanges, sizeof kNumberRanges / sizeof kNumberRanges[0], cp);
}
// Oniguruma's \s for Unicode: \t \n \v \f \r, U+0085, and the separators Zs, Zl, Zp.
bool is_space(uint32_t cp) {
  if (cp >= 0x09 && cp <= 0x0D) return true;
  switch (cp) {
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

// One code point of the text: where its bytes start. Invalid UTF-8 gives one "code point" per
// byte, of no class (cp = 0xFFFFFFFF).
struct CodePoint {
  uint32_t cp;
  size_t at;
};

// s as a JSON string literal, as it appears in a tokenizer.json.
std::string json_string(const std::string& s) {
  return nlohmann::json(s).dump();
}

std::vector<CodePoint> decode_utf8(const std::string& s) {
  std::vector<CodePoint> out;
  out.reserve(s.size() + 1);
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = b[i];
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) {
      len = 1, cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      ok = (b[i + k] & 0xC0) == 0x80;
      cp = (cp << 6) | (b[i + k] & 0x3F);
    }
    ok = ok && cp >= min && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (!ok) len = 1, cp = 0xFFFFFFFFu;
    out.push_back({cp, i});
    i += len;
  }
  out.push_back({0, n});  // the end, for the byte offset of the last boundary
  return out;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
}

// GPT-2's bytes_to_unicode: the printable bytes '!'..'~', '¡'..'¬', '®'..'ÿ' stand for
// themselves; the other 68 bytes, in order, for U+0100, U+0101, ... so that every byte is a
// visible character of the vocabulary's strings.
struct ByteAlphabet {
  std::string of_byte[256];                    // the UTF-8 of each byte's character
  std::unordered_map<uint32_t, uint8_t> byte;  // character -> byte
  ByteAlphabet() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : next++;
      append_utf8(of_byte[b], cp);
      byte[cp] = uint8_t(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the tokenizer file");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw ConfigError(path + ": cannot read the tokenizer file");
  return ss.str();
}

nlohmann::json parse_json(const std::string& path) {
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(path + ": not valid JSON: " + e.what());
  }
}

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i)
      ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string token_bytes(int32_t id) const override {
    return id >= 0 && id < 256 ? std::string(1, char(id)) : std::string();
  }
  int vocab_size() const override { return 256; }
  std::string describe() const override { return "bytes (vocab 256)"; }
};

// --- The pipeline's stages, as tokenizer.json describes them -----------------------------------

// Strings a tokenizer.json gives its normalizer, pre-tokenizer and decoder are bounded: a Replace
// of " " by a long string would grow the text by that factor.
constexpr size_t kMaxPieceString = 16;
// The ids a post_processor's template adds, in all.
constexpr size_t kMaxTemplateIds = 64;
// How deep Sequences of normalizers, pre-tokenizers, processors and decoders nest.
constexpr int kMaxNesting = 8;

// Every `from` in s by `to`, left to right, not overlapping (`from` is not empty).
std::string replace_all(const std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(from, at)) != std::string::npos; at = hit + from.size())
    out.append(s, at, hit - at).append(to);
  return out.append(s, at, std::string::npos);
}

// NFC (Unicode's canonical decomposition, then canonical composition; UAX #15), from the
// tables of unicode_nfc.inc. Bytes that are not UTF-8 pass through, composing with nothing.
uint32_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  size_t lo = 0, hi = sizeof kCombiningClass / sizeof kCombiningClass[0];
  while (lo < hi) {  // the last range starting at or before cp
    const size_t mid = (lo + hi) / 2;
    if (kCombiningClass[mid][0] <= cp)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo > 0 && cp <= kCombiningClass[lo - 1][1] ? kCombiningClass[lo - 1][2] : 0;
}

constexpr uint32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr uint32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr uint32_t kHangulN = kHangulVCount * kHangulTCount,
                   kHangulSCount = kHangulLCount * kHangulN;

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kHangulS && cp < kHangulS + kHangulSCount) {
    const uint32_t s = cp - kHangulS;
    out.push_back(kHangulL + s / kHangulN);
    out.push_back(kHangulV + (s % kHangulN) / kHangulTCount);
    if (s % kHangulTCount) out.push_back(kHangulT + s % kHangulTCount);
    return;
  }
  const auto* end = kDecomposition + sizeof kDecomposition / sizeof kDecomposition[0];
  const auto* it = std::lower_bound(kDecomposition, end, cp,
                                    [](const uint32_t(&row)[3], uint32_t c) { return row[0] < c; });
  if (it == end || (*it)[0] != cp) {
    out.push_back(cp);
    return;
  }
  decompose((*it)[1], out);
  if ((*it)[2]) decompose((*it)[2], out);
}

// The primary composite of a and b; 0 if none.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kHangulL && a < kHangulL + kHangulLCount && b >= kHangulV &&
      b < kHangulV + kHangulVCount)
    return kHangulS + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
  if (a >= kHangulS && a < kHangulS + kHangulSCount && (a - kHangulS) % kHangulTCount == 0 &&
      b > kHangulT && b < kHangulT + kHangulTCount)
    return a + (b - kHangulT);
  const auto* end = kComposition + sizeof kComposition / sizeof kComposition[0];
  const auto* it =
      std::lower_bound(kComposition, end, std::make_pair(a, b),
                       [](const uint32_t(&row)[3], std::pair<uint32_t, uint32_t> k) {
                         return row[0] != k.first ? row[0] < k.first : row[1] < k.second;
                       });
  return it != end && (*it)[0] == a && (*it)[1] == b ? (*it)[2] : 0;
}

std::string nfc(const std::string& s) {
  const std::vector<CodePoint> cps = decode_utf8(s);
  if (std::all_of(cps.begin(), cps.end() - 1, [](const CodePoint& c) { return c.cp < 0x300; }))
    return s;  // below U+0300 every text is its own NFC
  std::string out;
  out.reserve(s.size());
  std::vector<uint32_t> run;  // decomposed code points since the last invalid byte
  auto flush = [&] {
    // Canonical order: each stretch of non-starters sorted by class, stably.
    for (size_t i = 0; i < run.size();) {
      if (combining_class(run[i]) == 0) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < run.size() && combining_class(run[j]) != 0)
        ++j;
      std::stable_sort(
          run.begin() + std::ptrdiff_t(i), run.begin() + std::ptrdiff_t(j),
          [](uint32_t a, uint32_t b) { return combining_class(a) < combining_class(b); });
      i = j;
    }
    // Composition: each character with the last starter, unless a character between blocks it
    // (a starter, or one of the same or a higher class).
    std::vector<uint32_t> done;
    done.reserve(run.size());
    size_t starter = SIZE_MAX;
    uint32_t last_class = 0;
    for (uint32_t c : run) {
      const uint32_t cc = combining_class(c);
      if (starter != SIZE_MAX) {
        const bool adjacent = done.size() == starter + 1;
        if (adjacent || (last_class != 0 && last_class < cc)) {
          if (const uint32_t p = compose(done[starter], c)) {
            done[starter] = p;
            continue;
          }
        }
      }
      if (cc == 0) starter = done.size();
      done.push_back(c);
      last_class = cc;
    }
    for (uint32_t c : done)
      append_utf8(out, c);
    run.clear();
  };
  for (size_t k = 0; k + 1 < cps.size(); ++k) {
    if (cps[k].cp == 0xFFFFFFFFu) {
      flush();
      out += s[cps[k].at];
      continue;
    }
    decompose(cps[k].cp, run);
  }
  flush();
  return out;
}

// One step of the normalizer (a Sequence's steps in order).
struct NormStep {
  enum Kind { kPrepend, kReplace, kNfc } kind;
  std::string from, to;  // Replace: each `from` by `to`; Prepend: `to` before a text not empty
};

std::string normalize(const std::vector<NormStep>& steps, std::string s) {
  for (const NormStep& st : steps) {
    if (st.kind == NormStep::kPrepend) {
      if (!s.empty()) s.insert(0, st.to);
    } else if (st.kind == NormStep::kReplace) {
      s = replace_all(s, st.from, st.to);
    } else {
      s = nfc(s);
    }
  }
  return s;
}

// One step of the decoder, as Hugging Face's decoders act on the list of token strings.
struct DecStep {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string from, to;        // Replace: in each token; Metaspace: from = the replacement
  std::string content;         // Strip: the character, taken from each token's ends
  size_t start = 0, stop = 0;  // Strip: at most this many from the start, from the end
  bool strip_first = false;    // Metaspace: its prepend_scheme is not "never"
};

bool valid_utf8(const std::string& s) {
  for (const CodePoint& c : decode_utf8(s))
    if (c.cp == 0xFFFFFFFFu) return false;
  return true;
}

// "<0x41>" -> 0x41 (case-insensitive hex, as Hugging Face's ByteFallback decoder reads it); -1
// for any other token.
int fallback_byte(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

void run_decoder(const std::vector<DecStep>& steps, std::vector<std::string>& tokens) {
  static const std::string kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD
  for (const DecStep& st : steps) {
    switch (st.kind) {
      case DecStep::kReplace:
        for (std::string& t : tokens)
          t = replace_all(t, st.from, st.to);
        break;
      case DecStep::kByteFallback: {
        // A run of "<0xHH>" tokens is their bytes when those are UTF-8, else one U+FFFD a byte.
        std::vector<std::string> out;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (valid_utf8(run)) {
            out.push_back(run);
          } else {
            for (size_t i = 0; i < run_tokens; ++i)
              out.push_back(kReplacementChar);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : tokens) {
          const int b = fallback_byte(t);
          if (b >= 0) {
            run += char(b);
            ++run_tokens;
            continue;
          }
          flush();
          out.push_back(std::move(t));
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecStep::kFuse: {
        std::string all;
        for (const std::string& t : tokens)
          all += t;
        tokens.assign(1, all);
        break;
      }
      case DecStep::kStrip:
        for (std::string& t : tokens) {
          const std::string& c = st.content;
          size_t from = 0, to = t.size();
          for (size_t k = 0; k < st.start && t.compare(from, c.size(), c) == 0; ++k)
            from += c.size();
          for (size_t k = 0;
               k < st.stop && to >= from + c.size() && t.compare(to - c.size(), c.size(), c) == 0;
               ++k)
            to -= c.size();
          t = t.substr(from, to - from);
        }
        break;
      case DecStep::kMetaspace:
        // The replacement is a space, except in the first token, where (prepend_scheme other
        // than "never") it goes: the one the pre-tokenizer put before the text.
        for (size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = replace_all(tokens[i], st.from, i == 0 && st.strip_first ? "" : " ");
        break;
    }
  }
}

// How the pieces between added tokens become words.
struct Spec {
  // ByteLevel: a word's bytes in GPT-2's alphabet, split by `split` first (GPT-2's, Llama 3's,
  // Qwen2's). Otherwise the vocabulary's tokens are text, a word's characters its symbols
  // (SentencePiece's BPE, as Llama 2's tokenizer.json): by a Metaspace, or as the normalizer
  // left them.
  bool byte_level = true;
  bool add_prefix_space = false;
  Pattern split = Pattern::kGpt2;
  bool metaspace = false;
  std::string replacement;  // Metaspace: what a space becomes ("▁")
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool metaspace_split = true;  // each word starts at a replacement
  std::vector<NormStep> normalizer;
  bool ignore_merges = false;
  // model.byte_fallback: a character with no token of its own is spelt by the tokens "<0xHH>"
  // of its UTF-8 bytes, as Hugging Face's BPE does.
  bool byte_fallback = false;
  bool fuse_unk = false;
  std::string unk_token;           // "": none
  std::vector<int32_t> before;     // the post_processor's template: ids before the text
  std::vector<int32_t> after;      // and after it
  bool decoder_null = false;       // not byte-level: tokens joined by spaces, as Hugging Face's
  std::vector<DecStep> decoder;    // not byte-level: the decoder's steps
  std::vector<std::string> notes;  // what describe() says of the normalizer, decoder, template
};

struct Added {
  std::string content;
  int32_t id;
  bool normalized;  // matched in the normalized text, its content normalized too
};

class BpeTokenizer final : public Tokenizer {
 public:
  // vocab: token string (byte-level: in the byte alphabet) -> id; merges: pairs of token
  // strings, by rank; added: special or added tokens.
  BpeTokenizer(std::string source, const std::map<std::string, int32_t>& vocab,
               const std::vector<std::pair<std::string, std::string>>& merges,
               const std::vector<Added>& added, Spec spec)
      : source_(std::move(source)), spec_(std::move(spec)) {
    const ByteAlphabet& abc = alphabet();
    int32_t max_id = -1;
    for (const auto& [token, id] : vocab) {
      vocab_[token] = id;
      max_id = std::max(max_id, id);
    }
    for (const Added& a : added)
      max_id = std::max(max_id, a.id);
    vocab_size_ = max_id + 1;
    bytes_.resize(size_t(vocab_size_));
    text_.resize(size_t(vocab_size_));
    known_.assign(size_t(vocab_size_), false);
    for (const auto& [token, id] : vocab) {
      text_[size_t(id)] = token;
      known_[size_t(id)] = true;
      if (!spec_.byte_level) continue;
      std::string bytes;
      for (const CodePoint& c : decode_utf8(token)) {
        if (c.at == token.size()) break;
        const auto it = abc.byte.find(c.cp);
        if (it == abc.byte.end())
          throw ConfigError(source_ + ": vocabulary token \"" + token + "\" (id " +
                            std::to_string(id) +
                            ") has a character outside GPT-2's byte alphabet: not a byte-level "
                            "BPE vocabulary");
        bytes += char(it->second);
      }
      bytes_[size_t(id)] = bytes;
    }
    for (const Added& a : added) {
      bytes_[size_t(a.id)] = a.content;
      text_[size_t(a.id)] = a.content;
      known_[size_t(a.id)] = true;
      if (a.normalized && !spec_.normalizer.empty()) {
        const std::string n = normalize(spec_.normalizer, a.content);
        if (!n.empty()) normalized_added_.push_back({n, a.id});
      } else if (!a.content.empty()) {
        raw_added_.push_back({a.content, a.id});
      }
    }
    // Longest first: "<|endoftext|>" before "<|end".
    for (auto* list : {&raw_added_, &normalized_added_})
      std::stable_sort(list->begin(), list->end(), [](const auto& a, const auto& b) {
        return a.first.size() > b.first.size();
      });
    for (size_t r = 0; r < merges.size(); ++r) {
      const auto& [a, b] = merges[r];
      const int32_t ia = id_of(a, r), ib = id_of(b, r), merged = id_of(a + b, r);
      merges_[key(ia, ib)] = Merge{uint32_t(r), merged};  // a later rank wins, as Hugging Face's
    }
    if (!spec_.unk_token.empty()) {
      const auto it = vocab_.find(spec_.unk_token);
      if (it == vocab_.end())
        throw ConfigError(source_ + ": model.unk_token " + json_string(spec_.unk_token) +
                          " is not in model.vocab");
      unk_id_ = it->second;
    }
    for (const std::vector<int32_t>* ids : {&spec_.before, &spec_.after})
      for (int32_t id : *ids)
        if (id >= vocab_size_ || !known_[size_t(id)])
          throw ConfigError(source_ + ": post_processor adds the id " + std::to_string(id) +
                            ", which is neither in model.vocab nor in added_tokens");
    map_bytes();
  }

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids(spec_.before);
    // Added tokens out of the text as it is, then those matched in the normalized pieces, as
    // Hugging Face's AddedVocabulary does; what is left is pre-tokenized and merged.
    split_added(text, raw_added_, ids, [&](const std::string& piece, size_t at) {
      const std::string norm =
          spec_.normalizer.empty() ? piece : normalize(spec_.normalizer, piece);
      split_added(norm, normalized_added_, ids, [&](const std::string& sub, size_t sub_at) {
        encode_piece(sub, at == 0 && sub_at == 0, ids);
      });
    });
    ids.insert(ids.end(), spec_.after.begin(), spec_.after.end());
    return ids;
  }

  std::string token_bytes(int32_t id) const override {
    if (id < 0 || id >= vocab_size_) return std::string();
    if (spec_.byte_level) return bytes_[size_t(id)];
    // The token's text: its byte for "<0xHH>", the replacement character a space.
    std::string t = text_[size_t(id)];
    if (spec_.byte_fallback && fallback_byte(t) >= 0) return std::string(1, char(fallback_byte(t)));
    for (const DecStep& st : spec_.decoder) {
      if (st.kind == DecStep::kReplace) t = replace_all(t, st.from, st.to);
      if (st.kind == DecStep::kMetaspace) t = replace_all(t, st.from, " ");
    }
    return t;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    return spec_.byte_level ? decode_bytes(ids) : decode_text(ids);
  }
  bool is_byte_fallback(int32_t id) const override {
    if (spec_.byte_level) return fallback_byte_.count(id) > 0;
    return id >= 0 && id < vocab_size_ && fallback_byte(text_[size_t(id)]) >= 0 &&
           std::any_of(spec_.decoder.begin(), spec_.decoder.end(),
                       [](const DecStep& st) { return st.kind == DecStep::kByteFallback; });
  }

  int vocab_size() const override { return vocab_size_; }
  std::string describe() const override {
    std::string s = (spec_.byte_level ? "byte-level BPE '" : "BPE '") + source_ + "' (vocab " +
                    std::to_string(vocab_size_) + ", " + std::to_string(merges_.size()) + " merges";
    if (spec_.byte_level) {
      s += (spec_.add_prefix_space ? ", add_prefix_space" : "");
      s += spec_.split == Pattern::kLlama3  ? ", Llama 3's split"
           : spec_.split == Pattern::kQwen2 ? ", Qwen2's split"
           : spec_.split == Pattern::kNone  ? ", no split"
                                            : "";
    }
    for (const std::string& n : spec_.notes)
      s += ", " + n;
    return s + ")";
  }

 private:
  struct Merge {
    uint32_t rank;
    int32_t id;
  };
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  // "0x7a 'z'", "0x0a": a byte as messages name it.
  static std::string byte_name(unsigned b) {
    char buf[16];
    if (b >= 0x21 && b <= 0x7e)
      std::snprintf(buf, sizeof buf, "0x%02x '%c'", b, char(b));
    else
      std::snprintf(buf, sizeof buf, "0x%02x", b);
    return buf;
  }
  static std::string byte_list(const std::vector<unsigned>& bytes) {
    std::string s;
    for (size_t i = 0; i < bytes.size() && i < 16; ++i)
      s += (i ? ", " : "") + byte_name(bytes[i]);
    if (bytes.size() > 16) s += " and " + std::to_string(bytes.size() - 16) + " more";
    return s;
  }

  // Cuts `text` at the tokens of `list` (at each position the longest that matches): their ids
  // go to `ids`, each stretch between them, not empty, to piece(stretch, its offset).
  template <class F>
  void split_added(const std::string& text,
                   const std::vector<std::pair<std::string, int32_t>>& list,
                   std::vector<int32_t>& ids, F&& piece) const {
    if (list.empty()) {
      if (!text.empty()) piece(text, 0);
      return;
    }
    size_t start = 0, i = 0;
    while (i < text.size()) {
      const std::pair<std::string, int32_t>* hit = nullptr;
      for (const auto& a : list) {
        if (text.compare(i, a.first.size(), a.first) == 0) {
          hit = &a;
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      if (i > start) piece(text.substr(start, i - start), start);
      ids.push_back(hit->second);
      i += hit->first.size();
      start = i;
    }
    if (start < text.size()) piece(text.substr(start), start);
  }

  // Each byte's ids when no merge applies (byte-level): its own token, else (byte_fallback) the
  // "<0xHH>" tokens of its character's UTF-8 bytes, else none. A byte-level BPE without byte
  // fallback must have every byte's token: a byte it has none for would be dropped from the text
  // without a word (Hugging Face's BPE drops a character it has no token for), so such a file is
  // refused here, naming the bytes. With byte fallback a byte whose fallback tokens are missing
  // too is refused by encode(), naming it, where text holds it.
  void map_bytes() {
    const ByteAlphabet& abc = alphabet();
    for (unsigned u = 0; u < 256; ++u) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", u);
      const auto it = spec_.byte_fallback ? vocab_.find(name) : vocab_.end();
      fallback_id_[u] = it == vocab_.end() ? -1 : it->second;
      if (fallback_id_[u] >= 0) bytes_[size_t(fallback_id_[u])] = std::string(1, char(u));
      if (fallback_id_[u] >= 0) fallback_byte_[fallback_id_[u]] = uint8_t(u);
    }
    if (!spec_.byte_level) return;
    std::vector<unsigned> missing;
    for (unsigned b = 0; b < 256; ++b) {
      std::vector<int32_t>& ids = byte_ids_[b];
      const auto own = vocab_.find(abc.of_byte[b]);
      if (own != vocab_.end()) {
        ids = {own->second};
        continue;
      }
      if (spec_.byte_fallback) {
        for (unsigned char u : abc.of_byte[b]) {
          if (fallback_id_[u] < 0) {
            ids.clear();
            break;
          }
          ids.push_back(fallback_id_[u]);
        }
      }
      if (ids.empty()) missing.push_back(b);
    }
    if (!missing.empty() && !spec_.byte_fallback)
      throw ConfigError(source_ + ": a byte-level BPE needs a token for each of the 256 bytes; " +
                        "it has none for " + std::to_string(missing.size()) + " (" +
                        byte_list(missing) + "), whose bytes would be dropped from the text " +
                        "(add their tokens, or turn on model.byte_fallback with \"<0xHH>\" " +
                        "tokens)");
  }

  int32_t id_of(const std::string& token, size_t rank) const {
    const auto it = vocab_.find(token);
    if (it == vocab_.end())
      throw ConfigError(source_ + ": merge " + std::to_string(rank) + " names \"" + token +
                        "\", which is not in the vocabulary");
    return it->second;
  }

  // A piece between added tokens, normalized: its words, each merged. `at_start`: the piece
  // starts the text (Metaspace's prepend_scheme "first").
  void encode_piece(const std::string& piece, bool at_start, std::vector<int32_t>& ids) const {
    if (spec_.byte_level) {
      std::string p = piece;
      if (spec_.add_prefix_space && p[0] != ' ') p.insert(p.begin(), ' ');
      if (spec_.split == Pattern::kNone) {
        encode_byte_word(p, ids);
        return;
      }
      for (const std::string& word : pretokenize(p, spec_.split))
        encode_byte_word(word, ids);
      return;
    }
    if (!spec_.metaspace) {
      encode_text_word(piece, ids);
      return;
    }
    // Metaspace: spaces become the replacement, which goes before the piece (always, or where
    // it starts the text) unless it is there; with split, each word starts at one.
    const std::string& r = spec_.replacement;
    std::string p = replace_all(piece, " ", r);
    if (p.compare(0, r.size(), r) != 0 && (spec_.prepend == Spec::Prepend::kAlways ||
                                           (spec_.prepend == Spec::Prepend::kFirst && at_start)))
      p.insert(0, r);
    if (!spec_.metaspace_split) {
      encode_text_word(p, ids);
      return;
    }
    size_t from = 0;
    for (size_t hit = p.find(r, 1); hit != std::string::npos; hit = p.find(r, hit + r.size())) {
      encode_text_word(p.substr(from, hit - from), ids);
      from = hit;
    }
    encode_text_word(p.substr(from), ids);
  }

  // One pre-tokenized word of a byte-level BPE: its bytes as characters of the alphabet, then
  // the merges.
  void encode_byte_word(const std::string& word, std::vector<int32_t>& ids) const {
    const ByteAlphabet& abc = alphabet();
    if (spec_.ignore_merges) {
      std::string mapped;
      for (unsigned char c : word)
        mapped += abc.of_byte[c];
      const auto it = vocab_.find(mapped);
      if (it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    std::vector<int32_t> symbols;
    symbols.reserve(word.size());
    std::vector<unsigned> unencodable;
    for (unsigned char c : word) {
      const std::vector<int32_t>& b = byte_ids_[c];
      if (b.empty()) {
        unencodable.push_back(c);
        continue;
      }
      symbols.insert(symbols.end(), b.begin(), b.end());
    }
    if (!unencodable.empty()) {
      std::sort(unencodable.begin(), unencodable.end());
      unencodable.erase(std::unique(unencodable.begin(), unencodable.end()), unencodable.end());
      throw ConfigError(source_ + ": cannot encode the byte" +
                        (unencodable.size() > 1 ? "s " : " ") + byte_list(unencodable) +
                        " of the text: the tokenizer has neither " +
                        "a token for them nor their byte-fallback tokens \"<0xHH>\"");
    }
    merge(symbols);
    ids.insert(ids.end(), symbols.begin(), symbols.end());
  }

  // One word of a BPE over text (SentencePiece's): each character its token, else (byte
  // fallback) the "<0xHH>" tokens of its bytes, else unk_token, then the merges. As Hugging
  // Face's BPE does it, unknown characters in a row are one unk_token with fuse_unk, and an
  // unk_token waits for the next character with a token of its own (so it comes after the
  // fallback tokens of the characters between).
  void encode_text_word(const std::string& word, std::vector<int32_t>& ids) const {
    if (word.empty()) return;
    if (spec_.ignore_merges) {
      const auto it = vocab_.find(word);
      if (it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    const std::vector<CodePoint> cps = decode_utf8(word);
    std::vector<int32_t> symbols;
    symbols.reserve(word.size());
    bool unk_pending = false;
    for (size_t k = 0; k + 1 < cps.size(); ++k) {
      const std::string ch = word.substr(cps[k].at, cps[k + 1].at - cps[k].at);
      const auto it = vocab_.find(ch);
      if (it != vocab_.end()) {
        if (unk_pending) symbols.push_back(unk_id_);
        unk_pending = false;
        symbols.push_back(it->second);
        continue;
      }
      if (spec_.byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char b) {
            return fallback_id_[uint8_t(b)] >= 0;
          })) {
        for (char b : ch)
          symbols.push_back(fallback_id_[uint8_t(b)]);
        continue;
      }
      if (unk_id_ >= 0) {
        if (unk_pending && !spec_.fuse_unk) symbols.push_back(unk_id_);
        unk_pending = true;
        continue;
      }
      char cp[16];
      std::snprintf(cp, sizeof cp, "U+%04X", cps[k].cp == 0xFFFFFFFFu ? 0u : cps[k].cp);
      throw ConfigError(source_ + ": cannot encode the character " +
                        (cps[k].cp == 0xFFFFFFFFu
                             ? "(the byte " + byte_name(uint8_t(ch[0])) + ", not UTF-8)"
                             : std::string(cp) + " " + json_string(ch)) +
                        " of the text: the tokenizer has no token for it, " +
                        (spec_.byte_fallback ? "not all of its byte-fallback tokens \"<0xHH>\""
                                             : "no model.byte_fallback") +
                        " and no model.unk_token");
    }
    if (unk_pending) symbols.push_back(unk_id_);
    merge(symbols);
    ids.insert(ids.end(), symbols.begin(), symbols.end());
  }

  // The merges on a word's symbols, as Hugging Face's Word::merge_all: a heap of (rank,
  // position), lowest rank first, the leftmost of equal ranks; an entry whose pair has changed
  // since it went in is skipped unless the pair now there merges to the same token.
  void merge(std::vector<int32_t>& symbols) const {
    const size_t n = symbols.size();
    if (n < 2 || merges_.empty()) return;
    struct Entry {
      uint32_t rank;
      uint32_t pos;
      int32_t id;
    };
    auto later = [](const Entry& a, const Entry& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::priority_queue<Entry, std::vector<Entry>, decltype(later)> heap(later);
    std::vector<int64_t> prev(n), next(n);
    std::vector<char> alive(n, 1);
    for (size_t i = 0; i < n; ++i) {
      prev[i] = int64_t(i) - 1;
      next[i] = i + 1 < n ? int64_t(i + 1) : -1;
    }
    auto push = [&](size_t pos, size_t right) {
      const auto it = merges_.find(key(symbols[pos], symbols[right]));
      if (it != merges_.end()) heap.push({it->second.rank, uint32_t(pos), it->second.id});
    };
    for (size_t i = 0; i + 1 < n; ++i)
      push(i, i + 1);
    while (!heap.empty()) {
      const Entry top = heap.top();
      heap.pop();
      if (!alive[top.pos] || next[top.pos] < 0) continue;
      const size_t right = size_t(next[top.pos]);
      const auto it = merges_.find(key(symbols[top.pos], symbols[right]));
      if (it == merges_.end() || it->second.id != top.id) continue;
      symbols[top.pos] = top.id;
      alive[right] = 0;
      next[top.pos] = next[right];
      if (next[right] >= 0) prev[size_t(next[right])] = top.pos;
      if (prev[top.pos] >= 0) push(size_t(prev[top.pos]), top.pos);
      if (next[top.pos] >= 0) push(top.pos, size_t(next[top.pos]));
    }
    size_t out = 0;
    for (size_t i = 0; i < n; ++i)
      if (alive[i]) symbols[out++] = symbols[i];
    symbols.resize(out);
  }

  // Byte-level: the bytes of the tokens. Byte-fallback tokens spell the UTF-8 of a character of
  // the byte alphabet: a run of them is read as those characters, each the byte it stands for
  // (what Hugging Face's ByteFallback and ByteLevel decoders do in turn).
  std::string decode_bytes(const std::vector<int32_t>& ids) const {
    std::string s, run;
    auto flush = [&] {
      for (const CodePoint& c : decode_utf8(run)) {
        if (c.at == run.size()) break;
        const auto it = alphabet().byte.find(c.cp);
        if (it != alphabet().byte.end()) {
          s += char(it->second);
        } else {  // not a character of the alphabet: its bytes as they are
          const size_t len = c.cp == 0xFFFFFFFFu ? 1
                             : c.cp < 0x80       ? 1
                             : c.cp < 0x800      ? 2
                             : c.cp < 0x10000    ? 3
                                                 : 4;
          s += run.substr(c.at, len);
        }
      }
      run.clear();
    };
    for (int32_t id : ids) {
      const auto f = fallback_byte_.find(id);
      if (f != fallback_byte_.end()) {
        run += char(f->second);
        continue;
      }
      flush();
      s += token_bytes(id);
    }
    flush();
    return s;
  }

  // A BPE over text: the tokens' strings through the decoder's steps, as Hugging Face's
  // decode(ids, skip_special_tokens=False); ids it has no token for are left out.
  std::string decode_text(const std::vector<int32_t>& ids) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids)
      if (id >= 0 && id < vocab_size_ && known_[size_t(id)]) tokens.push_back(text_[size_t(id)]);
    std::string s;
    if (spec_.decoder_null) {
      for (size_t i = 0; i < tokens.size(); ++i)
        s += (i ? " " : "") + tokens[i];
      return s;
    }
    run_decoder(spec_.decoder, tokens);
    for (const std::string& t : tokens)
      s += t;
    return s;
  }

  std::string source_;
  Spec spec_;
  std::vector<std::pair<std::string, int32_t>> raw_added_;         // content -> id
  std::vector<std::pair<std::string, int32_t>> normalized_added_;  // normalized content -> id
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::vector<std::string> bytes_;  // id -> its bytes (byte-level)
  std::vector<std::string> text_;   // id -> its string in the vocabulary or added_tokens
  std::vector<bool> known_;         // id -> whether it has one
  int32_t vocab_size_ = 0;
  int32_t unk_id_ = -1;
  int32_t fallback_id_[256] = {};                       // byte -> "<0xHH>" id, -1 if none
  std::vector<int32_t> byte_ids_[256];                  // map_bytes()
  std::unordered_map<int32_t, uint8_t> fallback_byte_;  // "<0xHH>" token id -> 0xHH
};

std::map<std::string, int32_t> read_vocab(const nlohmann::json& v, const std::string& path) {
  if (!v.is_object())
    throw ConfigError(path + ": the vocabulary must be a JSON object of token -> id");
  std::map<std::string, int32_t> vocab;
  std::vector<bool> seen;
  for (auto it = v.begin(); it != v.end(); ++it) {
    // Bounded before anything is sized by it: the id tables hold one entry per id.
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() >= kMaxVocabSize)
      throw ConfigError(path + ": vocabulary token \"" + it.key() + "\" has id " +
                        it.value().dump() + "; ids run from 0 to " +
                        std::to_string(kMaxVocabSize - 1) + " (a model has at most " +
                        std::to_string(kMaxVocabSize) + " tokens)");
    const int32_t id = it.value().get<int32_t>();
    if (size_t(id) >= seen.size()) seen.resize(size_t(id) + 1);
    if (seen[size_t(id)])
      throw ConfigError(path + ": id " + std::to_string(id) + " is given to two tokens");
    seen[size_t(id)] = true;
    vocab[it.key()] = id;
  }
  if (vocab.empty()) throw ConfigError(path + ": the vocabulary is empty");
  return vocab;
}

// "a b" (merges.txt, older tokenizer.json) or ["a", "b"] (tokenizer.json from tokenizers 0.20).
std::pair<std::string, std::string> split_merge(const std::string& line, const std::string& where) {
  const size_t sp = line.find(' ');
  if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() ||
      line.find(' ', sp + 1) != std::string::npos)
    throw ConfigError(where + ": a merge must be two tokens separated by one space, got \"" + line +
                      "\"");
  return {line.substr(0, sp), line.substr(sp + 1)};
}

// Type-checked reads of a tokenizer.json's keys: a value of the wrong type names the file and
// the key ("normalizer.normalizers[1].prepend").
struct Reader {
  std::string path;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ConfigError(path + ": " + key + " " + what);
  }
  // The value at o[k], or nullptr where it is absent or null.
  static const nlohmann::json* get(const nlohmann::json& o, const char* k) {
    if (!o.is_object()) return nullptr;
    const auto it = o.find(k);
    return it == o.end() || it->is_null() ? nullptr : &*it;
  }
  std::string str(const nlohmann::json& o, const char* k, const std::string& key,
                  const std::string& otherwise = std::string()) const {
    const nlohmann::json* v = get(o, k);
    if (!v) return otherwise;
    if (!v->is_string()) fail(key, "must be a string, got " + v->dump().substr(0, 80));
    return v->get<std::string>();
  }
  // A string of one to kMaxPieceString bytes.
  std::string short_str(const nlohmann::json& o, const char* k, const std::string& key) const {
    const std::string s = str(o, k, key);
    if (s.empty() || s.size() > kMaxPieceString)
      fail(key, "is " + json_string(s) + "; headroom reads a string of 1 to " +
                    std::to_string(kMaxPieceString) + " bytes here");
    return s;
  }
  // One character (UTF-8).
  std::string one_char(const nlohmann::json& o, const char* k, const std::string& key) const {
    const std::string s = str(o, k, key);
    if (s.empty() || decode_utf8(s).size() != 2 || !valid_utf8(s))
      fail(key, "is " + json_string(s) + "; it must be one character");
    return s;
  }
  bool boolean(const nlohmann::json& o, const char* k, const std::string& key,
               bool otherwise) const {
    const nlohmann::json* v = get(o, k);
    if (!v) return otherwise;
    if (!v->is_boolean()) fail(key, "must be true or false, got " + v->dump().substr(0, 80));
    return v->get<bool>();
  }
  uint64_t count(const nlohmann::json& o, const char* k, const std::string& key,
                 uint64_t max) const {
    const nlohmann::json* v = get(o, k);
    if (!v) return 0;
    if (!v->is_number_unsigned() || v->get<uint64_t>() > max)
      fail(key, "is " + v->dump().substr(0, 80) + "; headroom reads a whole number from 0 to " +
                    std::to_string(max));
    return v->get<uint64_t>();
  }
  const nlohmann::json& array(const nlohmann::json& o, const char* k,
                              const std::string& key) const {
    const nlohmann::json* v = get(o, k);
    if (!v || !v->is_array()) fail(key, "must be an array");
    return *v;
  }
  // The type of a stage (o["type"]), where `key` is that stage's place ("normalizer").
  std::string type(const nlohmann::json& o, const std::string& key) const {
    if (!o.is_object()) fail(key, "must be an object, got " + o.dump().substr(0, 80));
    const std::string t = str(o, "type", key + ".type");
    if (t.empty()) fail(key, "has no \"type\"");
    return t;
  }
  void depth(int d, const std::string& key) const {
    if (d > kMaxNesting)
      fail(key, "nests Sequences more than " + std::to_string(kMaxNesting) + " deep");
  }
};

std::string at(const std::string& key, size_t i) {
  return key + "[" + std::to_string(i) + "]";
}

// A Replace's pattern: {"String": s}; a {"Regex": ...} is named as not read.
std::string replace_pattern(const Reader& r, const nlohmann::json& o, const std::string& key) {
  const nlohmann::json* p = Reader::get(o, "pattern");
  if (!p || !p->is_object())
    r.fail(key + ".pattern", "must be {\"String\": ...} (or {\"Regex\": ...})");
  if (p->contains("Regex"))
    r.fail(key + ".pattern", "is the regex " + (*p)["Regex"].dump().substr(0, 80) +
                                 "; headroom reads a Replace of a String pattern");
  return r.short_str(*p, "String", key + ".pattern.String");
}

void read_normalizer(const Reader& r, const nlohmann::json& n, const std::string& key, int depth,
                     Spec& spec, std::string& what) {
  r.depth(depth, key);
  const std::string type = r.type(n, key);
  if (type == "Sequence") {
    const nlohmann::json& steps = r.array(n, "normalizers", key + ".normalizers");
    for (size_t i = 0; i < steps.size(); ++i)
      read_normalizer(r, steps[i], at(key + ".normalizers", i), depth + 1, spec, what);
  } else if (type == "Prepend") {
    const std::string p = r.short_str(n, "prepend", key + ".prepend");
    spec.normalizer.push_back({NormStep::kPrepend, "", p});
    what += std::string(what.empty() ? "" : " + ") + "Prepend " + json_string(p);
  } else if (type == "Replace") {
    const std::string from = replace_pattern(r, n, key);
    const std::string to = r.str(n, "content", key + ".content");
    if (to.size() > kMaxPieceString)
      r.fail(key + ".content", "is " + json_string(to) + "; headroom reads at most " +
                                   std::to_string(kMaxPieceString) + " bytes here");
    spec.normalizer.push_back({NormStep::kReplace, from, to});
    what += std::string(what.empty() ? "" : " + ") + "Replace " + json_string(from) + " by " +
            json_string(to);
  } else if (type == "NFC") {
    spec.normalizer.push_back({NormStep::kNfc, "", ""});
    what += std::string(what.empty() ? "" : " + ") + "NFC";
  } else {
    r.fail(key, "is of type " + json_string(type) +
                    ", which headroom does not implement; it reads NFC (Qwen2's), Prepend, "
                    "Replace (of a String pattern) and a Sequence of them (Llama 2's, "
                    "TinyLlama's)");
  }
}

void read_metaspace(const Reader& r, const nlohmann::json& p, const std::string& key, Spec& spec) {
  spec.metaspace = true;
  spec.replacement = r.one_char(p, "replacement", key + ".replacement");
  const std::string scheme = r.str(p, "prepend_scheme", key + ".prepend_scheme");
  if (scheme.empty()) {  // before tokenizers 0.19: add_prefix_space
    spec.prepend = r.boolean(p, "add_prefix_space", key + ".add_prefix_space", true)
                       ? Spec::Prepend::kAlways
                       : Spec::Prepend::kNever;
  } else if (scheme == "always") {
    spec.prepend = Spec::Prepend::kAlways;
  } else if (scheme == "first") {
    spec.prepend = Spec::Prepend::kFirst;
  } else if (scheme == "never") {
    spec.prepend = Spec::Prepend::kNever;
  } else {
    r.fail(key + ".prepend_scheme",
           "is " + json_string(scheme) + "; it is \"always\", \"first\" or \"never\"");
  }
  spec.metaspace_split = r.boolean(p, "split", key + ".split", true);
  spec.notes.push_back(std::string("Metaspace ") + json_string(spec.replacement) + " prepend " +
                       (spec.prepend == Spec::Prepend::kAlways  ? "always"
                        : spec.prepend == Spec::Prepend::kFirst ? "first"
                                                                : "never") +
                       (spec.metaspace_split ? " split" : ""));
}

void read_pre_tokenizer(const Reader& r, const nlohmann::json& j, Spec& spec) {
  const std::string& path = r.path;
  const nlohmann::json* pre = Reader::get(j, "pre_tokenizer");
  if (!pre) {  // SentencePiece's as Llama 2's: the normalizer made the text its one word
    spec.byte_level = false;
    return;
  }
  const std::string type = r.type(*pre, "pre_tokenizer");
  nlohmann::json byte_level = *pre;  // the ByteLevel: the pre_tokenizer, or a Sequence's second
  if (type == "Metaspace") {
    spec.byte_level = false;
    read_metaspace(r, *pre, "pre_tokenizer", spec);
    return;
  }
  if (type == "Sequence") {
    // Llama 3's and Qwen2's: Split(their pattern, "Isolated") then ByteLevel(use_regex false).
    const nlohmann::json& seq = r.array(*pre, "pretokenizers", "pre_tokenizer.pretokenizers");
    if (seq.size() != 2 || !seq[0].is_object() || !seq[1].is_object() ||
        seq[0].value("type", nlohmann::json()) != "Split" ||
        seq[1].value("type", nlohmann::json()) != "ByteLevel")
      throw ConfigError(path + ": pre_tokenizer is a Sequence of " + seq.dump().substr(0, 200) +
                        "; headroom reads a Sequence of a Split and a ByteLevel (Llama 3's, "
                        "Qwen2's)");
    const nlohmann::json& split = seq[0];
    const nlohmann::json* pattern = Reader::get(split, "pattern");
    const std::string regex =
        pattern ? r.str(*pattern, "Regex", "pre_tokenizer.pretokenizers[0].pattern.Regex") : "";
    spec.split = pattern_of(regex);
    if (spec.split == Pattern::kNone)
      throw ConfigError(path + ": pre_tokenizer's Split pattern " +
                        (pattern ? pattern->dump().substr(0, 200) : "null") +
                        " is not one headroom knows; it reads Llama 3's " +
                        json_string(kLlama3Regex) + " and Qwen2's " + json_string(kQwen2Regex));
    if (r.str(split, "behavior", "pre_tokenizer.pretokenizers[0].behavior") != "Isolated" ||
        r.boolean(split, "invert", "pre_tokenizer.pretokenizers[0].invert", false))
      throw ConfigError(path + ": pre_tokenizer's Split has behavior " +
                        split.value("behavior", nlohmann::json()).dump() + " and invert " +
                        split.value("invert", nlohmann::json()).dump() +
                        "; headroom reads behavior \"Isolated\" with invert false");
    byte_level = seq[1];
    if (r.boolean(byte_level, "use_regex", "pre_tokenizer.pretokenizers[1].use_regex", true))
      throw ConfigError(path +
                        ": pre_tokenizer's ByteLevel after a Split has use_regex true (it "
                        "would split the words again by GPT-2's pattern); headroom reads it "
                        "false, as Llama 3's and Qwen2's");
  } else if (type != "ByteLevel") {
    throw ConfigError(path + ": pre_tokenizer is of type " + json_string(type) +
                      ", which headroom does not implement; it reads \"ByteLevel\" (GPT-2's), a "
                      "Sequence of a Split and a ByteLevel (Llama 3's, Qwen2's), \"Metaspace\" "
                      "(SentencePiece's) or none (Llama 2's, with its normalizer)");
  } else {
    spec.split = r.boolean(*pre, "use_regex", "pre_tokenizer.use_regex", true) ? Pattern::kGpt2
                                                                               : Pattern::kNone;
  }
  spec.add_prefix_space =
      r.boolean(byte_level, "add_prefix_space", "pre_tokenizer.add_prefix_space", true);
}

// post_processor: what encode() puts around the text. TemplateProcessing's "single" (BOS and
// EOS, as Llama's), ByteLevel (offsets only) and a Sequence of them.
void read_post_processor(const Reader& r, const nlohmann::json& p, const std::string& key,
                         int depth, Spec& spec, bool& templated) {
  r.depth(depth, key);
  const std::string type = r.type(p, key);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const nlohmann::json& steps = r.array(p, "processors", key + ".processors");
    for (size_t i = 0; i < steps.size(); ++i)
      read_post_processor(r, steps[i], at(key + ".processors", i), depth + 1, spec, templated);
    return;
  }
  if (type != "TemplateProcessing")
    r.fail(key, "is of type " + json_string(type) +
                    ", which headroom does not implement; it reads TemplateProcessing (the "
                    "BOS/EOS of Llama's), ByteLevel and a Sequence of them");
  if (templated) r.fail(key, "is a second TemplateProcessing; headroom reads one");
  templated = true;
  const nlohmann::json& single = r.array(p, "single", key + ".single");
  const nlohmann::json* specials = Reader::get(p, "special_tokens");
  bool seen_a = false;
  std::string names;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string where = at(key + ".single", i);
    const nlohmann::json& piece = single[i];
    if (const nlohmann::json* seq = Reader::get(piece, "Sequence")) {
      if (r.str(*seq, "id", where + ".Sequence.id") != "A" || seen_a)
        r.fail(where, "is " + piece.dump().substr(0, 80) +
                          "; a single template holds the sequence A once");
      seen_a = true;
      names += " $A";
      continue;
    }
    const nlohmann::json* special = Reader::get(piece, "SpecialToken");
    if (!special)
      r.fail(where,
             "is " + piece.dump().substr(0, 80) + "; expected a SpecialToken or the Sequence A");
    const std::string name = r.str(*special, "id", where + ".SpecialToken.id");
    const nlohmann::json* entry = specials ? Reader::get(*specials, name.c_str()) : nullptr;
    if (!entry)
      r.fail(where, "names the special token " + json_string(name) + ", which " + key +
                        ".special_tokens does not hold");
    const nlohmann::json& ids =
        r.array(*entry, "ids", key + ".special_tokens[" + json_string(name) + "].ids");
    for (const nlohmann::json& id : ids) {
      if (!id.is_number_unsigned() || id.get<uint64_t>() >= uint64_t(kMaxVocabSize))
        r.fail(key + ".special_tokens[" + json_string(name) + "].ids",
               "holds " + id.dump().substr(0, 40) + "; ids run from 0 to " +
                   std::to_string(kMaxVocabSize - 1));
      (seen_a ? spec.after : spec.before).push_back(id.get<int32_t>());
      if (spec.before.size() + spec.after.size() > kMaxTemplateIds)
        r.fail(key + ".single", "adds more than " + std::to_string(kMaxTemplateIds) + " ids");
    }
    names += " " + name;
  }
  if (!seen_a) r.fail(key + ".single", "has no Sequence A: it would drop the text");
  if (!spec.before.empty() || !spec.after.empty())
    spec.notes.push_back("adds" + names.substr(0, 120));
}

void read_decoder(const Reader& r, const nlohmann::json& d, const std::string& key, int depth,
                  Spec& spec, std::string& what) {
  r.depth(depth, key);
  const std::string type = r.type(d, key);
  DecStep st{};
  if (type == "Sequence") {
    const nlohmann::json& steps = r.array(d, "decoders", key + ".decoders");
    for (size_t i = 0; i < steps.size(); ++i)
      read_decoder(r, steps[i], at(key + ".decoders", i), depth + 1, spec, what);
    return;
  } else if (type == "Replace") {
    st.kind = DecStep::kReplace;
    st.from = replace_pattern(r, d, key);
    st.to = r.str(d, "content", key + ".content");
    if (st.to.size() > kMaxPieceString)
      r.fail(key + ".content", "is " + json_string(st.to) + "; headroom reads at most " +
                                   std::to_string(kMaxPieceString) + " bytes here");
  } else if (type == "ByteFallback") {
    st.kind = DecStep::kByteFallback;
  } else if (type == "Fuse") {
    st.kind = DecStep::kFuse;
  } else if (type == "Strip") {
    st.kind = DecStep::kStrip;
    st.content = r.one_char(d, "content", key + ".content");
    st.start = size_t(r.count(d, "start", key + ".start", 1u << 20));
    st.stop = size_t(r.count(d, "stop", key + ".stop", 1u << 20));
  } else if (type == "Metaspace") {
    st.kind = DecStep::kMetaspace;
    st.from = r.one_char(d, "replacement", key + ".replacement");
    const std::string scheme = r.str(d, "prepend_scheme", key + ".prepend_scheme");
    if (!scheme.empty() && scheme != "always" && scheme != "first" && scheme != "never")
      r.fail(key + ".prepend_scheme",
             "is " + json_string(scheme) + "; it is \"always\", \"first\" or \"never\"");
    st.strip_first = scheme.empty()
                         ? r.boolean(d, "add_prefix_space", key + ".add_prefix_space", true)
                         : scheme != "never";
  } else {
    r.fail(key, "is of type " + json_string(type) +
                    ", which headroom does not implement for a BPE over text; it reads Replace "
                    "(of a String pattern), ByteFallback, Fuse, Strip, Metaspace and a Sequence of "
                    "them (Llama 2's, TinyLlama's)");
  }
  spec.decoder.push_back(st);
  what += std::string(what.empty() ? "" : " + ") + type;
}

std::unique_ptr<Tokenizer> from_tokenizer_json(const std::string& path) {
  const nlohmann::json j = parse_json(path);
  if (!j.is_object() || !j.contains("model"))
    throw ConfigError(path + ": no \"model\": not a Hugging Face tokenizer.json");
  const Reader r{path};
  const nlohmann::json& m = j["model"];
  const std::string type = r.str(m, "type", "model.type");
  if (type != "BPE")
    throw ConfigError(path + ": model.type is \"" + type +
                      "\"; headroom reads BPE tokenizers (model.type \"BPE\": GPT-2's, Llama "
                      "3's, Qwen2's, Llama 2's)");
  auto is_set = [&](const char* k) {
    return m.contains(k) && !m[k].is_null() && !(m[k].is_string() && m[k].get<std::string>() == "");
  };
  if (m.contains("dropout") && !m["dropout"].is_null() &&
      (!m["dropout"].is_number() || m["dropout"].get<double>() != 0.0))
    throw ConfigError(path +
                      ": model.dropout is set: BPE dropout samples its merges; headroom "
                      "encodes deterministically (set it to null)");
  if (is_set("continuing_subword_prefix") || is_set("end_of_word_suffix"))
    throw ConfigError(path +
                      ": model.continuing_subword_prefix / end_of_word_suffix are set: not "
                      "a BPE as GPT-2's or SentencePiece's");
  Spec spec;
  read_pre_tokenizer(r, j, spec);
  if (const nlohmann::json* n = Reader::get(j, "normalizer")) {
    std::string what;
    read_normalizer(r, *n, "normalizer", 0, spec, what);
    spec.notes.insert(spec.notes.begin(), "normalizer " + what);
  }
  if (!spec.byte_level && !spec.metaspace && spec.normalizer.empty())
    throw ConfigError(path +
                      ": pre_tokenizer is null and there is no normalizer: headroom reads a BPE "
                      "over text as Llama 2's (a normalizer that puts \"▁\" for spaces) or with a "
                      "Metaspace pre_tokenizer");
  spec.ignore_merges = r.boolean(m, "ignore_merges", "model.ignore_merges", false);
  spec.byte_fallback = r.boolean(m, "byte_fallback", "model.byte_fallback", false);
  spec.fuse_unk = r.boolean(m, "fuse_unk", "model.fuse_unk", false);
  if (!spec.byte_level) {
    spec.unk_token = r.str(m, "unk_token", "model.unk_token");
    if (spec.byte_fallback) spec.notes.push_back("byte fallback");
    if (!spec.unk_token.empty()) spec.notes.push_back("unk " + json_string(spec.unk_token));
  }

  const nlohmann::json* dec = Reader::get(j, "decoder");
  if (spec.byte_level) {
    if (dec && r.type(*dec, "decoder") != "ByteLevel")
      r.fail("decoder", "is of type " + json_string(r.type(*dec, "decoder")) +
                            "; a byte-level BPE's decoder is ByteLevel (or null)");
  } else if (!dec) {
    spec.decoder_null = true;
  } else {
    std::string what;
    read_decoder(r, *dec, "decoder", 0, spec, what);
    spec.notes.push_back("decoder " + what);
  }
  bool templated = false;
  if (const nlohmann::json* p = Reader::get(j, "post_processor"))
    read_post_processor(r, *p, "post_processor", 0, spec, templated);

  const std::map<std::string, int32_t> vocab = read_vocab(m.value("vocab", nlohmann::json()), path);
  std::vector<std::pair<std::string, std::string>> merges;
  const nlohmann::json& ms = m.value("merges", nlohmann::json::array());
  if (!ms.is_array()) throw ConfigError(path + ": model.merges must be an array");
  for (const nlohmann::json& e : ms) {
    if (e.is_string()) {
      merges.push_back(split_merge(e.get<std::string>(), path));
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
    } else {
      throw ConfigError(path + ": model.merges holds " + e.dump().substr(0, 80) +
                        "; each merge is \"a b\" or [\"a\", \"b\"]");
    }
  }
  std::vector<Added> added;
  const nlohmann::json* at_list = Reader::get(j, "added_tokens");
  if (at_list && !at_list->is_array()) r.fail("added_tokens", "must be an array");
  for (size_t i = 0; at_list && i < at_list->size(); ++i) {
    const nlohmann::json& a = (*at_list)[i];
    const std::string key = at("added_tokens", i);
    if (!a.is_object() || !a.contains("content") || !a.contains("id") ||
        !a["content"].is_string() || !a["id"].is_number_integer())
      throw ConfigError(path + ": added_tokens holds " + a.dump().substr(0, 80) +
                        "; each needs a \"content\" string and an \"id\"");
    if (a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() >= kMaxVocabSize)
      throw ConfigError(path + ": added token " + a["content"].dump() + " has id " +
                        a["id"].dump() + "; ids run from 0 to " +
                        std::to_string(kMaxVocabSize - 1) + " (a model has at most " +
                        std::to_string(kMaxVocabSize) + " tokens)");
    for (const char* k : {"single_word", "lstrip", "rstrip"})
      if (r.boolean(a, k, key + "." + k, false))
        r.fail(key + "." + k, "is true (for " + a["content"].dump().substr(0, 40) +
                                  "); headroom matches added tokens as they are written, so "
                                  "reads it false");
    const bool special = r.boolean(a, "special", key + ".special", false);
    added.push_back({a["content"].get<std::string>(), a["id"].get<int32_t>(),
                     r.boolean(a, "normalized", key + ".normalized", !special)});
  }
  return std::make_unique<BpeTokenizer>(path, vocab, merges, added, std::move(spec));
}

// GPT-2's own files: vocab.json and merges.txt (its first line may be "#version: ...").
std::unique_ptr<Tokenizer> from_vocab_merges(const std::string& vocab_path,
                                             const std::string& merges_path) {
  const std::map<std::string, int32_t> vocab = read_vocab(parse_json(vocab_path), vocab_path);
  std::istringstream in(read_file(merges_path));
  std::vector<std::pair<std::string, std::string>> merges;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (n == 1 && line.rfind("#version", 0) == 0)) continue;
    merges.push_back(split_merge(line, merges_path + ":" + std::to_string(n)));
  }
  Spec spec;  // GPT-2's: no prefix space, the pattern
  return std::make_unique<BpeTokenizer>(vocab_path + " + " + merges_path, vocab, merges,
                                        std::vector<Added>{}, std::move(spec));
}
}  // namespace

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids)
    s += token_bytes(id);
  return s;
}

namespace {

// The length of s less an incomplete UTF-8 character at its end (a later token's bytes may
// complete it).
size_t settled_length(const std::string& s) {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const unsigned char c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t len = c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 && c < 0xF0 ? 3 : c >= 0xC0 ? 2 : 1;
    return len > back ? s.size() - back : s.size();
  }
  return s.size();
}

// What `text` adds to `shown` (from the first byte that differs, where it does not start so).
std::string past(const std::string& text, const std::string& shown) {
  size_t same = 0;
  const size_t n = std::min(text.size(), shown.size());
  while (same < n && text[same] == shown[same])
    ++same;
  return text.substr(same);
}

}  // namespace

DecodeStream::DecodeStream(const Tokenizer& tokenizer, std::vector<int32_t> context)
    : tokenizer_(tokenizer), ids_(std::move(context)), shown_(tokenizer_.decode(ids_)) {}

std::string DecodeStream::next(int32_t id) {
  ids_.push_back(id);
  if (tokenizer_.is_byte_fallback(id)) return std::string();  // the run decodes as a whole
  const std::string text = tokenizer_.decode(ids_);
  const std::string settled =
      text.substr(0, std::max(settled_length(text), std::min(text.size(), shown_.size())));
  std::string out = past(settled, shown_);
  shown_ = settled;
  return out;
}

std::string DecodeStream::finish() {
  const std::string text = tokenizer_.decode(ids_);
  std::string out = past(text, shown_);
  shown_ = text;
  return out;
}

std::unique_ptr<Tokenizer> make_byte_tokenizer() {
  return std::make_unique<ByteTokenizer>();
}

namespace {

// A text's code points classed for the pre-tokenizers' patterns (letters and numbers from the
// Unicode tables, whitespace as Oniguruma's \s), and the words cut from it so far.
struct Words {
  enum Class { kLetter, kNumber, kSpace, kOther };
  explicit Words(const std::string& t) : text(t), cps(decode_utf8(t)), n(cps.size() - 1), cls(n) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t c = cps[i].cp;
      cls[i] = is_letter(c) ? kLetter : is_number(c) ? kNumber : is_space(c) ? kSpace : kOther;
    }
  }
  uint32_t cp(size_t i) const { return i < n ? cps[i].cp : 0u; }
  // The code points [from, to) as one word.
  void emit(size_t from, size_t to) {
    words.push_back(text.substr(cps[from].at, cps[to].at - cps[from].at));
  }
  // The length of 's|'t|'re|'ve|'m|'ll|'d at i, 0 if none; `fold`: case-insensitive, as (?i:...)
  // (ASCII letters, and the long s U+017F, which folds to 's').
  size_t contraction(size_t i, bool fold) const {
    if (cp(i) != '\'') return 0;
    auto at = [&](size_t k) {
      const uint32_t c = cp(k);
      if (!fold) return c;
      if (c >= 'A' && c <= 'Z') return c + ('a' - 'A');
      return c == 0x17Fu ? uint32_t('s') : c;
    };
    const uint32_t a = at(i + 1), b = at(i + 2);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
  }
  const std::string& text;
  const std::vector<CodePoint> cps;
  const size_t n;  // code points (cps' last entry marks the end)
  std::vector<Class> cls;
  std::vector<std::string> words;
};

}  // namespace

std::vector<std::string> gpt2_pretokenize(const std::string& text) {
  Words w(text);
  const size_t n = w.n;
  const std::vector<Words::Class>& cls = w.cls;
  size_t i = 0;
  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (const size_t len = w.contraction(i, false)) {
      w.emit(i, i + len);
      i += len;
      continue;
    }
    //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+   (the optional space is U+0020 alone)
    const size_t j = w.cp(i) == ' ' ? i + 1 : i;
    if (j < n && cls[j] != Words::kSpace) {
      const Words::Class c = cls[j];
      size_t k = j + 1;
      while (k < n && cls[k] == c)
        ++k;
      w.emit(i, k);
      i = k;
      continue;
    }
    // \s+(?!\S) | \s+ : a run of whitespace, less its last character when a non-space follows
    // (that one starts the next word, " word"), unless the run is that one character.
    size_t k = i;
    while (k < n && cls[k] == Words::kSpace)
      ++k;
    if (k < n && k - i >= 2) --k;
    w.emit(i, k);
    i = k;
  }
  return std::move(w.words);
}

const char* const kLlama3Regex =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
const char* const kQwen2Regex =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

Pattern pattern_of(const std::string& regex) {
  if (regex == kLlama3Regex) return Pattern::kLlama3;
  if (regex == kQwen2Regex) return Pattern::kQwen2;
  return Pattern::kNone;
}

namespace {

// Llama 3's pattern (Qwen2's with max_digits 1), alternative by alternative, the first that
// matches at a position winning, as the regex engine's leftmost-first alternation does:
//   1. (?i:'s|'t|'re|'ve|'m|'ll|'d)     2. [^\r\n\p{L}\p{N}]?\p{L}+     3. \p{N}{1,max_digits}
//   4.  ?[^\s\p{L}\p{N}]+[\r\n]*       5. \s*[\r\n]+   6. \s+(?!\S)   7. \s+
std::vector<std::string> llama3_pretokenize(const std::string& text, size_t max_digits) {
  Words w(text);
  const size_t n = w.n;
  const std::vector<Words::Class>& cls = w.cls;
  using C = Words::Class;
  auto newline = [&](size_t i) { return w.cp(i) == '\r' || w.cp(i) == '\n'; };
  auto emit = [&](size_t from, size_t to) { w.emit(from, to); };
  size_t i = 0;
  while (i < n) {
    if (const size_t len = w.contraction(i, true)) {  // 1
      emit(i, i + len);
      i += len;
      continue;
    }
    size_t j = cls[i] == C::kLetter || cls[i] == C::kNumber || newline(i) ? i : i + 1;  // 2
    if (j < n && cls[j] == C::kLetter) {
      while (j < n && cls[j] == C::kLetter)
        ++j;
      emit(i, j);
      i = j;
      continue;
    }
    if (cls[i] == C::kNumber) {  // 3
      j = i;
      while (j < n && cls[j] == C::kNumber && j - i < max_digits)
        ++j;
      emit(i, j);
      i = j;
      continue;
    }
    j = w.cp(i) == ' ' ? i + 1 : i;  // 4
    if (j < n && cls[j] == C::kOther) {
      while (j < n && cls[j] == C::kOther)
        ++j;
      while (j < n && newline(j))
        ++j;
      emit(i, j);
      i = j;
      continue;
    }
    // Whitespace from here (every other class matched above): its maximal run [i, end).
    size_t end = i;
    while (end < n && cls[end] == C::kSpace)
      ++end;
    size_t last_newline = end;
    for (size_t k = end; k > i; --k)
      if (newline(k - 1)) {
        last_newline = k - 1;
        break;
      }
    if (last_newline < end) {  // 5: through the run's last CR or LF
      emit(i, last_newline + 1);
      i = last_newline + 1;
    } else if (end < n && end - i >= 2) {  // 6: less the space before the next word
      emit(i, end - 1);
      i = end - 1;
    } else {  // 6 at the end of the text, or 7
      emit(i, end);
      i = end;
    }
  }
  return std::move(w.words);
}

}  // namespace

std::vector<std::string> pretokenize(const std::string& text, Pattern pattern) {
  switch (pattern) {
    case Pattern::kNone:
      return {text};
    case Pattern::kGpt2:
      return gpt2_pretokenize(text);
    case Pattern::kLlama3:
      return llama3_pretokenize(text, 3);
    case Pattern::kQwen2:
      return llama3_pretokenize(text, 1);
  }
  return {text};
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(fs::path(path) / "tokenizer.json"))
      return from_tokenizer_json((fs::path(path) / "tokenizer.json").string());
    if (fs::exists(fs::path(path) / "vocab.json"))
      return load_tokenizer((fs::path(path) / "vocab.json").string());
    throw ConfigError(path + ": a folder with neither tokenizer.json nor vocab.json + merges.txt");
  }
  if (!fs::exists(path, ec))
    throw ConfigError(path +
                      ": no such tokenizer file (expected a Hugging Face tokenizer.json, "
                      "or GPT-2's vocab.json with merges.txt beside it)");
  const nlohmann::json j = parse_json(path);
  if (j.is_object() && j.contains("model")) return from_tokenizer_json(path);
  // A vocab.json: its merges.txt is beside it.
  const fs::path merges = fs::path(path).parent_path() / "merges.txt";
  if (!fs::exists(merges, ec))
    throw ConfigError(path + ": holds no \"model\" (so not a tokenizer.json) and there is no " +
                      merges.string() + " beside it (a vocab.json needs its merges.txt)");
  return from_vocab_merges(path, merges.string());
}

}  // namespace headroom
