"""Soak of `gen serve`: streaming clients that leave, read slowly or send garbage, and long prompts, for minutes.

    python benchmarks/serve_soak.py --model tiny --minutes 5 --clients 8 --long-every 5 --long-tokens 3000 \\
        --long-paths linear --max-prompt 4096 --json soak_tiny.json
    python benchmarks/serve_soak.py --model smollm2 --minutes 5 --clients 4 --long-every 20 --long-tokens 2000 \\
        --json soak_smollm2.json

Starts `gen serve` in a subprocess on 127.0.0.1 (a free port). A fixed set of requests (the prompts of
serve_bench.py, both `--paths` through each request's "attention", greedy and seeded sampling, 8-48
tokens, ignore_eos) is first run alone, one at a time, through the same server: those are the
reference answers (and the warm-up). Then for `--minutes`, `--clients` clients each loop: a request
from the set read whole (it must equal its solo run, token for token), or one it leaves mid-stream
(a disconnect on purpose), or one it reads slowly (a sleep after each read), or a bad request
(malformed JSON, wrong types, a body over the server's --max-body, an unknown route or method, a
lone surrogate, deep nesting, a foreign media type, an unknown model, a prompt over --max-prompt),
which must get a 4xx with OpenAI's error body ({"error": {"message", "type", ...}}), never a 5xx.
Beside them, a long prompt (`--long-tokens` random token ids, greedy, 8 tokens, checked against
its solo run too) starts every `--long-every` seconds (at most one at a time), after `--flush`
two-token requests have pushed it out of the server's prefix cache (else it would be restored, not
prefilled).

Counted: requests, completed, disconnected on purpose, failures (any 5xx, a stream that ends
without finishing, a mismatch with the solo run, a bad request answered otherwise than a 4xx in
OpenAI's shape); the worst and median inter-token gap of the completed streams that were read at
full speed; the server's RSS after the warm-up (baseline), its peak during the load, and once the
load has stopped and the server is idle, and the same less the bytes its prefix cache holds then (/stats:
entries it keeps on purpose, up to its budget; the ratio judged against --rss-tolerance). A table on
stdout, everything with `--json`. Not a test.
"""
from __future__ import annotations

import asyncio
import os
import platform
import random
import shlex
import statistics
import sys
import time

import httpx

from common import RssSampler, ServerProcess, load_average, options, pct, stream_one, write_json

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a big bird",
           "Tom had a red ball", "The sun was hot and", "Mom said", "In a small town there lived"]
MAX_BODY = 4 * 2 ** 20   # gen serve's default --max-body


