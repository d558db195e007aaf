"""Streaming detokenization: joined chunks == decode of all new ids, spaces kept, no U+FFFD.

The Llama 2 tokenizer (../shared) is the real case: 32k pieces with byte fallback, so CJK and
emoji arrive as several byte tokens. A small tokenizer trained here covers the same ground
when ../shared is absent.
"""
from __future__ import annotations

import pytest
import torch

from conftest import ScriptedModel, shared_path, tiny_model
from engine.api import LLM
from engine.detokenize import StreamDecoder
from engine.generate import Generation, GenerationConfig
from engine.sampling import SamplingParams
from models.tokenizer import Tokenizer

TEXTS = {
    "english": "Once upon a time, there was a little girl.",
    "chinese": "从前有一个小女孩，她喜欢在公园里玩。",
    "emoji": "I love 🦙 and 🎉! 👩‍👩‍👧 ok",
    "mixed": "Daenerys是 the 🐉 queen — naïve café ✓",
    "no-space": "Daenerysisthemotherofdragons🐉🐉🐉andsheknowsit",
}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llama2():
    return Tokenizer(shared_path("tokenizers", "llama2", "tokenizer.model"))


def stream(tok, ids):
    """Push ids one by one; return the chunk released by each, and the final flush."""
    dec = StreamDecoder(tok)
    return [dec.push(i) for i in ids], dec.finish()


def check_stream(tok, text, max_wait):
    ids = tok.encode(text)
    prompt = tok.encode(PROMPT, bos=True)
    chunks, tail = stream(tok, ids)
    joined = "".join(chunks) + tail
    print(repr(text), [tok.sp.id_to_piece(i) for i in ids][:12], chunks[:12])
    assert joined == tok.decode_continuation(ids)
    assert tok.decode(prompt) + joined == tok.decode(prompt + ids)      # the prompt's next word keeps its space
    assert not any("\ufffd" in c for c in chunks) and tail == ""
    waits, run = [], 0
    for c in chunks:
        run = run + 1 if c == "" else 0
        waits.append(run)
    assert max(waits) <= max_wait, f"text held back for {max(waits)} tokens"
    return chunks


@pytest.mark.parametrize("name", list(TEXTS))
def test_llama2_stream_equals_decode(llama2, name):
    # a 4-byte character is 4 byte tokens: at most 3 tokens release nothing
    check_stream(llama2, TEXTS[name], max_wait=3)


@pytest.mark.parametrize("name", list(TEXTS))
def test_small_tokenizer_stream_equals_decode(small_tokenizer, name):
    check_stream(small_tokenizer, TEXTS[name], max_wait=3)


def test_leading_space_of_the_first_new_token_is_kept(llama2):
    ids = llama2.encode("Once upon")                 # pieces '▁Once', '▁upon'
    chunks, _ = stream(llama2, ids)
    assert chunks == [" Once", " upon"]
    assert llama2.decode(ids) == "Once upon"         # plain decode drops it at the start of a text


def test_no_space_ascii_releases_every_token(llama2):
    chunks, _ = stream(llama2, llama2.encode("Daenerysisthemotherofdragons"))
    print(chunks)
    assert all(chunks)


@pytest.mark.parametrize("cut", [1, 2, 3], ids=lambda c: f"minus{c}")
def test_incomplete_character_is_flushed_at_the_end(llama2, cut):
    ids = llama2.encode("ok 🦙")[:-cut]              # the emoji's last bytes never arrive
    chunks, tail = stream(llama2, ids)
    print(chunks, repr(tail))
    assert not any("\ufffd" in c for c in chunks)
    assert "\ufffd" in tail and "".join(chunks) + tail == llama2.decode_continuation(ids)


@pytest.mark.parametrize("name", ["chinese", "emoji", "mixed"])
def test_generation_loop_streams_multibyte_text(llama2, name):
    ids = llama2.encode(TEXTS[name])
    model = ScriptedModel([ids + [llama2.eos_id]], llama2.vocab_size)
    gen = Generation(model, [[1]], GenerationConfig(max_new_tokens=500, sampling=SamplingParams(temperature=0)),
                     llama2)
    chunks = [e.text for e in gen]
    r = gen.results[0]
    assert r.finish_reason == "stop" and r.ids == ids + [llama2.eos_id]
    assert "".join(chunks) == r.text == llama2.decode_continuation(ids)
    assert r.text.strip() == TEXTS[name].strip()
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_random_model_stream_equals_generate_and_decode(llama2, path):
    """Random tokens (byte pieces in odd orders included): the same text however it is read."""
    model = tiny_model(seed=1, vocab_size=llama2.vocab_size, trained_for=("softmax", "linear"))
    llm = LLM(model, llama2, attention=path)
    settings = dict(max_new_tokens=60, temperature=1.5, seed=3, ignore_eos=True)
    s = llm.stream(PROMPT, **settings)
    chunks = list(s)
    r = llm.generate(PROMPT, **settings)
    print(path, chunks[:10])
    assert "".join(chunks) == s.result.text == r.text == llama2.decode_continuation(r.ids)
    assert s.result.ids == r.ids and len(r.ids) == 60
    assert torch.tensor(r.ids).unique().numel() > 10
