// The BPE tokenizers (core/data/bpe_tokenizer.h), byte-level and SentencePiece-style: their ids
// and decoded text against Hugging Face's `tokenizers` (the reference, tests/bpe/reference.py,
// run from .venv-test/ where scripts/setup installs it; the tests skip saying so where it is
// not), the pre-tokenizer against GPT-2's pattern on hand-checked cases, their errors, and
// `headroom shard --tokenizer` and `headroom sample` with them.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/data/bpe_tokenizer.h"
#include "core/data/shards.h"
#include "test_util.h"

namespace headroom {
namespace {

using test::contains;
using test::read_file;
using test::run_command;
using test::temp_dir;
using test::write_file;

// The text the reference trains on: English with contractions, numbers, code, whitespace runs,
// other scripts and emoji, so that the merges cover them.
std::string training_text() {
  std::string t;
  const char* lines[] = {
      "The quick brown fox jumps over the lazy dog. It's 2026; we've 12,345 tokens.\n",
      "I'm sure they'll say \"don't\" -- you'd agree? She's here, they're not.\n",
      "def f(x):\n    return x ** 2  # squares\n\n\tindented\ttabs\n",
      "Größe, Straße, naïve café, résumé; Ελληνικά κείμενα; русский текст.\n",
      "日本語のテキスト、中文文本。한국어 텍스트. ٣٤٥ ١٢ ½ ⅷ\n",
      "emoji 🙂🚀 and flags 🇫🇷, math ∑∫√ and symbols ©®™ — dashes – …\n",
      "   leading spaces, trailing spaces   \n\n\n  multiple\n\n blank lines\r\n",
  };
  for (int r = 0; r < 20; ++r)
    for (const char* l : lines)
      t += l;
  return t;
}

// The cases both encoders see: none of them is the training text verbatim.
std::vector<std::string> cases() {
  return {
      "Hello world",
      " Hello world",
      "It's what we've got; they'll see, I'm sure, you'd know, he's done, we're DONE'S",
      "'s 's' ''t '''re x'll y'LL",
      "numbers 1 22 333 4444 12345678901 3.14159 1,000,000 ٣٤٥ ½ ⅷ",
      "spaces:  two   three    four     end     ",
      "tabs\tand\t\tnew\nlines\n\n\nand \n \n mixed \t\n",
      "   leading",
      "trailing   ",
      "\n",
      " ",
      "",
      "Größe Straße naïve café résumé ÆØÅ",
      "Ελληνικά κείμενα, русский текст, עברית, العربية",
      "日本語のテキスト、中文文本。한국어 텍스트",
      "emoji 🙂🚀👍🏽 flags 🇫🇷🇩🇪 zwj 👩‍👩‍👧",
      "math ∑∫√∞ ≤≥ ©®™ — – … «quotes» “curly” ‘single’",
      "code: def f(x):\n    return x ** 2  # squares\n",
      "mixed123abc 456def ghi789 a1b2c3",
      "nbsp\u00a0here thin\u2009space ideographic\u3000space line\u2028sep",
      "<|endoftext|>after special<|endoftext|> and <|endoftext|",
      "The quick brown fox jumps over the lazy dog. It's 2026; we've 12,345 tokens.",
      "!!!??? ... ---- ==== ____ \\\\ // @@ ## $$ %% ^^ && ** (( ))",
      "\r\nwindows\r\nline endings\r\n",
      "'S 'Sound 'LLama x'RE ſ'ſ 123456 1234abc 12.5e10 -42",
      "\t\tword (tab)word !word ?!\n\nnext  \n\n  x\n \n",
      "a\r\n\r\n b \u00a0\u00a0c\t\n\td",
      // Characters the training text lacks (byte fallback, or unk), the replacement character
      // itself, and Llama 2's special tokens in the text.
      "Ωmega ŧ 𝔘𝔫𝔦 漢字 ✈ ☃⛄ ﬁ ǅ",
      "a\u2581b \u2581\u2581c\u2581",
      "<s>bos in text</s> and <unk> and </s",
      "  two leading, one trailing ",
      "x",
      "1234567890 0.5 1e-9 ৩৪ 二十",
      // NFC's cases: combining marks to compose and to reorder, singletons (Angstrom, Ohm),
      // composition exclusions, Hangul jamo, marks with no starter before them.
      "e\u0301 A\u030a \u212b \u2126 a\u0323\u0302 a\u0302\u0323 \u0958 \u0344 q\u0307\u0323",
      "\u1100\u1161\u11a8 \uac00\u11a8 \u1100\u1161 n\u0303o\u0308 \u00c5\u0301 \u0301x "
      "\u1e0b\u0323 \u0041\u0338 \u05d0\u05b7\u05bc \u0915\u093c",
      "<|im_start|>user\nhi<|im_end|>\n",
  };
}

// The venv scripts/setup makes; "" when it is not there.
std::string reference_python() {
  const std::string py = std::string(HEADROOM_SOURCE_DIR) + "/.venv-test/bin/python";
  return std::filesystem::exists(py) ? py : "";
}

struct Reference {
  std::string dir;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::string> decoded;  // Hugging Face's decode of ids (special tokens kept)
  std::vector<std::vector<int32_t>> random_ids;
  std::vector<std::string> random_decoded;
  int vocab_size = 0;
  std::string skip;  // why there is none
};

// pattern: tests/bpe/reference.py's KIND (gpt2, llama3, qwen2, spm-legacy, spm-metaspace,
// spm-split, spm-unk).
Reference make_reference(int vocab_size, bool add_prefix_space,
                         const std::string& pattern = "gpt2") {
  Reference r;
  const std::string py = reference_python();
  if (py.empty()) {
    r.skip = "Hugging Face's tokenizers is not installed: scripts/setup installs it into " +
             std::string(HEADROOM_SOURCE_DIR) + "/.venv-test/";
    return r;
  }
  r.dir = temp_dir();
  const std::string train = write_file(r.dir, "train.txt", training_text());
  const std::string cases_path = write_file(r.dir, "cases.json", nlohmann::json(cases()).dump());
  const test::RunResult run =
      run_command(py + " " + HEADROOM_SOURCE_DIR + "/tests/bpe/reference.py " + train + " " +
                  cases_path + " " + r.dir + " " + std::to_string(vocab_size) + " " +
                  (add_prefix_space ? "1" : "0") + " " + pattern);
  if (run.exit_code == 77) {
    r.skip = run.output;
    return r;
  }
  EXPECT_EQ(run.exit_code, 0) << run.output;
  const nlohmann::json j = nlohmann::json::parse(read_file(r.dir + "/ids.json"));
  r.ids = j["ids"].get<std::vector<std::vector<int32_t>>>();
  r.decoded = j["decoded"].get<std::vector<std::string>>();
  r.random_ids = j["random_ids"].get<std::vector<std::vector<int32_t>>>();
  r.random_decoded = j["random_decoded"].get<std::vector<std::string>>();
  r.vocab_size = j["vocab_size"].get<int>();
  return r;
}

void expect_same_ids(const Tokenizer& tok, const Reference& ref) {
  const std::vector<std::string> cs = cases();
  ASSERT_EQ(ref.ids.size(), cs.size());
  for (size_t i = 0; i < cs.size(); ++i) {
    EXPECT_EQ(tok.encode(cs[i]), ref.ids[i]) << "case " << i << ": \"" << cs[i] << "\"";
  }
}

// s as Rust's String::from_utf8_lossy makes it (Hugging Face's ByteLevel decoder): each
// maximal stretch of bytes that begins a UTF-8 sequence but does not finish one, and each byte
// that begins none, is one U+FFFD.
std::string lossy(const std::string& s) {
  std::string out;
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned c = b[i];
    size_t len = c < 0x80                 ? 1
                 : c >= 0xC2 && c <= 0xDF ? 2
                 : c >= 0xE0 && c <= 0xEF ? 3
                 : c >= 0xF0 && c <= 0xF4 ? 4
                                          : 0;
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k < len && i + k < s.size(); ++k) {
      const unsigned d = b[i + k];
      unsigned lo = 0x80, hi = 0xBF;  // the second byte's range is narrower after some leads
      if (k == 1 && c == 0xE0) lo = 0xA0;
      if (k == 1 && c == 0xED) hi = 0x9F;
      if (k == 1 && c == 0xF0) lo = 0x90;
      if (k == 1 && c == 0xF4) hi = 0x8F;
      if (d < lo || d > hi) break;
    }
    out += k == len ? s.substr(i, len) : std::string("\xEF\xBF\xBD");
    i += k;
  }
  return out;
}