def specs(model: str, paths: list[str], n: int, seed: int) -> list[dict]:
    """The soak's fixed request set: prompts x paths x (greedy, seeded sampling)."""
    rng = random.Random(seed)
    return [{"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(8, 48),
             "temperature": 0 if i % 2 == 0 else 0.8, "seed": i, "stream": True, "logprobs": 0,
             "ignore_eos": True, **attention(paths[(i // 2) % len(paths)])} for i in range(n)]


def attention(path: str) -> dict:
    """A request's "attention" field for a path; "default": none (the server's own run, e.g. a
    linearized model's hybrid + window + sparse keys)."""
    return {} if path == "default" else {"attention": path}


def long_specs(model: str, paths: list[str], tokens: int) -> list[dict]:
    """One long prompt per path (random ids, as benchmarks/prefill_chunk.py feeds): greedy, 8 tokens."""
    out = []
    for k, path in enumerate(paths):
        rng = random.Random(100 + k)
        out.append({"model": model, "prompt": [rng.randrange(100, 4000) for _ in range(tokens)], "max_tokens": 8,
                    "temperature": 0, "stream": True, "logprobs": 0, "ignore_eos": True, **attention(path)})
    return out


def bad_requests(model: str, max_body: int) -> list[tuple[str, str, str, bytes | None, dict]]:
    """(name, method, route, body, headers): each must be answered by a 4xx in OpenAI's error shape."""
    js = {"Content-Type": "application/json"}

    def body(obj) -> bytes:
        import json
        return json.dumps(obj).encode()
    return [
        ("malformed JSON", "POST", "/v1/completions", b'{"model": "%s", "prompt": "Once' % model.encode(), js),
        ("prompt of the wrong type", "POST", "/v1/completions", body({"model": model, "prompt": 5}), js),
        ("max_tokens a string", "POST", "/v1/completions",
         body({"model": model, "prompt": "hi", "max_tokens": "ten"}), js),
        ("negative temperature", "POST", "/v1/completions",
         body({"model": model, "prompt": "hi", "temperature": -1}), js),
        ("messages a string", "POST", "/v1/chat/completions", body({"model": model, "messages": "hi"}), js),
        ("content null", "POST", "/v1/chat/completions",
         body({"model": model, "messages": [{"role": "user", "content": None}]}), js),
        ("unknown attention", "POST", "/v1/completions",
         body({"model": model, "prompt": "hi", "attention": "quadratic"}), js),
        ("body over --max-body", "POST", "/v1/completions",
         b'{"model": "%s", "prompt": "%s"}' % (model.encode(), b"a" * (max_body + 1024)), js),
        ("unknown route", "GET", "/v1/nothing", None, {}),
        ("wrong method", "GET", "/v1/completions", None, {}),
        ("lone surrogate", "POST", "/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}' % model.encode(), js),
        ("JSON 5000 deep", "POST", "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", js),
        ("text/plain body", "POST", "/v1/completions", body({"model": model, "prompt": "hi"}),
         {"Content-Type": "text/plain"}),
        ("unknown model", "POST", "/v1/completions", body({"model": "no-such-model", "prompt": "hi"}), js),
        ("prompt over --max-prompt", "POST", "/v1/completions",
         body({"model": model, "prompt": [200] * 9000, "attention": "softmax"}), js),
    ]


def openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


class Soak:
    def __init__(self, url: str, a, paths: list[str]):
        self.url, self.a = url, a
        self.specs = specs(a.model, paths, a.specs, a.seed)
        self.long = long_specs(a.model, a.long_paths.split(","), a.long_tokens) if a.long_every > 0 else []
        self.bad = bad_requests(a.model, a.max_body)
        self.counts = {k: 0 for k in ("requests", "completed", "matched", "disconnected", "slow_completed",
                                      "bad_requests", "bad_answered_4xx", "long_requests", "long_completed",
                                      "rejected_429", "failures", "oversized_reset", "flush_requests")}
        self.failures: list[dict] = []
        self.gaps: list[float] = []        # completed streams read at full speed, seconds
        self.long_ttft: list[float] = []
        self.bad_by_case: dict[str, dict] = {}
        self.flushes = 0
        self.long_starts: list[float] = []
        self.stalls: list[dict] = []   # completed full-speed streams with a gap over 100 ms
        self.t0 = time.perf_counter()

    def fail(self, kind: str, **info) -> None:
        self.counts["failures"] += 1
        if len(self.failures) < 50:
            self.failures.append({"kind": kind, **info})

    def check(self, got: dict, ref: dict, what: str, slow: bool = False, path: str | None = None) -> bool:
        """A finished stream: it must be whole and equal its reference; True when it counts as completed."""
        if got["status"] == 429:
            self.counts["rejected_429"] += 1
            return False
        if got["status"] != 200 or got.get("finish_reason") is None:
            self.fail("status" if got["status"] != 200 else "unfinished", what=what, status=got["status"],
                      error=str(got.get("error"))[:200])
            return False
        if got["tokens"] != ref["tokens"] or got["text"] != ref["text"]:
            first = next((i for i, (x, y) in enumerate(zip(got["tokens"], ref["tokens"])) if x != y),
                         min(len(got["tokens"]), len(ref["tokens"])))
            self.fail("mismatch", what=what, first_difference=first, got=got["text"][:80], solo=ref["text"][:80])
            return False
        self.counts["matched"] += 1
        if not slow:
            gaps = [b - a for a, b in zip(got["times"], got["times"][1:])]
            self.gaps += gaps
            if gaps and max(gaps) > 0.1:   # where the long stalls were: when, on which path
                k = max(range(len(gaps)), key=gaps.__getitem__)
                self.stalls.append({"gap_ms": round(1e3 * gaps[k], 1), "at_s": round(got["times"][k] - self.t0, 1),
                                    "what": what, "path": path})
        return True

    async def reference(self, client) -> None:
        """Each request of the set alone, one at a time: the answers every later run must equal."""
        self.ref = []
        for s in self.specs:
            self.ref.append(await stream_one(client, self.url, s))
        self.long_ref = [await stream_one(client, self.url, s) for s in self.long]
        for i, r in enumerate(self.ref + self.long_ref):
            if r["status"] != 200 or r.get("finish_reason") is None:
                raise RuntimeError(f"the solo run of request {i} failed: {r}")

    async def bad_one(self, client, rng) -> None:
        name, method, route, body, headers = rng.choice(self.bad)
        self.counts["bad_requests"] += 1
        case = self.bad_by_case.setdefault(name, {"sent": 0, "statuses": {}})
        case["sent"] += 1
        try:
            r = await client.request(method, self.url + route, content=body, headers=headers)
        except httpx.HTTPError as e:
            if name == "body over --max-body" and isinstance(e, (httpx.ReadError, httpx.WriteError)):
                # a reset instead of the 413: the server closed without draining the body (fixed by the
                # lingering close, engine.serve.connections): counted, and a failure
                self.counts["oversized_reset"] += 1
                case["statuses"]["reset"] = case["statuses"].get("reset", 0) + 1
            self.fail("bad request unanswered", case=name, error=f"{type(e).__name__}: {e}"[:200])
            return
        case["statuses"][str(r.status_code)] = case["statuses"].get(str(r.status_code), 0) + 1
        if 400 <= r.status_code < 500 and openai_error(r):
            self.counts["bad_answered_4xx"] += 1
        else:
            self.fail("bad request", case=name, status=r.status_code, body=r.text[:200])

    async def client(self, w: int, deadline: float) -> None:
        rng = random.Random(self.a.seed * 1000 + w)
        async with httpx.AsyncClient(timeout=self.a.timeout) as client:
            while time.monotonic() < deadline:
                self.counts["requests"] += 1
                x = rng.random()
                if x < self.a.bad:
                    await self.bad_one(client, rng)
                    continue
                i = rng.randrange(len(self.specs))
                spec = self.specs[i]
                if x < self.a.bad + self.a.disconnect:
                    got = await stream_one(client, self.url, spec, rng.randint(1, spec["max_tokens"] - 1))
                    if got.get("disconnected"):
                        self.counts["disconnected"] += 1
                    else:
                        self.check(got, self.ref[i], f"spec {i} (meant to disconnect)")
                    continue
                slow = x < self.a.bad + self.a.disconnect + self.a.slow
                delay = rng.uniform(0.02, 0.2) if slow else 0.0
                got = await stream_one(client, self.url, spec, read_delay=delay)
                if self.check(got, self.ref[i], f"spec {i}" + (" (slow reader)" if slow else ""), slow,
                              spec.get("attention", "default")):
                    self.counts["completed"] += 1
                    self.counts["slow_completed"] += slow

    async def flush(self, client) -> None:
        """Push every entry out of the server's prefix cache (64 entries, least recently used first) with
        distinct two-token prompts, so the long prompt after it is prefilled under load, not restored."""
        for _ in range(self.a.flush):
            self.flushes += 1
            self.counts["flush_requests"] += 1
            ids = [100 + self.flushes % 3000, 100 + self.flushes // 3000]
            r = await client.post(self.url + "/v1/completions", json={
                "model": self.a.model, "prompt": ids, "max_tokens": 1, **attention(self.long[0].get("attention", "default"))})
            if r.status_code != 200:
                self.fail("flush", status=r.status_code, body=r.text[:200])

    async def long_prompts(self, deadline: float) -> None:
        k = 0
        async with httpx.AsyncClient(timeout=self.a.timeout) as client:
            while time.monotonic() + self.a.long_every < deadline:
                await asyncio.sleep(self.a.long_every)
                j = k % len(self.long)
                k += 1
                self.counts["requests"] += 1
                self.counts["long_requests"] += 1
                await self.flush(client)
                self.long_starts.append(round(time.perf_counter() - self.t0, 1))
                got = await stream_one(client, self.url, self.long[j])
                if self.check(got, self.long_ref[j], f"long prompt {j}", slow=True):
                    self.counts["completed"] += 1
                    self.counts["long_completed"] += 1
                    self.long_ttft.append(got["times"][0] - got["t0"])


async def wait_idle(url: str, timeout: float = 60) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        end = time.monotonic() + timeout
        while True:
            stats = (await client.get(url + "/stats")).json()
            if not (stats["active"] or stats["queued"] or stats.get("prefilling") or stats["states"]) \
                    or time.monotonic() > end:
                return {k: stats.get(k) for k in ("active", "queued", "prefilling", "states", "failures", "steps")}
            await asyncio.sleep(0.2)


async def cache_bytes(url: str) -> int:
    """The bytes the server's prefix cache holds (/stats)."""
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(url + "/stats")).json()["prefix_cache"]["bytes"]


async def run(server: ServerProcess, a, paths: list[str]) -> dict:
    soak = Soak(server.url, a, paths)
    async with httpx.AsyncClient(timeout=a.timeout) as client:
        t = time.perf_counter()
        await soak.reference(client)
        reference_s = time.perf_counter() - t
    await wait_idle(server.url)
    await asyncio.sleep(a.settle)
    baseline = server.rss()
    cache_before = await cache_bytes(server.url)
    timeline = []

    async def sample():
        t0 = time.monotonic()
        while True:
            timeline.append((round(time.monotonic() - t0, 1), server.rss() / 2 ** 20, os.getloadavg()[0]))
            await asyncio.sleep(10)
    sampler = asyncio.create_task(sample())
    deadline = time.monotonic() + 60 * a.minutes
    t = soak.t0 = time.perf_counter()
    with RssSampler(server) as peak:
        tasks = [soak.client(w, deadline) for w in range(a.clients)]
        if soak.long:
            tasks.append(soak.long_prompts(deadline))
        await asyncio.gather(*tasks)
    seconds = time.perf_counter() - t
    load_end = load_average()
    sampler.cancel()
    idle = await wait_idle(server.url)
    async with httpx.AsyncClient(timeout=10) as client:
        cache = (await client.get(server.url + "/stats")).json()["prefix_cache"]
    await asyncio.sleep(a.settle)
    after = server.rss()
    cache_after = await cache_bytes(server.url)
    g = soak.gaps
    return {"seconds": seconds, "reference_s": reference_s, "counts": soak.counts, "failures": soak.failures,
            "bad_by_case": soak.bad_by_case, "stalls_over_100ms": sorted(soak.stalls, key=lambda x: -x["gap_ms"]),
            "long_prompt_starts_s": soak.long_starts, "server_after": idle, "prefix_cache": cache,
            "gaps_ms": {"streams_timed": soak.counts["completed"] - soak.counts["slow_completed"]
                        - soak.counts["long_completed"], "gaps": len(g),
                        "median": 1e3 * statistics.median(g) if g else None, "p99": 1e3 * pct(g, 99) if g else None,
                        "worst": 1e3 * max(g) if g else None},
            "long_ttft_s": {"median": statistics.median(soak.long_ttft) if soak.long_ttft else None,
                            "worst": max(soak.long_ttft) if soak.long_ttft else None},
            "rss_mib": {"baseline": baseline / 2 ** 20, "peak": peak.peak / 2 ** 20, "after": after / 2 ** 20,
                        "after_over_baseline": after / baseline, "timeline": timeline,
                        # what the prefix cache holds (its budget: entries it keeps on purpose) taken out of both
                        "cache_baseline": cache_before / 2 ** 20, "cache_after": cache_after / 2 ** 20,
                        "after_over_baseline_less_cache": (after - cache_after) / (baseline - cache_before)},
            "load_average_end": load_end}


def table(r: dict, a) -> str:
    c, g, rss = r["counts"], r["gaps_ms"], r["rss_mib"]
    within = abs(rss["after_over_baseline_less_cache"] - 1) <= a.rss_tolerance
    rows = [("minutes", f"{r['seconds'] / 60:.1f} ({a.clients} clients + long prompts)"),
            ("requests", c["requests"]),
            ("completed (each = its solo run)", f"{c['completed']} ({c['slow_completed']} slow readers, "
                                                f"{c['long_completed']} of {c['long_requests']} long prompts)"),
            ("disconnected on purpose", c["disconnected"]),
            ("bad requests -> 4xx in OpenAI's shape", f"{c['bad_answered_4xx']} of {c['bad_requests']} "
                                                      f"({c['oversized_reset']} oversized bodies: reset before the 413)"),
            ("429", c["rejected_429"]),
            ("failures (5xx, unfinished, mismatch, bad answer)", c["failures"]),
            ("inter-token gap median / p99 / worst ms",
             f"{g['median'] or float('nan'):.1f} / {g['p99'] or float('nan'):.1f} / {g['worst'] or float('nan'):.1f}"
             f" ({g['streams_timed']} streams at full speed)"),
            ("full-speed streams with a gap over 100 ms", len(r["stalls_over_100ms"])),
            ("long prompt TTFT median / worst s", f"{r['long_ttft_s']['median'] or float('nan'):.1f} / "
                                                  f"{r['long_ttft_s']['worst'] or float('nan'):.1f}"),
            ("server RSS MiB: baseline / peak / idle after",
             f"{rss['baseline']:.0f} / {rss['peak']:.0f} / {rss['after']:.0f} (after = {rss['after_over_baseline']:.2f}x "
             f"baseline)"),
            ("prefix cache MiB: baseline / idle after", f"{rss['cache_baseline']:.1f} / {rss['cache_after']:.1f}"),
            ("server RSS less the prefix cache: after / baseline",
             f"{rss['after_over_baseline_less_cache']:.2f}x ({'within' if within else 'outside'} "
             f"+-{100 * a.rss_tolerance:.0f}%)"),
            ("server after (stats)", r["server_after"]),
            ("load average at the end (1, 5, 15 min)", r["load_average_end"])]
    return "| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main() -> None:
    ap = options(__doc__, model="tiny", paths="softmax,linear", long_paths="")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=5.0, help="seconds between long prompts (0: none)")
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--specs", type=int, default=16, help="requests in the fixed set")
    ap.add_argument("--bad", type=float, default=0.15, help="share of bad requests")
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of streams left mid-way")
    ap.add_argument("--slow", type=float, default=0.15, help="share of streams read slowly")
    ap.add_argument("--max-prompt", type=int, default=None, help="gen serve --max-prompt (default: its own)")
    ap.add_argument("--max-body", type=int, default=MAX_BODY, help="gen serve --max-body")
    ap.add_argument("--serve-args", default="", help="more gen serve options, one string")
    ap.add_argument("--timeout", type=float, default=300, help="client read timeout, seconds")
    ap.add_argument("--settle", type=float, default=5.0, help="idle seconds before the RSS baseline and after")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="idle RSS after / baseline - 1 called 'within', the prefix cache's bytes "
                                                                          "(/stats) taken out of both")
    ap.add_argument("--flush", type=int, default=64,
                    help="short requests sent before each long prompt to push it out of the prefix cache "
                         "(its 64 entries; 0: none, the long prompt is then restored from the cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    paths = a.paths.split(",")
    a.long_paths = a.long_paths or a.paths
    cmd = [sys.executable, "-m", "cli.main", "serve", "--model", a.model, "--port", "{port}",
           "--max-batch", str(a.clients + 1), "--max-body", str(a.max_body)]
    if a.max_prompt is not None:
        cmd += ["--max-prompt", str(a.max_prompt)]
    cmd += shlex.split(a.serve_args)
    load_start = load_average()
    server = ServerProcess(cmd)
    try:
        result = asyncio.run(run(server, a, paths))
        result["server_peak_rss_mib_vmhwm"] = server.rss("VmHWM") / 2 ** 20
    finally:
        tail = server.stop()
    result.update(settings=vars(a), command=" ".join(["python"] + sys.argv), server_command=" ".join(server.cmd[1:]),
                  machine={"cpu_count": os.cpu_count(), "platform": platform.platform(),
                           "load_average_start": load_start}, server_log_tail=tail)
    print(table(result, a))
    for f in result["failures"][:10]:
        print("failure:", f)
    if a.json_path:
        write_json(a.json_path, result)


if __name__ == "__main__":
    main()
