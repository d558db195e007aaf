"""`gen serve --open`: open the server's page in the browser once the server answers."""
from __future__ import annotations

import sys
import threading
import time
import urllib.error
import urllib.request
import webbrowser


def page_url(host: str, port: int) -> str:
    """The page's address for a server bound to `host` (a wildcard address: this machine's loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def open_when_ready(url: str, timeout: float = 300.0, opener=webbrowser.open, poll: float = 0.2) -> threading.Thread:
    """A daemon thread that waits (up to `timeout` s) for `url`health to answer, then calls opener(url)."""
    def wait_then_open():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "health", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(poll)
        else:
            print(f"gen serve: the server did not answer within {timeout:.0f} s; the page is {url}", file=sys.stderr)
            return
        print(f"gen serve: opening {url}", file=sys.stderr)
        if not opener(url):
            print(f"gen serve: no browser could be started; open {url} yourself", file=sys.stderr)

    thread = threading.Thread(target=wait_then_open, name="gen-serve-open", daemon=True)
    thread.start()
    return thread
