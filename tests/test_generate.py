"""The generation loop on small random models: batches, independence, errors, freeing, context."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from conftest import ScriptedModel, tiny_model
from engine.api import LLM, UntrainedPathWarning, is_single_prompt, load
from engine.errors import InvalidArgumentError
from engine.generate import Generation, GenerationConfig
from engine.sampling import SamplingParams

PATHS = ["softmax", "linear"]
PROMPTS = [[1, 17, 33, 5, 80, 41, 7], [1, 60, 2, 9], [1], [1, 22, 22, 22, 4, 3, 91, 15, 44, 12, 8]]


def make_llm(path, seed=0, dtype=torch.float32, tokenizer=None, **cfg):
    if tokenizer is not None:
        cfg["vocab_size"] = tokenizer.vocab_size
    model = tiny_model(seed=seed, dtype=dtype, trained_for=("softmax", "linear"), **cfg)
    return LLM(model, tokenizer, attention=path)


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# ---------------------------------------------------------------------- batches
@pytest.mark.parametrize("kv_heads", [4, 2], ids=lambda h: f"Hkv{h}")
@pytest.mark.parametrize("path", PATHS)
def test_greedy_batch_equals_each_prompt_alone(path, kv_heads):
    llm = make_llm(path, num_key_value_heads=kv_heads)
    settings = dict(max_new_tokens=16, temperature=0, ignore_eos=True)
    batch = llm.generate(PROMPTS, **settings)
    for prompt, got in zip(PROMPTS, batch):
        alone = llm.generate(prompt, **settings)
        print(path, len(prompt), got.ids, alone.ids, "first difference at", first_difference(got.ids, alone.ids))
        assert got.ids == alone.ids and got.finish_reason == alone.finish_reason == "length"
        assert got.stats.prompt_tokens == len(prompt) and got.stats.batch == len(PROMPTS)


@pytest.mark.parametrize("path", PATHS)
def test_sampled_batch_equals_each_prompt_alone(path):
    llm = make_llm(path, dtype=torch.float64)   # fp64: batch and single logits agree to ~1e-15
    settings = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    batch = llm.generate(PROMPTS[:3], **settings)
    for prompt, got in zip(PROMPTS, batch):
        alone = llm.generate(prompt, **settings)
        assert got.ids == alone.ids, (got.ids, alone.ids)


def test_batch_context_finish_per_sequence_equals_alone():
    llm = make_llm("softmax")
    settings = dict(max_new_tokens=30, temperature=0, ignore_eos=True, max_context=12)
    batch = llm.generate(PROMPTS, **settings)
    for prompt, got in zip(PROMPTS, batch):
        alone = llm.generate(prompt, **settings)
        print(len(prompt), got.finish_reason, len(got.ids))
        assert got.ids == alone.ids
        assert got.finish_reason == "context" and len(prompt) + len(got.ids) == 12 + 1


# ---------------------------------------------------------------------- context
@pytest.mark.parametrize("path,reason,n", [("softmax", "context", 4), ("linear", "length", 10)])
def test_context_finish_only_for_the_kv_cache(path, reason, n):
    llm = make_llm(path)
    r = llm.generate([1, 2, 3, 4, 5], max_new_tokens=10, temperature=0, ignore_eos=True, max_context=8)
    print(path, r.finish_reason, r.ids)
    assert r.finish_reason == reason and len(r.ids) == n


def test_prompt_filling_the_context_gives_one_token():
    r = make_llm("softmax").generate([1, 2, 3], max_new_tokens=5, temperature=0, ignore_eos=True, max_context=3)
    assert r.finish_reason == "context" and len(r.ids) == 1


def test_prompt_longer_than_the_context_is_refused():
    llm = make_llm("softmax")
    with pytest.raises(InvalidArgumentError, match="context holds 4"):
        llm.generate([1, 2, 3, 4, 5], max_context=4)
    make_llm("linear").generate([1, 2, 3, 4, 5], max_context=4, max_new_tokens=2)   # no limit there


def test_default_context_is_max_position_embeddings():
    llm = make_llm("softmax", max_position_embeddings=16)
    r = llm.generate([1, 2, 3, 4, 5, 6], max_new_tokens=100, temperature=0, ignore_eos=True)
    assert r.finish_reason == "context" and len(r.ids) == 16 - 6 + 1


# ---------------------------------------------------------------------- independence
@pytest.mark.parametrize("path", PATHS)
def test_interleaved_streams_equal_each_alone(path):
    llm = make_llm(path)
    a_set = dict(max_new_tokens=15, temperature=0.9, seed=1, ignore_eos=True)
    b_set = dict(max_new_tokens=15, temperature=1.2, top_k=20, seed=2, ignore_eos=True)
    alone_a, alone_b = llm.generate(PROMPTS[0], **a_set).ids, llm.generate(PROMPTS[1], **b_set).ids
    ga, gb = llm.start([PROMPTS[0]], **a_set), llm.start([PROMPTS[1]], **b_set)
    ids_a, ids_b = [], []
    for ea, eb in zip(ga, gb):          # one token of a, one of b, ...
        ids_a.append(ea.id)
        ids_b.append(eb.id)
        torch.rand(3)                   # other code drawing random numbers in between
    print(ids_a, alone_a, ids_b, alone_b)
    assert ids_a == alone_a and ids_b == alone_b


# ---------------------------------------------------------------------- the loop's calls
def test_prefill_is_last_only_and_decode_is_one_token_per_step():
    model = ScriptedModel([[5, 6, 7, 8], [9, 9, 9, 9]], vocab_size=20)
    Generation(model, [[1, 3, 4], [1]], GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=0),
                                                         ignore_eos=True)).run()
    print(model.calls)
    assert model.calls == [((2, 3), True), ((2, 1), False), ((2, 1), False), ((2, 1), False)]


class Boom(RuntimeError):
    pass


def spy_states(monkeypatch, model):
    """Record a weak reference to every state the model allocates."""
    refs = []
    real = model.init_state

    def init_state(*a, **kw):
        state = real(*a, **kw)
        refs.append(weakref.ref(state))
        return state
    monkeypatch.setattr(model, "init_state", init_state)
    return refs


def alive(refs):
    gc.collect()
    return [r for r in refs if r() is not None]


@pytest.mark.parametrize("at_step", [0, 1, 4], ids=lambda k: f"step{k}")
@pytest.mark.parametrize("path", PATHS)
def test_exception_in_a_step_reaches_the_caller_and_frees_the_state(monkeypatch, path, at_step):
    llm = make_llm(path)
    refs = spy_states(monkeypatch, llm.model)
    real_step, calls = llm.step, []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == at_step + 1:
            raise Boom(f"injected at step {at_step}")
        return real_step(*a, **kw)
    monkeypatch.setattr(llm, "step", step)
    gen = llm.start([PROMPTS[0]], max_new_tokens=10, temperature=0, ignore_eos=True)
    with pytest.raises(Boom):
        for _ in gen:
            pass
    assert gen.state is None and not alive(refs)
    assert len(gen.ids[0]) == at_step


@pytest.mark.parametrize("path", PATHS)
def test_leaving_a_stream_early_frees_the_state(monkeypatch, path, small_tokenizer):
    llm = make_llm(path, tokenizer=small_tokenizer)
    refs = spy_states(monkeypatch, llm.model)
    chunks = 0
    gc.disable()   # freed by reference counting at the break, not whenever the cycle collector runs
    try:
        for _ in llm.stream("the cat", max_new_tokens=50, temperature=0, ignore_eos=True):
            chunks += 1
            assert [r for r in refs if r() is not None]   # the state exists while streaming...
            break
        assert chunks == 1 and len(refs) == 1 and refs[0]() is None   # ...and is gone once the loop is left
    finally:
        gc.enable()

    s = llm.stream("the cat", max_new_tokens=50, temperature=0, ignore_eos=True)
    next(s)
    assert s.state is not None and alive(refs)        # a named stream can resume until closed
    s.close()
    assert s.state is None and not alive(refs)

    with llm.start([[1, 2]], max_new_tokens=50) as gen:
        next(gen)
    assert gen.state is None and not alive(refs)


def test_finished_generation_frees_the_state(monkeypatch):
    llm = make_llm("softmax")
    refs = spy_states(monkeypatch, llm.model)
    gen = llm.start([[1, 2]], max_new_tokens=3)
    gen.run()
    assert gen.state is None and not alive(refs)


# ---------------------------------------------------------------------- results and the API
def test_result_stats():
    llm = make_llm("softmax")
    r = llm.generate([1, 2, 3], max_new_tokens=6, temperature=0, ignore_eos=True)
    s = r.stats
    print(s)
    state = llm.model.init_state(batch=1, max_len=3 + 6 - 1, attention="softmax")
    assert (s.prompt_tokens, s.new_tokens, s.batch, s.attention) == (3, 6, 1, "softmax")
    assert s.state_bytes == state.nbytes > 0
    assert s.time_to_first_token_s >= s.prefill_s > 0 and s.decode_s > 0 and s.decode_tokens_per_s > 0


def test_eos_stops_a_real_model():
    llm = make_llm("linear")
    free = llm.generate([1, 5], max_new_tokens=8, temperature=0, ignore_eos=True)
    eos = free.ids[3]
    r = llm.generate([1, 5], max_new_tokens=8, temperature=0, eos_ids=[eos])
    first = free.ids.index(eos)
    assert r.finish_reason == "stop" and r.ids == free.ids[:first + 1]


def test_prompt_forms():
    assert is_single_prompt("text") and is_single_prompt([1, 2]) and is_single_prompt(torch.tensor([1, 2]))
    assert not is_single_prompt(["a", "b"]) and not is_single_prompt([[1], [2, 3]])
    llm = make_llm("softmax")
    a = llm.generate(torch.tensor([1, 2, 3]), max_new_tokens=3, temperature=0)
    b = llm.generate([[1, 2, 3]], max_new_tokens=3, temperature=0)
    assert isinstance(b, list) and a.ids == b[0].ids


@pytest.mark.parametrize("prompt,match", [([], "empty"), ([[1], []], "empty"), ([1, 500], "outside"),
                                          ("text", "no tokenizer"), ("", "empty")],
                         ids=["no-ids", "one-empty", "bad-id", "text-without-tokenizer", "empty-text"])
def test_bad_prompts(prompt, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_llm("softmax").generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(max_context=0), dict(temperature=-1),
                                dict(top_p=0)], ids=lambda d: next(iter(d)))
def test_bad_settings(kw):
    with pytest.raises(InvalidArgumentError):
        make_llm("softmax").generate([1], **kw)


def test_load_by_path_and_untrained_path_warning(small_model_dir, tmp_path):
    from models.weights import save_pretrained
    llm = load(str(small_model_dir), attention="linear")
    text = "".join(llm.stream("the cat", max_new_tokens=5, temperature=0))
    assert text == llm.generate("the cat", max_new_tokens=5, temperature=0).text
    save_pretrained(tiny_model(trained_for=("softmax",)), str(tmp_path / "m"))
    with pytest.warns(UntrainedPathWarning, match="not linear"):
        load(str(tmp_path / "m"), attention="linear")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(str(tmp_path / "m"), attention="softmax")


def test_stream_needs_a_tokenizer():
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        make_llm("softmax").stream([1, 2])


def test_public_names():
    import engine
    assert engine.load is load and engine.LLM is LLM and engine.Generation is Generation
    with pytest.raises(AttributeError):
        engine.no_such_name


def test_a_generation_returns_its_own_states_memory_when_it_ends(monkeypatch):
    """The state a generation allocated is freed when it ends, and the C heap's free pages go back to
    the kernel then (its pages lie between live blocks: a long prompt's KV cache otherwise stays in
    the resident set); a resumed state is the caller's, kept and not trimmed for."""
    import engine.generate as gen
    trims = []
    monkeypatch.setattr(gen, "trim_heap", lambda when_freed=False: trims.append(when_freed))
    model = tiny_model(seed=3)
    g = Generation(model, [[1, 5, 9]], GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=0)))
    state = weakref.ref(g.state)
    g.run()
    gc.collect()
    assert trims == [True] and state() is None
    kept = model.init_state(1, 32)
    Generation(model, [[1, 5, 9]], GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=0)),
               state=kept).run()
    assert trims == [True]

