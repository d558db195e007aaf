"""OpenAI compatibility of the server, as clients and a peer's test suite see it: a stream's last
token in a chunk of its own and then a chunk carrying finish_reason, n choices sharing one prefill,
presence/frequency penalties and logit_bias (in both samplers, the API's and the server's), a
negative seed, top_p 0, response_format, system_fingerprint. Servers run in-process on 127.0.0.1."""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import InvalidArgumentError
from engine.sampling import Sampler, SamplingParams, apply_presence_frequency, filtered_logits
from engine.serve.batch_sampling import RowSampler, sample_rows

V = 40


# ---------------------------------------------------------------------- the samplers
def logits_rows(B=3, seed=0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 2


def run_both(params: SamplingParams, steps: list[torch.Tensor], prompt=(1, 2, 3)) -> list[list[list[int]]]:
    """The tokens the API's Sampler and the server's sample_rows draw from a sequence of (B, V) logits:
    [api tokens per step, server tokens per step]."""
    B = steps[0].shape[0]
    api = Sampler(params, B, V)
    api.observe(torch.tensor([list(prompt)] * B))
    rows = [RowSampler(params, list(prompt), V) for _ in range(B)]
    return [[api.sample(x).tolist() for x in steps], [sample_rows(rows, x) for x in steps]]


def reference_greedy(params: SamplingParams, steps: list[torch.Tensor]) -> list[list[int]]:
    """Greedy tokens under OpenAI's definitions, written out: logit + bias - p * (c > 0) - f * c over
    the tokens generated so far (not the prompt)."""
    B = steps[0].shape[0]
    counts = [[0] * V for _ in range(B)]
    out = []
    for x in steps:
        row = []
        for b in range(B):
            adj = [float(x[b, j]) + dict(params.logit_bias).get(j, 0.0)
                   - params.presence_penalty * (counts[b][j] > 0) - params.frequency_penalty * counts[b][j]
                   for j in range(V)]
            t = max(range(V), key=lambda j: adj[j])
            counts[b][t] += 1
            row.append(t)
        out.append(row)
    return out


def test_presence_and_frequency_penalties_follow_openais_formula():
    x, counts = logits_rows(), torch.zeros(3, V, dtype=torch.int32)
    counts[0, 5], counts[1, 5], counts[1, 7] = 3, 1, 2
    got = apply_presence_frequency(x, counts, 0.5, 0.25)
    want = x.clone()
    want[0, 5] -= 0.5 + 0.75
    want[1, 5] -= 0.5 + 0.25
    want[1, 7] -= 0.5 + 0.5
    assert torch.allclose(got, want)


@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                                dict(presence_penalty=1.0, frequency_penalty=0.5), dict(frequency_penalty=-1.0),
                                dict(logit_bias={3: 100.0}), dict(logit_bias={0: -100.0, 9: 4.0}, frequency_penalty=1)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_greedy_with_penalties_and_bias_equals_the_written_out_rule_in_both_samplers(kw):
    """Constant logits for 12 steps: without penalties the same token every step; with them the
    generated tokens are penalized as OpenAI defines (the prompt's are not), in both samplers."""
    x = logits_rows()
    x[:, 1] = x.max() + 1.0        # a prompt token is the best: a penalty on it would show
    params = SamplingParams(temperature=0, **kw)
    steps = [x] * 12
    want = reference_greedy(params, steps)
    api, server = run_both(params, steps)
    print(kw, want)
    assert api == want and server == want
    if kw.get("frequency_penalty", 0) > 0 or kw.get("presence_penalty", 0) > 0:
        assert want != [[1] * 3] * 12   # the penalty moved the choice off the (unpenalized) prompt token


def test_penalties_and_bias_in_a_sampled_row_keep_the_server_row_independent_of_its_batch():
    p = SamplingParams(temperature=1.0, seed=11, frequency_penalty=1.5, logit_bias={4: 5.0})
    steps = [logits_rows(B=3, seed=s) for s in range(8)]
    solo = RowSampler(p, [1], V)
    alone = [sample_rows([solo], x[1:2]) for x in steps]
    rows = [RowSampler(SamplingParams(temperature=0.7, seed=3), [1], V), RowSampler(p, [1], V),
            RowSampler(SamplingParams(temperature=0), [1], V)]
    batched = [sample_rows(rows, x)[1:2] for x in steps]
    assert batched == alone


@pytest.mark.parametrize("kw,name", [(dict(presence_penalty=2.5), "presence_penalty"),
                                     (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                     (dict(logit_bias={1: 101.0}), "logit_bias"),
                                     (dict(logit_bias={-1: 1.0}), "logit_bias"),
                                     (dict(logit_bias={"a": 1.0}), "logit_bias")])
def test_bad_penalties_and_biases_are_refused(kw, name):
    with pytest.raises(InvalidArgumentError, match=name):
        SamplingParams(**kw)


def test_a_bias_outside_the_vocabulary_is_refused_by_the_api_sampler():
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias={V: 1.0}), 1, V)


