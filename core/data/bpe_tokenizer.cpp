#include "core/data/bpe_tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/config/config.h"

namespace headroom {

namespace {

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

class BpeTokenizer final : public Tokenizer {
 public:
  struct Options {
    bool add_prefix_space = false;
    // How the text is split into words before the merges: not at all (ByteLevel use_regex
    // false), GPT-2's pattern (ByteLevel's own), or the Split pattern of Llama 3 / Qwen2 before a
    // ByteLevel without its pattern (pretokenize()).
    Pattern split = Pattern::kGpt2;
    bool ignore_merges = false;
    // model.byte_fallback: a character with no token of its own is spelt by the tokens "<0xHH>"
    // of its UTF-8 bytes, as Hugging Face's BPE does.
    bool byte_fallback = false;
  };

  // vocab: token string (in the byte alphabet) -> id; merges: pairs of token strings, by rank;
  // added: special or added tokens (content as raw text -> id).
  BpeTokenizer(std::string source, const std::map<std::string, int32_t>& vocab,
               const std::vector<std::pair<std::string, std::string>>& merges,
               std::vector<std::pair<std::string, int32_t>> added, const Options& options)
      : source_(std::move(source)), options_(options), added_(std::move(added)) {
    const ByteAlphabet& abc = alphabet();
    int32_t max_id = -1;
    for (const auto& [token, id] : vocab) {
      vocab_[token] = id;
      max_id = std::max(max_id, id);
    }
    for (const auto& [content, id] : added_)
      max_id = std::max(max_id, id);
    vocab_size_ = max_id + 1;
    bytes_.resize(size_t(vocab_size_));
    for (const auto& [token, id] : vocab) {
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
    for (const auto& [content, id] : added_)
      bytes_[size_t(id)] = content;
    // Longest added token first: "<|endoftext|>" before "<|end".
    std::stable_sort(added_.begin(), added_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    for (size_t r = 0; r < merges.size(); ++r) {
      const auto& [a, b] = merges[r];
      const int32_t ia = id_of(a, r), ib = id_of(b, r), merged = id_of(a + b, r);
      merges_.emplace(key(ia, ib), Merge{uint32_t(r), merged});  // the first rank wins
    }
    map_bytes();
  }

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    size_t start = 0, i = 0;
    while (i < text.size()) {
      const std::pair<std::string, int32_t>* hit = nullptr;
      for (const auto& a : added_) {
        if (!a.first.empty() && text.compare(i, a.first.size(), a.first) == 0) {
          hit = &a;
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      if (i > start) encode_piece(text.substr(start, i - start), ids);
      ids.push_back(hit->second);
      i += hit->first.size();
      start = i;
    }
    if (start < text.size()) encode_piece(text.substr(start), ids);
    return ids;
  }

  std::string token_bytes(int32_t id) const override {
    return id >= 0 && id < vocab_size_ ? bytes_[size_t(id)] : std::string();
  }
  // Byte-fallback tokens spell the UTF-8 of a character of the byte alphabet: a run of them is
  // read as those characters, each the byte it stands for (what Hugging Face's ByteFallback and
  // ByteLevel decoders do in turn).
  std::string decode(const std::vector<int32_t>& ids) const override {
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
  int vocab_size() const override { return vocab_size_; }
  std::string describe() const override {
    return "byte-level BPE '" + source_ + "' (vocab " + std::to_string(vocab_size_) + ", " +
           std::to_string(merges_.size()) + " merges" +
           (options_.add_prefix_space ? ", add_prefix_space" : "") +
           (options_.split == Pattern::kLlama3  ? ", Llama 3's split"
            : options_.split == Pattern::kQwen2 ? ", Qwen2's split"
            : options_.split == Pattern::kNone  ? ", no split"
                                                : "") +
           ")";
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

  // Each byte's ids when no merge applies: its own token, else (byte_fallback) the "<0xHH>"
  // tokens of its character's UTF-8 bytes, else none. A byte-level BPE without byte fallback must
  // have every byte's token: a byte it has none for would be dropped from the text without a word
  // (Hugging Face's BPE drops a character it has no token for), so such a file is refused here,
  // naming the bytes. With byte fallback a byte whose fallback tokens are missing too is refused
  // by encode(), naming it, where text holds it.
  void map_bytes() {
    const ByteAlphabet& abc = alphabet();
    // Every fallback token stands for its byte (token_bytes, decode).
    int32_t fallback_id[256];
    for (unsigned u = 0; u < 256; ++u) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", u);
      const auto it = options_.byte_fallback ? vocab_.find(name) : vocab_.end();
      fallback_id[u] = it == vocab_.end() ? -1 : it->second;
      if (fallback_id[u] < 0) continue;
      fallback_byte_[fallback_id[u]] = uint8_t(u);
      bytes_[size_t(fallback_id[u])] = std::string(1, char(u));
    }
    std::vector<unsigned> missing;
    for (unsigned b = 0; b < 256; ++b) {
      std::vector<int32_t>& ids = byte_ids_[b];
      const auto own = vocab_.find(abc.of_byte[b]);
      if (own != vocab_.end()) {
        ids = {own->second};
        continue;
      }
      if (options_.byte_fallback) {
        for (unsigned char u : abc.of_byte[b]) {
          if (fallback_id[u] < 0) {
            ids.clear();
            break;
          }
          ids.push_back(fallback_id[u]);
        }
      }
      if (ids.empty()) missing.push_back(b);
    }
    if (!missing.empty() && !options_.byte_fallback)
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

  void encode_piece(std::string piece, std::vector<int32_t>& ids) const {
    if (options_.add_prefix_space && piece[0] != ' ') piece.insert(piece.begin(), ' ');
    if (options_.split == Pattern::kNone) {
      encode_word(piece, ids);
      return;
    }
    for (const std::string& word : pretokenize(piece, options_.split))
      encode_word(word, ids);
  }

  // One pre-tokenized word: its bytes as characters of the alphabet, then the merges.
  void encode_word(const std::string& word, std::vector<int32_t>& ids) const {
    const ByteAlphabet& abc = alphabet();
    if (options_.ignore_merges) {
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
      const std::vector<int32_t>& ids = byte_ids_[c];
      if (ids.empty()) {
        unencodable.push_back(c);
        continue;
      }
      symbols.insert(symbols.end(), ids.begin(), ids.end());
    }
    if (!unencodable.empty()) {
      std::sort(unencodable.begin(), unencodable.end());
      unencodable.erase(std::unique(unencodable.begin(), unencodable.end()), unencodable.end());
      throw ConfigError(source_ + ": cannot encode the byte" +
                        (unencodable.size() > 1 ? "s " : " ") + byte_list(unencodable) +
                        " of the text: the tokenizer has neither " +
                        "a token for them nor their byte-fallback tokens \"<0xHH>\"");
    }
    // Lowest rank first, the leftmost of equal ranks (Hugging Face's heap of (rank, position)).
    for (;;) {
      uint32_t best = UINT32_MAX;
      size_t at = 0;
      int32_t merged = -1;
      for (size_t j = 0; j + 1 < symbols.size(); ++j) {
        const auto it = merges_.find(key(symbols[j], symbols[j + 1]));
        if (it != merges_.end() && it->second.rank < best) {
          best = it->second.rank;
          at = j;
          merged = it->second.id;
        }
      }
      if (merged < 0) break;
      symbols[at] = merged;
      symbols.erase(symbols.begin() + std::ptrdiff_t(at) + 1);
    }
    ids.insert(ids.end(), symbols.begin(), symbols.end());
  }

  std::string source_;
  Options options_;
  std::vector<std::pair<std::string, int32_t>> added_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::vector<std::string> bytes_;  // id -> its bytes
  int32_t vocab_size_ = 0;
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

std::unique_ptr<Tokenizer> from_tokenizer_json(const std::string& path) {
  const nlohmann::json j = parse_json(path);
  if (!j.is_object() || !j.contains("model"))
    throw ConfigError(path + ": no \"model\": not a Hugging Face tokenizer.json");
  const nlohmann::json& m = j["model"];
  const std::string type = m.value("type", std::string());
  if (type != "BPE")
    throw ConfigError(path + ": model.type is \"" + type +
                      "\"; headroom reads byte-level BPE tokenizers (model.type \"BPE\", as "
                      "GPT-2's)");
  auto is_set = [&](const char* k) {
    return m.contains(k) && !m[k].is_null() && !(m[k].is_string() && m[k].get<std::string>() == "");
  };
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    throw ConfigError(path +
                      ": model.dropout is set: BPE dropout samples its merges; headroom "
                      "encodes deterministically (set it to null)");
  if (is_set("continuing_subword_prefix") || is_set("end_of_word_suffix"))
    throw ConfigError(path +
                      ": model.continuing_subword_prefix / end_of_word_suffix are set: not "
                      "a byte-level BPE as GPT-2's");
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    throw ConfigError(path + ": has a normalizer (" + j["normalizer"].value("type", "?") +
                      "); headroom reads byte-level BPE tokenizers without one, as GPT-2's");
  BpeTokenizer::Options o;
  const nlohmann::json& pre = j.value("pre_tokenizer", nlohmann::json());
  nlohmann::json byte_level = pre;  // the ByteLevel: the pre_tokenizer, or a Sequence's second
  if (pre.is_object() && pre.value("type", std::string()) == "Sequence") {
    // Llama 3's and Qwen2's: Split(their pattern, "Isolated") then ByteLevel(use_regex false).
    const nlohmann::json& seq = pre.value("pretokenizers", nlohmann::json());
    if (!seq.is_array() || seq.size() != 2 || !seq[0].is_object() || !seq[1].is_object() ||
        seq[0].value("type", std::string()) != "Split" ||
        seq[1].value("type", std::string()) != "ByteLevel")
      throw ConfigError(path + ": pre_tokenizer is a Sequence of " + seq.dump().substr(0, 200) +
                        "; headroom reads a Sequence of a Split and a ByteLevel (Llama 3's, "
                        "Qwen2's)");
    const nlohmann::json& split = seq[0];
    const nlohmann::json& pattern = split.value("pattern", nlohmann::json());
    const std::string regex = pattern.is_object() ? pattern.value("Regex", std::string()) : "";
    o.split = pattern_of(regex);
    if (o.split == Pattern::kNone)
      throw ConfigError(path + ": pre_tokenizer's Split pattern " + pattern.dump().substr(0, 200) +
                        " is not one headroom knows; it reads Llama 3's " +
                        json_string(kLlama3Regex) + " and Qwen2's " + json_string(kQwen2Regex));
    if (split.value("behavior", std::string()) != "Isolated" || split.value("invert", false))
      throw ConfigError(path + ": pre_tokenizer's Split has behavior " +
                        split.value("behavior", nlohmann::json()).dump() + " and invert " +
                        split.value("invert", nlohmann::json()).dump() +
                        "; headroom reads behavior \"Isolated\" with invert false");
    byte_level = seq[1];
    if (byte_level.value("use_regex", true))
      throw ConfigError(path +
                        ": pre_tokenizer's ByteLevel after a Split has use_regex true (it "
                        "would split the words again by GPT-2's pattern); headroom reads it "
                        "false, as Llama 3's and Qwen2's");
  } else if (pre.is_null() || pre.value("type", std::string()) != "ByteLevel") {
    throw ConfigError(path + ": pre_tokenizer is " +
                      (pre.is_null() ? std::string("null") : "\"" + pre.value("type", "?") + "\"") +
                      "; headroom reads byte-level BPE tokenizers, whose pre_tokenizer is "
                      "\"ByteLevel\" (GPT-2's) or a Sequence of a Split and a ByteLevel "
                      "(Llama 3's, Qwen2's)");
  } else {
    o.split = pre.value("use_regex", true) ? Pattern::kGpt2 : Pattern::kNone;
  }
  o.add_prefix_space = byte_level.value("add_prefix_space", true);
  o.ignore_merges = m.value("ignore_merges", false);
  o.byte_fallback = m.value("byte_fallback", false);

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
      throw ConfigError(path + ": model.merges holds " + e.dump() +
                        "; each merge is \"a b\" or [\"a\", \"b\"]");
    }
  }
  std::vector<std::pair<std::string, int32_t>> added;
  for (const nlohmann::json& a : j.value("added_tokens", nlohmann::json::array())) {
    if (!a.contains("content") || !a.contains("id") || !a["content"].is_string() ||
        !a["id"].is_number_integer())
      throw ConfigError(path + ": added_tokens holds " + a.dump() +
                        "; each needs a \"content\" string and an \"id\"");
    if (a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() >= kMaxVocabSize)
      throw ConfigError(path + ": added token " + a["content"].dump() + " has id " +
                        a["id"].dump() + "; ids run from 0 to " +
                        std::to_string(kMaxVocabSize - 1) + " (a model has at most " +
                        std::to_string(kMaxVocabSize) + " tokens)");
    added.emplace_back(a["content"].get<std::string>(), a["id"].get<int32_t>());
  }
  return std::make_unique<BpeTokenizer>(path, vocab, merges, std::move(added), o);
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
  BpeTokenizer::Options o;  // GPT-2's: no prefix space, the pattern
  return std::make_unique<BpeTokenizer>(vocab_path + " + " + merges_path, vocab, merges,
                                        std::vector<std::pair<std::string, int32_t>>{}, o);
}

}  // namespace

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids)
    s += token_bytes(id);
  return s;
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
