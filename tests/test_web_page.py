"""gen serve's page in a real browser: Debian's chromium, headless, driven by Selenium (skipped with
the reason when chromium, chromedriver or selenium is missing; the tests of what the page is served
run without one). The server is `gen serve --model tiny`
in a subprocess on a free loopback port (scripts/web_screenshot.py's helpers)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import web_screenshot as web  # noqa: E402

WHY = web.missing()
browser = pytest.mark.skipif(WHY is not None, reason=f"the page test needs a browser: {WHY}")

PROMPT = "Once upon a time"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def page():
    if WHY is not None:
        pytest.skip(f"the page test needs a browser: {WHY}")
    with web.serving("--model", "tiny") as url:
        driver = web.browser(1280, 900)
        try:
            yield url, driver
        finally:
            driver.quit()


def panes(driver) -> list[dict]:
    """Each pane's configuration, status, shown answer (the last assistant bubble's text), readouts and
    the points the page charted (from the server's `gen` fields)."""
    return driver.execute_script("""
        return window.gen.panes.map(p => {
          const answers = p.el.querySelectorAll('.msg.assistant');
          const value = name => p.el.querySelector(`[data-stat="${name}"]`).dataset.value;
          return {config: p.select.value, status: p.el.dataset.status,
                  shown: answers.length ? answers[answers.length - 1].textContent : null,
                  state_bytes: value('state_bytes'), context: value('context'),
                  points: p.points, stats: p.stats};
        });""")


def test_two_panes_stream_the_apis_greedy_text_with_the_servers_numbers(page):
    import engine
    url, driver = page
    web.open_page(driver, url, panes=("softmax", "linear"), max_tokens=MAX_TOKENS)
    web.send(driver, PROMPT)
    web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
    got = {p["config"]: p for p in panes(driver)}
    for path in ("softmax", "linear"):
        want = engine.load("tiny", attention=path).generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0)
        p = got[path]
        assert p["shown"] == want.text, path
        last = p["stats"]
        assert last["attention"] == path and last["completion_tokens"] == len(want.ids)
        assert int(p["context"]) == last["prompt_tokens"] + len(want.ids) == p["points"][-1]["context"]
        assert int(p["state_bytes"]) == last["state_bytes"] == p["points"][-1]["state_bytes"]
    soft = [q["state_bytes"] for q in got["softmax"]["points"]]
    lin = [q["state_bytes"] for q in got["linear"]["points"]]
    assert len(soft) > 10 and soft == sorted(set(soft))     # the KV row grows with every token
    assert len(lin) > 10 and len(set(lin)) == 1             # the linear row does not
    # the live chart drew every pane
    assert len(driver.find_elements("css selector", "#live-bytes polyline")) == 2


LOSSES = [0.1, 0.5, 0.05, 0.3, 0.2, 0.4]   # auto:2 keeps softmax on layers 1 and 5


@pytest.fixture(scope="module")
def ranked_dir(tmp_path_factory):
    """tiny's weights with per-layer transfer losses recorded (what `auto:K` ranks by; tiny itself has
    none): a copy of its config.json beside links to its weights and tokenizer."""
    import json
    from models.registry import REGISTRY
    tiny, d = REGISTRY["tiny"], tmp_path_factory.mktemp("ranked")
    cfg = json.loads((tiny / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, transfer_loss=LOSSES)))
    for name in ("model.safetensors", "tokenizer.model"):
        (d / name).symlink_to(tiny / name)
    return d


@pytest.fixture(scope="module")
def ranked(ranked_dir, page):
    """`gen serve` on ranked_dir, and the module's browser."""
    with web.serving("--model", str(ranked_dir)) as url:
        yield url, page[1], ranked_dir


def request_fields(conf: dict, number=None) -> dict:
    """The run fields a pane bound to `conf` sends (app.js, Pane.runFields), its number filled in."""
    out = {k: conf[k] for k in ("attention", "softmax_layers", "window") if conf.get(k)}
    if conf.get("param"):
        p = conf["param"]
        out[p["field"]] = p["format"].replace("{}", str(number)) if p["format"] not in (None, "list") else number
    return out


