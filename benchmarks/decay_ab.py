"""What a learned decay costs a decode step: smollm2-linear all linear with its decay against the same model without it.

    python benchmarks/decay_ab.py --rounds 6 --steps 80

One process, one thread, the native step: the `linear/` set's maps with their decay (constant or
gated), and the same model with the decay removed (`hedgehog.decay_logit = gate_weight = None`), alternating round by round so that a
busy machine disturbs both alike; each round is the median ms/token of `--steps` one-token steps
after a short prompt (the first 10 dropped). The linear state has the same size either way, so the
context does not matter. The model loads through `engine.load` (all linear, the native step on one
thread); the decay is switched on the model's maps (an internal on purpose: what is compared), and each
round gets a fresh step (benchmarks/runs.py `with_run`), as the native step copies the maps it runs.
"""
from __future__ import annotations

import statistics
import time

import torch

from common import load_average, options


def main() -> None:
    ap = options(__doc__, model="smollm2-linear")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=80)
    a = ap.parse_args()
    import engine
    from runs import with_run
    llm = engine.load(a.model, attention="linear", backend="native", threads=1)
    net, tok = llm.model, llm.tokenizer
    hh = net.hedgehog
    logit, gate = hh.decay_logit, hh.gate_weight
    if logit is None:
        raise SystemExit(f"{a.model}: its all-linear maps carry no decay")
    prompt = torch.tensor([tok.encode("Once upon a time there was a little girl who", bos=True)])
    res = {"decay": [], "none": []}
    print(f"load average before: {load_average()}")
    for _ in range(a.rounds):
        for name in res:
            hh.decay_logit, hh.gate_weight = (logit, gate) if name == "decay" else (None, None)
            step = with_run(llm).step
            state = net.init_state(1, None, "linear")
            step(prompt, state)
            token, times = torch.tensor([[42]]), []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                step(token, state)
                times.append(time.perf_counter() - t0)
                assert step.last_form == "native", step.fallback
            res[name].append(statistics.median(times[10:]) * 1e3)
    hh.decay_logit, hh.gate_weight = logit, gate
    print(f"decay: {'gated' if gate is not None else 'constant'}")
    for name, v in res.items():
        print(f"{name:6s} ms/token by round: {' '.join(f'{x:.2f}' for x in v)}; "
              f"median {statistics.median(v):.2f}, best {min(v):.2f}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