// decode() as Hugging Face's decode(ids, skip_special_tokens=False): of each case's ids, and of
// the random sequences (byte-fallback runs that are UTF-8 and runs that are not). A byte-level
// BPE's decode() gives the bytes as they are, where Hugging Face's gives bytes that are not UTF-8
// as U+FFFD (`lossy`).
void expect_same_decode(const Tokenizer& tok, const Reference& ref, bool byte_level = false) {
  auto text = [&](const std::vector<int32_t>& ids) {
    return byte_level ? lossy(tok.decode(ids)) : tok.decode(ids);
  };
  ASSERT_EQ(ref.decoded.size(), ref.ids.size());
  for (size_t i = 0; i < ref.ids.size(); ++i)
    EXPECT_EQ(text(ref.ids[i]), ref.decoded[i]) << "case " << i;
  ASSERT_EQ(ref.random_decoded.size(), ref.random_ids.size());
  ASSERT_FALSE(ref.random_ids.empty());
  for (size_t i = 0; i < ref.random_ids.size(); ++i)
    EXPECT_EQ(text(ref.random_ids[i]), ref.random_decoded[i])
        << "random sequence " << i << ": " << nlohmann::json(ref.random_ids[i]).dump();
}

// DecodeStream gives, id by id, decode(context + ids) past decode(context) where that is a
// prefix (a byte-fallback run that turns out not UTF-8 may rewrite it): `headroom sample`'s text.
void expect_stream_is_decode(const Tokenizer& tok, const Reference& ref) {
  size_t checked = 0;
  for (const auto* set : {&ref.ids, &ref.random_ids})
    for (const std::vector<int32_t>& ids : *set) {
      for (size_t k = 1; k < ids.size(); k += 3) {
        const std::vector<int32_t> context(ids.begin(), ids.begin() + std::ptrdiff_t(k));
        const std::string before = tok.decode(context), all = tok.decode(ids);
        if (all.compare(0, before.size(), before) != 0) continue;
        DecodeStream stream(tok, context);
        std::string streamed;
        for (size_t i = k; i < ids.size(); ++i)
          streamed += stream.next(ids[i]);
        streamed += stream.finish();
        EXPECT_EQ(streamed, all.substr(before.size())) << nlohmann::json(ids).dump() << " at " << k;
        ++checked;
      }
    }
  EXPECT_GT(checked, ref.ids.size());
}

