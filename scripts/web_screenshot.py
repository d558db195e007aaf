#!/usr/bin/env python3
"""A screenshot of `gen serve`'s page with two panes (softmax, linear) answering one prompt, taken
by Debian's chromium (headless, through Selenium and chromedriver; no browser download).

    python scripts/web_screenshot.py                        # -> docs/web.png (tiny, greedy, 96 tokens)
    python scripts/web_screenshot.py --dark --out dark.png  # the dark theme
    python scripts/web_screenshot.py --size 390x844         # a phone-sized window

Needs: apt-get install chromium chromium-driver; pip install selenium. The helpers here (a server
in a subprocess, a headless browser, sending and waiting) are also what tests/test_web_page.py uses.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = "chromedriver"


def missing() -> str | None:
    """Why a headless chromium cannot be driven here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if not any(shutil.which(c) for c in CHROMIUM):
        return "chromium is not installed (apt-get install chromium chromium-driver)"
    if not shutil.which(DRIVER):
        return "chromedriver is not installed (apt-get install chromium-driver)"
    return None


def browser(width: int = 1280, height: int = 900, dark: bool = False):
    """A headless chromium (Selenium WebDriver) with a `width` x `height` window."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(c) for c in CHROMIUM if shutil.which(c))
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument(f"--blink-settings=preferredColorScheme={0 if dark else 1}")
    driver = webdriver.Chrome(options=options, service=Service(shutil.which(DRIVER)))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]})
    return driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str, timeout: float = 60.0):
    """`gen serve ARGS` (this checkout's code) on a free loopback port, in a subprocess; yields its URL
    once /health answers, stops it on the way out."""
    with server_process(*args, timeout=timeout) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(*args: str, timeout: float = 60.0):
    """serving's server, yielding (URL, its subprocess.Popen): for a test that kills it."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"gen serve did not start: {proc.stderr.read()[-2000:]}") from None
                time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def open_page(driver, url: str, panes=("softmax", "linear"), max_tokens: int = 96, temperature: float = 0.0,
              ignore_eos: bool = False, timeout: float = 20.0) -> None:
    """Load the page, wait for its panes, bind them to `panes` and set the request settings."""
    from selenium.webdriver.support.ui import Select, WebDriverWait
    driver.get(url + "/")
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return !!(window.gen && window.gen.ready)"))
    while len(driver.find_elements("css selector", ".pane")) < len(panes):
        driver.find_element("id", "add-pane").click()
    for el, config in zip(driver.find_elements("css selector", ".pane"), panes):
        Select(el.find_element("css selector", "select.config")).select_by_value(config)
    for field, value in (("max-tokens", max_tokens), ("temperature", temperature)):
        box = driver.find_element("id", field)
        box.clear()
        box.send_keys(str(value))
    if driver.find_element("id", "ignore-eos").is_selected() != ignore_eos:
        driver.find_element("id", "ignore-eos").click()


def send(driver, text: str) -> None:
    """Type `text` into the message box and press Enter (what a person does)."""
    from selenium.webdriver.common.keys import Keys
    box = driver.find_element("id", "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def statuses(driver) -> list[str]:
    return [el.get_attribute("data-status") for el in driver.find_elements("css selector", ".pane")]


def wait_until(driver, predicate, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(predicate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--size", default="1280x900", help="window WIDTHxHEIGHT (the picture is the whole page)")
    ap.add_argument("--dark", action="store_true", help="the dark theme (prefers-color-scheme: dark)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "web.png"))
    args = ap.parse_args()
    why = missing()
    if why:
        sys.exit(f"web_screenshot: {why}")
    width, height = (int(v) for v in args.size.lower().split("x"))
    with serving("--model", args.model) as url:
        driver = browser(width, height, args.dark)
        try:
            open_page(driver, url, max_tokens=args.max_tokens)
            send(driver, args.prompt)
            wait_until(driver, lambda d: all(s in ("done", "error") for s in statuses(d)), 120)
            full = driver.execute_script("return document.documentElement.scrollHeight")
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {   # the viewport: the whole page
                "width": width, "height": max(height, full), "deviceScaleFactor": 1, "mobile": width < 700})
            time.sleep(0.5)
            driver.save_screenshot(args.out)
        finally:
            driver.quit()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
