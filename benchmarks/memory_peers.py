"""Resident memory of `gen` next to llama.cpp's on the same GGUF files, in one run (issue 33 item 4).

    python benchmarks/memory_peers.py smollm2 /tmp/llama1b.gguf /tmp/qwen2.gguf --json out.json
    python benchmarks/memory_peers.py FILE --llama-bench PATH/llama-bench --prompt 16 --tokens 32

For each file, one after the other (never two at once), each in a fresh process:
- gen: `benchmarks/load_memory.py FILE --attention A` (softmax and linear): RSS after `import engine`
  (the runtime's baseline), after load + one greedy generation of --tokens tokens after a
  --prompt-token prompt, and the peak (VmHWM); the issue's budget 1.25 x file + state + baseline.
- llama.cpp: `llama-bench -m FILE -p 0 -n 0 -pg P,N -r 1 --no-warmup -t T` (the same prompt and
  generation as one test; its context is P + N tokens; its other settings are its defaults: memory
  map on, batch 2048 / ubatch 512, blocks repacked; and again with `--repack 0`), its peak RSS as GNU time reports it (`/usr/bin/time -f %M`: a
  small process forks and execs it; a Python parent's own rusage would fold the parent's peak into the
  child's, since Linux carries the exec'ing image's high-water mark over).

llama-bench is found as benchmarks/peers.sh builds it (~/.cache/gen-peers/build-llama.cpp-*/bin), or
--llama-bench. Files without a vocabulary (benchmarks/kquant_decode.py write) work in both: prompts
are token ids. Prints a Markdown table and, with --json, every record.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def find_llama_bench() -> str | None:
    found = sorted(glob.glob(os.path.expanduser("~/.cache/gen-peers/build-llama.cpp-*/bin/llama-bench")))
    return found[-1] if found else None


def resolve(model: str) -> str:
    if os.path.exists(model):
        return model
    from models.registry import resolve as registry_resolve
    return str(registry_resolve(model))


GNU_TIME = "/usr/bin/time"


def peak_mb(cmd: list[str]) -> tuple[float, int, str]:
    """Run cmd to its end under GNU time; (its peak RSS in MB, exit status, last output line)."""
    with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        r = subprocess.run([GNU_TIME, "-f", "%M", "-o", f.name, *cmd], capture_output=True, text=True)
        kb = f.read().decode().strip().splitlines()
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    return int(kb[-1]) * 1024 / 1e6 if kb and kb[-1].isdigit() else float("nan"), r.returncode, lines[-1] if lines else ""


def gen_record(path: str, attention: str, a) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.join(HERE, "load_memory.py"), path, "--attention", attention,
               "--prompt", str(a.prompt), "--tokens", str(a.tokens), "--json", f.name]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
        if r.returncode != 0:
            raise SystemExit(f"gen failed on {path} ({attention}): {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.load(open(f.name))


def lcpp_record(path: str, a, extra: tuple[str, ...] = ()) -> dict:
    cmd = [a.llama_bench, "-m", path, "-p", "0", "-n", "0", "-pg", f"{a.prompt},{a.tokens}", "-r", "1",
           "--no-warmup", "-t", str(a.threads or os.cpu_count())]
    cmd += list(extra)
    mb, rc, last = peak_mb(cmd)
    if rc != 0:
        raise SystemExit(f"llama-bench failed on {path}: {last}")
    return {"peak": round(mb), "command": " ".join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="registered names (smollm2) or GGUF paths")
    ap.add_argument("--attention", default="softmax,linear", help="gen's paths, comma-separated")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-repack-run", type=int, default=1, help="also llama-bench with --repack 0 (by default its CPU "
                    "backend repacks Q4_0 / Q4_K / IQ4_NL blocks into interleaved copies: anonymous memory beside the "
                    "map); 0: skip")
    ap.add_argument("--llama-bench", default=find_llama_bench(), help="llama.cpp's llama-bench (benchmarks/peers.sh builds it)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not a.llama_bench or not os.path.exists(a.llama_bench):
        raise SystemExit("no llama-bench: build it with `bash benchmarks/peers.sh` or pass --llama-bench PATH")
    if not os.path.exists(GNU_TIME):
        raise SystemExit(f"no {GNU_TIME}: install GNU time (Debian: apt-get install time)")
    rows, records = [], []
    for model in a.models:
        path = resolve(model)
        rec = {"model": model, "path": path, "file_mb": round(os.path.getsize(path) / 1e6),
               "llama.cpp": lcpp_record(path, a)}
        if a.no_repack_run:
            rec["llama.cpp_no_repack"] = lcpp_record(path, a, ("--repack", "0"))
        for att in a.attention.split(","):
            rec[att] = gen_record(path, att, a)
        records.append(rec)
        for att in a.attention.split(","):
            g = rec[att]
            rows.append(f"| {os.path.basename(path)} | {rec['file_mb']:,} | {att} | {g['rss_import_engine']['rss']} | "
                        f"{g['rss_after_generate']['rss']:,} | {g['rss_after_generate']['peak']:,} | {g['budget_mb']:,} | "
                        f"{rec['llama.cpp']['peak']:,} | {rec.get('llama.cpp_no_repack', {}).get('peak', '-'):,} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"prompt {a.prompt} tokens, {a.tokens} generated, {a.threads} threads; MB = 10^6 bytes")
    print("| file | MB | gen path | gen `import engine` | gen after generate | gen peak | budget 1.25 x file + state + import "
          "| llama.cpp peak | llama.cpp peak, --repack 0 |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
