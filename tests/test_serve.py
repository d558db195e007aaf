"""gen serve through the official openai client and raw HTTP: endpoints, SSE framing, usage, errors."""
from __future__ import annotations

import json

import pytest

from test_serve_support import NAME, LiveServer, chat_model_dir, client, make_server, live  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def chat_live(chat_model_dir):
    srv = LiveServer(make_server(chat_model_dir))
    yield srv
    srv.stop()


def test_models_and_health(live):
    c = client(live)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_completion_stream_equals_non_stream_and_usage_counts(live, small_tokenizer, path):
    c = client(live)
    prompt = "the cat sat on"
    args = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"attention": path})
    whole = c.completions.create(**args)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    n_prompt = len(small_tokenizer.encode(prompt, bos=True))
    for usage in (whole.usage, chunks[-1].usage):
        assert usage.prompt_tokens == n_prompt
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == 12


def test_completion_matches_the_python_api(live, small_model_dir):
    from engine.api import load
    llm = load(str(small_model_dir), backend="torch")
    want = llm.generate("a happy girl", max_new_tokens=10, temperature=0)
    got = client(live).completions.create(model=NAME, prompt="a happy girl", max_tokens=10, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.ids)


def test_token_id_prompt_and_logprobs(live, small_tokenizer):
    ids = small_tokenizer.encode("the dog ran", bos=True)
    r = client(live).completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 2
        assert chosen >= max(top.values()) - 1e-5   # greedy: no alternative is more likely than the chosen one
    assert r.usage.prompt_tokens == len(ids)


