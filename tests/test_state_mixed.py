"""Window and hybrid states saved, restored and regrouped like KVState and LinearState (test_state_io):
state_dict round trips, concat/select_rows keep each row as it is alone, files restore through the
model's own (learned) feature maps; and the serve scheduler runs them: a job joining mid-batch changes
nobody, a prefix-cache hit equals a cold run, `gen serve`'s loader accepts a hybrid + window default."""
from __future__ import annotations

import pytest
import torch

from conftest import check_regrouping_copies_rows_exactly, check_rows_join_and_leave, greedy, tiny_model
from engine.api import LLM
from engine.attention import HybridState, WindowState
from engine.errors import StateMismatchError
from engine.sampling import SamplingParams
from engine.serve import PrefixCache, Scheduler
from engine.serve.scheduler import Job, Token
from engine.steps import Stepper
from engine.serve.schemas import CompletionRequest, parse

MIXES = {
    "window": dict(attention="linear", window=3, num_hidden_layers=2),
    "hybrid-hedgehog": dict(attention="hybrid", layer_attention=("linear", "softmax", "linear"), num_hidden_layers=3,
                            feature_map="hedgehog"),
    "hybrid-window-hedgehog": dict(attention="hybrid", layer_attention=("softmax", "linear", "linear"), window=3,
                                   feature_map="hedgehog", num_hidden_layers=3),
}
TRAINED = ("softmax", "linear", "hybrid")


def mixed_model(mix: str, seed: int = 1, **extra):
    return tiny_model(seed=seed, num_key_value_heads=2, trained_for=TRAINED, **MIXES[mix], **extra)


def expected_kind(mix):
    return WindowState if mix == "window" else HybridState


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("ids", [[1, 5], [1, 5, 9, 20, 3, 7]], ids=["inside-window", "past-window"])
def test_state_dict_round_trip_continues_identically(mix, ids):
    """A prompt shorter than the window (empty window slots masked) and a longer one (keys in S)."""
    model = mixed_model(mix)
    step = Stepper(model, "torch")
    prompt = torch.tensor([ids])
    a = model.init_state(1, 64)
    assert isinstance(a, expected_kind(mix))
    logits = step(prompt, a, last_only=True)[:, -1]
    sd = a.state_dict()
    assert sd["meta"]["slots"] == len(ids) and sd["meta"]["path"] == a.path
    fresh = model.init_state(1, 64)
    fresh.load_state_dict(sd)
    rebuilt = type(a).from_state_dict(sd, max_len=64, feature_map=model.feature_map())
    want = greedy(step, a.select_rows([0], max_len=64), logits, 12)
    assert greedy(step, fresh, logits, 12) == want
    assert greedy(step, rebuilt, logits, 12) == want
    assert greedy(step, a, logits, 12) == want


@pytest.mark.parametrize("mix", MIXES)
def test_load_state_dict_refuses_another_shape(mix):
    sd = mixed_model(mix).init_state(1, 32).state_dict()
    other = mixed_model("hybrid-hedgehog" if mix != "hybrid-hedgehog" else "window").init_state(1, 32)
    with pytest.raises(StateMismatchError, match="does not fit"):
        other.load_state_dict(sd)
    with pytest.raises(StateMismatchError, match="batch|sequences"):
        mixed_model(mix).init_state(2, 32).load_state_dict(sd)


@pytest.mark.parametrize("mix", MIXES)
def test_concat_and_select_rows_keep_every_row_as_it_is_alone(mix):
    """Rows prefilled alone (lengths 5, 2, 10 around a window of 3), joined into one batch at different
    times, dropped as they finish: each row's greedy tokens equal its solo run."""
    model = mixed_model(mix)
    step = Stepper(model, "torch")
    check_rows_join_and_leave(step, lambda max_len: model.init_state(1, max_len))


@pytest.mark.parametrize("mix", MIXES)
def test_select_rows_copies_scattered_rows_exactly(mix):
    model = mixed_model(mix)
    check_regrouping_copies_rows_exactly(Stepper(model, "torch"), lambda max_len: model.init_state(1, max_len))


@pytest.mark.parametrize("mix", ["window", "hybrid-window-hedgehog"])
def test_a_saved_state_file_continues_identically_on_the_models_own_maps(tmp_path, mix):
    """Saved to a file and loaded: linear layers run this model's learned maps (not a fresh map of the
    same name) in their own layers, and the continuation equals an uninterrupted run (a window state
    resumes on an LLM running the linear path)."""
    llm = LLM(mixed_model(mix), None, backend="torch")
    ids = [1, 5, 9, 20, 3, 7, 11, 2]
    want = llm.generate(ids, max_new_tokens=12, temperature=0, ignore_eos=True).ids
    llm.save_state(tmp_path / "s.safetensors", llm.prefill(ids))
    saved = llm.load_state(tmp_path / "s.safetensors")
    linear_part = saved.state.parts[-1] if isinstance(saved.state, HybridState) else saved.state
    assert linear_part.feature_map is llm.model.feature_map()
    assert llm.resume(saved, max_new_tokens=12, temperature=0, ignore_eos=True).run()[0].ids == want
    other = LLM(mixed_model("hybrid-hedgehog"), None, backend="torch")
    with pytest.raises(StateMismatchError, match="another model"):
        other.load_state(tmp_path / "s.safetensors")