def test_filtered_logits_applies_the_bias_before_the_filters():
    x = logits_rows(B=1)
    low = int(x.argmin())
    f = filtered_logits(x, SamplingParams(temperature=1.0, top_k=1, logit_bias={low: 100.0}))
    assert torch.isfinite(f).sum() == 1 and torch.isfinite(f[0, low])


# ---------------------------------------------------------------------- through the server
httpx = pytest.importorskip("httpx")
from test_serve_support import NAME, LiveServer, chat_model_dir, client, make_server   # noqa: E402,F401
from engine.serve.app import ChatFormat, Choice, CompletionFormat   # noqa: E402
from engine.serve.scheduler import Token   # noqa: E402
from engine.serve.schemas import ChatRequest, CompletionRequest   # noqa: E402


@pytest.fixture(scope="module")
def live(small_model_dir):
    srv = LiveServer(make_server(small_model_dir, max_batch=8))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chat_live(chat_model_dir):
    srv = LiveServer(make_server(chat_model_dir, max_batch=8))
    yield srv
    srv.stop()


def complete(live, **kw) -> dict:
    r = httpx.post(live.url + "/v1/completions", json=dict({"model": NAME, "prompt": "the cat"}, **kw), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat(live, **kw) -> dict:
    body = dict({"model": NAME, "messages": [{"role": "user", "content": "hello there"}]}, **kw)
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(live, endpoint: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{live.url}/v1/{endpoint}", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_streams_finish_reason_rides_in_a_chunk_of_its_own(live, chat_live):
    """The last token's text goes in its own chunk; the chunk with finish_reason carries no text
    (an empty delta in chat), as OpenAI sends them: a client that stops reading at finish_reason
    has the whole text."""
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = complete(live, **body)["choices"][0]
    chunks = stream_chunks(live, "completions", body)
    upto = next(i for i, c in enumerate(chunks) if c["choices"][0]["finish_reason"] is not None)
    assert upto == len(chunks) - 1 and chunks[upto]["choices"][0]["text"] == ""
    assert chunks[upto]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks[:upto]) == whole["text"]

    body = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    whole = chat(chat_live, **body)["choices"][0]
    chunks = stream_chunks(chat_live, "chat/completions", body)
    end = chunks[-1]["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == whole["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == whole["message"]["content"]


def test_n_choices_share_one_prefill_and_choice_i_uses_seed_plus_i(live):
    body = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    singles = [complete(live, seed=40 + i, **body)["choices"][0]["text"] for i in range(3)]
    before = live.scheduler.cache.prefill_tokens
    r = complete(live, seed=40, n=3, **body)
    prefilled = live.scheduler.cache.prefill_tokens - before
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == singles      # choice 0 is the n = 1 answer, choice i seed + i
    assert r["usage"]["completion_tokens"] == 24 and r["usage"]["prompt_tokens"] == prefilled  # the prompt once
    greedy = complete(live, n=2, prompt="the cat sat", max_tokens=5, temperature=0)["choices"]
    assert greedy[0]["text"] == greedy[1]["text"]


def test_n_choices_stream_each_to_its_own_finish(chat_live):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            "temperature": 1.0, "seed": 7, "n": 2, "ignore_eos": True}
    whole = chat(chat_live, **body)
    chunks = stream_chunks(chat_live, "chat/completions", body)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert "".join(m["delta"].get("content", "") for m in mine) == whole["choices"][i]["message"]["content"]


def test_penalties_and_bias_through_the_server_equal_the_api(live, small_model_dir):
    from engine.api import load
    llm = load(str(small_model_dir))
    for kw in (dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=0.3)):
        api = llm.generate("the cat", max_new_tokens=10, temperature=0, ignore_eos=True, **kw).text
        assert complete(live, max_tokens=10, temperature=0, ignore_eos=True, **kw)["choices"][0]["text"] == api
    greedy_ids = llm.generate("the cat", max_new_tokens=4, temperature=0, ignore_eos=True).ids
    banned = complete(live, max_tokens=1, temperature=0, logprobs=0, logit_bias={str(greedy_ids[0]): -100})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != llm.tokenizer.decode_continuation([greedy_ids[0]])
    forced = llm.tokenizer.encode(" dog")[-1]
    r = complete(live, prompt=[5, 6], max_tokens=4, temperature=0.9, seed=1, ignore_eos=True,
                 logit_bias={str(forced): 100})
    assert r["choices"][0]["text"] == llm.tokenizer.decode([5, 6] + [forced] * 4)[len(llm.tokenizer.decode([5, 6])):]