TEST(BpeTokenizer, TokenizerJsonIdsEqualHuggingFaces) {
  const Reference ref = make_reference(600, false);
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  EXPECT_EQ(tok->vocab_size(), ref.vocab_size);
  expect_same_ids(*tok, ref);
  // Decoding gives the text back, byte for byte (special tokens as their text).
  for (const std::string& c : cases())
    EXPECT_EQ(tok->decode(tok->encode(c)), c);
  expect_same_decode(*tok, ref, true);
  expect_stream_is_decode(*tok, ref);
}

TEST(BpeTokenizer, AddPrefixSpaceIdsEqualHuggingFaces) {
  const Reference ref = make_reference(400, true);
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  EXPECT_TRUE(contains(tok->describe(), "add_prefix_space")) << tok->describe();
  expect_same_ids(*tok, ref);
}

TEST(BpeTokenizer, VocabJsonAndMergesTxtEncodeAsTokenizerJson) {
  const Reference ref = make_reference(600, false);
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto json = load_tokenizer(ref.dir + "/tokenizer.json");
  const auto files = load_tokenizer(ref.dir + "/vocab.json");
  // vocab.json holds no added tokens: where the text has none, the ids are the reference's.
  const std::vector<std::string> cs = cases();
  for (size_t i = 0; i < cs.size(); ++i) {
    if (contains(cs[i], "<|endoftext|>")) continue;
    EXPECT_EQ(files->encode(cs[i]), ref.ids[i]) << "case " << i << ": \"" << cs[i] << "\"";
  }
  EXPECT_EQ(files->encode(training_text()), json->encode(training_text()));
}

