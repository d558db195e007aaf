"""Stop strings, EOS sets and finish reasons, on scripted token streams (no real model)."""
from __future__ import annotations

import random

import pytest

from conftest import ScriptedModel
from engine.errors import InvalidArgumentError
from engine.generate import Generation, GenerationConfig
from engine.sampling import SamplingParams
from engine.stopping import StopText, check_stop_strings

GREEDY = SamplingParams(temperature=0)


class PieceTokenizer:
    """Token id i decodes to pieces[i]; ids 0..2 are <unk>, <s>, </s> and decode to nothing."""

    def __init__(self, pieces: list[str]):
        self.pieces = ["", "", ""] + pieces
        self.eos_id = 2
        self.vocab_size = len(self.pieces)

    def ids(self, pieces: list[str]) -> list[int]:
        return [self.pieces.index(p, 3) for p in pieces]

    def decode_continuation(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def run_script(pieces: list[str], stop=(), max_new_tokens=50, extra_eos=None, eos_id=2):
    """Generate `pieces` (then </s>) from a scripted model; return (result, released chunks per token)."""
    tok = PieceTokenizer(sorted(set(pieces)))
    script = tok.ids(pieces) + [eos_id]
    model = ScriptedModel([script], tok.vocab_size)
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=GREEDY, stop=stop, eos_ids=extra_eos)
    gen = Generation(model, [[1]], config, tok)
    chunks = [event.text for event in gen]
    return gen.results[0], chunks


def reference_cut(text: str, stops) -> str:
    """Cut before the stop string completed first (ties: the one starting first)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return text if best is None else text[:best[1]]


# ---------------------------------------------------------------------- stop strings in the loop
SPANS = {
    "span1": ["Once", " upon", "<end>", " tail", " more"],
    "span2": ["Once", " upon", "<e", "nd>", " tail"],
    "span3": ["Once", " upon", "<", "en", "d>", " tail"],
    "inside-token": ["Once", " up", "on<e", "nd> tail"],
}


@pytest.mark.parametrize("name", list(SPANS))
def test_stop_string_over_tokens_is_cut_and_never_streamed(name):
    pieces = SPANS[name]
    result, chunks = run_script(pieces, stop=["<end>"])
    print(name, chunks, repr(result.text))
    assert "".join(chunks) == result.text == "Once upon"
    assert result.finish_reason == "stop"
    n_tokens_to_stop = next(i for i in range(1, len(pieces) + 1) if "<end>" in "".join(pieces[:i]))
    assert len(result.ids) == n_tokens_to_stop     # generation stops at the token completing the string


def test_held_text_is_released_as_soon_as_it_cannot_start_a_stop_string():
    result, chunks = run_script(["a", "<", "b", "<e", "n", "x", "c"], stop=["<end>"], max_new_tokens=7)
    print(chunks)
    assert chunks == ["a", "", "<b", "", "", "<enx", "c"]
    assert result.text == "a<b<enxc" and result.finish_reason == "length"


def test_text_held_at_the_end_is_flushed():
    result, chunks = run_script(["Once", " <e"], stop=["<end>"], max_new_tokens=2)
    print(chunks)
    assert chunks == ["Once", " <e"] and result.finish_reason == "length"


def test_stop_text_overlapping_prefixes():
    st = StopText(("abc",))
    out = [st.push(c) for c in ["ab", "ab", "c", "zzz"]]
    print(out)
    assert out == ["", "ab", "", ""] and st.matched == "abc"


@pytest.mark.parametrize("trial", range(20), ids=lambda t: f"seed{t}")
def test_stop_text_does_not_depend_on_chunking(trial):
    rng = random.Random(trial)
    alphabet = "ab<>x "
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)})
    text = "".join(rng.choice(alphabet) for _ in range(40))
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    st = StopText(stops)
    streamed = "".join(st.push(c) for c in chunks) + st.finish()
    print(stops, repr(text), repr(streamed))
    assert streamed == reference_cut(text, stops)


def test_several_stop_strings_first_completed_wins():
    result, _ = run_script(["x", "ab", "cd", "y"], stop=["abcd", "bc"])
    assert result.text == "xa"
    result, _ = run_script(["x", "ab", "cd", "y"], stop=["abcd", "zz"])
    assert result.text == "x"


@pytest.mark.parametrize("bad", ["", ["ok", ""], [3]], ids=["empty", "one-empty", "not-str"])
def test_bad_stop_strings(bad):
    with pytest.raises(InvalidArgumentError):
        check_stop_strings(bad)


# ---------------------------------------------------------------------- EOS set and finish reasons
@pytest.mark.parametrize("eos", [2, 7, 9], ids=lambda e: f"eos{e}")
def test_any_id_of_the_eos_set_stops(eos):
    tok = PieceTokenizer([f"w{i}" for i in range(10)])
    script = [3, 4, eos, 5, 6]
    model = ScriptedModel([script], tok.vocab_size, eos_token_id=(2, 7))
    tok.eos_id = 9                                     # the tokenizer disagrees with the config
    gen = Generation(model, [[1]], GenerationConfig(max_new_tokens=10, sampling=GREEDY), tok)
    chunks = [e.text for e in gen]
    r = gen.results[0]
    print(eos, chunks, r)
    assert r.finish_reason == "stop" and r.ids == [3, 4, eos] and r.text == "w0w1" == "".join(chunks)


def test_ignore_eos_runs_to_length():
    tok = PieceTokenizer(["a", "b"])
    model = ScriptedModel([[3, 2, 4]], tok.vocab_size)
    r = Generation(model, [[1]], GenerationConfig(max_new_tokens=5, sampling=GREEDY, ignore_eos=True), tok).run()[0]
    assert r.finish_reason == "length" and r.ids == [3, 2, 4, 4, 4]


def test_length_finish_and_event_reasons():
    tok = PieceTokenizer(["a", "b"])
    model = ScriptedModel([[3, 4, 3, 4]], tok.vocab_size)
    gen = Generation(model, [[1]], GenerationConfig(max_new_tokens=3, sampling=GREEDY), tok)
    events = list(gen)
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert gen.results[0].text == "aba"


def test_batch_rows_stop_independently():
    tok = PieceTokenizer(["a", "b", "<end>"])
    a, b, end = tok.ids(["a", "b", "<end>"])
    model = ScriptedModel([[a, end, a], [b, b, b, b], [a, 2]], tok.vocab_size)
    gen = Generation(model, [[1], [1, 1], [1]], GenerationConfig(max_new_tokens=4, sampling=GREEDY,
                                                                 stop=("<end>",)), tok)
    rows = [[] for _ in range(3)]
    for e in gen:
        rows[e.row].append(e.text)
    got = [(r.text, r.finish_reason) for r in gen.results]
    print(got, rows)
    assert got == [("a", "stop"), ("bbbb", "length"), ("a", "stop")]
    assert ["".join(r) for r in rows] == [r.text for r in gen.results]


def test_stop_strings_need_a_tokenizer():
    model = ScriptedModel([[3]], 10)
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        Generation(model, [[1]], GenerationConfig(stop=("x",), sampling=GREEDY))
