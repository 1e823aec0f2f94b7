"""Reference tokenizers for the GGUF vocabularies the oracles are run on: byte-level BPE
(SmolLM2, below) and SentencePiece-style BPE (Gemma 3, load_spm_tokenizer further down).

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
    if model == "llama":
        return load_spm_tokenizer(reader)
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) and SentencePiece (llama) vocabularies supported, got {model!r}")
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


# ---- SentencePiece-style BPE (tokenizer.ggml.model == "llama"), e.g. Gemma 3 ----
#
# Built the way transformers' GemmaConverter builds tokenizer.json from Gemma's tokenizer.model
# (convert_slow_tokenizer.py): normalizer Replace(" ", "▁"), BPE with byte_fallback over the
# vocabulary, merges = every split of a token into two vocabulary pieces, ordered by the score of
# the merged token (then longer left part, longer right part, token order: generate_merges), and
# the decoder Replace("▁", " ") + ByteFallback + Fuse. Two things the GGUF changed are undone:
#   - llama.cpp's converter stores the whitespace-run user-defined pieces ("▁▁".."▁"*31) with real
#     spaces; they are spelled with "▁" again (as transformers' GGUF loader also does);
#   - it gave user-defined pieces the score -1000; in tokenizer.model they score 0 (SentencePiece
#     matches them whole, longest first, so "▁"*33 is 31 + 2). The transformers GGUF loader orders
#     Gemma merges by token position instead, which turns runs of 32+ spaces into 16-space pieces;
#     tests/tokenizer/oracle_gemma.py keeps that case as a documented exception.
# CONTROL tokens are special added tokens, other USER_DEFINED ones (newline and tab runs, HTML
# tags, <start_of_image>) plain added tokens, all matched whole on the raw text.


def _spm_pieces(tokens, types):
    return ["\u2581" * len(t) if ty == 4 and t and set(t) <= {" ", "\u2581"} else t
            for t, ty in zip(tokens, types)]


def _generate_merges(pieces, scores):
    """transformers.tokenization_utils_base.generate_merges(vocab, vocab_scores), re-implemented."""
    vocab = {p: i for i, p in enumerate(pieces)}
    vocab_scores = dict(zip(pieces, scores))
    merges = []
    for merge, score in vocab_scores.items():
        local = [(merge[:k], merge[k:], score) for k in range(1, len(merge))
                 if merge[:k] in vocab and merge[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def load_spm_tokenizer(reader) -> Tokenizer:
    from tokenizers import normalizers, processors
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    scores = _field(reader, "tokenizer.ggml.scores")
    if _field(reader, "tokenizer.ggml.add_space_prefix") is not False:
        raise ValueError("only add_space_prefix = False (Gemma) is wired up in tokenizer_ref.py")
    pieces = _spm_pieces(tokens, types)
    model_scores = [0.0 if ty == 4 else s for s, ty in zip(scores, types)]
    vocab = {p: i for i, p in enumerate(pieces)}
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_generate_merges(pieces, model_scores),
                               unk_token=None if unk_id is None else tokens[unk_id],
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, p, ty in zip(tokens, pieces, types) if ty == 4 and p == t])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token") is not False and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    assert tok.get_vocab_size() == len(tokens), "added tokens must not grow the vocab"
    return tok
