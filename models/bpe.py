"""Byte-level BPE tokenizers (GPT-2 / SmolLM / Llama 3 / Qwen style), built with the `tokenizers` library.

    tok = BPETokenizer.from_gguf(meta, where)      # a GGUF's tokenizer.ggml.* metadata
    tok = BPETokenizer.from_dir(path)              # a directory's tokenizer.json (+ tokenizer_config.json)
    tok.encode(text, bos=False, eos=False, special=False) -> ids
    tok.decode(ids), tok.decode_continuation(ids), tok.bos_id, tok.eos_id, tok.vocab_size

Same interface as the SentencePiece `models.tokenizer.Tokenizer`, plus what chat needs:
- special (control) tokens such as `<|im_start|>` are single ids, never split by BPE;
- `special=False` (the default) reads text as plain characters: a user who types "<|im_end|>" gets
  the ids of those characters, not the control token (PITFALLS #19); the chat template's own
  markers are encoded with `special=True` (`models.chat_template`);
- `bos=True` adds BOS only when the model's metadata says so (`add_bos`): SmolLM2 says no, so a
  prompt is never given a BOS its training never saw (PITFALLS #18).
Byte-level decoding is concatenative (no SentencePiece-style dropped leading space), so
`decode_continuation` is `decode`; a character cut between tokens decodes as U+FFFD until its
last byte arrives, which is what the streaming detokenizer waits on.
"""
from __future__ import annotations

import json
import os
import threading
from functools import lru_cache
from pathlib import Path

from models.errors import CheckpointError

# llama.cpp token types (tokenizer.ggml.token_type)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
WHOLE = (UNKNOWN, CONTROL, USER_DEFINED)   # matched in the text as a whole before BPE (llama.cpp's special cache)

# Regular expressions that cut text before BPE, by `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 / Qwen2.5 / Qwen3 (their tokenizer.json's Split): Llama 3's, but one digit per piece
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's, with combining marks (\p{M}) kept inside words
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek Coder (v1) and Falcon: llama.cpp's lists of splits
DEEPSEEK_CODER_SPLITS = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
FALCON_SPLITS = [r"[\p{P}\$\+<=>\^~\|`]+",
                 r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)", r"[0-9][0-9][0-9]"]
LONG_TEXT = 16_384   # characters from which encode lets other Python threads run meanwhile

