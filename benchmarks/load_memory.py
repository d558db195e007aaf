"""Resident memory of a load and one generation, public API only (issue 33: memory that scales).

    python benchmarks/load_memory.py smollm2
    python benchmarks/load_memory.py /tmp/llama1b-q4km.gguf --backend torch --json out.json

Prints one JSON record, in MB (10^6 bytes) of this process's resident set (/proc/self/status):
`import engine` (the runtime's baseline), after `engine.load`, after one greedy generation of
--tokens tokens (a --prompt-token prompt), and the peak (VmHWM); each with its split into
anonymous memory (copies: dequantized or fused weights, the state, scratch) and file pages (the
checkpoint's memory map as far as it was read). Also the file's size and the state's bytes, so
the issue's budget reads off directly: RSS <= 1.25 x file + state + baseline. Run it under
another checkout's PYTHONPATH to compare (e.g. git main).
"""
from __future__ import annotations

import argparse
import json
import os


def rss(exact: bool = False) -> dict:
    """VmRSS, RssAnon, RssFile and VmHWM of this process in MB (10^6 bytes; whole MB unless exact)."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in keys:
                mb = int(value.split()[0]) * 1024 / 1e6
                out[keys[name]] = mb if exact else round(mb)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a registered name (smollm2) or a checkpoint path")
    ap.add_argument("--backend", default="auto", help="engine.load's backend (auto, native, torch, module)")
    ap.add_argument("--attention", default=None, help="softmax, linear, ... (default: the model's own)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated (greedy)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json")
    a = ap.parse_args()

    base = rss()
    import engine
    rec = {"engine": os.path.dirname(engine.__file__), "model": a.model, "backend": a.backend,
           "rss_start": base, "rss_import_engine": rss()}
    llm = engine.load(a.model, attention=a.attention, backend=a.backend, threads=a.threads)
    rec["rss_after_load"] = rss()
    path = a.model if os.path.exists(a.model) else None
    if path is None:
        from models.registry import resolve
        path = str(resolve(a.model))
    rec["file_mb"] = round(sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
                           / 1e6 if os.path.isdir(path) else os.path.getsize(path) / 1e6)
    prompt = [1] + [(7 * i + 3) % 1000 + 10 for i in range(a.prompt - 1)]
    r = llm.generate(prompt, max_new_tokens=a.tokens, temperature=0)
    rec["rss_after_generate"] = rss()
    state = llm.model.init_state(1, a.prompt + a.tokens)
    rec["state_mb"] = round(sum(t.nbytes for t in state.tensors()) / 1e6, 1)
    rec["generated"] = len(r.ids)
    rec["budget_mb"] = round(1.25 * rec["file_mb"] + rec["state_mb"] + rec["rss_import_engine"]["rss"])
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
