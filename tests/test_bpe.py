"""Byte-level BPE tokenizers: from tokenizer.json and from GGUF metadata they agree; special tokens
are single ids from template text and plain characters from user text; BOS as the metadata says;
the streaming detokenizer is exact on CJK and emoji."""
from __future__ import annotations

import json
import random
from array import array

import pytest

pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

from chat_fixtures import SPECIALS, UNICODE_LINES, gguf_tokenizer_fields, train_bpe  # noqa: E402
from conftest import generated_sentences  # noqa: E402
from engine.detokenize import REPLACEMENT, StreamDecoder  # noqa: E402
from models.bpe import BPETokenizer  # noqa: E402
from models.errors import CheckpointError  # noqa: E402

ALPHABET = "abc XYZ 0123456789 \n\t.,!?'\"éü日本😀<|>_-"


def strings(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["Hello world", "  leading spaces", "tabs\tand\nnewlines\n\n\nx", "don't won't I'm", "x = 3.14; y=[1,2]",
           "<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b", "", " ", "\n", *UNICODE_LINES]
    out += generated_sentences(50, seed=seed + 1)
    out += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def gguf_meta(tok_dir, pre="gpt2", **extra) -> dict:
    f = gguf_tokenizer_fields(tok_dir)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": f["tokens"],
            "tokenizer.ggml.merges": f["merges"], "tokenizer.ggml.token_type": f["types"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False}
    meta.update(extra)
    return meta


def test_gguf_metadata_and_tokenizer_json_agree(tok_dir):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    a, b = BPETokenizer.from_dir(tok_dir), BPETokenizer.from_gguf(gguf_meta(tok_dir), "m.gguf")
    assert (a.bos_id, a.eos_id, a.vocab_size, a.add_bos) == (b.bos_id, b.eos_id, b.vocab_size, b.add_bos) == \
        (1, 2, ref.get_vocab_size(), False)
    for s in strings():
        ids = a.encode(s, special=True)
        assert ids == b.encode(s, special=True) == ref.encode(s, add_special_tokens=False).ids, s
        assert a.encode(s) == b.encode(s), s
        assert a.decode(ids) == b.decode(ids) == s


def test_gguf_metadata_as_the_reader_hands_it_up_builds_the_same_tokenizer(tok_dir):
    """The reader hands a long vocabulary up as a StringArray (its bytes, not a list of str), and a file
    with more token types than tokens loaded before (the extra types unread): both still do."""
    from models.gguf_metadata import StringArray
    meta = gguf_meta(tok_dir)
    tokens = meta["tokenizer.ggml.tokens"]
    raw = b"".join(t.encode("utf-8") for t in tokens)
    ends = array("Q")
    for t in tokens:
        start = ends[-1] if ends else 0
        ends.extend([start, start + len(t.encode("utf-8"))])
    compact = dict(meta, **{"tokenizer.ggml.tokens": StringArray(raw, ends),
                            "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"] + [3, 3]})
    a, b = BPETokenizer.from_gguf(meta, "m.gguf"), BPETokenizer.from_gguf(compact, "m.gguf")
    assert a.vocab_size == b.vocab_size and a.special_tokens == b.special_tokens
    for s in strings():
        assert a.encode(s, special=True) == b.encode(s, special=True), s


def test_special_tokens_single_ids_only_from_template_text(tok_dir):
    tok = BPETokenizer.from_dir(tok_dir)
    assert tok.special_tokens == {t: i for i, t in enumerate(SPECIALS)}
    text = "<|im_start|>user\nclose it: <|im_end|><|im_end|>"
    parsed = tok.encode(text, special=True)
    assert parsed[0] == 1 and parsed[-2:] == [2, 2]
    plain = tok.encode(text)                     # user text: the characters, never the control ids
    assert not set(plain) & {0, 1, 2}
    assert tok.decode(plain) == tok.decode(parsed) == text


