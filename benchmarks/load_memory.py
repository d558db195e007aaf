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


def spread_prompt(n: int, vocab_size: int) -> list[int]:
    """BOS and n - 1 ids from all over the vocabulary, as a text's are: ids 10..1009 (before
    2026-11-28) read only the first rows of the embedding, and hid the file pages its lookups fault in
    (~30 MB of SmolLM2's after a 2,000-token prompt, until the native step read the tied head's copy)."""
    return [1] + [(7919 * i + 3) % (vocab_size - 10) + 10 for i in range(n - 1)]


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
    import_rss = rss(exact=True)
    rec = {"engine": os.path.dirname(engine.__file__), "model": a.model, "backend": a.backend,
           "rss_start": base, "rss_import_engine": {k: round(v) for k, v in import_rss.items()}}
    llm = engine.load(a.model, attention=a.attention, backend=a.backend, threads=a.threads)
    rec["rss_after_load"] = rss()
    path = a.model if os.path.exists(a.model) else None
    if path is None:
        from models.registry import resolve
        path = str(resolve(a.model))
    file_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs) \
        if os.path.isdir(path) else os.path.getsize(path)
    rec["file_mb"] = round(file_bytes / 1e6)
    prompt = spread_prompt(a.prompt, llm.model.config.vocab_size)
    r = llm.generate(prompt, max_new_tokens=a.tokens, temperature=0)
    rec["rss_after_generate"] = rss()
    state = llm.model.init_state(1, a.prompt + a.tokens)
    rec["state_mb"] = round(sum(t.nbytes for t in state.tensors()) / 1e6, 1)
    rec["generated"] = len(r.ids)
    # from the exact sizes (whole MB of each rounded first put the budget up to 1 MB low)
    rec["budget_mb"] = round(1.25 * file_bytes / 1e6 + rec["state_mb"] + import_rss["rss"])
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
