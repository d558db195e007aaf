"""engine.sequence.Sequence: one sequence's finish rules, which Generation and the server's scheduler
both call (their own tests, test_stopping.py and test_serve*.py, check the loops end to end)."""
from __future__ import annotations

from test_stopping import PieceTokenizer

from engine.sequence import Sequence

TOK = PieceTokenizer(["Hel", "lo", " wor", "ld", "!"])
HEL, LO, WOR, LD, BANG = TOK.ids(["Hel", "lo", " wor", "ld", "!"])
EOS = frozenset({2})


def feed(seq: Sequence, ids: list[int]) -> list[tuple[str, str | None]]:
    out = []
    for i in ids:
        out.append(seq.push(i))
        if out[-1][1] is not None:
            break
    return out


def test_an_eos_id_ends_the_sequence_even_on_its_last_allowed_token():
    seq = Sequence(TOK, eos=EOS, max_tokens=3)
    assert feed(seq, [HEL, LO, 2]) == [("Hel", None), ("lo", None), ("", "stop")]
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", 2, "Hello")


def test_a_stop_string_is_cut_and_wins_over_length():
    seq = Sequence(TOK, stop=("o w",), eos=EOS, max_tokens=3)
    assert feed(seq, [HEL, LO, WOR]) == [("Hel", None), ("l", None), ("", "stop")]   # "o" held, then cut
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", "o w", "Hell")


def test_length_then_context_and_the_held_text_is_flushed():
    seq = Sequence(TOK, stop=("!!",), eos=EOS, max_tokens=2, room=2)
    assert feed(seq, [HEL, BANG]) == [("Hel", None), ("!", "length")]   # "!" held (could begin "!!"), flushed
    seq = Sequence(TOK, eos=EOS, max_tokens=10, room=2)
    assert feed(seq, [HEL, LO, WOR]) == [("Hel", None), ("lo", None), (" wor", "context")]


def test_no_tokenizer_no_text_but_eos_and_limits_hold_and_ids_go_to_the_given_list():
    ids = []
    seq = Sequence(None, eos=EOS, max_tokens=5, ids=ids)
    assert feed(seq, [HEL, 2]) == [("", None), ("", "stop")]
    assert ids == [HEL, 2] and seq.text == ""
    assert feed(Sequence(None, max_tokens=2), [2, 2]) == [("", None), ("", "length")]   # no EOS set: no stop