def test_bos_as_the_metadata_says(tok_dir):
    no = BPETokenizer.from_gguf(gguf_meta(tok_dir), "m")
    yes = BPETokenizer.from_gguf(gguf_meta(tok_dir, **{"tokenizer.ggml.add_bos_token": True}), "m")
    assert no.encode("Hi", bos=True) == no.encode("Hi")
    assert yes.encode("Hi", bos=True) == [1] + yes.encode("Hi")
    assert no.encode("Hi", eos=True)[-1] == 2
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    try:
        assert BPETokenizer.from_dir(tok_dir).encode("Hi", bos=True)[0] == 1
    finally:
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_smollm_pre_tokenizer_splits_digits(tok_dir):
    """llama.cpp's `smollm` (and starcoder) pre-tokenizer cuts every digit off on its own first."""
    tok = BPETokenizer.from_gguf(gguf_meta(tok_dir, pre="smollm"), "m")
    for s in ("in 2024 there", "x 12 y", "  7"):
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        digits = [tok.decode([i]) for i in ids if any(c.isdigit() for c in tok.decode([i]))]
        assert all(len(d) == 1 for d in digits), digits


@pytest.mark.parametrize("text", UNICODE_LINES + ["plain ascii words", "日本語" * 5 + "😀" * 3])
def test_stream_decoder_exact_on_multibyte_text(tok_dir, text):
    tok = BPETokenizer.from_dir(tok_dir)
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in ids] + [dec.finish()]
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any(REPLACEMENT in c for c in chunks), chunks
    if len(ids) > len(text):   # some character spans several tokens: it was held, not split
        assert any(c == "" for c in chunks[:-1])


def test_decode_continuation_is_concatenative(tok_dir):
    tok = BPETokenizer.from_dir(tok_dir)
    ids = tok.encode("Hello there, the cat sat. 日本 ok")
    for k in range(len(ids)):
        head = tok.decode(ids[:k])
        if REPLACEMENT not in head:
            assert head + tok.decode_continuation(ids[k:]) == tok.decode(ids)


def test_gguf_tokenizer_errors(tok_dir):
    with pytest.raises(CheckpointError, match="pre-tokenizer 'mystery' is not supported; supported: "):
        BPETokenizer.from_gguf(gguf_meta(tok_dir, pre="mystery"), "m.gguf")
    with pytest.raises(CheckpointError, match="tokenizer model 'bert' is not supported"):
        BPETokenizer.from_gguf(gguf_meta(tok_dir, **{"tokenizer.ggml.model": "bert"}), "m.gguf")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.tokens"):
        BPETokenizer.from_gguf(gguf_meta(tok_dir, **{"tokenizer.ggml.tokens": []}), "m.gguf")


def test_stream_decoder_releases_bytes_that_never_make_a_character(tok_dir):
    """A stray continuation byte (as an untrained model may emit) is released at once as U+FFFD, not held
    to the end (PITFALLS #3); a real character's first bytes are still held; joined == decode."""
    tok = BPETokenizer.from_dir(tok_dir)
    from models.bpe import bytes_to_unicode
    b80 = tok.token_to_id(bytes_to_unicode()[0x80])
    e6 = tok.token_to_id(bytes_to_unicode()[0xE6])
    assert b80 is not None and e6 is not None
    ids = [b80, b80, tok.encode("ok")[0], e6]
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in ids]
    assert chunks[0] == chunks[1] == REPLACEMENT           # released at once
    assert chunks[3] == ""                                 # 0xE6 starts a 3-byte character: held
    assert "".join(chunks) + dec.finish() == tok.decode(ids)
    assert tok.bytes_of(tok.encode("日本 <|im_end|>", special=True)) == "日本 <|im_end|>".encode()


def test_a_long_text_is_encoded_without_holding_the_gil(tok_dir):
    """From LONG_TEXT characters on, encode goes through encode_batch, which lets go of Python's lock:
    another thread runs while a long prompt is read (a server's streams do not freeze), the ids the same
    as the short path's, piece by piece."""
    import threading

    from models.bpe import LONG_TEXT
    tok = BPETokenizer.from_dir(tok_dir)
    piece = " ".join(generated_sentences(20, seed=4)) + "\n"
    text = piece * (300_000 // len(piece))
    assert len(text) >= LONG_TEXT
    long_ids, piece_ids = tok.encode(text), tok.encode(piece)
    assert long_ids[:len(piece_ids)] == piece_ids and len(long_ids) > 100 * len(piece_ids)
    assert long_ids == tok.tok.encode(text, add_special_tokens=False).ids
    ticks, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)
    t = threading.Thread(target=ticker)
    t.start()
    try:
        started = len(ticks)
        tok.encode(text)
        during = len(ticks) - started
    finally:
        done.set()
        t.join()
    assert during >= 10, f"another thread ran {during} times while {len(text)} characters were encoded"
