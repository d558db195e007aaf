"""SentencePiece-style BPE from GGUF metadata (`tokenizer.ggml.model` "llama": Llama 2, Mistral) on a
hand-made vocabulary whose tokenizations follow by hand from llama.cpp's rule (merge the pair whose
joined piece scores best; "▁" before the text and after each special token; bytes for unknown
characters); a GGUF model file with such a tokenizer loads with it. llama.cpp's own files:
tests/test_ggml_vocab.py."""
from __future__ import annotations

import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

from chat_fixtures import write_gguf  # noqa: E402
from conftest import tiny_model  # noqa: E402
from models.errors import CheckpointError  # noqa: E402
from models.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from models.registry import read_checkpoint  # noqa: E402
from models.spm_gguf import SentencePieceBPE  # noqa: E402

PIECES = [("▁", -1), ("a", -2), ("b", -3), ("c", -4), ("ab", -5), ("▁a", -6), ("▁ab", -7), ("bc", -8),
          ("abc", -9), ("▁▁", -100)]
TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in PIECES]
          + ["<|c|>", "<|u|>"])
SCORES = [0.0] * 259 + [float(s) for _, s in PIECES] + [0.0, 0.0]
TYPES = [2, 3, 3] + [6] * 256 + [1] * len(PIECES) + [3, 4]


def meta(**extra) -> dict:
    m = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.scores": SCORES,
         "tokenizer.ggml.token_type": TYPES, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
         "tokenizer.ggml.unknown_token_id": 0}
    m.update(extra)
    return m


def pieces(tok, text, **kw) -> list[str]:
    return [TOKENS[i] for i in tok.encode(text, **kw)]


@pytest.fixture(scope="module")
def tok():
    return gguf_tokenizer(meta(), "m.gguf")


@pytest.mark.parametrize("text,expected", [
    ("ab", ["▁ab"]),                           # ab (-5) before ▁a (-6), then ▁ab
    ("abc", ["▁ab", "c"]),                     # then ▁ab (-7) before abc (-9)
    (" a", ["▁", "▁a"]),                       # ▁a (-6) before ▁▁ (-100); "▁▁a" is no piece
    ("  ", ["▁▁", "▁"]),
    ("é", ["▁", "<0xC3>", "<0xA9>"]),          # no piece: its UTF-8 bytes
    ("", []),
    ("x<|u|>b", ["▁", "<0x78>", "<|u|>", "▁", "b"]),     # user-defined: whole in any text, "▁" after it
    ("<|c|>", ["▁", "<0x3C>", "<0x7C>", "c", "<0x7C>", "<0x3E>"]),   # control: characters in user text
])
def test_encodes_by_scores(tok, text, expected):
    assert pieces(tok, text) == expected
    # the "▁" put after a whole token decodes as a space (llama.cpp and transformers' legacy Llama alike)
    assert tok.decode(tok.encode(text)) == text.replace("<|u|>", "<|u|> ")


def test_special_bos_and_continuation(tok):
    assert pieces(tok, "<|c|>b", special=True) == ["<|c|>", "▁", "b"]
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2, "<|c|>": 269}
    assert tok.encode("ab", bos=True, eos=True) == [1, TOKENS.index("▁ab"), 2]   # add_bos: llama.cpp's default
    ids = tok.encode("ab abc")
    assert tok.decode(ids[1:]) == "abc" and tok.decode_continuation(ids[1:]) == " abc"
    assert tok.bytes_of([TOKENS.index("▁a"), 3 + 0xC3]) == b" a\xc3"
    no_prefix = gguf_tokenizer(meta(**{"tokenizer.ggml.add_space_prefix": False}), "m.gguf")
    assert pieces(no_prefix, "ab") == ["ab"] and no_prefix.decode(no_prefix.encode(" ab")) == " ab"


def test_bad_metadata_is_one_line():
    with pytest.raises(CheckpointError, match="one tokenizer.ggml.scores entry per token"):
        gguf_tokenizer(meta(**{"tokenizer.ggml.scores": SCORES[:-1]}), "m.gguf")
    with pytest.raises(CheckpointError, match="tokenizer model 't5' is not supported; supported: gpt2 .*llama"):
        gguf_tokenizer(meta(**{"tokenizer.ggml.model": "t5"}), "m.gguf")


def test_gguf_model_file_loads_its_sentencepiece_tokenizer(tmp_path):
    def write(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(TOKENS)
        w.add_token_scores(SCORES)
        w.add_token_types(TYPES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    path = tmp_path / "spm.gguf"
    write_gguf(path, tiny_model(seed=3, vocab_size=300), None, template=None, write_tokenizer=write)
    ckpt = read_checkpoint(path)
    assert isinstance(ckpt.tokenizer, SentencePieceBPE)
    assert ckpt.tokenizer.encode("abc", bos=True) == [1, TOKENS.index("▁ab"), TOKENS.index("c")]
