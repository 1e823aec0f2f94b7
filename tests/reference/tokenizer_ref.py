"""Reference tokenizer for the GGUF byte-level BPE vocabularies the oracle is run on.

Built offline from the GGUF itself (tokenizer.ggml.tokens / merges / token_type) with the
HuggingFace `tokenizers` library. No network, no tokenizer.json, no torch.

Why not `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)`: in the installed
transformers that path imports torch (not installed here), and its GGUF converter has no
entry for `tokenizer.ggml.pre == "smollm"`, so it would fall back to the plain GPT-2 split
and NOT split digits one by one. llama.cpp (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM,
same as STARCODER/REFACT/COMMAND_R) pre-splits with two regexes in sequence:
    "\\p{N}"                                        (every digit on its own)
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"   (GPT-2)
which is exactly tokenizers' Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].

Tokens marked CONTROL (token_type 3, e.g. <|im_start|>, <|endoftext|>) are matched whole in
the input text (llama.cpp's parse_special=true behaviour). No BOS is added
(tokenizer.ggml.add_bos_token is False for SmolLM2).
"""

from __future__ import annotations

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# tokenizer.ggml.pre -> list of pre-tokenizers (only what we have checked against llama.cpp)
_PRE = {
    "smollm": lambda: [pre_tokenizers.Digits(individual_digits=True),
                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
    "starcoder": lambda: [pre_tokenizers.Digits(individual_digits=True),
                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
    "gpt-2": lambda: [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
}


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def load_tokenizer(path_or_reader) -> Tokenizer:
    reader = (path_or_reader if isinstance(path_or_reader, gguf.GGUFReader)
              else gguf.GGUFReader(str(path_or_reader)))
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) vocabularies supported, got {model!r}")
    if pre not in _PRE:
        raise ValueError(f"pre-tokenizer {pre!r} not wired up in tokenizer_ref.py")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(_PRE[pre]())
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(control)
    assert tok.get_vocab_size() == len(tokens), "special tokens must not grow the vocab"
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids
