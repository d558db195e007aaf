"""The comparison page: the same conversation through two to four attention configurations side by
side, with each stream's live numbers (engine.serve.row_stats), and a tab that draws `gen bench --json`
files. Plain HTML, CSS and JavaScript shipped in engine/serve/web/ (package data): no build step, no
third-party code, nothing fetched from elsewhere.

Routes:
    GET /                     the page (public: it holds no secret; a key is asked for by the page)
    GET /web/<asset>          its script and style sheets (public)
    GET /web/config           what the page may offer: the model, its configurations (fixed, and those
                              taking a number: hybrid auto:K, window W), chat or not
    GET /web/bench            the bench files shipped in docs/ (a source checkout; none when installed)
    GET /web/bench/<name>     one of them, read-only

The page's own files are PUBLIC_PATHS: a guard asking for an API key must let them through; the data
routes are behind the key like the API.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from starlette.responses import JSONResponse, Response

from engine.errors import EngineError
from engine.serve.errors import APIError

ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "chart.js": "text/javascript; charset=utf-8", "bench.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
PUBLIC_PATHS = frozenset({"/"} | {f"/web/{name}" for name in ASSETS if name != "index.html"})
HEADERS = {   # the page runs only its own files; model output is shown as text, never as markup
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
DOCS = Path(__file__).resolve().parents[2] / "docs"   # a source checkout's docs/ (absent when installed)


def asset(name: str) -> bytes:
    return resources.files("engine.serve").joinpath("web", name).read_bytes()


def configurations(llm) -> list[dict]:
    """The configurations a pane may pick on this server, each with the request options that ask for
    it (a request's attention, softmax_layers and window resolve as gen's options do on this model,
    RunSpec.for_request): `attention` omitted (the server's default), softmax, linear (with the
    server's window, when it runs one) and hybrid (the server's softmax layers, else the model's)."""
    cfg, spec = llm.model.config, llm.spec
    trained = set(cfg.trained_for)
    w = spec.linear_window
    window = f" + window {w}" if w else ""
    extra = {"window": w} if w else {}

    def note(path):
        return "" if path in trained or (path == "hybrid" and "linear" in trained) else " (untrained)"
    sparse = f" + {spec.sparse_keys} sparse keys" if w and spec.sparse_keys else ""   # a request's own mode runs none
    out = [{"id": "default", "attention": None, "label": f"default: {llm.attention}{sparse}"},
           {"id": "softmax", "attention": "softmax", "label": "softmax" + note("softmax")},
           {"id": "linear", "attention": "linear", **extra, "label": "linear" + window + note("linear")}]
    layers = spec.layer_attention if spec.layer_attention is not None else cfg.layer_attention
    if layers is not None:
        soft = [i for i, p in enumerate(layers) if p == "softmax"]
        out.append({"id": "hybrid", "attention": "hybrid", "softmax_layers": soft, **extra,
                    "label": f"hybrid (softmax layers {','.join(map(str, soft))}){window}{note('hybrid')}"})
    return out


def custom_configurations(llm) -> list[dict]:
    """The configurations a pane picks with a number of its own: hybrid auto:K (the K layers with the
    highest transfer loss keep softmax: `softmax_layers` "auto:K", K in 1..layers-1), hybrid layers L
    (those layers keep softmax: `softmax_layers` [..], each in 0..layers-1: what a model without
    transfer losses runs) and window W (linear + the exact last W keys: `window` W >= 1). `param`
    says which request field takes the number, its format ("auto:{}", "list": comma-separated layers,
    None: the number) and bounds (max None: unbounded); the page checks them, the server decides
    whether this model runs it (a 400 with its one-line reason otherwise: no transfer losses
    recorded, another set of learned maps)."""
    cfg, spec = llm.model.config, llm.spec
    trained = set(cfg.trained_for)
    untrained = "" if "linear" in trained else " (untrained)"
    layers = cfg.num_hidden_layers
    out = []
    if layers > 1:
        now = spec.layer_attention if spec.layer_attention is not None else cfg.layer_attention
        k = min(max(1, sum(p == "softmax" for p in now or ())), layers - 1)
        out.append({"id": "hybrid-auto", "attention": "hybrid", "label": "hybrid auto:K" + untrained,
                    "param": {"field": "softmax_layers", "name": "K", "format": "auto:{}", "min": 1,
                              "max": layers - 1, "value": k,
                              "title": f"the K of {layers} layers with the highest transfer loss keep softmax"}})
        out.append({"id": "hybrid-layers", "attention": "hybrid", "label": "hybrid layers L" + untrained,
                    "param": {"field": "softmax_layers", "name": "L", "format": "list", "min": 0,
                              "max": layers - 1, "value": ",".join(map(str, [i for i, p in enumerate(now or ())
                                                                              if p == "softmax"] or [0])),
                              "title": f"the layers that keep softmax, e.g. 0,3 (0-{layers - 1})"}})
    out.append({"id": "window", "attention": "linear", "label": "window W" + untrained,
                "param": {"field": "window", "name": "W", "format": None, "min": 1, "max": None,
                          "value": spec.linear_window or 64,
                          "title": "linear layers that also attend exactly to the last W keys"}})
    return out


def page_config(server) -> dict:
    llm = server.llm
    try:
        llm.chat_eos_ids()
        chat = True
    except EngineError:
        chat = False
    cfg = llm.model.config
    return {"model": server.name, "chat": chat, "default_attention": llm.attention,
            "configurations": configurations(llm), "custom": custom_configurations(llm), "window": llm.spec.linear_window, "max_context": server.max_context,
            "layers": cfg.num_hidden_layers, "trained_for": list(cfg.trained_for)}


def bench_files(docs: Path = DOCS) -> dict[str, Path]:
    """{name: path} of the `gen bench --json` reports in `docs` (records with a context, decode
    ms/token and state bytes)."""
    found = {}
    for path in sorted(docs.glob("*.json")) if docs.is_dir() else ():
        try:
            report = json.loads(path.read_text())
            results = report["results"]
            if isinstance(report.get("settings"), dict) and results and all(
                    {"context", "decode_ms_per_token", "state_bytes"} <= r.keys() for r in results):
                found[path.name] = path
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def add_page(app, server, docs: Path = DOCS) -> None:
    """The page's routes on `app` (a FastAPI app serving `server`)."""

    @app.get("/", include_in_schema=False)
    async def index():
        return Response(asset("index.html"), media_type=ASSETS["index.html"], headers=HEADERS)

    @app.get("/web/config")
    async def config():
        return page_config(server)

    @app.get("/web/bench")
    async def benches():
        out = []
        for name, path in bench_files(docs).items():
            s = json.loads(path.read_text())["settings"]
            out.append({"name": name, "model": s.get("model"), "cpu": (s.get("machine") or {}).get("cpu")})
        return {"files": out}

    @app.get("/web/bench/{name}")
    async def bench(name: str):
        path = bench_files(docs).get(name)
        if path is None:
            raise APIError(404, f"no bench file {name!r} here (see GET /web/bench)", code="not_found")
        return JSONResponse(json.loads(path.read_text()))

    @app.get("/web/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in ASSETS or name == "index.html":
            raise APIError(404, f"no page file {name!r} (the page's files: /, "
                                + ", ".join(sorted(PUBLIC_PATHS - {"/"})) + ")", code="not_found")
        return Response(asset(name), media_type=ASSETS[name], headers=HEADERS)