// GPT-2's pattern by hand, for a machine without the reference.
TEST(BpeTokenizer, PretokenizerSplitsAsGpt2sPattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(gpt2_pretokenize("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(gpt2_pretokenize("I'm don't we'LL"), (V{"I", "'m", " don", "'t", " we", "'", "LL"}));
  EXPECT_EQ(gpt2_pretokenize("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(gpt2_pretokenize("a \n b  "), (V{"a", " \n", " b", "  "}));
  EXPECT_EQ(gpt2_pretokenize("x\nb"), (V{"x", "\n", "b"}));
  EXPECT_EQ(gpt2_pretokenize("abc123 456!!? ½"), (V{"abc", "123", " 456", "!!?", " ½"}));
  EXPECT_EQ(gpt2_pretokenize("Größe 日本語🙂🚀"), (V{"Größe", " 日本語", "🙂🚀"}));
  EXPECT_EQ(gpt2_pretokenize("\xff\xfe ab"), (V{"\xff\xfe", " ab"}));  // not UTF-8: kept as bytes
  EXPECT_TRUE(gpt2_pretokenize("").empty());
}

// Llama 3's and Qwen2's tokenizer.json: a Split by their regex before a ByteLevel without its
// own pattern (reference.py builds them as those files are, with Hugging Face's tokenizers).
TEST(BpeTokenizer, Llama3SplitIdsEqualHuggingFaces) {
  const Reference ref = make_reference(600, false, "llama3");
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  EXPECT_TRUE(contains(tok->describe(), "Llama 3's split")) << tok->describe();
  // Its template puts <|endoftext|> before each text, as Llama 3's <|begin_of_text|>.
  EXPECT_TRUE(contains(tok->describe(), "adds <|endoftext|> $A")) << tok->describe();
  expect_same_ids(*tok, ref);
  for (const std::string& c : cases())
    EXPECT_EQ(tok->decode(tok->encode(c)), "<|endoftext|>" + c);
  expect_same_decode(*tok, ref, true);
}

TEST(BpeTokenizer, Qwen2SplitIdsEqualHuggingFaces) {
  const Reference ref = make_reference(600, false, "qwen2");
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  EXPECT_TRUE(contains(tok->describe(), "Qwen2's split")) << tok->describe();
  expect_same_ids(*tok, ref);
}

// Qwen2's tokenizer.json: its NFC normalizer before the Split by its regex, its chat tokens.
TEST(BpeTokenizer, Qwen2NfcIdsEqualHuggingFaces) {
  const Reference ref = make_reference(600, false, "qwen2-nfc");
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  EXPECT_TRUE(contains(tok->describe(), "Qwen2's split")) << tok->describe();
  EXPECT_TRUE(contains(tok->describe(), "normalizer NFC")) << tok->describe();
  expect_same_ids(*tok, ref);
  expect_same_decode(*tok, ref, true);
}

// Llama 3's pattern by hand, for a machine without the reference; Qwen2's splits digits one by
// one.
TEST(BpeTokenizer, PretokenizerSplitsAsLlama3sPattern) {
  using V = std::vector<std::string>;
  auto llama = [](const std::string& t) { return pretokenize(t, Pattern::kLlama3); };
  EXPECT_EQ(llama("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(llama("I'M don't 'Sound"), (V{"I", "'M", " don", "'t", " '", "Sound"}));
  EXPECT_EQ(llama("1234567 ab12"), (V{"123", "456", "7", " ab", "12"}));
  EXPECT_EQ(llama("(x) !word"), (V{"(x", ")", " !", "word"}));
  EXPECT_EQ(llama("\tword a   b"), (V{"\tword", " a", "  ", " b"}));
  EXPECT_EQ(llama("x.\n\ny  \n\n  z"), (V{"x", ".\n\n", "y", "  \n\n", " ", " z"}));
  EXPECT_EQ(llama("end  "), (V{"end", "  "}));
  EXPECT_EQ(pretokenize("1234567", Pattern::kQwen2), (V{"1", "2", "3", "4", "5", "6", "7"}));
  EXPECT_TRUE(llama("").empty());
  EXPECT_EQ(pattern_of(kLlama3Regex), Pattern::kLlama3);
  EXPECT_EQ(pattern_of(kQwen2Regex), Pattern::kQwen2);
  EXPECT_EQ(pattern_of("\\s+"), Pattern::kNone);
}

// SentencePiece-style BPE over text, laid out as Llama 2's and TinyLlama's tokenizer.json
// (reference.py's spm-* kinds): ids and decoded text equal Hugging Face's.
void expect_sentencepiece_as_huggingface(const std::string& kind,
                                         const std::vector<std::string>& described) {
  const Reference ref = make_reference(600, false, kind);
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  EXPECT_EQ(tok->vocab_size(), ref.vocab_size);
  for (const std::string& d : described)
    EXPECT_TRUE(contains(tok->describe(), d)) << tok->describe();
  expect_same_ids(*tok, ref);
  expect_same_decode(*tok, ref);
  expect_stream_is_decode(*tok, ref);
}

TEST(BpeTokenizer, Llama2NormalizerByteFallbackIdsEqualHuggingFaces) {
  expect_sentencepiece_as_huggingface(
      "spm-legacy",
      {"BPE '", "normalizer Prepend \"▁\" + Replace \" \" by \"▁\"", "byte fallback",
       "unk \"<unk>\"", "adds <s> $A", "decoder Replace + ByteFallback + Fuse + Strip"});
}

TEST(BpeTokenizer, MetaspaceFirstWithEosIdsEqualHuggingFaces) {
  expect_sentencepiece_as_huggingface(
      "spm-metaspace", {"Metaspace \"▁\" prepend first", "adds <s> $A </s>", "byte fallback"});
}

TEST(BpeTokenizer, MetaspaceSplitUnkWithoutFuseIdsEqualHuggingFaces) {
  expect_sentencepiece_as_huggingface(
      "spm-split", {"Metaspace \"▁\" prepend always split", "decoder Metaspace"});
}

TEST(BpeTokenizer, FusedUnkAmongByteFallbackIdsEqualHuggingFaces) {
  expect_sentencepiece_as_huggingface("spm-unk", {"unk \"<unk>\"", "byte fallback"});
}

// Llama 2's tokenizer.json by hand, for a machine without the reference: "▁" for each space and
// before the text, <s> first, characters without a token as their UTF-8 bytes' <0xHH>; decoding
// is the inverse (the Strip takes the "▁" put before the text).
TEST(BpeTokenizer, Llama2LayoutByHand) {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  int next = 259;
  for (const char* t : {"\u2581", "h", "i", "\u2581h", "\u2581hi", "!"})
    vocab[t] = next++;
  const nlohmann::json j = {
      {"added_tokens",
       {{{"id", 0}, {"content", "<unk>"}, {"special", true}, {"normalized", false}},
        {{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
        {{"id", 2}, {"content", "</s>"}, {"special", true}, {"normalized", false}}}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\u2581"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"byte_fallback", true},
        {"fuse_unk", true},
        {"unk_token", "<unk>"},
        {"vocab", vocab},
        {"merges", {"\u2581 h", {"\u2581h", "i"}}}}}};
  const std::string path = write_file(temp_dir(), "tokenizer.json", j.dump());
  const auto tok = load_tokenizer(path);
  const int32_t sp = 259, hi = 263, bang = 264;
  // "hi hi!é": ▁hi ▁hi ! then é as <0xC3> <0xA9>.
  const std::vector<int32_t> want = {1, hi, hi, bang, 3 + 0xC3, 3 + 0xA9};
  EXPECT_EQ(tok->encode("hi hi!\u00e9"), want);
  EXPECT_EQ(tok->decode(want), "<s> hi hi!\u00e9");
  EXPECT_EQ(tok->decode({hi, sp, sp, hi}), "hi   hi");
  EXPECT_EQ(tok->decode({3 + 0xC3}), "\ufffd");  // a run that is not UTF-8: U+FFFD a byte
  EXPECT_EQ(tok->token_bytes(hi), " hi");
  EXPECT_EQ(tok->token_bytes(3 + 0xC3), "\xC3");
  DecodeStream stream(*tok, {1, hi});
  EXPECT_EQ(stream.next(3 + 0xC3), "");  // the first byte of é: held back
  EXPECT_EQ(stream.next(3 + 0xA9), "");  // the run may go on
  EXPECT_EQ(stream.next(hi), "\u00e9 hi");
  EXPECT_EQ(stream.finish(), "");
}

TEST(BpeTokenizer, BadFilesAreConfigErrorsNamingThem) {
  const std::string dir = temp_dir();
  auto err = [](const std::string& path) { return test::error_of([&] { load_tokenizer(path); }); };
  EXPECT_TRUE(contains(err(dir + "/none.json"), "no such tokenizer file"));
  const std::string bad = write_file(dir, "bad.json", "{ not json");
  EXPECT_TRUE(contains(err(bad), "not valid JSON")) << err(bad);
  const std::string wp =
      write_file(dir, "wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}})");
  EXPECT_TRUE(contains(err(wp), "model.type is \"WordPiece\"")) << err(wp);
  const std::string norm =
      write_file(dir, "norm.json",
                 R"({"normalizer": {"type": "NFKC"}, "pre_tokenizer": {"type": "ByteLevel"},
          "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  EXPECT_TRUE(contains(err(norm), "normalizer is of type \"NFKC\"")) << err(norm);
  const std::string merge = write_file(dir, "merge.json",
                                       R"({"pre_tokenizer": {"type": "ByteLevel"},
          "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})");
  EXPECT_TRUE(contains(err(merge), "merge 0 names \"ab\", which is not in the vocabulary"))
      << err(merge);
  // A Split by a regex headroom does not implement names the file and the patterns it reads.
  const std::string split =
      write_file(dir, "split.json", R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": false},
          {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
          "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  EXPECT_TRUE(contains(err(split), split + ": pre_tokenizer's Split pattern")) << err(split);
  EXPECT_TRUE(contains(err(split), "Llama 3's")) << err(split);
  const std::string vocab_only = write_file(dir, "vocab.json", R"({"a": 0})");
  EXPECT_TRUE(contains(err(vocab_only), "merges.txt")) << err(vocab_only);
}

// A tokenizer.json over text with `patch` merged in (a JSON merge patch: null removes a key).
std::string spm_json(const std::string& dir, const std::string& name, const nlohmann::json& patch) {
  nlohmann::json j = {
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\u2581"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
      {"pre_tokenizer", nullptr},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}}}}},
      {"model",
       {{"type", "BPE"},
        {"byte_fallback", true},
        {"unk_token", "<unk>"},
        {"vocab", {{"<unk>", 0}, {"\u2581", 1}, {"a", 2}}},
        {"merges", nlohmann::json::array()}}}};
  j.merge_patch(patch);
  return write_file(dir, name, j.dump());
}

// Each stage of a type headroom does not implement, or a key of the wrong type or size, is a
// ConfigError naming the file and the key; `headroom shard` exits 2 on it.
TEST(BpeTokenizer, SentencePieceBadFilesNameTheKey) {
  const std::string dir = temp_dir();
  auto err = [](const std::string& path) { return test::error_of([&] { load_tokenizer(path); }); };
  struct Case {
    const char* name;
    const char* patch;  // JSON
    std::string want;
  };
  const std::vector<Case> bad = {
      {"nfkc", R"({"normalizer": {"type": "NFKC"}})", "normalizer is of type \"NFKC\""},
      {"nested", R"({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}})",
       "normalizer.normalizers[0] is of type \"Lowercase\""},
      {"regex",
       R"({"normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": "_"}})",
       "normalizer.pattern is the regex"},
      {"long",
       R"({"normalizer": {"type": "Prepend", "prepend": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}})",
       "normalizer.prepend is \"xxx"},
      {"bert", R"({"pre_tokenizer": {"type": "BertPreTokenizer"}})",
       "pre_tokenizer is of type \"BertPreTokenizer\""},
      {"scheme",
       R"({"normalizer": null, "pre_tokenizer": {"type": "Metaspace", "replacement": "_",
           "prepend_scheme": "sometimes"}})",
       "pre_tokenizer.prepend_scheme is \"sometimes\""},
      {"repl",
       R"({"normalizer": null, "pre_tokenizer": {"type": "Metaspace", "replacement": "ab"}})",
       "pre_tokenizer.replacement is \"ab\"; it must be one character"},
      {"nothing", R"({"normalizer": null})", "pre_tokenizer is null and there is no normalizer"},
      {"wordpiece", R"({"decoder": {"type": "WordPiece"}})", "decoder is of type \"WordPiece\""},
      {"strip", R"({"decoder": {"type": "Strip", "content": " ", "start": 1000000000000}})",
       "decoder.start is 1000000000000"},
      {"roberta", R"({"post_processor": {"type": "RobertaProcessing"}})",
       "post_processor is of type \"RobertaProcessing\""},
      {"template",
       R"({"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
           {"Sequence": {"id": "A"}}], "special_tokens": {}}})",
       "post_processor.single[0] names the special token \"<s>\""},
      {"noa",
       R"({"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<unk>"}}],
           "special_tokens": {"<unk>": {"ids": [0]}}}})",
       "post_processor.single has no Sequence A"},
      {"unknown_id",
       R"({"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
           {"Sequence": {"id": "A"}}], "special_tokens": {"<s>": {"ids": [7]}}}})",
       "post_processor adds the id 7, which is neither in model.vocab nor in added_tokens"},
      {"unk", R"({"model": {"unk_token": "<missing>"}})",
       "model.unk_token \"<missing>\" is not in"},
      {"typed", R"({"model": {"byte_fallback": "yes"}})",
       "model.byte_fallback must be true or false"},
      {"lstrip", R"({"added_tokens": [{"id": 0, "content": "<unk>", "lstrip": true}]})",
       "added_tokens[0].lstrip is true"},
  };
  for (const Case& c : bad) {
    const std::string path =
        spm_json(dir, std::string(c.name) + ".json", nlohmann::json::parse(c.patch));
    const std::string msg = err(path);
    EXPECT_TRUE(contains(msg, path + ": ")) << c.name << ": " << msg;
    EXPECT_TRUE(contains(msg, c.want)) << c.name << ": " << msg;
  }
  // Text with a character it has neither a token, byte-fallback tokens nor unk_token for.
  const std::string bare =
      spm_json(dir, "bare.json",
               nlohmann::json::parse(R"({"model": {"byte_fallback": false, "unk_token": null}})"));
  const std::string msg = test::error_of([&] { load_tokenizer(bare)->encode("ab"); });
  EXPECT_TRUE(contains(msg, bare + ": cannot encode the character U+0062 \"b\"")) << msg;
  write_file(dir, "t.txt", "a b\n");
  const auto r = test::run_headroom("shard " + dir + "/t.txt " + dir + "/out --tokenizer " + dir +
                                    "/wordpiece.json");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "decoder is of type \"WordPiece\"")) << r.output;
}

