#!/usr/bin/env bash
# Issue 35's GPU checks and figures in one run, on a machine with one CUDA GPU and no network:
#   OUT=dir bash benchmarks/gpu_run.sh [full|compiled|hedgehog]   (everything lands in $OUT/gpu.tgz and $OUT/run.log)
# `hedgehog` is the short run for the hedgehog map fused into the linear decode kernel: its CUDA tests, the
# kernels alone, and benchmarks/gpu_maps.py under `graph` at batch 1 / depth 1k (the row it was slower than
# softmax in: 2.84 vs 2.19 ms on an H100) and batch 32 / 32k, with the map-in-torch A/B row beside it.
# 1. the CUDA tests (graph step, Triton kernels, serve/linearize/train/bench on --device cuda);
# 2. a random checkpoint of Llama-3.2-1B's shape (benchmarks/random_checkpoint.py, bf16);
# 3. the kernels alone (benchmarks/gpu_kernels.py);
# 4. `gen bench --device cuda` on it: softmax and linear, batch 1 and 32, depths 1k/8k/32k: the CUDA-graph
#    step ("graph"), the compiled+captured step ("compiled") and the eager torch step, with the bandwidth floor;
# 5. the anchor: transformers with a static cache + torch.compile(reduce-overhead) on the same weights.
# Python packages the image lacks travel as wheels in .whl/ (see /work/.library/device/README.md): for the
# 2026-11 image (torch 2.11, python 3.12) `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .whl` of: gguf fastapi starlette sse-starlette uvicorn pydantic
# pydantic_core annotated-types typing-inspection opentelemetry-api (fastapi needs it: without it the serve
# tests skip there) openai jiter distro sniffio, at the versions this venv holds.
set -u
MODE=${1:-full}
OUT=${OUT:-$PWD/gpu_out}
W=/tmp/gpu_work
mkdir -p "$OUT" $W
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stamp() { echo "== $(date +%T) $*" | tee -a "$OUT/run.log"; }
pack() { tar czf "$OUT/gpu.tgz" -C $W . 2>/dev/null; }
step() {   # name, timeout, command...: its whole log in $W/name.log, its tail in run.log
  local name=$1 limit=$2; shift 2
  stamp "$name"
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  echo "rc=$?" >> "$W/$name.log"
  tail -${TAIL:-12} "$W/$name.log" | tee -a "$OUT/run.log"
  pack
}
M=/tmp/llama-3.2-1b-random
bench() {   # name, args...
  local name=$1; shift
  TAIL=22 step "bench_$name" 200 python3 -m cli.main bench --model $M --device cuda --dtype bfloat16 --no-isolate \
    --prefill-tokens 256 --steps 32 --warmup 4 --json "$W/bench_$name.json" "$@"
}

step device 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c "import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__)"'
if [ "$MODE" = compiled ]; then TESTS="tests/test_graph_step.py";
elif [ "$MODE" = hedgehog ]; then TESTS="tests/test_kernels.py tests/test_graph_step.py"; else
  TESTS="tests/test_graph_step.py tests/test_kernels.py tests/test_bench_floor.py tests/test_device_training.py tests/test_serve_device.py"; fi
TAIL=30 step tests 200 python3 -m pytest -q -n 4 -p no:cacheprovider -rs -p no:logging $TESTS \
  -k "(cuda or compile or bandwidth) and not bad_device and not needs_cuda and not compiled_static"
step model 120 python3 benchmarks/random_checkpoint.py $M --device cuda
[ "$MODE" = compiled ] || TAIL=50 step kernels 150 python3 benchmarks/gpu_kernels.py --json $W/gpu_kernels.json
# the hedgehog + gated decay row under `graph` at batch 1 (map fused in the kernel, and the map in torch: A/B)
[ "$MODE" = compiled ] || TAIL=10 step maps_b1_graph 150 python3 benchmarks/gpu_maps.py $M --batch 1 --depth 1024 \
  --backend graph --json $W/maps_b1_1k_graph.json
if [ "$MODE" = hedgehog ]; then
  TAIL=10 step maps_b32_graph 150 python3 benchmarks/gpu_maps.py $M --batch 32 --depth 32768 --backend graph \
    --json $W/maps_b32_32k_graph.json
elif [ "$MODE" = compiled ]; then   # the second run: the compiled+captured step beside the captured one and the anchor
  bench b1_graph --batch 1 --contexts 1024 --attention softmax,linear --backend graph
  bench b1_compiled --batch 1 --contexts 1024,32768 --attention softmax,linear --backend compiled
  step hf_compile 180 python3 benchmarks/hf_static_compile.py $M --depth 1024 --steps 64 --json $W/hf_compile_b1_1k.json
  TAIL=10 step maps_b1 120 python3 benchmarks/gpu_maps.py $M --batch 1 --depth 1024 --json $W/maps_b1_1k.json
  TAIL=10 step maps_b32 120 python3 benchmarks/gpu_maps.py $M --batch 32 --depth 32768 --json $W/maps_b32_32k.json
else
  bench b1_graph --batch 1 --contexts 1024,8192,32768 --attention softmax,linear --backend graph
  bench b32_graph --batch 32 --contexts 1024,8192,32768 --attention softmax,linear --backend graph
  bench b1_torch --batch 1 --contexts 1024,32768 --attention softmax,linear --backend torch
  bench b32_torch --batch 32 --contexts 32768 --attention softmax,linear --backend torch
  step hf_compile 180 python3 benchmarks/hf_static_compile.py $M --depth 1024 --steps 64 --json $W/hf_compile_b1_1k.json
  bench b1_compiled --batch 1 --contexts 1024 --attention softmax,linear --backend compiled
fi
stamp done
