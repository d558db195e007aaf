"""Which layers retrieve: each layer's share of passkey retrieval, and hybrids whose softmax layers are
chosen by it rather than by transfer loss (issue 30: "choose them by a retrieval score").

    python benchmarks/retrieval_layers.py ablate --length 1024 --out scores.json   # one layer linear at a time
    python benchmarks/retrieval_layers.py compare --length 2048 --scores scores.json --keep 8,12,16

The score of a configuration is the log-probability of the key's tokens after the passkey prompt
(engine.tasks.passkey.make_prompt: three prompts, depths 0.2 / 0.3 / 0.5), teacher-forced through the
module forward, averaged over the prompts: 0 is certain retrieval; a miss costs tens of nats. `ablate`
runs `smollm2-linear` with every layer softmax but one (that one linear + window 256, the default
set's maps and adapters) and reports each layer's drop from all-softmax. `compare` scores the default
(`auto:8`, the layers of highest transfer loss) beside hybrids that keep the K layers of largest drop
softmax, all with window 256 on the linear layers, and the state each keeps at 32k tokens.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine import load
from engine.attention.hybrid import state_bytes
from engine.tasks.passkey import make_prompt

CASES = ((0.2, "48213"), (0.5, "71946"), (0.3, "30587"))
WINDOW = 256


def prompts(tokenizer, length: int) -> list[tuple[torch.Tensor, int]]:
    out = []
    for depth, key in CASES:
        p = make_prompt(tokenizer, length, depth, key)
        full = tokenizer.encode(p.text + " " + key, bos=True)
        assert full[:len(p.ids)] == p.ids, "the key's tokens do not extend the prompt's"
        out.append((torch.tensor([full]), len(p.ids)))
    return out


def score(llm, cases) -> float:
    total = 0.0
    with torch.no_grad():
        for ids, n in cases:
            logp = torch.log_softmax(llm.model(ids[:, :-1]).float()[0, n - 1:], -1)
            target = ids[0, n:]
            total += logp[torch.arange(len(target)), target].sum().item()
    return total / len(cases)


def hybrid(layers, threads: int):
    return load("smollm2-linear", attention="hybrid", softmax_layers=layers, window=WINDOW, threads=threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["ablate", "compare"])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--scores", help="compare: the JSON ablate wrote")
    ap.add_argument("--keep", default="8,12,16", help="compare: numbers of softmax layers to keep")
    ap.add_argument("--out", help="ablate: where to write the per-layer scores")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base = load("smollm2", threads=a.threads)
    cases = prompts(base.tokenizer, a.length)
    L = base.model.config.num_hidden_layers
    ref = score(base, cases)
    print(f"softmax: {ref:.3f}", flush=True)
    if a.mode == "ablate":
        out = {"length": a.length, "softmax": ref, "layers": {}}
        for i in range(L):
            t0 = time.perf_counter()
            s = score(hybrid([j for j in range(L) if j != i], a.threads), cases)
            out["layers"][str(i)] = s
            print(f"layer {i} linear: {s:.3f} ({s - ref:+.3f}, {time.perf_counter() - t0:.0f} s)", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
        return
    with open(a.scores) as f:
        layers = json.load(f)["layers"]
    order = sorted(range(L), key=lambda i: layers[str(i)])     # largest drop first
    cfg = base.model.config
    soft = state_bytes(cfg, ("softmax",) * L, 32768)
    for name, keep in [("auto:8 (the default)", "auto:8")] + [(f"retrieval {k}", sorted(order[:int(k)]))
                                                               for k in a.keep.split(",")]:
        llm = hybrid(keep, a.threads)
        kinds = llm.spec.layer_attention
        share = state_bytes(cfg, kinds, 32768, feature_dim=2 * cfg.head_dim, window=WINDOW) / soft
        print(f"{name}: layers {keep if isinstance(keep, str) else ','.join(map(str, keep))}: "
              f"{score(llm, cases):.3f}; state at 32k {share:.0%} of the KV cache", flush=True)


if __name__ == "__main__":
    main()