def test_top_p_zero_is_greedy_and_a_negative_seed_is_random(live):
    greedy = complete(live, max_tokens=6, temperature=0, ignore_eos=True)["choices"][0]["text"]
    assert complete(live, max_tokens=6, temperature=1.5, top_p=0, ignore_eos=True)["choices"][0]["text"] == greedy
    assert complete(live, max_tokens=3, temperature=1.0, seed=-1)["choices"][0]["finish_reason"] is not None
    from engine.serve.server import choice_seeds
    assert choice_seeds(-1, 1) == [None] and choice_seeds(None, 1) == [None]
    base = choice_seeds(-1, 3)
    assert base == [base[0], base[0] + 1, base[0] + 2] or base[0] >= 2 ** 63 - 2
    assert choice_seeds(2 ** 63 - 1, 2) == [2 ** 63 - 1, 0]


def test_response_format_text_is_accepted_and_structured_output_is_refused_by_name(chat_live):
    answer = chat(chat_live, max_tokens=2, response_format={"type": "text"})
    assert answer["choices"][0]["message"]["content"] is not None
    for kind in ("json_object", "json_schema"):
        fmt = {"type": kind} if kind == "json_object" else {"type": kind, "json_schema": {"name": "x", "schema": {}}}
        r = httpx.post(chat_live.url + "/v1/chat/completions", timeout=30, json={
            "model": NAME, "messages": [{"role": "user", "content": "x"}], "response_format": fmt})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "response_format" and kind in err["message"]
        assert "not supported" in err["message"]


@pytest.mark.parametrize("bias,what", [({"abc": 1}, "token ids"), ({"1": 200}, "[-100, 100]"),
                                       ({str(10 ** 6): 1}, "vocabulary")], ids=["key", "value", "vocab"])
def test_a_bad_logit_bias_is_a_400_naming_it(live, bias, what):
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "logit_bias": bias}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias" and what in err["message"], err


@pytest.mark.parametrize("content", ["", " \n "], ids=["empty", "blank"])
def test_a_blank_last_user_message_is_a_400_as_a_blank_prompt_is(chat_live, content):
    r = httpx.post(chat_live.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "last user message is empty" in err["message"], err
    ok = httpx.post(chat_live.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "max_tokens": 2, "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text


def test_more_messages_than_the_prompt_can_hold_are_refused_before_rendering(chat_live, monkeypatch):
    """A message takes at least one token: more of them than --max-prompt is a 400 before the template
    renders them (100,000 one-letter messages took seconds of the server's CPU to reach the same 400)."""
    server = chat_live.server
    monkeypatch.setattr(type(server.llm.chat_template), "encode", lambda *a, **k: pytest.fail("rendered them"))
    n = server.max_prompt + 1
    r = httpx.post(chat_live.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}] * n})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and f"are {n}," in err["message"], err


