#!/usr/bin/env python3
# Made examples/own-text-llama/tokenizer.json: a byte-level BPE of 1024 ids laid out as Llama 3's
# tokenizer.json is (its Split pre-tokenizer regex, then ByteLevel without a regex;
# <|begin_of_text|> and <|end_of_text|> as special tokens, the template that puts
# <|begin_of_text|> before each text), trained by Hugging Face's tokenizers on docs/design.md. To
# remake it (scripts/setup installs tokenizers into .venv-test/):
#   .venv-test/bin/python examples/own-text-llama/make_tokenizer.py
# Your own: a Llama 3, SmolLM2 or Qwen2 model's tokenizer.json from its Hugging Face folder.
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
])
tok.decoder = decoders.ByteLevel()
special = ["<|begin_of_text|>", "<|end_of_text|>"]
trainer = trainers.BpeTrainer(vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              special_tokens=special, show_progress=False)
tok.train(["docs/design.md"], trainer)
bos = tok.token_to_id("<|begin_of_text|>")
tok.post_processor = processors.Sequence([
    processors.ByteLevel(trim_offsets=False),
    processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                  pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                  special_tokens=[("<|begin_of_text|>", bos)]),
])
tok.save("examples/own-text-llama/tokenizer.json")
print("examples/own-text-llama/tokenizer.json: vocab", tok.get_vocab_size())
