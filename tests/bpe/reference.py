#!/usr/bin/env python3
# The reference for tests/bpe_tokenizer_test.cpp: Hugging Face's `tokenizers` trains a small
# byte-level BPE on TRAIN, saves it as OUTDIR/tokenizer.json and OUTDIR/vocab.json +
# OUTDIR/merges.txt, and writes the ids it encodes each line of CASES to (a JSON list of
# strings) into OUTDIR/ids.json. Exit 77 when `tokenizers` is not installed (the test skips).
# Usage: reference.py TRAIN CASES OUTDIR VOCAB_SIZE ADD_PREFIX_SPACE(0|1) [PATTERN]
# PATTERN: gpt2 (the default: ByteLevel with its own pattern), or llama3 / qwen2: their Split
# (Llama 3's and Qwen2's regexes, "isolated") before a ByteLevel without its pattern, as their
# tokenizer.json files have it.
import json
import sys

try:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders, trainers
except ImportError as e:
    print("tokenizers is not installed (%s); scripts/setup installs it into .venv-test/" % e)
    sys.exit(77)

PATTERNS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
train, cases_path, out, vocab_size, prefix = sys.argv[1:6]
pattern = sys.argv[6] if len(sys.argv) > 6 else "gpt2"
tok = Tokenizer(models.BPE())
if pattern == "gpt2":
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix == "1")
else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[pattern]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=prefix == "1", use_regex=False),
    ])
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=1,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              special_tokens=["<|endoftext|>"], show_progress=False)
tok.train([train], trainer)
tok.save(out + "/tokenizer.json")
tok.model.save(out)  # vocab.json + merges.txt
with open(cases_path, encoding="utf-8") as f:
    cases = json.load(f)
ids = [tok.encode(c).ids for c in cases]
with open(out + "/ids.json", "w") as f:
    json.dump({"ids": ids, "vocab_size": tok.get_vocab_size(), "version": __import__("tokenizers").__version__}, f)