PRE_TOKENIZERS = {   # pre name -> (splits applied in order, ignore_merges)
    "default": ([GPT2_SPLIT], False), "gpt2": ([GPT2_SPLIT], False), "gpt-2": ([GPT2_SPLIT], False),
    "olmo": ([GPT2_SPLIT], False), "mpt": ([GPT2_SPLIT], False),
    # every digit on its own, then GPT-2's split (SmolLM, StarCoder)
    "smollm": ([r"\p{N}", GPT2_SPLIT], False), "starcoder": ([r"\p{N}", GPT2_SPLIT], False),
    "refact": ([r"\p{N}", GPT2_SPLIT], False), "command-r": ([r"\p{N}", GPT2_SPLIT], False),
    "llama-bpe": ([LLAMA3_SPLIT], True), "llama3": ([LLAMA3_SPLIT], True), "llama-v3": ([LLAMA3_SPLIT], True),
    "smaug-bpe": ([LLAMA3_SPLIT], True),
    "qwen2": ([QWEN2_SPLIT], False), "deepseek-r1-qwen": ([QWEN2_SPLIT], False), "qwen35": ([QWEN35_SPLIT], False),
    "deepseek-coder": (DEEPSEEK_CODER_SPLITS, False), "falcon": (FALCON_SPLITS, False),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of byte-level BPE vocabularies)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class BPETokenizer:
    def __init__(self, tokenizer, bos_id: int | None, eos_id: int | None, add_bos: bool, where: str = ""):
        # one tokenizers.Tokenizer (a second one for plain text held its ~6 MB vocabulary and merges
        # again): `encode` sets whether it reads special tokens as text, under a lock
        self.tok = tokenizer
        self._encoding = threading.Lock()
        self.bos_id = bos_id if bos_id is not None else -1
        self.eos_id = eos_id if eos_id is not None else -1
        self.add_bos = add_bos
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.path = where
        self.special_tokens = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    # ------------------------------------------------------------------ the Tokenizer interface
    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False) -> list[int]:
        """ids of `text`; bos: prepend BOS if the model adds one (add_bos); eos: append EOS;
        special: parse special-token strings as their single ids (template text), else as plain text."""
        with self._encoding:
            self.tok.encode_special_tokens = not special
            if len(text) < LONG_TEXT:
                ids = self.tok.encode(text, add_special_tokens=False).ids
            else:   # the same ids; tokenizers' encode keeps the GIL for the whole call, encode_batch lets
                # it go: a server's streams go on while one long prompt is read (2 s for 4 MB of SmolLM2)
                ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        head = [self.bos_id] if bos and self.add_bos and self.bos_id >= 0 else []
        return head + ids + ([self.eos_id] if eos and self.eos_id >= 0 else [])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def chars_per_token(self) -> int | None:
        """At least the non-whitespace characters of a text that any one token covers (the longest
        spelling in the vocabulary: byte-level BPE spells one character a byte, SentencePiece pieces
        their text), so a text of more than N times it needs more than N tokens; None where the
        normalizer may fold several characters into one (NFKC, a regex replace): no such bound.
        Whitespace is left out: templates trim it, added tokens may absorb it."""
        if getattr(self, "_chars_per_token", False) is False:
            norm = self.tok.normalizer
            keeps = norm is None or keeps_characters(json.loads(norm.__getstate__()))
            self._chars_per_token = max(1, max(map(len, self.tok.get_vocab()))) if keeps else None
        return self._chars_per_token

    def whole_token_texts(self) -> tuple[str, ...]:
        """The texts matched as one token wherever they stand (special ones only in template text)."""
        if getattr(self, "_whole_texts", None) is None:
            self._whole_texts = tuple(t.content for t in self.tok.get_added_tokens_decoder().values())
        return self._whole_texts

    def decode_continuation(self, ids) -> str:
        """decode(a + b) == decode(a) + decode_continuation(b) whenever a ends on a whole character:
        byte-level BPE carries its spaces inside the tokens, so this is plain `decode`."""
        return self.decode(ids)

    def bytes_of(self, ids) -> bytes:
        """The bytes `ids` stand for (special tokens: their UTF-8 text), so a streaming detokenizer can
        tell a character still arriving from bytes that will never make one."""
        if getattr(self, "_byte_of", None) is None:   # (_byte_of last: a thread that sees it sees both)
            self._special_ids = {i: t for t, i in self.special_tokens.items()}
            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in self._special_ids:
                out += self._special_ids[i].encode("utf-8")
                continue
            piece = self.tok.id_to_token(i) or ""
            out += bytes(self._byte_of[c] for c in piece) if all(c in self._byte_of for c in piece) \
                else piece.encode("utf-8")
        return bytes(out)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, meta: dict, where: str = "") -> "BPETokenizer":
        """From tokenizer.ggml.{model,pre,tokens,merges,token_type,bos/eos_token_id,add_bos_token}."""
        # lazy: `gen --model tiny` never needs it
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"{where}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2 "
                                  f"(byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(f"{where}: GGUF pre-tokenizer {pre!r} is not supported; supported: "
                                  f"{', '.join(PRE_TOKENIZERS)}")
        tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise CheckpointError(f"{where}: GGUF tokenizer without tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        splits, ignore_merges = PRE_TOKENIZERS[pre]
        # What outlives the build is made first, and the vocabulary's ~100k short-lived objects (its
        # spellings, ids and merge pairs) last, freed before anything else is made: a long-lived object
        # made among them would keep their memory's arenas (Python's, 1 MiB each) from going back.
        bytes_to_unicode()   # (its cached map: long-lived)
        whole = whole_tokens(tokens, types)
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        decoder = decoders.ByteLevel()
        tok = Tokenizer(models.BPE({}, []))
        vocab, pairs = vocab_and_merges(tokens, merges, whole)
        tok.model = models.BPE(vocab, pairs, ignore_merges=ignore_merges)
        del vocab, pairs
        tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
        add_whole_tokens(tok, whole, AddedToken)
        out = cls(tok, meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                  add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)), where=where)
        out.vocab_size = len(tokens)   # not the tokenizer's count: raw spellings share their token's id
        return out

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "BPETokenizer":
        """From DIR/tokenizer.json, with BOS/EOS and add_bos_token from DIR/tokenizer_config.json."""
        from tokenizers import Tokenizer  # lazy: `gen --model tiny` never needs it
        path = Path(path)
        try:
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"{path / 'tokenizer.json'}: not a tokenizers file "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        config = read_tokenizer_config(path)
        bos, eos = token_content(config.get("bos_token")), token_content(config.get("eos_token"))
        bos_id = tok.token_to_id(bos) if bos else None
        eos_id = tok.token_to_id(eos) if eos else None
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:   # no flag: BOS is added iff the file's post-processor adds it (Llama 3 does)
            with_special = tok.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_special[:1] == [bos_id]
        return cls(tok, bos_id, eos_id, add_bos=add_bos, where=str(path))


def keeps_characters(spec: dict) -> bool:
    """True for a tokenizers normalizer (its JSON) that never folds several non-whitespace characters
    into fewer: prepending, lowercasing, stripping, replacing a string by one no shorter."""
    kind = spec.get("type")
    if kind == "Sequence":
        return all(keeps_characters(n) for n in spec.get("normalizers", []))
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        return "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"])
    return kind in ("Prepend", "Lowercase", "Strip")


def whole_tokens(tokens, types) -> list[tuple[int, str, int]]:
    """(id, text, type) of the tokens llama.cpp matches whole (`types`: tokenizer.ggml.token_type; types
    past the last token are not read)."""
    return [(i, tokens[i], ty) for i, ty in enumerate(types[:len(tokens)]) if ty in WHOLE]


def vocab_and_merges(tokens, merges, whole: list) -> tuple[dict, list]:
    """tokenizers' BPE vocabulary {spelling: id} and merges [(a, b)] of a GGUF vocabulary: tokens outside
    the byte-level alphabet spelled in it. Tokens matched whole (control, user-defined) are stored as raw
    text ("  " in GPT-NeoX's vocabulary, not "ĠĠ"): their raw spelling names the same id too, so the
    added token keeps it."""
    to_char = bytes_to_unicode()
    alphabet = set(to_char.values())
    spelled = (t if set(t) <= alphabet else "".join(to_char[b] for b in t.encode("utf-8")) for t in tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    for i, t, _ in whole:
        vocab.setdefault(t, i)
    return vocab, [tuple(m.split(" ", 1)) for m in merges]


def add_whole_tokens(tok, whole: list, AddedToken) -> None:
    """Tokens llama.cpp matches whole before BPE (`whole`: (id, text, type)): control and unknown ones
    (<|im_start|>, <unk>) are special (single ids only in template text), user-defined ones are matched
    in any text."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t, ty in whole
                            if ty in (UNKNOWN, CONTROL) and tok.token_to_id(t) is not None])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for _, t, ty in whole
                    if ty == USER_DEFINED and tok.token_to_id(t) is not None])


def read_tokenizer_config(path: Path) -> dict:
    file = Path(path) / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    return raw if isinstance(raw, dict) else {}


def token_content(token) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None