@pytest.mark.filterwarnings("ignore:these weights were trained")
def test_the_configurations_taking_a_number_ask_for_the_runs_the_api_loads(ranked_dir):
    """No browser: what /web/config offers, as the page turns it into a request, is the run
    engine.load gives for the same options; where the model cannot run one, the server says why."""
    import engine
    from engine.serve import Server
    from engine.serve.errors import APIError
    from engine.serve.page import page_config
    from engine.serve.schemas import CompletionRequest
    server = Server(engine.load(str(ranked_dir)), "ranked")
    cfg = page_config(server)
    assert [c["id"] for c in cfg["configurations"]] == ["default", "softmax", "linear"]   # the fixed list stays
    custom = {c["id"]: c for c in cfg["custom"]}
    assert custom["hybrid-auto"]["param"]["min"] == 1 and custom["hybrid-auto"]["param"]["max"] == len(LOSSES) - 1
    assert custom["window"]["param"]["min"] == 1 and custom["window"]["param"]["max"] is None
    assert (custom["hybrid-layers"]["param"]["min"], custom["hybrid-layers"]["param"]["max"]) == (0, len(LOSSES) - 1)
    for conf, n, options in ((custom["hybrid-auto"], 2, {"attention": "hybrid", "softmax_layers": "auto:2"}),
                             (custom["hybrid-layers"], [5, 1], {"attention": "hybrid", "softmax_layers": [1, 5]}),
                             (custom["window"], 4, {"attention": "linear", "window": 4})):
        spec = server.request_spec(CompletionRequest(prompt="x", **request_fields(conf, n)))
        assert spec.mode == engine.load(str(ranked_dir), **options).spec.mode, options
    assert spec.layer_paths(len(LOSSES)) == ("linear",) * len(LOSSES) and spec.window == 4
    hybrid = server.request_spec(CompletionRequest(prompt="x", **request_fields(custom["hybrid-auto"], 2)))
    assert [i for i, p in enumerate(hybrid.layer_attention) if p == "softmax"] == [1, 5]   # the highest losses
    plain = Server(engine.load("tiny"), "tiny")      # no transfer losses: auto:K is the server's 400
    conf = {c["id"]: c for c in page_config(plain)["custom"]}
    with pytest.raises(APIError) as e:
        plain.request_spec(CompletionRequest(prompt="x", **request_fields(conf["hybrid-auto"], 2)))
    assert e.value.status == 400 and "transfer losses" in str(e.value)
    listed = plain.request_spec(CompletionRequest(prompt="x", **request_fields(conf["hybrid-layers"], [1, 5])))
    assert listed.mode == engine.load("tiny", softmax_layers=[1, 5]).spec.mode


def pick(driver, slot: int, config: str, number) -> None:
    """Bind pane `slot` to `config` (one taking a number) and type `number` into its number box."""
    from selenium.webdriver.support.ui import Select
    el = driver.find_elements("css selector", ".pane")[slot]
    Select(el.find_element("css selector", "select.config")).select_by_value(config)
    box = el.find_element("css selector", "input.param")
    assert box.is_displayed()
    box.clear()
    box.send_keys(str(number))


def errors(driver) -> list[str]:
    """Each pane's last error bubble's text (None where it has none)."""
    return driver.execute_script("""
        return window.gen.panes.map(p => {
          const e = p.el.querySelectorAll('.msg.error');
          return e.length ? e[e.length - 1].textContent : null;
        });""")


@pytest.mark.filterwarnings("ignore:these weights were trained")   # hybrid on weights trained for softmax, linear
def test_hybrid_auto_k_and_window_w_panes_stream_the_apis_greedy_text(ranked):
    import engine
    url, driver, d = ranked
    web.open_page(driver, url, max_tokens=MAX_TOKENS)
    pick(driver, 0, "hybrid-auto", 2)
    pick(driver, 1, "window", 4)
    web.send(driver, PROMPT)
    web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
    got = panes(driver)
    for p, options in zip(got, ({"attention": "hybrid", "softmax_layers": "auto:2"}, {"attention": "linear", "window": 4})):
        want = engine.load(str(d), **options).generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0)
        assert p["shown"] == want.text, options
        assert p["stats"]["attention"] == options["attention"] and p["stats"]["completion_tokens"] == len(want.ids)
    # the legend names each pane's run with its number
    legend = [t.text for t in driver.find_elements("css selector", "#live-bytes .legend text")]
    assert any("hybrid auto:2" in t for t in legend) and any("window 4" in t for t in legend), legend


