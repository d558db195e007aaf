"""Where the resident memory of a GGUF load and one generation goes, item by item (issue 33).

    python benchmarks/load_memory_attribution.py smollm2 [--attention linear]

Runs what benchmarks/load_memory.py runs (engine.load, one greedy generation of --tokens tokens
after a --prompt-token prompt) and splits the growth over `import engine` into: the native step's
derived copies (torch byte sums of NativeStep.weights, per matrix), model tensors held outside the
file's map (copies the loader made), the file's pages still mapped (/proc/self/pagemap, per tensor
group), other files' pages (shared libraries first touched by the load: /proc/self/smaps), Python's
small-object memory (sys._debugmallocstats: live blocks and pools left empty), the tokenizer (an
identical one built again at the end: its RSS growth), and what remains unattributed (the C heap
PyTorch, tokenizers and glibc keep). MB = 10^6 bytes. Prints one JSON record.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile

from load_memory import rss, spread_prompt


def status() -> dict:
    return rss(exact=True)


def file_pages() -> dict:
    """Resident MB per mapped file (smaps Rss), by base name."""
    out, name = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split(None, 5)
                name = os.path.basename(parts[5].strip()) if len(parts) > 5 and parts[5].startswith("/") else None
            elif name and line.startswith("Rss:"):
                out[name] = out.get(name, 0) + int(line.split()[1]) * 1024 / 1e6
    return out


def pymalloc() -> dict:
    """Python's small-object allocator: MB in live blocks and in pools left empty inside arenas."""
    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    live = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    unused = re.search(r"([\d,]+) unused pools \* \d+ bytes\s*=\s*([\d,]+)", text)
    num = lambda m, i: int(m.group(i).replace(",", "")) / 1e6 if m else 0.0  # noqa: E731
    return {"live": num(live, 1), "empty_pools": num(unused, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a registered name (smollm2) or a GGUF path")
    ap.add_argument("--attention", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()

    import engine
    import torch
    from engine.steps.native.step import NativeStep
    from models.pages import resident_file_bytes
    from models.registry import resolve
    base, base_files, base_py = status(), file_pages(), pymalloc()
    llm = engine.load(a.model, attention=a.attention, threads=a.threads)
    after_load = status()
    prompt = spread_prompt(a.prompt, llm.model.config.vocab_size)
    llm.generate(prompt, max_new_tokens=a.tokens, temperature=0)
    gc.collect()
    end, end_files, end_py = status(), file_pages(), pymalloc()
    path = resolve(a.model)
    gguf_name = path.name

    items: dict[str, float] = {}
    # the native step's copies, per matrix role
    model = llm.model
    roles = {}
    for i, b in enumerate(model.layers):
        for role, m in (("qkv", b.self_attn.qkv), ("o_proj", b.self_attn.o_proj), ("gate_up", b.mlp.gate_up),
                        ("down_proj", b.mlp.down_proj)):
            roles[id(getattr(m, "blocks", None))] = role
    roles[id(getattr(model.lm_head, "blocks", None))] = "lm_head"
    steps = [f for f in getattr(llm.step, "forms", []) if isinstance(f, NativeStep)]
    for step in steps:
        for (tag, key), (ref, _, copy) in list(step.weights._cache.items()):
            if copy is not None:
                name = f"native {tag} copy: {roles.get(key, 'other')}"
                items[name] = items.get(name, 0) + copy.nbytes / 1e6
    # model tensors outside the file's map (the loader's copies), per role
    map_lo = map_hi = None
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(gguf_name):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                map_lo, map_hi = min(lo, map_lo or lo), max(hi, map_hi or hi)
    seen = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "cpu" or t.is_meta or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            continue
        st = t.untyped_storage()
        p = st.data_ptr()
        if p in seen or st.nbytes() == 0 or (map_lo is not None and map_lo <= p < map_hi):
            continue
        seen.add(p)
        role = name.split(".")[-2] if "layers." in name else name.rsplit(".", 1)[0]
        key = f"model tensor outside the map: {role}"
        items[key] = items.get(key, 0) + st.nbytes() / 1e6
    # the file's pages still mapped, per tensor group (and the header)
    from models.gguf import open_reader
    reader = open_reader(path)
    groups: dict[str, float] = {}
    if map_lo is not None:
        for t in reader.tensors:
            g = re.sub(r"blk\.\d+\.", "", t.name)
            groups[g] = groups.get(g, 0) + resident_file_bytes(map_lo + t.data_offset, t.n_bytes) / 1e6
        groups["header"] = resident_file_bytes(map_lo, min(t.data_offset for t in reader.tensors)) / 1e6
    del reader
    for g, mb in groups.items():
        if mb >= 0.05:
            items[f"file pages of the checkpoint: {g}"] = mb
    other_files = {k: end_files.get(k, 0) - base_files.get(k, 0) for k in set(end_files) | set(base_files)
                   if k != gguf_name}
    for k, mb in sorted(other_files.items(), key=lambda kv: -kv[1]):
        if mb >= 0.5:
            items[f"pages of {k}"] = mb
    items["pages of other files"] = sum(mb for mb in other_files.values() if mb < 0.5)
    items["Python objects (pymalloc live blocks)"] = end_py["live"] - base_py["live"]
    items["Python pools left empty (fragmentation)"] = end_py["empty_pools"] - base_py["empty_pools"]
    # the tokenizer: build the same one again and count its growth (Rust heap + Python side)
    tok = llm.tokenizer
    if tok is not None and path.suffix == ".gguf":
        try:
            from models.gguf import metadata
        except ImportError:   # an older checkout (attributed with models/pages.py copied in)
            from models.gguf import field_value
            metadata = lambda r: {k: field_value(f) for k, f in r.fields.items()}  # noqa: E731
        from models.gguf_tokenizer import gguf_tokenizer
        from models.pages import trim_heap
        reader = open_reader(path)
        meta = {k: v for k, v in metadata(reader).items() if k.startswith("tokenizer.")}
        del reader
        gc.collect()
        trim_heap()
        before = status()["anon"]
        held = [gguf_tokenizer(meta, str(path))]
        del meta
        gc.collect()
        trim_heap()
        items["tokenizer (measured by building it again)"] = status()["anon"] - before if held else 0.0
        del held
    grown = end["rss"] - base["rss"]
    counted = sum(items.values())
    items["unattributed (C heaps: PyTorch, glibc, native plans' scratch)"] = grown - counted
    file_mb = os.path.getsize(path) / 1e6
    state = model.init_state(1, a.prompt + a.tokens)
    state_mb = sum(t.nbytes for t in state.tensors()) / 1e6
    rec = {"model": a.model, "attention": a.attention, "file_mb": round(file_mb, 1),
           "rss_import_engine": round(base["rss"], 1), "rss_after_load": round(after_load["rss"], 1),
           "rss_after_generate": round(end["rss"], 1), "peak": round(end["peak"], 1),
           "budget": round(1.25 * file_mb + state_mb + base["rss"], 1), "grown_mb": round(grown, 1),
           "items_mb": {k: round(v, 1) for k, v in sorted(items.items(), key=lambda kv: -kv[1])}}
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
