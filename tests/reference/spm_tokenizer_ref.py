"""Reference tokenizer for SentencePiece ("llama" model) GGUF vocabularies, e.g. Gemma 3.

Built offline from the GGUF itself: tokenizer.ggml.tokens / scores / token_type become a
SentencePiece ModelProto (BPE, byte fallback, identity normalizer, whitespace escaped to
U+2581, no dummy prefix when tokenizer.ggml.add_space_prefix is false), loaded into Google's
`sentencepiece` library. No network, no tokenizer.model file.

Special tokens follow llama.cpp's llama_tokenize(add_special=true, parse_special=true):
  * CONTROL (3), USER_DEFINED (4) and UNKNOWN (2) tokens are cut out of the text first,
    longest token text first (llama_vocab::tokenizer_st_partition), and emitted whole;
    e.g. "<start_of_turn>", "<end_of_turn>", and Gemma's "\\n", "\\n\\n", runs of spaces/tabs,
    which are USER_DEFINED pieces;
  * the remaining text fragments are encoded with SentencePiece BPE (merge the adjacent pair
    whose merged piece has the highest score; unknown characters fall back to <0xXX>);
  * BOS is prepended when tokenizer.ggml.add_bos_token is true (Gemma: yes, id 2).
Checked against llama.cpp's tokenizer on every golden prompt (tests/reference/compare_llamacpp.py).
"""

from __future__ import annotations

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class SpmTokenizer:
    def __init__(self, path_or_reader):
        reader = (path_or_reader if isinstance(path_or_reader, gguf.GGUFReader)
                  else gguf.GGUFReader(str(path_or_reader)))
        model = _field(reader, "tokenizer.ggml.model")
        if model != "llama":
            raise ValueError(f"only SentencePiece ('llama') vocabularies supported, got {model!r}")
        self.tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        self.scores = [float(s) for s in _field(reader, "tokenizer.ggml.scores")]
        self.types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
        self.bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id", 1))
        self.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
        self.unk_id = int(_field(reader, "tokenizer.ggml.unknown_token_id", 0))
        self.pad_id = _field(reader, "tokenizer.ggml.padding_token_id", None)
        self.add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
        self.add_space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))

        mp = pb.ModelProto()
        ts = mp.trainer_spec
        ts.model_type = pb.TrainerSpec.BPE
        ts.vocab_size = len(self.tokens)
        ts.byte_fallback = True
        ts.unk_id = self.unk_id
        ts.bos_id = self.bos_id
        ts.eos_id = self.eos_id
        ts.pad_id = -1 if self.pad_id is None else int(self.pad_id)
        ns = mp.normalizer_spec
        ns.name = "identity"
        ns.add_dummy_prefix = self.add_space_prefix
        ns.remove_extra_whitespaces = False
        ns.escape_whitespaces = True
        for i, (t, s, ty) in enumerate(zip(self.tokens, self.scores, self.types)):
            p = mp.pieces.add()
            p.piece = t
            p.score = s
            if i == self.unk_id:
                p.type = pb.ModelProto.SentencePiece.UNKNOWN
            elif i in (self.bos_id, self.eos_id) or (self.pad_id is not None and i == self.pad_id):
                p.type = pb.ModelProto.SentencePiece.CONTROL
            else:
                p.type = {NORMAL: pb.ModelProto.SentencePiece.NORMAL,
                          CONTROL: pb.ModelProto.SentencePiece.CONTROL,
                          USER_DEFINED: pb.ModelProto.SentencePiece.USER_DEFINED,
                          UNUSED: pb.ModelProto.SentencePiece.UNUSED,
                          BYTE: pb.ModelProto.SentencePiece.BYTE,
                          UNKNOWN: pb.ModelProto.SentencePiece.NORMAL}[ty]
        self.sp = spm.SentencePieceProcessor(model_proto=mp.SerializeToString())
        assert self.sp.get_piece_size() == len(self.tokens)

        # llama.cpp's cache_special_tokens: CONTROL | USER_DEFINED | UNKNOWN, longest text first
        special = [i for i, ty in enumerate(self.types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)
                   or i == self.unk_id]
        special.sort(key=lambda i: -len(self.tokens[i].encode("utf-8")))
        self._special = [(self.tokens[i], i) for i in special if self.tokens[i]]

    def _partition(self, text: str):
        """[(str, None) raw fragment | (None, id) special token], as tokenizer_st_partition."""
        frags = [(text, None)]
        for s, sid in self._special:
            out = []
            for raw, tid in frags:
                if raw is None or s not in raw:
                    out.append((raw, tid))
                    continue
                pos = 0
                while True:
                    j = raw.find(s, pos)
                    if j < 0:
                        break
                    if j > pos:
                        out.append((raw[pos:j], None))
                    out.append((None, sid))
                    pos = j + len(s)
                if pos < len(raw):
                    out.append((raw[pos:], None))
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = [self.bos_id] if (add_special and self.add_bos) else []
        for raw, sid in self._partition(text):
            if raw is None:
                ids.append(sid)
            else:
                ids.extend(self.sp.encode(raw, out_type=int))
        return ids

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            ty = self.types[i]
            if ty == BYTE:
                out.append(bytes([int(self.tokens[i][3:5], 16)]))
            else:
                out.append(self.tokens[i].replace("\u2581", " ").encode("utf-8"))
        return b"".join(out).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        return self.tokens[int(i)]


def load_tokenizer(path_or_reader) -> SpmTokenizer:
    return SpmTokenizer(path_or_reader)
