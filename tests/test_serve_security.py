"""Security by default (engine.serve.guard): a Host allow-list (DNS rebinding), foreign origins and
non-JSON bodies refused (a web page cannot drive the server), an API key when one is set, CORS only
when asked, no docs unless asked, and every error in OpenAI's shape, malformed input included."""
from __future__ import annotations

import json

import pytest

from test_serve_support import NAME, LiveServer, chat_model_dir, make_server, live  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from engine.serve import Policy   # noqa: E402

GOOD = {"model": NAME, "prompt": "the cat", "max_tokens": 2, "temperature": 0}
KEY = "sk-test-0123456789"


def openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    """Asserts `r` is `status` with OpenAI's error body (and `code`, when given); returns the error."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture(scope="module")
def keyed(small_model_dir):
    srv = LiveServer(make_server(small_model_dir), Policy(api_key=KEY, cors_origins=("http://localhost:3000",),
                                                          allow_hosts=("localhost", "127.0.0.1", "::1", "my.box")))
    yield srv
    srv.stop()


# ---------------------------------------------------------------------- who may call
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.7",
                                  "[127.0.0.1].evil.example:8000", "[::1]evil.example", "[::1]@evil.example", "[::1",
                                  "[localhost].evil.example",   # (a bracket's content was taken, the rest ignored)
                                  "localhost:80@evil.example", "localhost@evil.example", "localhost:x"])   # (after a colon)
def test_a_foreign_host_is_refused(live, host):
    err = openai_error(httpx.get(live.url + "/v1/models", headers={"Host": host}), 400, "host_not_allowed")
    assert "--allow-host" in err["message"]
    openai_error(httpx.post(live.url + "/v1/completions", json=GOOD, headers={"Host": host}), 400, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1", "[::1]:8000", "[::1]", "LOCALHOST."])
def test_loopback_hosts_are_answered(live, host):
    assert httpx.get(live.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_allow_host_adds_names_and_star_allows_any(small_model_dir, keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/v1/models", headers={"Host": "my.box:80", **auth}).status_code == 200
    openai_error(httpx.get(keyed.url + "/v1/models", headers={"Host": "other.box", **auth}), 400)
    srv = LiveServer(make_server(small_model_dir), Policy(allow_hosts=("*",)))
    try:
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "anything.example"}).status_code == 200
    finally:
        srv.stop()


def test_a_web_page_cannot_drive_the_server(live):
    """What a page can send without a CORS preflight (a text/plain or form POST), from a foreign
    Host (DNS rebinding) or a foreign Origin: refused, never a completion."""
    body = json.dumps(GOOD)
    for headers, status in (({"Host": "evil.example", "Origin": "http://evil.example"}, 400),
                            ({"Origin": "http://evil.example"}, 403),
                            ({}, 415)):
        for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = httpx.post(live.url + "/v1/completions", content=body, headers={"Content-Type": media, **headers})
            openai_error(r, status)
    openai_error(httpx.post(live.url + "/v1/completions", json=GOOD, headers={"Origin": "http://evil.example"}),
                 403, "origin_not_allowed")
    same = httpx.post(live.url + "/v1/completions", json=GOOD, headers={"Origin": live.url})   # its own page
    assert same.status_code == 200, same.text
    for scheme in ("evil", "file", "chrome-extension"):   # this Host under another scheme is not this page
        openai_error(httpx.post(live.url + "/v1/completions", json=GOOD,
                                headers={"Origin": live.url.replace("http", scheme, 1)}), 403, "origin_not_allowed")


def test_json_with_a_charset_is_json(live):
    r = httpx.post(live.url + "/v1/completions", content=json.dumps(GOOD),
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_the_api_key_is_asked_on_every_route_but_health(keyed):
    routes = [("GET", "/v1/models"), ("GET", f"/v1/models/{NAME}"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("GET", "/stats")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = httpx.request(method, keyed.url + path, json=GOOD if method == "POST" else None, headers=headers)
            openai_error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(keyed.url + "/health").status_code == 200
    c = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert c.completions.create(model=NAME, prompt="the cat", max_tokens=2).choices[0].finish_reason
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_gen_api_key_env_sets_the_key(monkeypatch):
    """`gen serve` reads GEN_API_KEY (click's envvar) into the Policy it serves with."""
    from click.testing import CliRunner

    import cli.serve
    from cli.main import main
    seen = {}
    monkeypatch.setattr(cli.serve, "check_listen", lambda host, port: None)   # no socket: the Policy is the subject
    monkeypatch.setattr(cli.serve, "open_server", lambda *a, **k: "server")
    monkeypatch.setattr(cli.serve, "run", lambda server, **k: seen.update(k))
    r = CliRunner().invoke(main, ["serve"], env={"GEN_API_KEY": "from-env"})
    assert r.exit_code == 0, r.output
    policy = seen["policy"]
    assert policy.api_key == "from-env" and policy.cors_origins == () and not policy.docs
    assert set(policy.allow_hosts) == {"localhost", "127.0.0.1", "::1"}
    r = CliRunner().invoke(main, ["serve", "--api-key", "flag", "--allow-host", "my.box", "--cors-origin",
                                  "http://a.example", "--docs", "--host", "192.168.5.5"], env={"GEN_API_KEY": "env"})
    assert r.exit_code == 0, r.output
    policy = seen["policy"]
    assert policy.api_key == "flag" and policy.docs and policy.cors_origins == ("http://a.example",)
    assert {"my.box", "192.168.5.5"} <= set(policy.allow_hosts)
    for bad in ("my.box:", "my.box:*", "a b", "x@y"):   # no name: "" in the list matched every malformed Host
        r = CliRunner().invoke(main, ["serve", "--allow-host", bad])
        assert r.exit_code == 2 and "not a host name" in r.output and "Traceback" not in r.output, r.output
        with pytest.raises(ValueError, match="not a host name"):
            Policy(allow_hosts=("localhost", bad))
    assert not Policy(allow_hosts=("*.example",)).host_allowed("localhost:80@evil.example")


# ---------------------------------------------------------------------- CORS
def test_without_cors_options_is_a_405_in_openais_shape(live):
    for headers in ({}, {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}):
        r = httpx.options(live.url + "/v1/chat/completions", headers=headers)
        openai_error(r, 405, "method_not_allowed")
        assert "access-control-allow-origin" not in r.headers


def test_with_cors_origin_preflights_are_answered_for_that_origin_only(keyed):
    pre = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=pre)   # no key: preflights carry none
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                 r.headers["access-control-allow-headers"].split(",")}
    # a page using an official OpenAI SDK (openai-node in a browser) asks for its own headers too
    sdk = ("authorization, content-type, x-stainless-os, x-stainless-retry-count, x-stainless-timeout, openai-project, "
           "user-agent")   # (Firefox and Safari preflight the SDK's User-Agent)
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=dict(pre, **{"Access-Control-Request-Headers": sdk}))
    assert r.status_code == 200, r.text
    assert {h.strip() for h in sdk.split(",")} <= {h.strip().lower() for h in
                                                  r.headers["access-control-allow-headers"].split(",")}
    for ask in ("x-stainless-os", "x-stainless-os, x-secret"):   # alone; beside one the server does not take
        r = httpx.options(keyed.url + "/v1/chat/completions", headers=dict(pre, **{"Access-Control-Request-Headers": ask}))
        assert (r.status_code == 200) == ("x-secret" not in ask), r.text
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=dict(pre, Origin="http://evil.example"))
    openai_error(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    # the allowed origin asking for a method or header the server does not take: Starlette's refusal
    # was plain text ("Disallowed CORS method"); now OpenAI's shape
    for ask, word in (({"Access-Control-Request-Method": "PUT"}, "method"),
                      ({"Access-Control-Request-Headers": "x-secret"}, "headers")):
        r = httpx.options(keyed.url + "/v1/chat/completions", headers=dict(pre, **ask))
        assert word in openai_error(r, 400, "cors_refused")["message"].lower()
        # Starlette's headers kept (what a browser's console reports from; Vary for caches)
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000" and "Origin" in r.headers["vary"]
    r = httpx.post(keyed.url + "/v1/completions", json=GOOD,
                   headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


# ---------------------------------------------------------------------- docs and OpenAI-shaped errors
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_are_off_unless_asked(live, small_model_dir, path):
    openai_error(httpx.get(live.url + path), 404)
    srv = LiveServer(make_server(small_model_dir), Policy(docs=True))
    try:
        assert httpx.get(srv.url + path).status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{NAME}", "/stats", "/"])
def test_every_get_route_answers_head_as_get(live, path):
    """HEAD (RFC 9110: a server that answers GET answers HEAD) gets the GET's status and headers without a
    body; it was a 405 everywhere but /health. A route that takes no GET answers HEAD as GET: 405."""
    get, head = httpx.get(live.url + path), httpx.head(live.url + path)
    assert get.status_code == head.status_code == 200 and get.content and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-length"] == get.headers["content-length"]
    assert httpx.head(live.url + "/v1/completions").status_code == 405


def test_a_post_to_a_get_route_is_405_whatever_its_body(live):
    """The body's media type (415) is checked only where a route takes the POST: elsewhere the router's
    405 (or 404) says what is wrong (text/plain to /health was a 415)."""
    r = httpx.post(live.url + "/health", content=b"x", headers={"Content-Type": "text/plain"})
    openai_error(r, 405, "method_not_allowed")
    openai_error(httpx.post(live.url + "/v1/nothing", content=b"x", headers={"Content-Type": "text/plain"}), 404)
    r = httpx.post(live.url + "/v1/completions", content=b"x", headers={"Content-Type": "text/plain"})
    openai_error(r, 415, "unsupported_media_type")


def test_unknown_route_and_wrong_method_are_openai_errors(live):
    openai_error(httpx.get(live.url + "/v1/nothing"), 404, "unknown_url")
    openai_error(httpx.post(live.url + "/v1/nothing", json={}), 404, "unknown_url")
    r = httpx.get(live.url + "/v1/completions")
    openai_error(r, 405, "method_not_allowed")
    assert "POST" in r.headers["allow"]
    openai_error(httpx.delete(live.url + "/v1/models"), 405, "method_not_allowed")


def test_a_validation_error_is_an_openai_error(small_model_dir):
    """FastAPI's own parameter validation (a 422) answers in OpenAI's shape too (a probe route: the
    server's routes parse their bodies themselves)."""
    srv = LiveServer(make_server(small_model_dir))
    try:
        @srv.app.get("/probe")
        async def probe(n: int):
            return {"n": n}
        assert httpx.get(srv.url + "/probe?n=3").json() == {"n": 3}
        openai_error(httpx.get(srv.url + "/probe?n=x"), 422)
    finally:
        srv.stop()


def deep(n: int) -> bytes:
    return b'{"model": "small", "prompt": "x", "user": ' + b"[" * n + b"]" * n + b"}"


MALFORMED = {   # id: (endpoint, raw body, param)
    "lone-surrogate-prompt": ("completions", b'{"model": "small", "prompt": "a \\ud800 b", "max_tokens": 2}', None),
    "lone-low-surrogate": ("completions", b'{"model": "small", "prompt": "\\uDC00", "max_tokens": 2}', None),
    "surrogate-in-a-key": ("completions", b'{"model": "small", "prompt": "x", "\\ud800": 1}', None),
    "surrogate-in-chat": ("chat/completions", b'{"model": "small", "messages": [{"role": "user", '
                                              b'"content": "hi \\ud800"}]}', None),
    "nested-5000": ("completions", deep(5000), None),
    "nested-100": ("completions", deep(100), None),
    "user-content-null": ("chat/completions", json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": None}]}).encode(), "messages[0].content"),
    "user-content-missing": ("chat/completions", json.dumps({"model": NAME, "messages": [
        {"role": "user"}]}).encode(), "messages[0].content"),
    "not-utf8": ("completions", b'{"model": "small", "prompt": "\xff\xfe"}', None),
    # Python's json refuses an integer literal past 4300 digits with a ValueError, not a JSONDecodeError
    "integer-of-5000-digits": ("completions", b'{"model": "small", "prompt": "x", "max_tokens": 1' + b"0" * 5000
                               + b"}", None),
    "text-part-not-a-string": ("chat/completions", json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(), "messages[0].content"),
    "text-part-without-text": ("chat/completions", json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}).encode(), "messages[0].content"),
    "part-without-type": ("chat/completions", json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}).encode(), "messages[0].content"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_is_a_400_not_a_500(chat_live, case):
    endpoint, body, param = MALFORMED[case]
    r = httpx.post(f"{chat_live.url}/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"})
    err = openai_error(r, 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(chat_live.url + "/v1/completions", json=GOOD, timeout=30)
    assert ok.status_code == 200


def test_a_valid_surrogate_pair_and_an_assistant_without_content_are_fine(chat_live):
    body = b'{"model": "small", "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}, ' \
           b'{"role": "assistant", "content": null}, {"role": "user", "content": "again"}], "max_tokens": 2}'
    r = httpx.post(chat_live.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", ["window", "sparse_keys"])
def test_a_window_or_sparse_keys_past_the_context_is_a_400_not_an_allocation(live, field):
    """Every row allocates its window (and sparse keys) whole: `window: 10**9` asked for terabytes (a
    500 after a failed allocation; 10**6, gigabytes that were granted)."""
    ctx = live.server.max_context
    run = {"attention": "linear", "window": 4}
    for asked in (ctx + 1, 10 ** 9, 2 ** 63):
        r = httpx.post(live.url + "/v1/completions", json={**GOOD, **run, field: asked}, timeout=30)
        err = openai_error(r, 400, "invalid_value")
        assert err["param"] == field and str(ctx) in err["message"]
    ok = httpx.post(live.url + "/v1/completions", json={**GOOD, "attention": "linear", "window": ctx}, timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("raw", [
    b"\x16\x03\x01\x02\x00 not http\r\n\r\n",                                      # TLS to a plain port
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 200000 + b"\r\n\r\n",  # past h11's limit
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",                                                      # no Host
], ids=["tls", "huge-header", "negative-length", "no-host"])
def test_a_request_that_is_not_http_gets_an_openai_400(live, raw):
    """h11's parse errors: uvicorn answered them in plain text."""
    import socket
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(raw)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:   # the unread rest of a huge header
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower(), answer[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_http_request"


def test_an_unexpected_error_closes_its_connection(small_model_dir):
    """A bug's 500: Starlette re-raises after the answer and uvicorn closes the connection, so the
    answer says `Connection: close` (a keep-alive client reusing it got a reset)."""
    srv = LiveServer(make_server(small_model_dir))
    try:
        @srv.app.get("/boom")
        async def boom():
            raise RuntimeError("boom")
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.get("/boom")
            assert openai_error(r, 500, "internal_error")["message"] == "RuntimeError: boom"
            assert r.headers["connection"] == "close"
            assert c.post("/v1/completions", json=GOOD).status_code == 200
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def chat_live(chat_model_dir):
    srv = LiveServer(make_server(chat_model_dir))
    yield srv
    srv.stop()


def test_a_text_too_long_for_max_prompt_is_refused_before_it_is_tokenized(chat_model_dir):
    """A prompt or messages of more non-space characters than max_prompt tokens can cover (no token
    spans more than the vocabulary's longest spelling) is a 400 without being tokenized or rendered:
    megabytes of it held Python's lock for seconds. At the bound, or with spaces beyond it, it is
    tokenized and judged by its tokens."""
    from engine.serve.errors import APIError
    from engine.serve.schemas import ChatRequest, CompletionRequest
    srv = make_server(chat_model_dir, max_prompt=64)
    tok = srv.llm.tokenizer
    bound = tok.chars_per_token()
    longest = max(tok.tok.get_vocab(), key=len)
    assert bound == len(longest) > 1
    # the bound holds: the longest spellings' own text needs a token per `bound` characters at least
    text = tok.decode([tok.token_to_id(longest)] * 50)
    assert len(tok.encode(text)) >= len(text.replace(" ", "")) / bound
    encoded = []
    real = srv.llm.encode
    srv.llm.encode = lambda text, *a, **k: encoded.append(len(text)) or real(text, *a, **k)
    at, spaced = "a" * (64 * bound), "a " * (64 * bound)
    for prompt in (at, spaced):   # tokenized: their tokens decide
        try:
            srv.completion_ids(CompletionRequest(model=NAME, prompt=prompt))
        except APIError:
            pass
    assert encoded == [len(at), len(spaced)]
    with pytest.raises(APIError) as e:
        srv.completion_ids(CompletionRequest(model=NAME, prompt=at + "a"))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and "characters" in str(e.value)
    assert encoded == [len(at), len(spaced)]   # the longer one never reached the tokenizer
    srv.llm.chat_template.encode = lambda *a, **k: pytest.fail("rendered")
    big = [{"role": "user", "content": "b" * (64 * bound // 2 + 1)}] * 2
    with pytest.raises(APIError) as e:
        srv.chat_ids(ChatRequest(model=NAME, messages=big))
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"


def test_a_tokenizer_that_may_fold_characters_has_no_bound(chat_model_dir):
    """A normalizer that can fold several characters into one (NFKC, a regex replace) leaves no
    characters-per-token bound: nothing is refused by its length alone."""
    from tokenizers import Regex, normalizers

    from models.bpe import BPETokenizer
    for norm, bounded in ((None, True), (normalizers.Sequence([normalizers.Prepend("_"),
                                                               normalizers.Replace(" ", "_")]), True),
                          (normalizers.NFKC(), False), (normalizers.Replace(Regex(" +"), " "), False),
                          (normalizers.Replace("ab", "x"), False)):
        tok = BPETokenizer.from_dir(chat_model_dir)
        tok.tok.normalizer = norm
        assert (tok.chars_per_token() is not None) == bounded, norm


@pytest.mark.parametrize("route", ["POST /v1/completions", "GET /health"])   # reads its body; answers first
@pytest.mark.parametrize("split", [False, True])
def test_a_body_that_breaks_after_its_answer_began_just_closes(live, caplog, split, route):
    """A chunked body gone bad (in the request's packet, or in a later one after the answer went out):
    the connection closes, with the 400 where no answer had begun, and no traceback is logged (h11
    refused to send a second answer: a LocalProtocolError out of the app task or data_received)."""
    import logging
    import socket
    import time
    head = route.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
           b"Transfer-Encoding: chunked\r\n\r\n"
    caplog.set_level(logging.ERROR)
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        if split:
            s.sendall(head + b"5\r\n{\"a\":\r\n")
            time.sleep(0.3)   # not a timing assertion: lets the app task start before the bad chunk
            s.sendall(b"zz\r\n")
        else:
            s.sendall(head + b"zz\r\n")
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    time.sleep(0.3)   # the server's side of the close, logged (if at all) after the socket ends
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], \
        [r.getMessage() for r in caplog.records]
    if not split or route.startswith("POST"):   # no answer had begun: the 400 goes out
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert httpx.post(live.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
