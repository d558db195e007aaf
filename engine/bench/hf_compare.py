"""`--compare-hf`: our greedy decode against transformers' `generate` on the same checkpoint.

Same Hugging Face layout directory, same dtype, same prompt ids, same number of new tokens,
batch 1, greedy, EOS ignored (min_new_tokens = max_new_tokens on their side, no EOS check on
ours). Both sides count one prefill of the prompt and N - 1 single-token forwards for N
tokens. Our side is the decode loop the bench times (model.step + argmax, softmax path); if
the engine's generation loop (`engine.generate.Generation`) is importable it is timed too.
Runs alternate (ours, theirs) after one untimed warm-up each; the median of `repeats` counts.
transformers is optional: without it this raises a BenchError saying how to install it.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from engine.bench.sweep import BenchError
from engine.generate import Generation, GenerationConfig
from engine.sampling import SamplingParams

DEFAULT_PROMPT = "Once upon a time"


def prompt_ids(model, tokenizer, prompt: str) -> list[int]:
    """The prompt as ids: tokenized with BOS when the checkpoint ships a tokenizer, else BOS and
    fixed ids (the same ids on both sides is what matters for timing)."""
    cfg = model.config
    if tokenizer is not None:
        return tokenizer.encode(prompt, bos=True)
    return [cfg.bos_token_id] + [(7 * i + 3) % cfg.vocab_size for i in range(4)]


@torch.inference_mode()
def greedy_step_loop(model, ids: list[int], n: int) -> torch.Tensor:
    """n greedy tokens after `ids` with model.step: (n,) int64."""
    prompt = torch.tensor([ids], device=model.device)
    state = model.init_state(1, max_len=len(ids) + n, attention="softmax")
    tok = model.step(prompt, state, last_only=True)[:, -1].argmax(-1, keepdim=True)   # (1, 1)
    out = [tok]
    for _ in range(n - 1):
        tok = model.step(tok, state)[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, 1)[0]


def _engine_generation(model, ids: list[int], n: int):
    """The engine's own generation loop, greedy, EOS ignored, no tokenizer (no text work)."""
    def run():
        cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingParams(temperature=0.0, seed=0), ignore_eos=True)
        gen = Generation(model, [ids], cfg, tokenizer=None, attention="softmax")
        return torch.tensor([ev.id for ev in gen])
    return run


def _load_hf(model_dir: Path, dtype: torch.dtype):
    try:
        import transformers
    except ImportError:
        raise BenchError("--compare-hf needs the optional transformers package: "
                         "pip install 'gen-engine[hf]' (or pip install transformers)") from None
    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).eval(), transformers.__version__


def _timed(fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def compare_hf(model_dir, model, tokenizer=None, new_tokens: int = 128, prompt: str = DEFAULT_PROMPT,
               repeats: int = 3) -> dict:
    """Time both sides on `model_dir` (a Hugging Face layout directory holding `model`'s weights)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise BenchError(f"--compare-hf needs a Hugging Face layout directory (config.json + safetensors); "
                         f"{model_dir} is not one (convert it with `gen convert`)")
    if model.config.position_encoding != "rope" or "softmax" not in model.config.trained_for:
        raise BenchError(f"{model_dir}: not Llama-compatible (needs rotary positions and softmax-trained weights)")
    if new_tokens < 2 or repeats < 1:
        raise BenchError(f"--compare-hf needs at least 2 new tokens and 1 repeat, got {new_tokens}, {repeats}")
    hf, version = _load_hf(model_dir, model.dtype)
    ids = prompt_ids(model, tokenizer, prompt)
    inp = torch.tensor([ids])
    eos = model.config.eos_ids[0]

    @torch.inference_mode()
    def theirs():
        out = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=eos)
        return out[0, len(ids):]

    sides = {"engine": lambda: greedy_step_loop(model, ids, new_tokens), "hf": theirs}
    generation = _engine_generation(model, ids, new_tokens)
    if generation is not None:
        sides["engine_generate"] = generation
    outs, generation_error = {}, None
    for k, fn in list(sides.items()):                           # warm-up, untimed
        try:
            outs[k] = fn()
        except Exception as e:   # the generation loop is optional here; the step loop is the headline
            if k != "engine_generate":
                raise
            del sides[k]
            generation_error = f"{type(e).__name__}: {e}"
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for k, fn in sides.items():
            dt, outs[k] = _timed(fn)
            times[k].append(dt)
    rate = {k: new_tokens / statistics.median(v) for k, v in times.items()}
    n = min(len(outs["engine"]), len(outs["hf"]))
    same = torch.equal(outs["engine"][:n].cpu(), outs["hf"][:n].cpu()) and len(outs["hf"]) == new_tokens
    result = {"checkpoint": str(model_dir), "transformers": version, "prompt_tokens": len(ids),
              "new_tokens": new_tokens, "repeats": repeats, "dtype": str(model.dtype).removeprefix("torch."),
              "engine_tokens_per_s": rate["engine"], "hf_tokens_per_s": rate["hf"],
              "ratio": rate["engine"] / rate["hf"], "same_tokens": bool(same),
              "engine_loop": "model.step + argmax (softmax path), the loop the bench times"}
    if generation_error:
        result["engine_generate_error"] = generation_error
    if "engine_generate" in rate:
        result["engine_generate_tokens_per_s"] = rate["engine_generate"]
        result["engine_generate_ratio"] = rate["engine_generate"] / rate["hf"]
    return result
