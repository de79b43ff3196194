#!/usr/bin/env python3
# Made examples/own-text/tokenizer.json: a byte-level BPE of 512 ids (as GPT-2's, smaller) trained
# by Hugging Face's tokenizers on docs/design.md. To remake it (scripts/setup installs tokenizers
# into .venv-test/):  .venv-test/bin/python examples/own-text/make_tokenizer.py
# Your own: GPT-2's tokenizer.json from Hugging Face (vocab 50257), or one trained like this on
# your text.
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              special_tokens=["<|endoftext|>"], show_progress=False)
tok.train(["docs/design.md"], trainer)
tok.save("examples/own-text/tokenizer.json")
print("examples/own-text/tokenizer.json: vocab", tok.get_vocab_size())
