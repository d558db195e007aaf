#!/usr/bin/env bash
# Issue 35's GPU checks and figures in one run, on a machine with one CUDA GPU and no network:
#   bash benchmarks/gpu_run.sh [quick|full]        (writes logs and JSON under $OUT, default ./gpu_out)
# 1. the CUDA tests (graph step, Triton kernels, --device paths);
# 2. a random checkpoint of Llama-3.2-1B's shape (benchmarks/random_checkpoint.py, bf16);
# 3. `gen bench --device cuda` on it: softmax and linear, batch 1 and 32, depths 1k/8k/32k, the
#    CUDA-graph step next to the eager torch step, with the bandwidth floor;
# 4. the anchor: transformers with a static cache + torch.compile(reduce-overhead) on the same weights.
# Python packages the image lacks travel as wheels in .whl/ (see /work/.library/device/README.md).
set -u
MODE=${1:-full}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
gen() { python3 -m cli.main "$@"; }
stamp() { echo "== $(date +%T) $*" | tee -a "$OUT/run.log"; }

stamp device
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee -a "$OUT/run.log"

stamp tests
timeout 240 python3 -m pytest -q -n 4 -p no:cacheprovider -x --timeout 120 \
  tests/test_graph_step.py tests/test_kernels.py tests/test_device.py 2>&1 | tail -40 | tee "$OUT/tests.log"

stamp model
M=/tmp/llama-3.2-1b-random
timeout 120 python3 benchmarks/random_checkpoint.py $M --device cuda 2>&1 | tail -2 | tee -a "$OUT/run.log"

bench() {   # name, args...
  local name=$1; shift
  stamp "bench $name"
  timeout 240 python3 -m cli.main bench --model $M --device cuda --dtype bfloat16 --no-isolate \
    --prefill-tokens 256 --steps 32 --warmup 4 --json "$OUT/bench_$name.json" "$@" 2>&1 | tail -25 | tee "$OUT/bench_$name.log"
}
if [ "$MODE" = quick ]; then
  bench b1_graph --batch 1 --contexts 1024 --attention softmax,linear --backend graph
  bench b1_torch --batch 1 --contexts 1024 --attention softmax,linear --backend torch
else
  bench b1_graph --batch 1 --contexts 1024,8192,32768 --attention softmax,linear --backend graph
  bench b32_graph --batch 32 --contexts 1024,8192,32768 --attention softmax,linear --backend graph
  bench b1_torch --batch 1 --contexts 1024,32768 --attention softmax,linear --backend torch
  bench b32_torch --batch 32 --contexts 32768 --attention softmax,linear --backend torch
fi

stamp "anchor transformers static cache + compile"
timeout 200 python3 benchmarks/hf_static_compile.py $M --depth 1024 --steps 64 --json "$OUT/hf_compile_b1_1k.json" \
  2>&1 | tail -3 | tee -a "$OUT/run.log"
stamp done