def test_system_fingerprint_is_sent_and_stable(live, chat_live):
    a = complete(live, max_tokens=2)
    chunks = stream_chunks(live, "completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
    assert a["system_fingerprint"].startswith("fp_")
    assert {c["system_fingerprint"] for c in chunks} == {a["system_fingerprint"]}
    res = client(chat_live).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
    assert res.system_fingerprint and res.system_fingerprint.startswith("fp_")


def test_the_fingerprint_is_the_requests_own_run(live):
    """A request's attention options decide its tokens as the model does: another run, another
    system_fingerprint (streamed too); the server's own run asked for by name, the server's."""
    own = complete(live, max_tokens=2)["system_fingerprint"]
    assert complete(live, max_tokens=2, attention="softmax")["system_fingerprint"] == own
    linear = complete(live, max_tokens=2, attention="linear")["system_fingerprint"]
    window = complete(live, max_tokens=2, attention="linear", window=4)["system_fingerprint"]
    hybrid = complete(live, max_tokens=2, attention="hybrid", softmax_layers="0")["system_fingerprint"]
    assert len({own, linear, window, hybrid}) == 4
    assert complete(live, max_tokens=2, attention="linear")["system_fingerprint"] == linear
    chunks = stream_chunks(live, "completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "attention": "linear"})
    assert {c["system_fingerprint"] for c in chunks} == {linear}


def test_null_optional_fields_take_their_defaults(live, chat_live):
    """OpenAI types its optional fields `T | null`: null is the default, not a 400."""
    nulls = dict.fromkeys(("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "echo", "best_of",
                           "top_k", "min_p", "repetition_penalty", "ignore_eos", "stream"))
    a = complete(live, max_tokens=3, seed=5, **nulls)
    assert a["choices"][0]["text"] == complete(live, max_tokens=3, seed=5)["choices"][0]["text"]
    b = chat(chat_live, max_tokens=3, temperature=0, logprobs=None, top_logprobs=None)
    assert b["choices"][0]["logprobs"] is None
    chunks = stream_chunks(chat_live, "chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2, "stream_options": {"include_usage": None}})
    assert all(c["usage"] is None for c in chunks)
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": None}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"   # a required field stays required


def test_a_developer_message_is_the_system_message_and_text_parts_are_lines(chat_live):
    """OpenAI's `developer` role is its newer name for `system`: a template that does not name it (ChatML)
    gets a system message (transformers would render an unknown turn after the default system prompt).
    Text parts of a content list are joined a line each, as vLLM joins them."""
    def reply(messages):
        r = chat(chat_live, messages=messages, max_tokens=4, temperature=0)
        return r["usage"]["prompt_tokens"], r["choices"][0]["message"]["content"]
    user = {"role": "user", "content": "hello there"}
    assert reply([{"role": "developer", "content": "Be brief."}, user]) == \
        reply([{"role": "system", "content": "Be brief."}, user])
    parts = {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}
    assert reply([parts]) == reply([{"role": "user", "content": "hello\nthere"}])


def test_text_offset_counts_the_tokens_while_a_stop_string_holds_text_back(live):
    """text_offset is where each token's text starts in the choice's text. A stop string that begins to
    match holds the released text back for a few tokens (then lets it go when it does not go on); the
    offsets must not lag with it."""
    body = dict(prompt="the cat", max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    plain = complete(live, **body)["choices"][0]
    lp, text = plain["logprobs"], plain["text"]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    for tok, off in zip(lp["tokens"], offsets):
        if not tok.startswith("bytes:"):
            assert text[off:off + len(tok)] == tok, (tok, off, text)
    start = offsets[2]
    held = text[start:start + 8] + "\x01"     # matches for 8 characters, then never
    for got in (complete(live, stop=held, **body)["choices"][0],
                [c for c in stream_chunks(live, "completions", dict(body, model=NAME, stop=held)) if c["choices"]]):
        if isinstance(got, list):   # the stream's chunks, joined
            got = {"text": "".join(c["choices"][0]["text"] for c in got),
                   "logprobs": {"text_offset": [o for c in got if c["choices"][0]["logprobs"]
                                                for o in c["choices"][0]["logprobs"]["text_offset"]]}}
        assert got["text"] == text
        assert got["logprobs"]["text_offset"] == offsets


def byte_token_ids(server, values=(0xE4, 0xE5)) -> list[int]:
    """The ids of tokens that stand for one byte each (of a character's first byte: never whole text)."""
    found = {server.token_bytes(i): i for i in range(server.llm.model.config.vocab_size)}
    return [found[bytes([v])] for v in values]


def test_a_token_holding_part_of_a_character_shows_its_own_bytes(live, chat_live):
    """Such tokens are "bytes:\\xNN" (OpenAI's form) with their own bytes in chat's `bytes`, not U+FFFD's
    three: two of them are two keys of a completion's top_logprobs (they collided as one U+FFFD). The
    tokens through the server (logit_bias picks them), their alternatives as the formats lay them out."""
    for srv, endpoint in ((live, "completions"), (chat_live, "chat/completions")):
        e4, e5 = byte_token_ids(srv.server)
        ev = Token(e4, "", None, -0.5, [(e4, -0.5), (e5, -1.5)])
        if endpoint == "completions":
            lp = complete(srv, prompt="the cat", logprobs=1, max_tokens=2, temperature=0,
                          logit_bias={str(e4): 100})["choices"][0]["logprobs"]
            assert lp["tokens"] == ["bytes:\\xe4"] * 2
            piece = CompletionFormat(srv.server, CompletionRequest(prompt="x", logprobs=2))._piece(ev, Choice())
            assert piece["top_logprobs"] == [{"bytes:\\xe4": -0.5, "bytes:\\xe5": -1.5}]
        else:
            content = chat(srv, logprobs=True, max_tokens=2, temperature=0,
                           logit_bias={str(e4): 100})["choices"][0]["logprobs"]["content"]
            assert [(t["token"], t["bytes"]) for t in content] == [("bytes:\\xe4", [0xE4])] * 2
            req = ChatRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2)
            piece = ChatFormat(srv.server, req)._piece(ev, Choice())
            assert [(t["token"], t["bytes"]) for t in piece["top_logprobs"]] == [("bytes:\\xe4", [0xE4]),
                                                                               ("bytes:\\xe5", [0xE5])]


def test_a_completions_top_logprobs_holds_the_sampled_token(live):
    """OpenAI: up to logprobs + 1 entries, the sampled token's among them (logprobs 0: it alone)."""
    for logprobs, temperature in ((0, 0), (1, 2.0)):
        lp = complete(live, max_tokens=12, temperature=temperature, seed=1, ignore_eos=True,
                      logprobs=logprobs)["choices"][0]["logprobs"]
        for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[tok] == chosen and len(top) <= logprobs + 1


def test_a_request_for_n_choices_takes_n_places_and_is_cancelled_whole(live, small_model_dir):
    from engine.serve.scheduler import Full, Job, Scheduler
    llm = live.server.llm
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=3, max_queue=0)   # not started: all queue

    def job(**kw):
        return Job(ids=[1, 2], path="linear", params=SamplingParams(temperature=0), max_tokens=2, emit=print, **kw)
    group = job()
    group.copies = [job(index=1), job(index=2)]
    sched.submit(group)
    assert sched.queued_rows == 3
    with pytest.raises(Full):
        sched.submit(job())
    group.cancel()
    assert all(j.cancelled for j in group.group) and not sched.pending
    bigger = job()
    bigger.copies = [job(index=i) for i in range(1, 4)]
    with pytest.raises(ValueError, match="max_batch"):   # 4 rows would never fit in 3
        sched.submit(bigger)
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "n": 9}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-batch" in r.json()["error"]["message"]


def test_served_model_names_and_a_request_without_model(small_model_dir):
    """--served-model-name: every name is accepted as `model`, the first is reported; a request with no
    `model` gets the served model (as vLLM and llama-server take it); any other name is still a 404."""
    srv = LiveServer(make_server(small_model_dir, aliases=("gpt-3.5-turbo", "HuggingFaceTB/SmolLM2-135M")))
    try:
        c = client(srv)   # the openai client's models.retrieve
        for name in (NAME, "gpt-3.5-turbo", "HuggingFaceTB/SmolLM2-135M"):   # a name with a slash too
            assert c.models.retrieve(name).id == name
        r = httpx.get(srv.url + "/v1/models/HuggingFaceTB/other")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for model in ("gpt-3.5-turbo", NAME, None):
            body = {"prompt": "x", "max_tokens": 2} | ({"model": model} if model else {})
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["model"] == NAME, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == \
            [NAME, "gpt-3.5-turbo", "HuggingFaceTB/SmolLM2-135M"]
    finally:
        srv.stop()