# ---------------------------------------------------------------------- the serve scheduler on mixed states
def drive(llm, jobs_at: dict, cache=None, iterations: int = 80, **settings) -> dict:
    """Run a Scheduler by hand (no thread, no HTTP): jobs_at {iteration: [(key, ids, params, n)]}.
    Returns {key: token ids}. settings: more Scheduler arguments."""
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=8, cache=cache or PrefixCache(max_entries=0),
                      **settings)
    outs: dict = {}
    peak = 0
    for it in range(iterations):
        new = [Job(ids=ids, path=llm.attention, params=params, max_tokens=n, ignore_eos=True,
                   emit=lambda ev, k=key: outs.setdefault(k, []).append(ev.id if isinstance(ev, Token) else ev))
               for key, ids, params, n in jobs_at.get(it, [])]
        sched._iterate(new)
        peak = max(peak, sched.active)
        if not sched.active and it > max(jobs_at):
            break
    outs["peak"] = peak
    outs["stats"] = sched.cache.stats()
    return outs


@pytest.mark.parametrize("mix", MIXES)
def test_a_job_joining_mid_batch_changes_nobody(mix):
    llm = LLM(mixed_model(mix), None, backend="auto")
    long = ("long", [1, 5, 9, 20, 3, 7], SamplingParams(temperature=0.9, seed=7), 30)
    short = ("short", [1, 7], SamplingParams(temperature=0), 10)
    other = ("other", [4, 4, 4, 4, 1], SamplingParams(temperature=0.8, seed=3, top_k=20), 14)
    together = drive(llm, {0: [long], 4: [short], 6: [other]})
    assert together["peak"] == 3
    for job in (long, short, other):
        alone = drive(llm, {0: [job]})
        assert together[job[0]] == alone[job[0]], job[0]
        assert len(alone[job[0]]) == job[3]


@pytest.mark.parametrize("mix", MIXES)
def test_prefix_cache_hit_equals_a_cold_run(mix):
    llm = LLM(mixed_model(mix), None, backend="auto")
    first = ("first", [1, 5, 9, 20, 3, 7], SamplingParams(temperature=0), 6)
    more = ("more", [1, 5, 9, 20, 3, 7, 30, 31, 32], SamplingParams(temperature=0.9, seed=5), 12)
    same = ("same", [1, 5, 9, 20, 3, 7], SamplingParams(temperature=0), 6)
    cold = drive(llm, {0: [first], 10: [more], 25: [same]})
    warm = drive(llm, {0: [first], 10: [more], 25: [same]}, cache=PrefixCache(max_entries=8))
    assert warm["stats"]["hits"] == 2 and warm["stats"]["tokens_saved"] == 6 + 6
    for key in ("first", "more", "same"):
        assert warm[key] == cold[key], key
    assert cold["stats"]["hits"] == 0


def test_gen_serve_accepts_a_hybrid_window_default(tmp_path, small_tokenizer):
    """open_server (what `gen serve --model M` runs) serves a hybrid + window checkpoint as it is, and
    each request can still pick the softmax or linear path."""
    from models.weights import save_pretrained
    from engine.serve import open_server
    model = tiny_model(seed=3, vocab_size=small_tokenizer.vocab_size, max_position_embeddings=64,
                       num_hidden_layers=3, attention="hybrid", layer_attention=("softmax", "linear", "linear"),
                       window=3, trained_for=TRAINED)
    save_pretrained(model, str(tmp_path), tokenizer_path=small_tokenizer.path)
    server = open_server(str(tmp_path), max_batch=4)
    assert server.llm.attention == "hybrid"
    for path in (None, "softmax", "linear"):
        job = server.make_job(_Req(path), [1, 5, 9, 20], lambda ev: None, 8)
        assert job.path == (path or "hybrid")
    got = drive(server.llm, {0: [("a", [1, 5, 9, 20, 3, 7], SamplingParams(temperature=0), 8)]})
    assert len(got["a"]) == 8


def _Req(attention):
    """A completion request body as the server parses it (every field Server.make_job reads)."""
    body = {"prompt": [1, 5, 9, 20], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return parse(CompletionRequest, {**body, **({"attention": attention} if attention else {})})


@pytest.mark.parametrize("kind", ["softmax", "linear", "window", "hybrid-hedgehog"])
def test_concat_refuses_states_of_another_shape(kind):
    """Rows of different models never share a batch: a state of another shape (here heads of size 8
    instead of 16) is refused, whichever side it is on."""
    def state(heads):
        if kind in MIXES:
            return mixed_model(kind, num_attention_heads=heads).init_state(1, 16)
        return tiny_model(num_attention_heads=heads).init_state(1, 16, kind)
    a, b = state(4), state(8)
    for pair in ([a, b], [b, a], [a, a, b]):
        with pytest.raises(StateMismatchError, match="cannot share a batch"):
            type(a).concat(pair)
    assert type(a).concat([a, a]).batch_size == 2