@pytest.mark.filterwarnings("ignore:these weights were trained")
def test_a_k_the_model_cannot_run_shows_the_servers_message_and_a_bad_number_the_pages(page):
    import engine
    import httpx
    url, driver = page
    web.open_page(driver, url, panes=("softmax", "linear", "softmax"), max_tokens=MAX_TOKENS)
    pick(driver, 0, "hybrid-auto", 2)      # tiny records no transfer losses: the server refuses auto:K
    pick(driver, 2, "hybrid-layers", "1, 5")   # what tiny runs as a hybrid: the layers listed
    web.send(driver, PROMPT)
    web.wait_until(driver, lambda d: not {"streaming", "idle"} & set(web.statuses(d)), 30)
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "attention": "hybrid",
                                                  "softmax_layers": "auto:2"})
    assert r.status_code == 400
    assert web.statuses(driver) == ["error", "done", "done"] and errors(driver)[0] == r.json()["error"]["message"]
    assert "transfer losses" in errors(driver)[0]
    want = engine.load("tiny", softmax_layers=[1, 5]).generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0)
    assert panes(driver)[2]["shown"] == want.text and panes(driver)[2]["stats"]["attention"] == "hybrid"
    # numbers out of bounds are refused by the page, in the pane, before any request
    layers = driver.execute_script("return window.gen.config.layers")
    pick(driver, 0, "hybrid-auto", layers)
    pick(driver, 1, "window", 0)
    pick(driver, 2, "hybrid-layers", "1,1")
    boxes = driver.find_elements("css selector", ".pane input.param")
    assert [b.get_attribute("aria-invalid") for b in boxes] == ["true", "true", "true"]
    web.send(driver, "again")
    web.wait_until(driver, lambda d: web.statuses(d) == ["error", "error", "error"], 10)
    k, w, layer_list = errors(driver)
    assert k.startswith(f"K must be a whole number from 1 to {layers - 1}") and k.endswith(f'got "{layers}"')
    assert w.startswith("W must be a whole number at least 1") and w.endswith('got "0"')
    assert layer_list.startswith(f"L must list distinct layers from 0 to {layers - 1}") and layer_list.endswith('got "1,1"')
    # a failed turn stays out of the pane's conversation: a good number then runs on what it had
    texts = driver.execute_script("return window.gen.panes.map(p => p.text)")
    assert texts[0] == "" and "again" not in texts[1]
    pick(driver, 1, "window", 4)
    web.send(driver, PROMPT)
    web.wait_until(driver, lambda d: web.statuses(d)[1] == "done", 30)


def test_escape_stops_every_pane_and_frees_the_rows(page):
    import httpx
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys
    url, driver = page
    web.open_page(driver, url, panes=("linear", "linear"), max_tokens=100000, temperature=0.8, ignore_eos=True)
    web.send(driver, PROMPT)
    try:
        web.wait_until(driver, lambda d: all(len(p["points"]) >= 20 for p in panes(d)), 30)
        assert web.statuses(driver) == ["streaming", "streaming"]
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        web.wait_until(driver, lambda d: web.statuses(d) == ["stopped", "stopped"], 10)
        deadline = time.monotonic() + 10
        while (stats := httpx.get(url + "/stats").json())["active"] or stats["queued"]:
            assert time.monotonic() < deadline, f"the server still decodes the stopped panes' rows: {stats}"
            time.sleep(0.05)
    finally:
        driver.get("about:blank")   # whatever happened, the page's streams end here


