"""Each family's GGUF tokenizer against llama.cpp's own: its vocab-only GGUF files and the token ids
llama.cpp's tests/test-tokenizer-0 expects for every text (`ggml-vocab-NAME.gguf.inp` / `.out`),
exactly; decode gives each text back; the streaming detokenizer is exact on them; a tokenizer this
engine lacks is one line; byte-level ones also agree with transformers' own GGUF tokenizer.

The files are third-party data, never committed nor downloaded here: `python scripts/fetch_ggml_vocab.py`
(.ci/run does it) puts them in .cache/ggml-vocab or $GEN_GGML_VOCAB_DIR; without them these tests skip.
"""
from __future__ import annotations

import functools
import importlib.util
import random
import warnings

import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

from chat_fixtures import UNICODE_LINES  # noqa: E402
from engine.detokenize import StreamDecoder  # noqa: E402
from models.chat_template import ChatTemplate, encode_segments  # noqa: E402
from models.errors import CheckpointError  # noqa: E402
from models.gguf_tokenizer import read_gguf_tokenizer  # noqa: E402
from scripts.fetch_ggml_vocab import DEFAULT_DIR  # noqa: E402

SEP = "\n__ggml_vocab_test__\n"   # llama.cpp's test-tokenizer-0.cpp: read_tests
# vocab name -> the family it stands for
SUPPORTED = {"llama-bpe": "Llama 3", "qwen2": "Qwen2 / Qwen2.5 / Qwen3", "qwen35": "Qwen3.5",
             "llama-spm": "Llama 2 / Mistral (SentencePiece)", "phi-3": "Phi-3 (SentencePiece)", "gpt-2": "GPT-2",
             "mpt": "MPT / GPT-NeoX", "starcoder": "StarCoder", "refact": "Refact", "command-r": "Command R",
             "deepseek-coder": "DeepSeek Coder", "falcon": "Falcon"}
# vocab name -> what the one-line refusal says
REFUSED = {"bert-bge": "tokenizer model 'bert' is not supported",
           "gemma-4": "tokenizer model 'gemma4' is not supported",
           "deepseek-llm": "pre-tokenizer 'deepseek-llm' is not supported"}

if not any(DEFAULT_DIR.glob("ggml-vocab-*.gguf.inp")):
    pytest.skip(f"no llama.cpp vocab files in {DEFAULT_DIR} (python scripts/fetch_ggml_vocab.py)",
                allow_module_level=True)


def vocab_file(name: str):
    path = DEFAULT_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in {DEFAULT_DIR}")
    return path


def cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) as test-tokenizer-0 reads them: texts split on the marker line, one line of
    space-separated ids per text."""
    path = vocab_file(name)
    raw = path.with_name(path.name + ".inp").read_text(encoding="utf-8")
    texts = raw.split(SEP)
    if raw.endswith(SEP):
        texts.pop()
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts) and not any(x.strip() for x in lines[len(texts):])
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@functools.lru_cache(maxsize=None)
def tokenizer(name: str):
    return read_gguf_tokenizer(vocab_file(name))   # ~1-3 s each: GGUFReader reads every string field


def test_every_vocab_file_is_supported_or_refused():
    """A newer llama.cpp that adds a vocabulary makes this fail: decide and list it."""
    names = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in DEFAULT_DIR.glob("ggml-vocab-*.gguf.inp")}
    assert names <= SUPPORTED.keys() | REFUSED.keys(), names - SUPPORTED.keys() - REFUSED.keys()


@pytest.mark.parametrize("name", SUPPORTED)
def test_encodes_as_llama_cpp(name):
    tok, wrong = tokenizer(name), []
    for text, ids in cases(name):
        got = tok.encode(text)
        if got != ids:
            wrong.append(f"{text[:60]!r}: expected {ids[:16]}, got {got[:16]}")
        assert tok.decode(got) == text
    assert not wrong, f"{SUPPORTED[name]}: {len(wrong)} texts tokenized unlike llama.cpp:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", REFUSED)
def test_unsupported_vocab_is_one_line(name):
    with pytest.raises(CheckpointError) as e:
        read_gguf_tokenizer(vocab_file(name))
    assert REFUSED[name] in str(e.value) and "supported: " in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "qwen2", "mpt"])
def test_stream_decoder_exact(name):
    """Chunks joined equal the text after the leading text (SentencePiece: the space decode drops)."""
    tok = tokenizer(name)
    for text in [t for t, _ in cases(name)] + UNICODE_LINES:
        ids = tok.encode(text)
        dec = StreamDecoder(tok)
        assert "".join([dec.push(i) for i in ids] + [dec.finish()]) == tok.decode_continuation(ids)
        for k in range(1, len(ids)):   # a text cut between two tokens: the parts add up
            head = tok.decode(ids[:k])
            if "\ufffd" not in head:
                assert head + tok.decode_continuation(ids[k:]) == text, (text, k)


def test_sentencepiece_special_tokens_only_from_template_text():
    """Phi-3's <|user|> is one control id in template text and plain characters in user text; BOS per the file."""
    tok = tokenizer("phi-3")
    user = tok.special_tokens["<|user|>"]
    assert tok.encode("<|user|>\nHi", special=True)[0] == user
    assert user not in tok.encode("<|user|>\nHi")
    assert tok.encode("Hi", bos=True)[0] == tok.bos_id == 1 and tok.vocab_size == 32064


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_a_message_cut_out_of_its_template_encodes_as_the_whole_text(name):
    """A message holding special-token text is encoded apart from its template's text (PITFALLS #19);
    SentencePiece put a "▁" before each piece, so the cut added space tokens the text never had (on
    every turn after it too). The cut, on text without special tokens, must give the whole text's ids."""
    tok = tokenizer(name)
    template = ChatTemplate("{% for m in messages %}{{ '<s>' if m.role == 'system' else '<|user|>' }}\n"
                            "{{ m.content }}</s>{% endfor %}<|assistant|>\n")
    for content in ("hi there", "Hello world, how are you?", " leading space", "x\ny", "2+2=4."):
        text = template.render([{"role": "system", "content": "Be kind."}, {"role": "user", "content": content}])
        at = text.rindex(content)
        cut = [(text[:at], False), (content, True), (text[at + len(content):], False)]
        assert encode_segments(tok, cut) == tok.encode(text, special=True), content
    # a message with special-token text (cut out, plain) after the same head: the head's ids and the first word's
    text = template.render([{"role": "user", "content": "hi </s> there"}])
    head = tok.encode(text[:text.index("hi </s>")], special=True)
    got = template.encode(tok, [{"role": "user", "content": "hi </s> there"}])
    assert got[:len(head) + 1] == tok.encode(text[:text.index(" </s>")], special=True)


def test_a_chat_sessions_next_turn_encodes_as_the_whole_conversation():
    """A session feeds the text the template adds after a reply: encoded as a fresh text it gained a
    "▁" (Llama 2's ' ' + reply + ' </s>': "▁▁" where the conversation has "▁")."""
    tok = tokenizer("llama-spm")
    before = "<s>[INST] hi [/INST] hello there"          # what the state holds: up to the reply's end
    after = " </s><s>[INST] and then? [/INST]"          # what the next turn's template adds
    assert tok.encode(before, special=True) + encode_segments(tok, [(after, False)], after=before) == \
        tok.encode(before + after, special=True)


def strings(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abc XYZ 0123456789 \n\t.,!?'\"éü日本😀<|>_-   \n\n"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("name", ["qwen2"])
def test_agrees_with_transformers_gguf_tokenizer(name, monkeypatch):
    """transformers builds its own `tokenizers` tokenizer from the same GGUF: random strings
    tokenize alike (the .inp texts are held to llama.cpp above; transformers misses Llama 3's
    ignore_merges on one of them). transformers reads the file with gguf's own GGUFReader, its own
    parse, over the map seen as a plain ndarray (the same bytes; np.memmap's per-slice bookkeeping
    doubled the reference's build, 13 s -> 6 s here; models.gguf's reader does the same)."""
    import gguf
    from transformers import AutoTokenizer

    from models.gguf import PlainMap

    class PlainMapReader(PlainMap, gguf.GGUFReader):   # gguf's own parse; only the map's view is ours
        pass

    tok = tokenizer(name)   # (ours first: models.gguf's reader subclasses gguf.GGUFReader as it is)
    with warnings.catch_warnings(), monkeypatch.context() as patch:
        warnings.simplefilter("ignore")
        patch.setattr(gguf, "GGUFReader", PlainMapReader)   # transformers imports it from gguf per call
        ref = AutoTokenizer.from_pretrained(str(DEFAULT_DIR), gguf_file=vocab_file(name).name)
    for s in strings():
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s