// `headroom shard` and `headroom sample` with Llama 2's layout: the shards hold Hugging Face's
// ids (<s> first), and sample prints the prompt then text decoded as Llama 2's decoder does it.
TEST(BpeTokenizer, ShardAndSampleWithALlama2Tokenizer) {
  const Reference ref = make_reference(600, false, "spm-legacy");
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const std::string text = write_file(ref.dir, "corpus.txt", training_text());
  const test::RunResult r = test::run_headroom(
      "shard " + text + " " + ref.dir + "/shards --tokenizer " + ref.dir + "/tokenizer.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "tokens: BPE '")) << r.output;
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  const std::vector<int32_t> ids = tok->encode(training_text());
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 1);  // <s>
  const std::string shard = ref.dir + "/shards/shard_000000.bin";
  const ShardInfo info = validate_shard(shard, 1);
  ASSERT_EQ(info.tokens, ids.size());
  const std::vector<uint16_t> stored = read_tokens(shard, 0, ids.size());
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), stored.begin()));
  const std::string cfg = write_file(
      ref.dir, "spm.toml",
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = " +
          std::to_string(tok->vocab_size()) +
          "\n[train]\nsteps = 2\nmicro_batch = 1\n[data]\nkind = \"shards\"\npattern = "
          "\"shards/*.bin\"\ntokenizer = \"tokenizer.json\"\n[snapshot]\nevery = 2\ndir = "
          "\"snaps\"\n");
  const test::RunResult trained = test::run_headroom("train -q " + cfg);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const test::RunResult sampled =
      test::run_headroom("sample " + cfg + " --prompt 'The quick' --tokens 12 --seed 3");
  ASSERT_EQ(sampled.exit_code, 0) << sampled.output;
  EXPECT_TRUE(contains(sampled.output, "tokens: BPE '")) << sampled.output;
  // The ids it drew, decoded whole, are the text it printed after the prompt.
  const test::RunResult as_ids =
      test::run_headroom("sample " + cfg + " --prompt 'The quick' --tokens 12 --seed 3 --ids");
  ASSERT_EQ(as_ids.exit_code, 0) << as_ids.output;
  const std::string last =
      as_ids.output.substr(as_ids.output.rfind('\n', as_ids.output.size() - 2) + 1);
  std::vector<int32_t> drawn;
  std::istringstream in(last);
  for (int32_t id; in >> id;)
    drawn.push_back(id);
  const std::vector<int32_t> prompt = tok->encode("The quick");
  ASSERT_EQ(drawn.size(), prompt.size() + 12) << as_ids.output;
  const std::string want = "The quick" + tok->decode(drawn).substr(tok->decode(prompt).size());
  EXPECT_TRUE(contains(sampled.output, "\n" + want + "\n")) << sampled.output << "\nwant: " << want;
}