def test_clear_while_the_panes_stream_forgets_the_running_turns(page):
    """Clear stops the running answers and forgets them: the next message starts a fresh conversation
    (the aborted turn's text is not sent with it, its pane does not say `stopped`)."""
    import httpx
    url, driver = page
    web.open_page(driver, url, panes=("linear", "linear"), max_tokens=100000, temperature=0.8, ignore_eos=True)
    web.send(driver, PROMPT)
    try:
        web.wait_until(driver, lambda d: all(len(p["points"]) >= 5 for p in panes(d)), 30)
        driver.find_element("id", "clear").click()
        deadline = time.monotonic() + 10
        while (stats := httpx.get(url + "/stats").json())["active"] or stats["queued"]:
            assert time.monotonic() < deadline, f"the server still decodes the cleared panes' rows: {stats}"
            time.sleep(0.05)
        assert web.statuses(driver) == ["idle", "idle"]
        assert driver.execute_script("return window.gen.panes.map(p => [p.text, p.history.length])") == [["", 0]] * 2
        driver.find_element("id", "ignore-eos").click()
        for field, value in (("max-tokens", 3), ("temperature", 0)):
            box = driver.find_element("id", field)
            box.clear()
            box.send_keys(str(value))
        web.send(driver, "Hi")
        web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
        for p in driver.execute_script("return window.gen.panes.map(p => [p.text, p.answer])"):
            assert p[0] == "Hi" + p[1]
        assert len(driver.find_elements("css selector", ".pane .msg")) == 4   # each pane: the message, its answer
    finally:
        driver.get("about:blank")


@browser
def test_a_server_gone_mid_answer_or_before_it_is_one_clear_line(page):
    """The browser's own words ("network error", "Failed to fetch") name neither the server nor what to do.
    (A server of its own, which it kills; the module's browser, on that server's origin.)"""
    import signal
    driver = page[1]
    with web.server_process("--model", "tiny") as (url, proc):
        try:
            web.open_page(driver, url, panes=("linear", "linear"), max_tokens=100000, temperature=0.8, ignore_eos=True)
            web.send(driver, PROMPT)
            web.wait_until(driver, lambda d: all(len(p["points"]) >= 5 for p in panes(d)), 30)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            web.wait_until(driver, lambda d: web.statuses(d) == ["error", "error"], 10)
            assert all(e.startswith("The connection to the server broke before the answer ended")
                       and e.endswith("is gen serve still running?") for e in errors(driver))
            web.send(driver, "again")
            web.wait_until(driver, lambda d: all(e.startswith("Could not reach") for e in errors(d)), 10)
            assert all(e.startswith(f"Could not reach the server at {url} (")
                       and e.endswith("is gen serve still running?") for e in errors(driver))
        finally:
            driver.get("about:blank")


@browser
def test_a_stream_cut_before_its_done_event_is_an_error_not_an_answer(page):
    """A proxy that ends a stream early (whole, without `data: [DONE]`): the pane says the answer was cut.
    (The proxy stands before the module's server; the module's browser opens the page at the proxy.)"""
    import http.server
    import threading
    import httpx
    url, driver = page
    class Cutting(http.server.BaseHTTPRequestHandler):   # forwards to the server; drops [DONE]
        def forward(self, body=None):
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("content-length", "connection")}
            r = httpx.request(self.command, url + self.path, headers=headers, content=body, timeout=30)
            data = r.content.replace(b"data: [DONE]\r\n\r\n", b"")
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.forward()

        def do_POST(self):
            self.forward(self.rfile.read(int(self.headers["Content-Length"])))

        def log_message(self, *args):
            pass
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Cutting)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        web.open_page(driver, f"http://127.0.0.1:{proxy.server_address[1]}", max_tokens=4)
        web.send(driver, PROMPT)
        web.wait_until(driver, lambda d: "streaming" not in web.statuses(d), 30)
        assert web.statuses(driver) == ["error", "error"]
        assert errors(driver) == ["The server's stream ended before the answer did (no `data: [DONE]`)"] * 2
    finally:
        driver.get("about:blank")
        proxy.shutdown()


def shown_stats(driver) -> list[dict]:
    """Each pane's readouts as the page shows them: {stat name: text}."""
    return driver.execute_script("""
        return window.gen.panes.map(p => Object.fromEntries(
          [...p.el.querySelectorAll('[data-stat]')].map(dd => [dd.dataset.stat, dd.textContent])));""")


