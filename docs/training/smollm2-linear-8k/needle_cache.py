"""After a passkey prompt's prefill, how many of the needle's 14 tokens each linear layer's sparse cache
holds (its cached values matched to the needle's), per depth (docs/eval.md, "A band the five depths
miss", 2026-11-28). Usage, from the repository root:

    python docs/training/smollm2-linear-8k/needle_cache.py LENGTH SPARSE_KEYS DEPTH...
"""
import sys, torch
from engine import load
from engine.tasks.passkey import make_prompt
from engine.attention.sparse import SparseWindowState

length, sparse = int(sys.argv[1]), int(sys.argv[2])
depths = [float(d) for d in sys.argv[3:]]
torch.set_num_threads(1)
llm = load("smollm2-linear", sparse_keys=sparse, threads=1)
model, cfg = llm.model, llm.model.config
H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
captured = {}
paths = llm.spec.layer_paths(cfg.num_hidden_layers)
for i, (b, p) in enumerate(zip(model.layers, paths)):
    if p == "softmax":
        continue
    qkv = b.self_attn.projections(True)[0]
    qkv.register_forward_hook(lambda m, inp, out, i=i: captured.__setitem__(i, out[0, :, (H + Hkv) * D:].float()))
for depth in depths:
    p = make_prompt(llm.tokenizer, length, depth, "65125")
    ids = torch.tensor([p.ids])
    needle = llm.tokenizer.encode("The pass key is 65125. Remember it.", bos=False)
    pos = list(range(p.needle_start, p.needle_start + len(needle)))
    state = model.init_state(1, length + 16, spec=llm.spec)
    with torch.inference_mode():
        model.step(ids, state, last_only=True)
    sub = [s for s in state.parts if isinstance(s, SparseWindowState)][0]
    counts = []
    for li, layer in enumerate(sub.layer_ids):
        v = captured[layer]                      # (T, Hkv*D)
        for h in range(Hkv):
            cv = sub.cv[li, 0, h][sub.cuse[li, 0, h]].float()       # (m, D)
            nv = v[pos, h * D:(h + 1) * D]                            # (n, D)
            hit = ((nv[:, None, :] - cv[None]).abs().amax(-1) < 1e-4).any(1)
            counts.append(int(hit.sum()))
    full = sum(c == len(pos) for c in counts)
    print(f"len {length} sparse {sparse} depth {depth}: needle at {p.needle_start}/{len(p.ids)} ({len(pos)} tokens); "
          f"caches holding any: {sum(c > 0 for c in counts)}/{len(counts)}, all: {full}, mean held {sum(counts)/len(counts):.1f}",
          flush=True)