// `headroom shard --tokenizer` writes the ids of the tokenizer, records its vocab size in the
// header (int 3 of 256), and training with a smaller model.vocab_size names both; so does a
// config whose data.tokenizer is larger than its model.
TEST(BpeTokenizer, ShardWithTokenizerRecordsItsVocabSize) {
  const Reference ref = make_reference(600, false);
  if (!ref.skip.empty()) GTEST_SKIP() << ref.skip;
  const std::string text = write_file(ref.dir, "corpus.txt", training_text());
  const std::string out = ref.dir + "/shards";
  const test::RunResult r = test::run_headroom("shard " + text + " " + out + " --tokenizer " +
                                               ref.dir + "/tokenizer.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string vocab = std::to_string(ref.vocab_size);  // what training reached, <= 600
  EXPECT_TRUE(contains(r.output, "(vocab " + vocab)) << r.output;
  const std::string shard = out + "/shard_000000.bin";
  const ShardInfo info = validate_shard(shard, 1);
  EXPECT_EQ(info.vocab_size, uint32_t(ref.vocab_size));
  const auto tok = load_tokenizer(ref.dir + "/tokenizer.json");
  const std::vector<int32_t> ids = tok->encode(training_text());
  ASSERT_EQ(info.tokens, ids.size());
  const std::vector<uint16_t> stored = read_tokens(shard, 0, ids.size());
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), stored.begin()));

  const std::string cfg = write_file(ref.dir, "small.toml",
                                     "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = "
                                     "16\nvocab_size = 512\n[train]\nsteps = 1\nmicro_batch = 1\n"
                                     "[data]\nkind = \"shards\"\npattern = \"shards/*.bin\"\n");
  const test::RunResult small = test::run_headroom("train -q " + cfg);
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_TRUE(contains(small.output, "vocab_size " + vocab)) << small.output;
  EXPECT_TRUE(contains(small.output, "model.vocab_size is 512")) << small.output;

  // The config names the tokenizer ([data] tokenizer): training checks it against the model and
  // the shards, `sample` encodes the prompt and decodes with it.
  const std::string fits = write_file(
      ref.dir, "fits.toml",
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = " + vocab +
          "\n[train]\nsteps = 2\nmicro_batch = 1\n[data]\nkind = \"shards\"\npattern = "
          "\"shards/*.bin\"\ntokenizer = \"tokenizer.json\"\n[snapshot]\nevery = 2\ndir = "
          "\"snaps\"\n");
  const test::RunResult trained = test::run_headroom("train -q " + fits);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const test::RunResult sampled =
      test::run_headroom("sample " + fits + " --prompt 'The quick' --tokens 5 --seed 1");
  EXPECT_EQ(sampled.exit_code, 0) << sampled.output;
  EXPECT_TRUE(contains(sampled.output, "sampling from snapshot " + ref.dir + "/snaps/step_"))
      << sampled.output;
  EXPECT_TRUE(contains(sampled.output, "tokens: byte-level BPE")) << sampled.output;
  EXPECT_TRUE(contains(sampled.output, "\nThe quick")) << sampled.output;
  const test::RunResult smaller =
      test::run_headroom("train -q " + fits + " --set model.vocab_size=300");
  EXPECT_EQ(smaller.exit_code, 2) << smaller.output;
  EXPECT_TRUE(contains(smaller.output,
                       "data.tokenizer has vocab_size " + vocab + ", but model.vocab_size is 300"))
      << smaller.output;
  // Text is bytes: a tokenizer there is refused, saying what to do instead.
  const std::string text_cfg = write_file(
      ref.dir, "text.toml",
      "[model]\nvocab_size = 600\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\n"
      "[data]\nkind = \"text\"\npath = \"corpus.txt\"\ntokenizer = \"tokenizer.json\"\n");
  const test::RunResult text_run = test::run_headroom("check " + text_cfg);
  EXPECT_TRUE(contains(text_run.output, "text.toml:10:13: data.tokenizer names the tokenizer"))
      << text_run.output;
  EXPECT_EQ(text_run.exit_code, 2) << text_run.output;
}

}  // namespace
}  // namespace headroom
