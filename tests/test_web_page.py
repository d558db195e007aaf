"""gen serve's page in a real browser: Debian's chromium, headless, driven by Selenium (skipped with
the reason when chromium, chromedriver or selenium is missing). The server is `gen serve --model tiny`
in a subprocess on a free loopback port (scripts/web_screenshot.py's helpers)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import web_screenshot as web  # noqa: E402

WHY = web.missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the page test needs a browser: {WHY}")

PROMPT = "Once upon a time"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def page():
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


def test_the_page_asks_for_the_api_key_and_sends_it():
    import cli.serve
    if "api_key" not in {p.name for p in cli.serve.serve_cmd.params}:
        pytest.skip("this gen serve has no --api-key")
    with web.serving("--model", "tiny", "--api-key", "s3cret") as url:
        driver = web.browser(1280, 900)
        try:
            driver.get(url + "/")
            assert driver.find_elements("id", "prompt"), \
                "/ must be public (the guard lets engine.serve.page.PUBLIC_PATHS through without a key)"
            web.wait_until(driver, lambda d: d.find_element("id", "key-form").is_displayed(), 10)
            driver.find_element("id", "key-input").send_keys("s3cret\n")
            web.wait_until(driver, lambda d: d.execute_script("return window.gen.ready"), 10)
            assert driver.execute_script("return sessionStorage.getItem('gen.apiKey')") == "s3cret"
            web.open_page(driver, url, max_tokens=4)         # a reload: the tab keeps the key, asks nothing
            assert not driver.find_element("id", "key-form").is_displayed()
            web.send(driver, PROMPT)
            web.wait_until(driver, lambda d: web.statuses(d) == ["done", "done"], 30)
        finally:
            driver.quit()
