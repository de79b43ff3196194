#!/usr/bin/env python3
# The reference for tests/bpe_tokenizer_test.cpp: Hugging Face's `tokenizers` trains a small BPE
# on TRAIN, saves it as OUTDIR/tokenizer.json (and, byte-level, OUTDIR/vocab.json +
# OUTDIR/merges.txt), and writes to OUTDIR/ids.json the ids it encodes each string of CASES (a
# JSON list) to, its decode of those ids (skip_special_tokens=False), and its decode of id
# sequences drawn at random (seed 0) from the vocabulary, byte-fallback tokens often. Exit 77
# when `tokenizers` is not installed (the test skips).
# Usage: reference.py TRAIN CASES OUTDIR VOCAB_SIZE ADD_PREFIX_SPACE(0|1) [KIND]
# KIND, byte-level: gpt2 (the default: ByteLevel with its own pattern); llama3 / qwen2: their
# Split (Llama 3's and Qwen2's regexes, "isolated") before a ByteLevel without its pattern, as
# their tokenizer.json files have it; llama3 also puts <|endoftext|> before each text (the
# template of Llama 3's <|begin_of_text|>); qwen2-nfc: qwen2 as Qwen2's tokenizer.json is, with
# the NFC normalizer, <|im_start|> and <|im_end|> and a ByteLevel post-processor.
# KIND, SentencePiece-style BPE over text, laid out as Llama 2's / TinyLlama's tokenizer.json
# (<unk> <s> </s> as ids 0-2, <0x00>..<0xFF> as 3-258 in the vocabulary, byte_fallback, unk_token
# <unk>, the template "<s> $A"):
#   spm-legacy:    normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, decoder
#                  Replace("▁", " ") + ByteFallback + Fuse + Strip(" ", 1, 0) (Llama 2's);
#   spm-metaspace: pre-tokenizer Metaspace(prepend_scheme "first", split false), the same decoder
#                  (transformers' non-legacy conversion), the template "<s> $A </s>";
#   spm-split:     Metaspace(prepend_scheme "always", split true) and its decoder, merges as
#                  "a b" strings, ignore_merges, no template, fuse_unk false, and no
#                  byte-fallback tokens for 0xF0-0xF4 and 0xE6 (emoji and some CJK become <unk>);
#   spm-unk:       spm-legacy with the same bytes missing and fuse_unk true.
import json
import random
import sys

try:
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)
except ImportError as e:
    print("tokenizers is not installed (%s); scripts/setup installs it into .venv-test/" % e)
    sys.exit(77)

PATTERNS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
train, cases_path, out, vocab_size, prefix = sys.argv[1:6]
kind = sys.argv[6] if len(sys.argv) > 6 else "gpt2"


def byte_level():
    tok = Tokenizer(models.BPE())
    special = ["<|endoftext|>"]
    if kind == "qwen2-nfc":
        tok.normalizer = normalizers.NFC()
        special += ["<|im_start|>", "<|im_end|>"]
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix == "1")
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERNS[kind.split("-")[0]]), behavior="isolated",
                                 invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix == "1", use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=special, show_progress=False)
    tok.train([train], trainer)
    if kind == "qwen2-nfc":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if kind == "llama3":
        bos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|endoftext|> $A",
                                          special_tokens=[("<|endoftext|>", bos)]),
        ])
    tok.save(out + "/tokenizer.json")
    tok.model.save(out)  # vocab.json + merges.txt
    return tok


def sentencepiece():
    legacy = kind in ("spm-legacy", "spm-unk")
    tok = Tokenizer(models.BPE())
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="always" if kind == "spm-split" else "first",
            split=kind == "spm-split")
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2,
                                  special_tokens=special, show_progress=False)
    tok.train([train], trainer)
    j = json.loads(tok.to_str())
    # Llama 2's layout: the specials, then the 256 byte-fallback tokens, then the pieces.
    missing = set(range(0xF0, 0xF5)) | {0xE6} if kind in ("spm-split", "spm-unk") else set()
    vocab = {t: i for i, t in enumerate(special)}
    for b in range(256):
        if b not in missing:
            vocab["<0x%02X>" % b] = len(vocab)
    trained = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    for t, _ in trained:
        if t not in vocab:
            vocab[t] = len(vocab)
    m = j["model"]
    m["vocab"] = vocab
    m["byte_fallback"] = True
    m["unk_token"] = "<unk>"
    m["fuse_unk"] = kind != "spm-split"
    if kind == "spm-split":
        m["ignore_merges"] = True
        m["merges"] = [a + " " + b for a, b in m["merges"]]
    for a in j["added_tokens"]:
        a["id"] = vocab[a["content"]]
    single = {"spm-metaspace": "<s> $A </s>", "spm-split": None}.get(kind, "<s> $A")
    if single:
        j["post_processor"] = json.loads(processors.TemplateProcessing(
            single=single, special_tokens=[("<s>", 1), ("</s>", 2)]).__getstate__())
    if kind == "spm-split":
        j["decoder"] = json.loads(decoders.Metaspace(
            replacement="▁", prepend_scheme="always", split=True).__getstate__())
    else:
        j["decoder"] = json.loads(decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)]).__getstate__())
    text = json.dumps(j, ensure_ascii=False)
    with open(out + "/tokenizer.json", "w", encoding="utf-8") as f:
        f.write(text)
    return Tokenizer.from_str(text)


tok = byte_level() if kind in ("gpt2", "llama3", "qwen2", "qwen2-nfc") else sentencepiece()
with open(cases_path, encoding="utf-8") as f:
    cases = json.load(f)
ids = [tok.encode(c).ids for c in cases]
decoded = [tok.decode(i, skip_special_tokens=False) for i in ids]
# Random id sequences: any id, a byte-fallback one ("<0xHH>") half the time.
rng = random.Random(0)
n = tok.get_vocab_size()
fallback = [i for t, i in tok.get_vocab().items() if t.startswith("<0x")] or list(range(n))
random_ids = [[rng.choice(fallback) if rng.random() < 0.5 else rng.randrange(n)
               for _ in range(rng.randrange(1, 24))] for _ in range(200)]
random_decoded = [tok.decode(i, skip_special_tokens=False) for i in random_ids]
with open(out + "/ids.json", "w") as f:
    json.dump({"ids": ids, "decoded": decoded, "random_ids": random_ids,
               "random_decoded": random_decoded, "vocab_size": n,
               "version": __import__("tokenizers").__version__}, f)
