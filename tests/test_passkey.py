"""Passkey retrieval (engine.tasks.passkey): the prompt states the key once, at the requested depth, at the
requested length; trials that reuse the filler's prefilled state answer what each prompt alone answers."""
import warnings

import pytest

from engine.api import load
from engine.errors import InvalidArgumentError
from engine.tasks.passkey import FILLER, INTRO, make_prompt, run_passkey

LENGTHS = [260, 500, 1200]


def sentence_tokens(tokenizer) -> int:
    return max(len(tokenizer.encode(" " + s)) for s in FILLER)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_prompt_holds_the_key_once_at_the_depth_and_the_length(small_tokenizer, length, depth):
    tok = small_tokenizer
    p = make_prompt(tok, length, depth, "48213")
    slack = sentence_tokens(tok) + 2
    assert length - slack <= len(p.ids) <= length
    assert p.text.count("48213") == 1 and tok.decode(p.ids).count("48213") == 1
    assert p.ids == tok.encode(p.text, bos=True)
    head = len(tok.encode(INTRO, bos=True))
    question = len(tok.encode(p.text[p.text.index("What is the pass key"):]))
    needle = len(tok.encode("The pass key is 48213. Remember it."))
    filler = len(p.ids) - head - question - needle
    print(f"needle at {p.needle_start}, {filler} filler tokens, depth {(p.needle_start - head) / filler:.3f}")
    assert abs((p.needle_start - head) - depth * filler) <= slack
    # the needle really starts there: its tokens follow the text before it
    assert tok.decode(p.ids[p.needle_start:]).lstrip().startswith("The pass key is 48213.")


def test_a_length_too_short_for_the_question_is_one_line(small_tokenizer):
    with pytest.raises(InvalidArgumentError, match="passkey length 200 is too short") as e:
        make_prompt(small_tokenizer, 200, 0.5, "12345")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [dict(attention="softmax"), dict(attention="linear"),
                                dict(attention="hybrid", softmax_layers=[1]), dict(attention="linear", window=8),
                                dict(attention="linear", window=8, feature_map="zero")],
                         ids=["softmax", "linear", "hybrid", "window", "window-only"])
def test_reused_prefix_answers_what_each_prompt_alone_answers(small_model_dir, kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = load(str(small_model_dir), backend="torch", **kw)
    report = run_passkey(llm, lengths=[260, 330], depths=[0.2, 0.7], trials=4, seed=3, batch_tokens=700)
    assert report["prefilled_tokens"] < report["prompt_tokens"]          # the filler was shared
    assert sum(c["trials"] for c in report["lengths"].values()) == 8
    for t in report["trials"]:
        p = make_prompt(llm.tokenizer, t["length"], t["depth"], t["key"])
        alone = llm.generate(p.ids, max_new_tokens=10, temperature=0, max_context=400)
        assert t["answer"] == alone.text, (t, alone.text)


def test_accuracy_counts_the_first_number_written(small_tokenizer):
    """A trial is right when the first number of the answer is the key; counted per length and depth."""
    from engine.tasks.passkey import summarize
    prompts = {(260, d): [make_prompt(small_tokenizer, 260, d, k) for k in ("11111", "22222")] for d in (0.1, 0.9)}
    answers = {(260, 0.1): [("11111", " 11111. Remember it."), ("22222", " 2222 and 22222")],
               (260, 0.9): [("11111", "11111"), ("22222", " the pass key")]}
    report = summarize(prompts, answers, [260], [0.1, 0.9], seconds=1.0, fed=10, whole=20)
    assert report["lengths"]["260"]["correct"] == 2 and report["lengths"]["260"]["accuracy"] == 0.5
    assert report["depths"]["260"] == {"0.1": {"correct": 1, "trials": 2}, "0.9": {"correct": 1, "trials": 2}}