def test_sse_framing(live):
    body = {"model": NAME, "prompt": "the sun", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    objects = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert {o["object"] for o in objects} == {"text_completion"}
    assert objects[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_stream_and_non_stream(chat_live):
    c = client(chat_live)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    whole = c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.object == "chat.completion" and chunks[1].object == "chat.completion.chunk"
    llm = chat_live.server.llm
    ids = llm.chat_template.encode(llm.tokenizer, messages, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_equals_llm_chat(chat_live):
    messages = [{"role": "user", "content": "hello there"}]
    want = chat_live.server.llm.chat(messages, max_new_tokens=10, temperature=0)
    "".join(want)
    got = client(chat_live).chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.result.text
    assert got.choices[0].finish_reason == want.result.finish_reason


def test_chat_logprobs_and_the_turn_end_ends_a_reply(chat_live):
    r = client(chat_live).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    end = chat_live.server.llm.tokenizer.token_to_id("<|im_end|>")
    assert end in chat_live.server._chat_eos


GOOD = {"model": NAME, "prompt": "the cat", "max_tokens": 3, "temperature": 0}
BAD = {   # id: (endpoint, body (bytes: sent raw), status, param)
    "malformed-json": ("completions", b'{"model": "small", "prompt": ', 400, None),
    # a surrogate's UTF-8-shaped bytes (ED A0 80): json.loads of the bytes passed them on (a 500 rendering the
    # 404 that names the model, or a stop string that never matches)
    "surrogate-bytes-in-model": ("completions", b'{"prompt": "hi", "max_tokens": 2, "model": "x\xed\xa0\x80"}', 400, None),
    "surrogate-bytes-in-stop": ("completions", b'{"prompt": "hi", "max_tokens": 2, "stop": "\xed\xa0\x80"}', 400, None),
    "logit-bias-superscript-key": ("completions", dict(GOOD, logit_bias={"\u00b2": 5}), 400, "logit_bias"),   # a 500
    "logit-bias-5000-digit-key": ("completions", dict(GOOD, logit_bias={"9" * 5000: 5}), 400, "logit_bias"),   # a 500
    "not-an-object": ("completions", [1, 2], 400, None),
    "max_tokens-string": ("completions", dict(GOOD, max_tokens="5"), 400, "max_tokens"),
    "max_tokens-negative": ("completions", dict(GOOD, max_tokens=-1), 400, "max_tokens"),
    "temperature-string": ("completions", dict(GOOD, temperature="hot"), 400, "temperature"),
    "temperature-nan": ("completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "unknown-attention": ("completions", dict(GOOD, attention="flash"), 400, "attention"),
    "hybrid-without-softmax-layers": ("completions", dict(GOOD, attention="hybrid"), 400, "attention"),
    "unknown-field": ("completions", dict(GOOD, frobnicate=1), 400, "frobnicate"),
    "n-over-max": ("completions", dict(GOOD, n=17), 400, "n"),
    "n-zero": ("completions", dict(GOOD, n=0), 400, "n"),
    "token-out-of-vocab": ("completions", dict(GOOD, prompt=[1, 10 ** 6]), 400, "prompt"),
    "empty-prompt": ("completions", dict(GOOD, prompt=""), 400, "prompt"),
    "blank-prompt": ("completions", dict(GOOD, prompt="   "), 400, "prompt"),
    "stop-not-string": ("completions", dict(GOOD, stop=[1]), 400, "stop"),
    # checks across fields named no field (param null); each names the one to change
    "stop-five": ("completions", dict(GOOD, stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    "stop-empty": ("completions", dict(GOOD, stop=""), 400, "stop"),
    "echo": ("completions", dict(GOOD, echo=True), 400, "echo"),
    "best-of": ("completions", dict(GOOD, best_of=2), 400, "best_of"),
    "stream-options-without-stream": ("completions", dict(GOOD, stream_options={"include_usage": True}), 400,
                                      "stream_options"),
    "prompt-too-long": ("completions", dict(GOOD, prompt=list(range(1, 80))), 400, "prompt"),
    "unknown-model": ("completions", dict(GOOD, model="gpt-9"), 404, "model"),
    "model-not-a-string": ("completions", dict(GOOD, model=7), 400, "model"),
    "chat-no-messages": ("chat/completions", {"model": NAME}, 400, "messages"),
    "chat-bad-role": ("chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]},
                      400, "messages[0].role"),
    "chat-message-without-role": ("chat/completions", {"model": NAME, "messages": [{}]}, 400, "messages[0].role"),
    "chat-top-logprobs-alone": ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                     "top_logprobs": 2}, 400, "top_logprobs"),
    "chat-unknown-model": ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                           404, "model"),
}


def test_a_number_that_is_not_finite_is_named_so(live):
    """NaN passes no range check: it was refused as 'less than or equal to 2', which 0.5 also is."""
    for field in ("temperature", "frequency_penalty", "top_p"):
        r = httpx.post(f"{live.url}/v1/completions", content=f'{{"prompt": "hi", "{field}": NaN}}'.encode(),
                       headers={"content-type": "application/json"}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and "finite number" in err["message"], err


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_its_error_and_the_next_request_succeeds(live, case):
    endpoint, body, status, param = BAD[case]
    url = f"{live.url}/v1/{endpoint}"
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30) \
        if isinstance(body, bytes) else httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    ok = httpx.post(live.url + "/v1/completions", json=GOOD, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_unknown_model_through_the_client(live):
    with pytest.raises(openai.NotFoundError) as e:
        client(live).completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_chat_without_a_template_is_a_400(live):
    with pytest.raises(openai.BadRequestError) as e:
        client(live).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("host", ["127.0.0.1", "192.0.2.1", "no-such-host.invalid"], ids=["in-use", "not-ours", "unknown"])
def test_gen_serve_that_cannot_listen_says_so_in_one_line_before_loading(host, monkeypatch):
    """A port in use, an address this machine does not have (TEST-NET-1), an unknown name: one line and
    exit 2 before the model loads (it loaded the model, then printed uvicorn's log and exited 3)."""
    import socket
    from click.testing import CliRunner
    import cli.serve
    from cli.main import main
    monkeypatch.setattr(cli.serve, "open_server", lambda *a, **k: pytest.fail("loaded the model first"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", "--model", "tiny", "--host", host, "--port", str(port)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert {"127.0.0.1": f"cannot listen on 127.0.0.1:{port}: the address is in use",
            "192.0.2.1": f"cannot listen on 192.0.2.1:{port}: this machine has no such address",
            "no-such-host.invalid": "--host no-such-host.invalid: "}[host] in r.output, r.output


def test_every_address_a_host_may_name_passes_the_listen_check():
    """--host '' (every address, as asyncio reads it), 0.0.0.0, localhost on a free port: no refusal."""
    import socket
    from engine.serve.connections import check_listen
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for host in ("", "0.0.0.0", "localhost", "127.0.0.1"):
        check_listen(host, port)


def test_gen_serve_refuses_bad_arguments_in_one_line(monkeypatch):
    from click.testing import CliRunner
    import cli.serve
    from cli.main import main
    monkeypatch.setattr(cli.serve, "check_listen", lambda host, port: None)   # port 8000 may be taken here
    for args, what in ((["--model", "no-such-model"], "unknown model"), (["--max-batch", "0"], "--max-batch"),
                       (["--port", "0"], "--port"), (["--api-key", " spaced "], "--api-key must be printable ASCII"),
                       (["--api-key", "cl\u00e9"], "--api-key must be printable ASCII")):
        r = CliRunner().invoke(main, ["serve", *args])
        assert r.exit_code == 2, r.output
        assert what in r.output and "Traceback" not in r.output