def test_numbers_belong_to_the_turn_shown_and_a_bad_max_tokens_is_refused(page):
    """Clear, a turn that measures less (one token: no ms/token) and another configuration showed the last
    turn's numbers; max tokens 0 ran as 128."""
    from selenium.webdriver.support.ui import Select
    url, driver = page
    try:
        web.open_page(driver, url, panes=("softmax", "linear"), max_tokens=12)
        web.send(driver, PROMPT)
        web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
        assert all(s["ms_per_token"] != "\u2013" and s["context"] != "\u2013" for s in shown_stats(driver))
        driver.find_element("id", "clear").click()
        assert all(set(s.values()) == {"\u2013"} for s in shown_stats(driver))
        box = driver.find_element("id", "max-tokens")
        box.clear()
        box.send_keys("1")
        web.send(driver, PROMPT)
        web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
        assert all(s["ms_per_token"] == "\u2013" and s["context"] != "\u2013" for s in shown_stats(driver))
        first = driver.find_elements("css selector", ".pane")[0]
        Select(first.find_element("css selector", "select.config")).select_by_value("linear")
        assert set(shown_stats(driver)[0].values()) == {"\u2013"}
        asked = len(driver.find_elements("css selector", ".msg.user"))
        box.clear()
        box.send_keys("0")
        web.send(driver, "The dog")
        assert "max tokens must be a whole number >= 1" in driver.find_element("id", "notice").text
        assert driver.find_element("id", "prompt").get_attribute("value") == "The dog"   # kept to send again
        assert len(driver.find_elements("css selector", ".msg.user")) == asked   # nothing sent
    finally:
        driver.get("about:blank")


def test_a_page_opened_before_the_server_answers_tries_again(page):
    """/web/config failing once (a server starting or restarting) left a page that ignored every Send."""
    url, driver = page
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/web/config"]})
        driver.get(url + "/")
        web.wait_until(driver, lambda d: "trying again" in d.find_element("id", "notice").text, 10)
        web.send(driver, PROMPT)
        assert "has not read the server's configuration yet" in driver.find_element("id", "notice").text
        driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
        web.wait_until(driver, lambda d: d.execute_script("return !!(window.gen && window.gen.ready)"), 15)
        assert len(driver.find_elements("css selector", ".pane")) == 2
    finally:
        driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
        driver.get("about:blank")


def test_enter_sends_and_shift_enter_makes_a_new_line(page):
    from selenium.webdriver.common.keys import Keys
    url, driver = page
    web.open_page(driver, url, max_tokens=3)
    box = driver.find_element("id", "prompt")
    box.send_keys("one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "two")
    assert box.get_property("value") == "one\ntwo" and web.statuses(driver)[0] != "streaming"
    box.send_keys(Keys.ENTER)
    web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
    assert box.get_property("value") == ""
    users = driver.find_elements("css selector", ".pane .msg.user")
    assert users[-1].get_property("textContent") == "one\ntwo"


def test_phone_layout_and_dark_theme(page):
    url, driver = page
    try:
        driver.set_window_size(390, 844)
        web.open_page(driver, url)
        a, b = (el.rect for el in driver.find_elements("css selector", ".pane")[:2])
        assert b["y"] >= a["y"] + a["height"] and a["width"] > 300     # stacked, full width
        assert driver.execute_script("return document.documentElement.scrollWidth") <= 390
        light = driver.execute_script("return getComputedStyle(document.body).backgroundColor")
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
            "features": [{"name": "prefers-color-scheme", "value": "dark"}]})
        dark = driver.execute_script("return getComputedStyle(document.body).backgroundColor")
        assert light != dark and sum(int(v) for v in dark[4:-1].split(",")[:3]) < 150
    finally:
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
            "features": [{"name": "prefers-color-scheme", "value": "light"}]})
        driver.set_window_size(1280, 900)


