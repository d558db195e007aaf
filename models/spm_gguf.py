"""SentencePiece-style BPE from a GGUF's metadata (`tokenizer.ggml.model` "llama": Llama 2, Mistral,
Phi-3), built with the `tokenizers` library as Hugging Face's LlamaTokenizerFast is.

    tok = SentencePieceBPE.from_gguf(meta, where)

llama.cpp's SPM tokenizer merges, at each step, the adjacent pair whose joined piece has the highest
score; `tokenizers` merges by rank, so the merges are every split of a normal piece into two normal
pieces, ranked by the joined piece's score. Spaces are "▁", one is put before the text and after
every special token (`tokenizer.ggml.add_space_prefix`, llama.cpp's rule); a character with no piece
falls back to its bytes (<0xNN>). Decoding drops the first space again; `decode_continuation` keeps it.
Same interface as `models.bpe.BPETokenizer` (special tokens, `special=`, `bytes_of`).
"""
from __future__ import annotations

import re

from models.bpe import BPETokenizer, add_whole_tokens, whole_tokens
from models.errors import CheckpointError

NORMAL, BYTE = 1, 6
SPACE = "\u2581"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def score_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """(left, right) for every normal piece that splits into two normal pieces, best joined score first."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == NORMAL}
    found = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                found.append((-scores[i], normal[left], normal[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


class SentencePieceBPE(BPETokenizer):
    def decode_continuation(self, ids) -> str:
        """Like `decode`, but the first token's leading space is kept (it separates it from the text before)."""
        return self.continuation.decode([self.tok.id_to_token(int(i)) or "" for i in ids])

    def encode_continuation(self, text: str, special: bool = False) -> list[int]:
        """ids of `text` going on from a text that did not end in a special token (a chat message cut out of
        its template's text): no "▁" put before it, as encoding the two together would not; after each
        token matched whole in it (special ones where `special`, user-defined ones always), as there."""
        if not getattr(self, "space_prefix", False):
            return self.encode(text, special=special)
        whole = [t for t in self.whole_token_texts() if special or t not in self.special_tokens]
        found = [i for i in (text.find(t) for t in whole) if i >= 0]
        head, rest = (text[:min(found)], text[min(found):]) if found else (text, "")
        ids = []
        if head:
            with self._encoding:   # the same tokenizer, its normalizer without the "▁" it puts first
                prefixed = self.tok.normalizer
                self.tok.normalizer, self.tok.encode_special_tokens = self._unprefixed, True
                try:
                    ids = self.tok.encode(head, add_special_tokens=False).ids
                finally:
                    self.tok.normalizer = prefixed
        return ids + (self.encode(rest, special=special) if rest else [])

    def bytes_of(self, ids) -> bytes:
        """The bytes `ids` stand for as a continuation: "▁" is a space, <0xNN> its byte."""
        if getattr(self, "_special_ids", None) is None:
            self._special_ids = {i: t for t, i in self.special_tokens.items()}
        out = bytearray()
        for i in ids:
            i = int(i)
            piece = self.tok.id_to_token(i) or ""
            byte = BYTE_PIECE.fullmatch(piece) if i not in self._special_ids else None
            out += bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE, " ").encode("utf-8")
        return bytes(out)

    @classmethod
    def from_gguf(cls, meta: dict, where: str = "") -> "SentencePieceBPE":
        """From tokenizer.ggml.{tokens,scores,token_type,bos/eos/unknown_token_id,add_bos_token,add_space_prefix}."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers  # lazy, as in models.bpe
        tokens, scores = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.scores")
        if not tokens or not scores or len(scores) != len(tokens):
            raise CheckpointError(f"{where}: GGUF SentencePiece tokenizer without tokenizer.ggml.tokens and "
                                  f"one tokenizer.ggml.scores entry per token")
        types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}   # a repeated piece: its first id
        merges = score_merges(tokens, types, scores)
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))

        def build():
            tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
            # a normalizer, not Metaspace: that one adds no "▁" before a text that starts with a space
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE)] * prefix
                                                  + [normalizers.Replace(" ", SPACE)])
            tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
            add_whole_tokens(tok, whole_tokens(tokens, types), AddedToken)
            return tok
        out = cls(build(), meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                  add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)), where=where)
        out.continuation = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        out.space_prefix, out._unprefixed = prefix, normalizers.Replace(" ", SPACE)
        out.vocab_size = len(tokens)
        return out

