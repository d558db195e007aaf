"""One bench configuration in a fresh process: `python -m engine.bench.worker` with a JSON job
on stdin; prints one JSON record on stdout. Peak RSS is this process's VmHWM at the end."""
from __future__ import annotations

import json
import sys

from engine.bench.configs import preset
from engine.bench.memory import peak_rss_bytes, rss_bytes
from engine.bench.sweep import INTERRUPTED, measure_entry
from engine.errors import EngineError
from engine.loader import load_model
from engine.quant import quantize_model
from engine.threads import set_threads


def main() -> int:
    job = json.loads(sys.stdin.read())
    set_threads(job.get("threads"))
    try:
        options = {k: job.get(k) for k in ("feature_map", "kv_dtype", "threads", "quantize", "sparse_keys")}
        model, _ = load_model(job["model"], spec=lambda cfg: preset(   # the row's run: its set of maps, its dtypes
            cfg, job["attention"], job.get("softmax_layers"), job.get("window"), dtype=job["dtype"],
            device=job["device"], backend=job.get("backend", "auto"), **options))
        if model.spec.quantize:
            quantize_model(model, model.spec.quantize)
        after_load = rss_bytes()
        rec = measure_entry(model, job["attention"], job["context"], job["steps"], job["warmup"],
                            job.get("feature_map"), job.get("seed", 0), job.get("backend", "auto"),
                            job.get("batch", 1), job.get("prefill_tokens"), job.get("softmax_layers"),
                            job.get("window"), threads=job.get("threads"), sparse_keys=job.get("sparse_keys"))
    except EngineError as e:
        print(f"gen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return INTERRUPTED
    rec["peak_rss_bytes"] = peak_rss_bytes()
    rec["rss_after_load_bytes"] = after_load
    rec["rss_method"] = ("VmHWM (/proc/self/status) of a fresh subprocess running only this configuration: "
                         "interpreter, torch, model weights, one state, one prefill")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