def test_bench_tab_draws_a_shipped_report_and_opened_files(page, tmp_path):
    url, driver = page
    web.open_page(driver, url)
    driver.find_element("id", "tab-bench").click()
    buttons = web.wait_until(driver, lambda d: d.find_elements("css selector", "#shipped button"), 10)
    next(b for b in buttons if b.text == "tiny_bench.json").click()
    web.wait_until(driver, lambda d: d.find_elements("css selector", "#bench-ms polyline"), 10)
    assert len(driver.find_elements("css selector", "#bench-ms polyline")) == 2        # softmax, linear
    assert len(driver.find_elements("css selector", "#bench-bytes polyline")) == 2
    marks = [t.text for t in driver.find_elements("css selector", "#bench-ms .marklabel")]
    assert marks and marks[0].startswith("crossover")
    dot = driver.find_elements("css selector", "#bench-ms circle.dot")[-1]
    from selenium.webdriver.common.action_chains import ActionChains
    ActionChains(driver).move_to_element(dot).perform()
    tip = driver.find_element("css selector", "#bench-ms .tip")
    assert tip.get_attribute("visibility") == "visible" and "ms per token" in tip.text
    # the file picker: a report of the user's beside the shipped one, and a file that is none
    import json
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"settings": {"model": "m"}, "results": [
        {"attention": a, "context": c, "decode_ms_per_token": ms, "state_bytes": b}
        for a, c, ms, b in (("softmax", 64, 1.0, 1000), ("softmax", 256, 3.0, 4000),
                            ("linear", 64, 1.5, 500), ("linear", 256, 1.6, 500))]}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"runs": []}))
    driver.find_element("id", "bench-files").send_keys(f"{mine}\n{other}")
    web.wait_until(driver, lambda d: len(d.find_elements("css selector", "#bench-ms polyline")) == 4, 10)
    loaded = [li.text for li in driver.find_elements("css selector", "#bench-loaded li")]
    assert any(t.startswith("other.json: no `results`") for t in loaded)
    marks = [t.text for t in driver.find_elements("css selector", "#bench-ms .marklabel")]
    # the file has no summary: the page interpolates as engine.bench.report.decode_crossover does
    from engine.bench.report import decode_crossover
    want = decode_crossover(json.loads(mine.read_text())["results"])["estimate"]
    assert f"mine.json: crossover ~{want}" in marks


@browser
def test_the_page_asks_for_the_api_key_and_sends_it(page):
    """A server of its own (with a key); the module's browser, on that server's origin (a tab's key is
    kept per origin: nothing carries over from or to the other tests)."""
    import cli.serve
    if "api_key" not in {p.name for p in cli.serve.serve_cmd.params}:
        pytest.skip("this gen serve has no --api-key")
    driver = page[1]
    with web.serving("--model", "tiny", "--api-key", "s3cret") as url:
        try:
            driver.get(url + "/")
            assert driver.find_elements("id", "prompt"), \
                "/ must be public (the guard lets engine.serve.page.PUBLIC_PATHS through without a key)"
            web.wait_until(driver, lambda d: d.find_element("id", "key-form").is_displayed(), 10)
            driver.find_element("id", "key-input").send_keys("s3cret\u2713\n")   # (a header takes no such key)
            assert "printable ASCII" in driver.find_element("id", "key-note").text
            assert driver.execute_script("return sessionStorage.getItem('gen.apiKey')") is None
            driver.find_element("id", "key-input").clear()
            driver.find_element("id", "key-input").send_keys("wrong\n")   # a typo: the page says it was refused
            web.wait_until(driver, lambda d: d.find_element("id", "key-note").text.startswith(
                "The server refused the key this tab sent"), 10)
            assert driver.find_element("id", "key-form").is_displayed()
            driver.find_element("id", "key-input").send_keys("s3cret\n")
            web.wait_until(driver, lambda d: d.execute_script("return window.gen.ready"), 10)
            assert driver.execute_script("return sessionStorage.getItem('gen.apiKey')") == "s3cret"
            web.open_page(driver, url, max_tokens=4)         # a reload: the tab keeps the key, asks nothing
            assert not driver.find_element("id", "key-form").is_displayed()
            web.send(driver, PROMPT)
            web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
        finally:
            driver.get("about:blank")
