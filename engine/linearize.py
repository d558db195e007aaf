"""`gen linearize`: learn hedgehog feature maps that make linear attention imitate a frozen
softmax model (attention transfer, Hedgehog / LoLCATs), then finetune them end to end.

    linearize(LinearizeArgs(model="smollm2", data=["a.txt", "b.txt"], out="weights/smollm2-linear"))

1. Data: each file's documents (shuffled by the seed) as BOS + text + EOS, packed into rows of
   `seq_len` tokens, the same number of tokens from each file. The last `eval_rows` rows are a
   fixed batch on which every layer's transfer loss is reported. The transfer uses the first
   `tokens` of the other rows; the finetune all `finetune_tokens` of them (default: the same rows).
   Fresh rows matter: 800 LM steps over 34,816 tokens memorised them (train loss 1.5, held-out
   perplexity worse than after 67 steps).
2. Transfer, layer by layer, with the model frozen: the softmax model's residual stream entering
   layer i (one (N, T, C) fp32 file on disk: the bounded temporary store, replaced as the layers
   advance, removed at the end) gives the post-rotary q, k, v and the target, the layer's softmax
   attention output through o_proj. Layer i's query and key maps are trained with Adam to minimise
   the MSE between that target and the same projection of linear attention (the calibration in
   issue 14: MSE of the o_proj output). Reported per layer: absolute and relative loss (MSE over
   the target's mean square), before and after.
3. Finetune (`finetune_steps`): all maps at once through the whole model run linear (or hybrid:
   the `hybrid` layers with the highest relative loss stay softmax, or the `softmax_layers` listed), loss = the LM loss
   (`finetune_loss="lm"`) or KL(softmax model || this model) on the logits ("kl"). With
   `lora_rank` R > 0, low-rank adapters on the linear layers' q/k/v and o projections
   (`engine.adapters`, LoLCATs) train beside the maps and ship as DIR/adapters.safetensors.

The model's quantized blocks (a GGUF's) are dequantized once at the start: the same fp32 math the
PyTorch forms compute, without widening every block on every call (SmolLM2's Q4_1, batch 2 x 256,
2 threads: 2.62 s a finetune step instead of 3.07).

Resumable: progress (maps, Adam state, counters) is saved after every layer and every
`save_every` finetune steps under OUT/.linearize; `resume=True` continues from there. Batches
are a function of (seed, layer, step), so a resumed run equals an uninterrupted one. `budget`
(minutes) caps the wall time: half for the transfer (split evenly over the layers), the rest for
the finetune; a run cut by the budget records the steps it made.
"""
from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.adapters import LoRA, attach, detach
from engine.attention.feature_maps import FeatureMap, hedgehog_phi
from engine.attention.hybrid import highest_loss_layers, layer_attention_for
from engine.attention.linear import linear_attention
from engine.attention.softmax import softmax_attention
from engine.attention.window import window_attention
from engine.distributed import Group, join
from engine.errors import InvalidArgumentError
from engine.runspec import RunSpec, check_window
from engine.loader import build, parse_device
from engine.quant import dequantize_model
from models.corpus import file_sha256, read_documents
from models.linearized import read_adapters, read_maps, write_adapters, write_json, write_maps
from models.registry import PACKAGED, REGISTRY, read_checkpoint, resolve

WORK = ".linearize"
FINETUNE_DTYPES = ("float32", "bfloat16")
WEIGHT_DTYPES = ("float32", "bfloat16")   # the frozen model's weights (--dtype)
FINETUNE_SCHEDULES = ("constant", "cosine")
TRANSFER_INPUTS = ("softmax", "linear")


# what an interrupted run has already computed with: a --resume must give the same (the budget, the save
# interval, the device, threads and --grad-checkpoint may change; --lora-rank and --maps-lr are checked where
# the finetune's saved state depends on them)
RESUME_SAME = ("model", "data", "seq_len", "tokens", "finetune_tokens", "eval_rows", "layer_steps", "batch_size", "lr",
               "finetune_steps", "finetune_batch", "finetune_lr", "finetune_loss", "finetune_dtype", "finetune_clip",
               "finetune_schedule", "finetune_linear_every", "decay", "decay_lr", "gate", "gate_lr", "hybrid", "softmax_layers",
               "window", "seed", "init", "control", "dtype")


def check_resume_settings(saved: dict, a: "LinearizeArgs") -> None:
    """One line naming the first setting a --resume changes (it mixed them silently: layers transferred
    on rows of one length and the rest on another, the summary recording only the last)."""
    now = json.loads(json.dumps(asdict(a)))   # as the progress file holds them (lists, not tuples)
    for key in RESUME_SAME:
        was = saved.get(key, ADDED_LATER.get(key, now[key]))   # a key older progress files lack: its default
        if was != now[key]:
            flag = "--" + key.replace("_", "-")
            if isinstance(was, bool) and isinstance(now[key], bool):   # a switch: given or not
                raise InvalidArgumentError(f"--resume {'with' if now[key] else 'without'} {flag}, but the interrupted "
                                           f"run ran {'with' if was else 'without'} it; resume as it began (or start a "
                                           f"new --out)")
            raise InvalidArgumentError(f"--resume with {flag} {shown(now[key])}, but the interrupted run used "
                                       f"{shown(was)}; resume with the same value (or start a new --out)")


def check_resume(state: dict, a: "LinearizeArgs") -> None:
    """Every setting an interrupted run's progress (`state`) fixes: RESUME_SAME, and once its finetune began
    the adapters' rank and the maps' learning rate (the optimizer's saved layout)."""
    check_resume_settings(state["args"], a)
    if state.get("finetune_done") and state["args"].get("lora_rank", 0) != a.lora_rank:
        raise InvalidArgumentError(f"--resume with --lora-rank {shown(a.lora_rank)}, but the interrupted finetune "
                                   f"used {shown(state['args'].get('lora_rank', 0))}; resume with the same value")
    if state.get("finetune_done") and state["args"].get("maps_lr") != a.maps_lr:   # another optimizer layout
        raise InvalidArgumentError(f"--resume with --maps-lr {shown(a.maps_lr)}, but the interrupted finetune "
                                   f"used {shown(state['args'].get('maps_lr'))}; resume with the same value")


ADDED_LATER = {"softmax_layers": None}   # RESUME_SAME keys a progress file written before them lacks, and their value then


def shown(value) -> str:
    """A setting as its flag takes it: [2, 9] -> 2,9; None -> (not given)."""
    if value is None:
        return "(not given)"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


@dataclass
class LinearizeArgs:
    model: str
    data: list[str]
    out: str
    seq_len: int = 256
    tokens: int = 65536            # transfer tokens (split evenly over the data files)
    finetune_tokens: int | None = None   # finetune tokens (None: the transfer's rows); more = fresh rows
    eval_rows: int = 4             # rows of the fixed batch the transfer losses are reported on
    layer_steps: int = 300
    transfer_inputs: str = "softmax"   # what layer i+1's transfer reads: the softmax model's stream, or "linear":
                                       # the stream with layers 0..i already running their transferred maps
    batch_size: int = 8
    lr: float = 1e-2
    finetune_steps: int = 100
    finetune_batch: int = 4
    finetune_lr: float = 1e-3
    maps_lr: float | None = None   # the maps' own learning rate (None: finetune_lr; with finetune_lr 0 only the maps move)
    finetune_loss: str = "lm"      # "lm" or "kl"
    finetune_dtype: str = "float32"   # the finetune's forward: "float32", or "bfloat16" under autocast
    finetune_clip: float = 0.0     # clip the finetune's gradient norm to this (0: off)
    finetune_schedule: str = "constant"   # "cosine": finetune_lr decays to 0 over finetune_steps
    finetune_linear_every: int = 0  # every N-th finetune step runs all layers linear, no window (0: never)
    grad_checkpoint: bool = False  # recompute each layer's activations in the finetune's backward (long rows)
    decay: bool = False            # learn a decay per key/value head and feature in the finetune
    decay_lr: float = 0.05         # the decay logits' learning rate (the same schedule as finetune_lr)
    gate: bool = False             # the decay depends on the token (a learned gate on its value; implies decay)
    gate_lr: float = 3e-3          # the gate's learning rate (the same schedule)
    lora_rank: int = 0             # low-rank adapters on the linear layers' q/k/v/o, trained in the finetune (0: none)
    hybrid: int = 0                # softmax layers kept during the finetune (highest relative loss)
    softmax_layers: list[int] | None = None   # or these layers kept softmax (e.g. chosen by a retrieval score)
    window: int = 0                # sliding window + linear during transfer and finetune (0: off)
    budget: float | None = None    # minutes
    seed: int = 0
    save_every: int = 10
    resume: bool = False
    init: str | None = None        # a linearized model directory: finetune from its maps (and adapters), no transfer
    control: bool = False          # the softmax control: the same finetune (adapters only) with softmax attention
    device: str = "cpu"            # where the model and the training run ("cuda": under torchrun, cuda:LOCAL_RANK)
    dtype: str = "float32"         # the frozen weights: float32, or bfloat16 (half the memory; maps, adapters fp32)
    command: str = ""
    extra: dict = field(default_factory=dict)


class StepMaps(FeatureMap):
    """One layer's maps as a FeatureMap (what the attention functions call): phi by role."""
    name = "hedgehog"

    def __init__(self, qw, qb, kw, kb):
        self.p = {"q": (qw, qb), "k": (kw, kb)}

    def out_dim(self, d):
        return 2 * d

    def __call__(self, x, layer=None, role="k"):
        return hedgehog_phi(x.float(), *self.p[role])


class TransferStep(torch.nn.Module):
    """Layer i's query and key maps as parameters, and their transfer loss on a batch: the module a
    torchrun launch wraps in DistributedDataParallel (engine.distributed)."""

    def __init__(self, model, i: int, maps, window: int):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(t[i].detach().clone()) for t in
                                              (maps.q_weight, maps.q_bias, maps.k_weight, maps.k_bias)])
        self.__dict__["model"] = model    # not a submodule: the frozen model is not what trains
        self.i, self.window = i, window
        self.maps = StepMaps(*self.params)

    def forward(self, q, k, v, y):
        return transfer_loss(self.model, self.i, self.maps, q, k, v, y, self.window)


class Trainee(torch.nn.Module):
    """What the finetune trains: the model (its maps, decay, gate) and the adapters, as one module (the
    unit DistributedDataParallel averages gradients over)."""

    def __init__(self, model, lora):
        super().__init__()
        self.model, self.lora = model, lora

    def forward(self, tokens, spec=None):
        return self.model(tokens, spec=spec)


def check_args(a: LinearizeArgs) -> None:
    """Bad input: one line (InvalidArgumentError), before anything is written."""
    if not a.data:
        raise InvalidArgumentError("give at least one --data file")
    if a.finetune_tokens is not None and a.finetune_tokens < a.tokens:
        raise InvalidArgumentError(f"--finetune-tokens must be at least --tokens ({a.tokens}), got {a.finetune_tokens}")
    for name, v in (("tokens", a.tokens), ("batch_size", a.batch_size),
                    ("finetune_batch", a.finetune_batch), ("save_every", a.save_every)):
        if v < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if a.seq_len < 2:   # one token: attention sees only itself (linear = softmax), and the finetune predicts nothing
        raise InvalidArgumentError(f"--seq-len must be at least 2 (a row of one token has nothing to learn from), "
                                   f"got {a.seq_len}")
    for name, v in (("layer_steps", a.layer_steps), ("finetune_steps", a.finetune_steps), ("hybrid", a.hybrid),
                    ("lora_rank", a.lora_rank), ("finetune_linear_every", a.finetune_linear_every)):
        if v < 0:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be 0 or more, got {v}")
    check_window(a.window or None)   # 0: no window
    if a.softmax_layers is not None:
        if a.hybrid:
            raise InvalidArgumentError("give --hybrid K (the K layers of highest transfer loss) or --softmax-layers "
                                       "LIST, not both")
        if not a.softmax_layers:
            raise InvalidArgumentError("--softmax-layers names no layer: give layer numbers like 2,9,11 (none at "
                                       "all: leave the option out)")
    if a.finetune_loss not in ("lm", "kl"):
        raise InvalidArgumentError(f"--finetune-loss must be lm or kl, got {a.finetune_loss!r}")
    if a.finetune_dtype not in FINETUNE_DTYPES:
        raise InvalidArgumentError(f"--finetune-dtype must be one of {', '.join(FINETUNE_DTYPES)}, "
                                   f"got {a.finetune_dtype!r}")
    if a.dtype not in WEIGHT_DTYPES:
        raise InvalidArgumentError(f"--dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {a.dtype!r}")
    if a.finetune_schedule not in FINETUNE_SCHEDULES:
        raise InvalidArgumentError(f"--finetune-schedule must be one of {', '.join(FINETUNE_SCHEDULES)}, "
                                   f"got {a.finetune_schedule!r}")
    if a.transfer_inputs not in TRANSFER_INPUTS:
        raise InvalidArgumentError(f"--transfer-inputs must be one of {', '.join(TRANSFER_INPUTS)}, "
                                   f"got {a.transfer_inputs!r}")
    if a.transfer_inputs != "softmax" and (a.init is not None or a.control):
        raise InvalidArgumentError(f"--transfer-inputs: a {'--control' if a.control else '--init'} run has no "
                                   "transfer; leave it out")
    for name, v in (("lr", a.lr), ("finetune_lr", a.finetune_lr), ("maps_lr", a.maps_lr), ("decay_lr", a.decay_lr),
                    ("gate_lr", a.gate_lr), ("finetune_clip", a.finetune_clip), ("budget", a.budget)):
        if v is not None and not math.isfinite(v):   # NaN passes every comparison below
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be a finite number, got {v}")
    if a.finetune_clip < 0:
        raise InvalidArgumentError(f"--finetune-clip must be 0 (off) or more, got {a.finetune_clip}")
    # learning rates: 0 freezes what it drives (--lr 0: the transfer's maps; --finetune-lr 0: the adapters)
    for name, v in (("lr", a.lr), ("finetune_lr", a.finetune_lr), ("maps_lr", a.maps_lr)):
        if v is not None and v < 0:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be 0 or more, got {v}")
    if a.maps_lr is not None and a.control:
        raise InvalidArgumentError("--maps-lr: a --control run has no maps to train; leave it out")
    if a.decay_lr <= 0:
        raise InvalidArgumentError(f"--decay-lr must be positive, got {a.decay_lr}")
    if a.gate_lr <= 0:
        raise InvalidArgumentError(f"--gate-lr must be positive, got {a.gate_lr}")
    if a.budget is not None and a.budget <= 0:
        raise InvalidArgumentError(f"--budget must be a positive number of minutes, got {a.budget}")
    seen = {}
    for path in a.data:               # one file given twice was read twice: twice its share of every row mix
        key = Path(path).resolve()
        if key in seen:
            raise InvalidArgumentError(f"--data {path} is given twice ({seen[key]} already): give each file once")
        seen[key] = path
    for path in a.data:
        read_documents(path)          # raises on a missing, non-UTF-8 or empty file
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(p.name != WORK for p in out.iterdir()) and not a.resume:
        raise InvalidArgumentError(f"{out}: directory is not empty; give a new --out (or --resume an interrupted run)")
    if (out / WORK / "progress.json").is_file() and not a.resume:   # (run again, it started over: the work was lost)
        raise InvalidArgumentError(f"{out}: holds an interrupted run; add --resume to continue it, or give a new --out")
    if a.resume and not (out / WORK / "progress.json").is_file():
        raise InvalidArgumentError(f"{out}: nothing to resume (no {WORK}/progress.json); run without --resume")
    if a.resume:   # a changed setting: one line now, before the model and the data are read
        try:
            saved = json.loads((out / WORK / "progress.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"{out / WORK / 'progress.json'}: cannot be read ({e}); start a new --out") \
                from None
        if not isinstance(saved, dict) or not isinstance(saved.get("args"), dict):
            raise InvalidArgumentError(f"{out / WORK / 'progress.json'}: not a gen linearize progress file; start a "
                                       f"new --out")
        check_resume(saved, a)
    if a.init is not None:
        init_config(a)
    if a.control:
        check_control(a)


def check_control(a: LinearizeArgs) -> None:
    """--control trains the adapters alone with softmax attention: it needs them and a finetune, and
    takes none of the linear-attention options."""
    if not a.lora_rank or not a.finetune_steps:
        raise InvalidArgumentError("--control trains low-rank adapters in the finetune: give --lora-rank R and "
                                   "--finetune-steps N, as for the linearized run it is the control of")
    given = [flag for flag, on in (("--hybrid", a.hybrid), ("--softmax-layers", a.softmax_layers),
                                   ("--window", a.window), ("--decay", a.decay),
                                   ("--gate", a.gate),
                                   ("--finetune-linear-every", a.finetune_linear_every),
                                   ("--finetune-loss kl", a.finetune_loss == "kl")) if on]
    if given:
        raise InvalidArgumentError(f"--control runs softmax attention only; drop {', '.join(given)}")


def init_config(a: LinearizeArgs) -> None:
    """Checks --init DIR against the run: a linearize output (config.json, maps, losses) made from the
    same base model, with adapters of the run's --lora-rank if it has any (without, as after a
    transfer-only run, the finetune starts fresh ones; one line otherwise). A --control run
    continues a control: DIR holds adapters on every layer (config "adapters_on": "all") and no maps."""
    d = Path(a.init)
    if a.control:
        cfg = init_json(d) if (d / "config.json").is_file() else {}
        if cfg.get("adapters_on") != "all" or not (d / "adapters.safetensors").is_file():
            raise InvalidArgumentError(f"--init {d}: not a `gen linearize --control` output (a control continues "
                                       "a control's adapters)")
        if not same_model(cfg.get("base_model"), a.model):
            raise InvalidArgumentError(f"--init {d}: made from {cfg.get('base_model')!r}, not --model {a.model!r}")
        if cfg.get("lora_rank") != a.lora_rank:
            raise InvalidArgumentError(f"--init {d}: its adapters have rank {cfg.get('lora_rank')}; "
                                       f"give --lora-rank {cfg.get('lora_rank')}")
        return
    missing = [n for n in ("config.json", "maps.safetensors", "transfer_losses.json") if not (d / n).is_file()]
    if missing:
        raise InvalidArgumentError(f"--init {d}: not a `gen linearize` output (no {', '.join(missing)})")
    cfg = init_json(d)
    if not same_model(cfg.get("base_model"), a.model):
        raise InvalidArgumentError(f"--init {d}: made from {cfg.get('base_model')!r}, not --model {a.model!r}")
    if (d / "adapters.safetensors").is_file():   # without: fresh adapters of --lora-rank (a transfer-only output)
        rank = cfg.get("lora_rank", 0)
        if rank != a.lora_rank:
            raise InvalidArgumentError(f"--init {d}: its adapters have rank {rank}; give --lora-rank {rank}")


def kept_from_init(a: LinearizeArgs) -> dict:
    """The run settings of --init DIR's config that a further stage keeps: its sparse cache (`sparse_keys`),
    when this run trains the same window (the output, loaded as a model, then runs DIR's cache). Not its
    `variants` (other sets, named by paths relative to DIR): a shipped directory names those by hand. For a
    linearized --init (a control runs no window)."""
    if not a.window:
        return {}
    cfg = init_json(Path(a.init))
    keys = cfg.get("sparse_keys")
    return {"sparse_keys": keys} if keys and cfg.get("window") == a.window else {}


def init_transfer_inputs(d: Path) -> str | None:
    """The stream --init DIR's transfer learned on (its linearize.json; runs before the flag: the softmax
    model's), None where DIR has no readable record of it."""
    try:
        run = json.loads((d / "linearize.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(run, dict):
        return None
    return run.get("transfer_inputs") or (run.get("args") or {}).get("transfer_inputs", "softmax")


def init_json(d: Path) -> dict:
    """--init DIR's config.json as a dict (one line where it is not a JSON object)."""
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"--init {d}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise InvalidArgumentError(f"--init {d}: config.json holds no JSON object; give a `gen linearize` output")
    return cfg


# ---------------------------------------------------------------------- data
def base_model_name(model: str) -> str:
    """What an output records as its base model: a registered name as given, a path made absolute (a
    relative one loaded only from the directory the run was started in)."""
    if model in REGISTRY or model in PACKAGED or not os.path.exists(model):
        return model
    return os.path.abspath(model)


def same_model(recorded, model: str) -> bool:
    """`--init`'s base model and --model name one model (a path as typed or made absolute)."""
    return isinstance(recorded, str) and base_model_name(recorded) == base_model_name(model)


def build_rows(tok, a: LinearizeArgs) -> tuple[torch.Tensor, list[dict]]:
    """(N, seq_len) int64 rows, the same number of tokens from each file, and what was used."""
    total = max(a.tokens, a.finetune_tokens or 0)
    per_file = total // len(a.data) + a.eval_rows * a.seq_len // len(a.data) + a.seq_len
    rows, used = [], []
    for path in a.data:
        docs = read_documents(path)
        random.Random(a.seed).shuffle(docs)
        stream, n_docs = [], 0
        for doc in docs:
            stream += tok.encode(doc, bos=True, eos=True)
            n_docs += 1
            if len(stream) >= per_file:
                break
        n = len(stream) // a.seq_len
        if n == 0:
            raise InvalidArgumentError(f"{path}: holds fewer than {a.seq_len} tokens; give more text")
        rows.append(torch.tensor(stream[:n * a.seq_len]).view(n, a.seq_len))
        used.append({"file": str(path), "sha256": file_sha256(path), "documents_used": n_docs,
                     "documents_in_file": len(docs), "tokens_used": n * a.seq_len})
    # interleave the files' rows so the eval rows and every batch mix them
    n = min(r.shape[0] for r in rows)
    for u in used:   # the same number of rows from each file
        u["tokens_used"] = n * a.seq_len
    mixed = torch.stack([r[:n] for r in rows], 1).flatten(0, 1)
    if mixed.shape[0] <= a.eval_rows:   # (none left to train on: a traceback deep in the transfer, files left)
        raise InvalidArgumentError(f"--data makes {mixed.shape[0]} rows of --seq-len {a.seq_len} tokens; the run needs "
                                   f"more than the {a.eval_rows} kept for the transfer losses: give more text or a "
                                   f"shorter --seq-len")
    return mixed, used


# ---------------------------------------------------------------------- one layer
def layer_qkv(model, i: int, x: torch.Tensor):
    """x (B, T, C) entering layer i -> post-rotary q (B, H, T, D), k, v (B, Hkv, T, D) and the layer's o_proj."""
    layer = model.layers[i]
    B, T, _ = x.shape
    rope = model.rotary(torch.arange(T, device=x.device).expand(B, T), x.dtype) if model.rotary is not None else None
    return layer.self_attn.heads(layer.input_layernorm(x), rope)


def project(model, i, out):   # (B, H, T, D) -> (B, T, C) through layer i's o_proj
    B, H, T, D = out.shape
    return model.layers[i].self_attn.o_proj(out.transpose(1, 2).reshape(B, T, H * D))


def linear_out(maps: FeatureMap, q, k, v, window: int):
    if window:
        return window_attention(q, k, v, maps, window)
    return linear_attention(q, k, v, maps)


@torch.no_grad()
def layer_targets(model, i, xs: np.ndarray, batch: int):
    """For every row: q, k, v (fp32) and the softmax target through o_proj."""
    qs, ks, vs, ys = [], [], [], []
    for s in range(0, xs.shape[0], batch):
        x = torch.from_numpy(np.array(xs[s:s + batch])).to(model.device, model.dtype)
        q, k, v = layer_qkv(model, i, x)
        ys.append(project(model, i, softmax_attention(q, k, v)))
        qs.append(q), ks.append(k), vs.append(v)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(ys)


@torch.no_grad()
def advance(model, i, xs: np.ndarray, out: np.ndarray, batch: int, maps: FeatureMap | None = None,
            window: int = 0) -> None:
    """The residual stream after layer i (the next layer's input): through softmax attention (the
    softmax model's stream), or with `maps` through layer i's linear attention (`--transfer-inputs
    linear`: every later layer learns on the stream the linearized layers before it write)."""
    if maps is None:
        attend = lambda q, k, v: softmax_attention(q, k, v)   # noqa: E731
    else:
        attend = lambda q, k, v: linear_out(maps, q, k, v, window).to(q.dtype)   # noqa: E731
    for s in range(0, xs.shape[0], batch):
        x = torch.from_numpy(np.array(xs[s:s + batch])).to(model.device, model.dtype)
        T = x.shape[1]
        rope = (model.rotary(torch.arange(T, device=x.device).expand(x.shape[0], T), x.dtype)
                if model.rotary is not None else None)
        out[s:s + batch] = model.layers[i](x, rope, attend).float().cpu().numpy()


def transfer_loss(model, i, maps, q, k, v, y, window):
    pred = project(model, i, linear_out(maps, q, k, v, window))
    return F.mse_loss(pred.float(), y.float())   # (16-bit weights: the loss in fp32)


# ---------------------------------------------------------------------- the run
class Progress:
    """OUT/.linearize: progress.json, maps.pt (maps + optimizer state), x_<layer>.npy."""

    def __init__(self, out: Path, writes: bool = True):
        self.dir = out / WORK
        self.file = self.dir / "progress.json"
        self.writes = writes   # False: a rank other than 0 of a torchrun launch (it only reads)

    def load(self) -> dict:
        return json.loads(self.file.read_text()) if self.file.is_file() else {}

    def save(self, state: dict, tensors: dict) -> None:
        if not self.writes:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "maps.pt.tmp"
        torch.save(tensors, tmp)
        os.replace(tmp, self.dir / "maps.pt")
        write_json(self.file, state)

    def tensors(self) -> dict:
        return torch.load(self.dir / "maps.pt", weights_only=True, map_location="cpu")


def linearize(a: LinearizeArgs, log=print, on_step=None) -> dict | None:
    """Run the recipe; returns the summary written to OUT/linearize.json. `on_step(phase, layer, step)`
    is called after every optimizer step (tests raise KeyboardInterrupt from it).

    Under torchrun (WORLD_SIZE > 1; engine.distributed) every rank runs this: each takes its slice of
    every global batch (--batch-size, --finetune-batch: multiples of the world size), gradients are
    averaged by DistributedDataParallel, and rank 0 alone writes OUT and logs; the other ranks return
    None. OUT must be on a filesystem every rank sees (rank 0 writes the residual stream there)."""
    check_args(a)
    g = join(parse_device(a.device))
    try:
        g.check_batch("--batch-size", a.batch_size)
        g.check_batch("--finetune-batch", a.finetune_batch)
        g.barrier()   # every rank has checked OUT before rank 0 writes to it
        return _linearize(a, g, log if g.main else (lambda m: None), on_step)
    finally:
        g.close()


def _linearize(a: LinearizeArgs, g: Group, log, on_step) -> dict | None:
    ckpt = read_checkpoint(resolve(a.model))
    if ckpt.tokenizer is None:
        raise InvalidArgumentError(f"{a.model}: ships no tokenizer; linearize needs one to encode the data")
    cfg = ckpt.config.replace(feature_map="hedgehog", attention="linear", layer_attention=None,
                              window=a.window, transfer_loss=None)
    if a.hybrid >= cfg.num_hidden_layers:   # before anything is written: every layer softmax linearizes nothing
        raise InvalidArgumentError(f"--hybrid {a.hybrid}: the model has {cfg.num_hidden_layers} layers, and --hybrid K "
                                   f"must leave at least one linear; give at most {cfg.num_hidden_layers - 1}")
    if a.softmax_layers:   # each layer exists, once, and one at least stays linear
        layer_attention_for(cfg.num_hidden_layers, a.softmax_layers)
        if len(a.softmax_layers) >= cfg.num_hidden_layers:
            raise InvalidArgumentError(f"--softmax-layers names all {cfg.num_hidden_layers} layers: leave at least "
                                       f"one linear")
    model = build(cfg, ckpt.tensors, g.device, getattr(torch, a.dtype), interleaved_rotary=ckpt.interleaved_rotary)
    dequantize_model(model)   # the same fp32 math, without widening every block on every call
    for p in model.parameters():
        p.requires_grad_(False)
    maps = model.hedgehog.float()   # trained in fp32 whatever the frozen weights' dtype
    if a.gate:    # (a resumed or --init run also takes one below when its maps carry one)
        maps.add_gate()
    elif a.decay:
        maps.add_decay()
    out = Path(a.out)
    progress = Progress(out, writes=g.main)
    t0 = time.monotonic()
    deadline = t0 + a.budget * 60 if a.budget else None
    rows, used = build_rows(ckpt.tokenizer, a)
    eval_rows, train_rows = rows[-a.eval_rows:], rows[:-a.eval_rows]
    transfer_rows = train_rows[:max(1, a.tokens // a.seq_len)]
    have = train_rows.shape[0] * a.seq_len
    if have < a.tokens:   # (it went on with what there was, unsaid)
        log(f"note: --data gives {have:,} training tokens, fewer than --tokens {a.tokens:,}: the transfer uses those")
    if a.finetune_tokens and have < a.finetune_tokens:
        log(f"note: --data gives {have:,} training tokens, fewer than --finetune-tokens {a.finetune_tokens:,}: the "
            f"finetune draws its rows from those")
    L = cfg.num_hidden_layers
    state = progress.load() if a.resume else {}
    data_sha256 = [u["sha256"] for u in used]   # what a --resume checks its text by
    if state:   # (its settings were checked with the arguments: check_args)
        was = state.get("data_sha256")
        if was is not None and was != data_sha256:   # the same names, other text: the layers done learned on the old one
            changed = next(u["file"] for u, w in zip(used, was) if u["sha256"] != w)
            raise InvalidArgumentError(f"--resume with --data {changed} changed since the interrupted run began "
                                       f"(its sha256 differs); resume with the same text (or start a new --out)")
    # the later layers of an interrupted transfer learn on the stream the earlier ones did
    if state and state["layers_done"] < L and state.get("transfer_inputs", "softmax") != a.transfer_inputs:
        raise InvalidArgumentError(f"--resume with --transfer-inputs {a.transfer_inputs}, but the interrupted "
                                   f"transfer used {state.get('transfer_inputs', 'softmax')}; resume with the same value")
    if state:
        saved = progress.tensors()
        maps.add_parts_of(saved["maps"])
        maps.load_state_dict(saved["maps"])
        log(f"resuming: {state['layers_done']} layers transferred, {state['finetune_done']} finetune steps done")
    elif a.control:   # no maps, no transfer: the adapters alone (a fresh pair, or --init's), softmax attention
        saved = None
        if a.init is not None:
            init_lora = LoRA.for_config(cfg, a.lora_rank, a.seed)
            init_lora.load_export(read_adapters(Path(a.init) / "adapters.safetensors", cfg))
            saved = {"lora": init_lora.state_dict()}
            log(f"starting from {a.init}: its adapters")
        state = {"layers_done": L, "finetune_done": 0, "losses": [], "finetune_log": [], "seconds": 0.0,
                 "args": asdict(a), "data_sha256": data_sha256,
                 "losses_measured": "none: a softmax control has no transfer"}
        progress.save(state, {"maps": maps.state_dict(), **(saved or {})})
    elif a.init is not None:   # the transfer is the init's: its maps, adapters and per-layer losses
        d = Path(a.init)
        init_maps = {k.removeprefix("hedgehog."): v.float() for k, v in read_maps(d / "maps.safetensors", cfg).items()}
        maps.add_parts_of(init_maps)
        maps.load_state_dict({**maps.state_dict(), **init_maps})   # --decay / --gate on maps without: fresh
        saved = None
        if a.lora_rank and (d / "adapters.safetensors").is_file():   # else fresh ones, as after a transfer
            init_lora = LoRA.for_config(cfg, a.lora_rank, a.seed)
            init_lora.load_export(read_adapters(d / "adapters.safetensors", cfg))
            saved = {"lora": init_lora.state_dict()}
        losses = json.loads((d / "transfer_losses.json").read_text(encoding="utf-8"))
        if len(losses["layers"]) != L:
            raise InvalidArgumentError(f"--init {d}: {len(losses['layers'])} layers of transfer losses, the model has {L}")
        state = {"layers_done": L, "finetune_done": 0, "losses": losses["layers"], "finetune_log": [], "seconds": 0.0,
                 "args": asdict(a), "data_sha256": data_sha256,
                 "losses_measured": f"{losses['loss']} (the transfer of --init {d})",
                 "kept_from_init": kept_from_init(a),   # read now (and saved for --resume), not when DIR may be gone
                 "transfer_inputs": init_transfer_inputs(d)}
        progress.save(state, {"maps": maps.state_dict(), **(saved or {})})
        log(f"starting from {d}: its maps{' and adapters' if saved else ''}, no transfer")
    else:
        state = {"layers_done": 0, "finetune_done": 0, "losses": [], "finetune_log": [], "seconds": 0.0,
                 "args": asdict(a), "data_sha256": data_sha256, "transfer_inputs": a.transfer_inputs}
        saved = None
        if g.main:
            layer_rows = torch.cat([transfer_rows, eval_rows])
            progress.dir.mkdir(parents=True, exist_ok=True)
            x0 = np.lib.format.open_memmap(progress.dir / "x_0.npy", "w+", np.float32,
                                           (layer_rows.shape[0], a.seq_len, cfg.hidden_size))
            with torch.no_grad():
                for s in range(0, layer_rows.shape[0], a.batch_size):
                    x0[s:s + a.batch_size] = model.embed_tokens(layer_rows[s:s + a.batch_size].to(g.device)).float().cpu().numpy()
            x0.flush()
            del x0
        progress.save(state, {"maps": maps.state_dict()})
    g.barrier()   # rank 0's x_0.npy (and progress) are on disk
    # ----------------------------------------------------------------- transfer
    share = 0.5 if a.finetune_steps else 0.95
    per_layer = (a.budget * 60 * share / L) if a.budget else None
    bar = tqdm(total=L, initial=state["layers_done"], desc="transfer", unit="layer", dynamic_ncols=True,
               disable=not g.main)
    for i in range(state["layers_done"], L):
        t_layer = time.monotonic()
        xs = np.load(progress.dir / f"x_{i}.npy", mmap_mode="r")
        q, k, v, y = layer_targets(model, i, xs, a.batch_size)
        n_train = transfer_rows.shape[0]
        ev = slice(n_train, n_train + a.eval_rows)
        y_ms = float(y[ev].float().pow(2).mean())
        step_net = TransferStep(model, i, maps, a.window)
        step_maps, params = step_net.maps, list(step_net.params)
        with torch.no_grad():
            before = float(transfer_loss(model, i, step_maps, q[ev], k[ev], v[ev], y[ev], a.window))
        net = g.wrap(step_net)
        opt = torch.optim.Adam(params, lr=a.lr)
        steps = 0
        for steps in range(1, a.layer_steps + 1):
            gen = torch.Generator().manual_seed(a.seed * 1_000_003 + i * 10_007 + steps)
            idx = g.shard(torch.randint(0, n_train, (a.batch_size,), generator=gen)).to(q.device)
            loss = net(q[idx], k[idx], v[idx], y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if steps % 10 == 0:
                bar.set_postfix_str(f"layer {i} step {steps} loss {loss.item():.4g}")
            if on_step:
                on_step("transfer", i, steps)
            if per_layer and g.any(time.monotonic() - t_layer > per_layer):
                break
        with torch.no_grad():
            for t, p in zip((maps.q_weight, maps.q_bias, maps.k_weight, maps.k_bias), params):
                t[i].copy_(p)
            after = float(transfer_loss(model, i, step_maps, q[ev], k[ev], v[ev], y[ev], a.window))
        del q, k, v, y, net, step_net
        if g.main:
            nxt = np.lib.format.open_memmap(progress.dir / f"x_{i + 1}.npy.tmp", "w+", np.float32, xs.shape)
            layer_maps = (StepMaps(maps.q_weight[i], maps.q_bias[i], maps.k_weight[i], maps.k_bias[i])
                          if a.transfer_inputs == "linear" else None)
            advance(model, i, xs, nxt, a.batch_size, layer_maps, a.window)
            nxt.flush()
            del nxt
            os.replace(progress.dir / f"x_{i + 1}.npy.tmp", progress.dir / f"x_{i + 1}.npy")
        del xs
        rec = {"layer": i, "steps": steps, "loss_before": before, "loss": after, "relative_before": before / y_ms,
               "relative": after / y_ms, "target_mean_square": y_ms, "seconds": round(time.monotonic() - t_layer, 1)}
        state["losses"].append(rec)
        state["layers_done"] = i + 1
        state["seconds"] += time.monotonic() - t_layer
        progress.save(state, {"maps": maps.state_dict()})
        g.barrier()   # every rank is done with x_i; x_{i+1} is on disk
        if g.main:
            os.remove(progress.dir / f"x_{i}.npy")
        bar.update(1)
        log(f"layer {i}: {steps} steps, transfer loss {before:.4g} -> {after:.4g} "
            f"(relative {before / y_ms:.3f} -> {after / y_ms:.3f}), {rec['seconds']:.0f} s")
    bar.close()
    relative = [r["relative"] for r in state["losses"]]
    layer_attention = None if a.control else layer_attention_for(
        L, a.softmax_layers if a.softmax_layers else highest_loss_layers(relative, a.hybrid))
    # ----------------------------------------------------------------- finetune
    finetune_rows = train_rows[:a.finetune_tokens // a.seq_len] if a.finetune_tokens else transfer_rows
    state["args"]["lora_rank"] = a.lora_rank   # what the finetune's saved progress holds from here on
    state["args"]["maps_lr"] = a.maps_lr
    if a.lora_rank and not a.finetune_steps:
        log(f"--lora-rank {a.lora_rank} ignored: the adapters train in the finetune, and --finetune-steps is 0")
    lora = LoRA.for_config(cfg, a.lora_rank, a.seed).to(g.device) if a.lora_rank and a.finetune_steps else None
    if lora is not None and saved is not None and "lora" in saved:
        lora.load_state_dict(saved["lora"])
    if a.finetune_steps and state["finetune_done"] < a.finetune_steps:
        finetune(model, a, state, progress, saved, finetune_rows, layer_attention, deadline, log, on_step, lora, g)
    rows_used = {"transfer_rows": transfer_rows.shape[0], "finetune_rows": finetune_rows.shape[0],
                 "eval_rows": eval_rows.shape[0],
                 "finetune_tokens_seen": state["finetune_done"] * a.finetune_batch * a.seq_len}
    g.barrier()
    summary = None
    if g.main:
        summary = write_output(model, a, state, used, layer_attention if is_hybrid(a) else None, t0, rows_used, lora, g)
        shutil.rmtree(progress.dir, ignore_errors=True)
    g.barrier()   # the ranks leave the group together: none tears it down while rank 0 still writes
    return summary


def is_hybrid(a: LinearizeArgs) -> bool:
    """Whether the run keeps some layers softmax (--hybrid K or --softmax-layers LIST)."""
    return bool(a.hybrid or a.softmax_layers)


def finetune_lr(a: LinearizeArgs, step: int, base: float | None = None) -> float:
    """The learning rate of finetune step `step` (1-based): constant, or a half cosine from `base`
    (default: finetune_lr; the decay's group: decay_lr) at step 1 towards 0 after step finetune_steps.
    A function of the step alone, so a resumed run and an uninterrupted one take the same steps."""
    base = a.finetune_lr if base is None else base
    if a.finetune_schedule == "constant":
        return base
    return base * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / a.finetune_steps))


def step_configs(cfg, a: LinearizeArgs, layer_attention):
    """The configurations the finetune trains, as a function of the (1-based) step: the run's mix
    (--hybrid's softmax layers, --window), or, every --finetune-linear-every-th step, every layer a
    pure linear RNN (what `--attention linear` runs), so one set of maps keeps serving both."""
    if a.control:   # the control: every step softmax (its adapters sit in every layer's own projections)
        control = cfg.replace(attention="softmax", layer_attention=None, window=0)
        return lambda step: control
    mix = cfg.replace(attention="hybrid" if is_hybrid(a) else "linear",
                      layer_attention=layer_attention if is_hybrid(a) else None)
    pure = cfg.replace(attention="linear", layer_attention=None, window=0)
    return lambda step: pure if a.finetune_linear_every and step % a.finetune_linear_every == 0 else mix


def finetune(model, a, state, progress, saved, rows, layer_attention, deadline, log, on_step, lora, g=Group()):
    cfg = model.config
    hh = model.hedgehog
    decay = [hh.decay_logit] if hh.decay_logit is not None else []
    gate = [hh.gate_weight] if hh.gate_weight is not None else []
    maps = [] if a.control else [p for p in hh.parameters() if p is not hh.decay_logit and p is not hh.gate_weight]
    adapters = list(lora.parameters()) if lora is not None else []
    params = maps + adapters
    for p in params + decay + gate:
        p.requires_grad_(True)
    if lora is not None:
        attach(model, lora, into_base=a.control)
    model.checkpoint_layers = a.grad_checkpoint
    # some steps leave parameters unused (a hybrid's softmax steps read no decay; the control no maps)
    net = g.wrap(Trainee(model, lora), find_unused_parameters=True)
    if a.maps_lr is None:
        groups = [{"params": params, "base_lr": a.finetune_lr}]
    else:   # the maps on their own rate (--finetune-lr 0 --maps-lr R: the adapters stay as they are)
        groups = [{"params": adapters, "base_lr": a.finetune_lr}, {"params": maps, "base_lr": a.maps_lr}]
    if decay:   # its own learning rate: a logit that starts at -8 must travel several units
        groups.append({"params": decay, "base_lr": a.decay_lr})
    if gate:
        groups.append({"params": gate, "base_lr": a.gate_lr})
    opt = torch.optim.Adam(groups, lr=a.finetune_lr)
    params = params + decay + gate
    if saved is not None and "opt" in saved:
        opt.load_state_dict(saved["opt"])
    teacher = RunSpec.from_config(cfg, attention="softmax")   # runs, not configs: model.config stays as built
    student_configs = step_configs(cfg, a, layer_attention)
    student_at = lambda step: RunSpec.from_config(student_configs(step))  # noqa: E731
    precision = functools.partial(torch.autocast, g.device.type, dtype=torch.bfloat16,
                                  enabled=a.finetune_dtype == "bfloat16")
    bar = tqdm(total=a.finetune_steps, initial=state["finetune_done"], desc="finetune", unit="step",
               dynamic_ncols=True, disable=not g.main)
    t_last = time.monotonic()
    for step in range(state["finetune_done"] + 1, a.finetune_steps + 1):
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + 7_777_777 + step)
        batch = g.shard(rows[torch.randint(0, rows.shape[0], (a.finetune_batch,), generator=gen)]).to(g.device)
        student = student_at(step)
        with precision():
            logits = net(batch[:, :-1], spec=student).float()
        if a.finetune_loss == "lm":
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        else:
            with torch.no_grad(), precision():
                target = F.log_softmax(model(batch[:, :-1], spec=teacher).float(), -1)
            loss = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean") / logits.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = finetune_lr(a, step, group["base_lr"])
        if a.finetune_clip:
            torch.nn.utils.clip_grad_norm_(params, a.finetune_clip)
        opt.step()
        loss = g.mean(loss).item()   # the whole batch's loss (each rank's is its slice's)
        state["finetune_done"] = step
        state["finetune_log"].append([step, round(loss, 5)])
        bar.update(1)
        bar.set_postfix_str(f"{a.finetune_loss} loss {loss:.4f}")
        if on_step:
            on_step("finetune", None, step)
        out_of_time = deadline is not None and g.any(time.monotonic() > deadline)
        if step % a.save_every == 0 or step == a.finetune_steps or out_of_time:
            now = time.monotonic()
            state["seconds"] += now - t_last
            t_last = now
            progress.save(state, {"maps": model.hedgehog.state_dict(), "opt": opt.state_dict(),
                                  **({"lora": lora.state_dict()} if lora is not None else {})})
        if out_of_time:
            log(f"budget reached after {step} finetune steps")
            break
    bar.close()
    for p in params:
        p.requires_grad_(False)
    if lora is not None:
        detach(model)


def write_output(model, a, state, used, layer_attention, t0, rows_used, lora=None, g=Group()) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    L = model.config.num_hidden_layers
    relative = [round(r["relative"], 6) for r in state["losses"]]
    if not a.control:
        write_maps(out / "maps.safetensors", {f"hedgehog.{k}": v for k, v in model.hedgehog.state_dict().items()})
    if lora is not None:
        write_adapters(out / "adapters.safetensors", lora.export())
    if a.control:
        config = {"base_model": base_model_name(a.model), "attention": "softmax", "adapters_on": "all"}
    else:
        config = {"base_model": base_model_name(a.model), "feature_map": "hedgehog",
                  "attention": "hybrid" if layer_attention else "linear", "window": a.window,
                  "transfer_loss": relative}
    if layer_attention:
        config["layer_attention"] = list(layer_attention)
    if lora is not None:
        config["lora_rank"] = a.lora_rank
    config.update(state.get("kept_from_init", {}))
    stream = state.get("transfer_inputs", "softmax")   # (progress saved before the flag: the softmax stream)
    what = state.get("losses_measured",   # --init: the losses are its transfer's, measured on its rows
                     f"MSE of the o_proj output of linear vs softmax attention, on a fixed batch of {a.eval_rows} "
                     f"rows x {a.seq_len} tokens; relative = loss / the target's mean square; each layer's "
                     + ("inputs: the stream of the linearized layers before it (--transfer-inputs linear)"
                        if stream == "linear" else "inputs: the softmax model's stream"))
    write_json(out / "transfer_losses.json", {"loss": what, "layers": state["losses"]})
    write_json(out / "data.json", {"files": used, "seq_len": a.seq_len, "seed": a.seed, **rows_used,
                                   "format": "per file: documents shuffled by the seed, BOS + text + EOS, "
                                             "packed into rows, the files' rows interleaved; the last "
                                             "eval_rows are the fixed transfer-loss batch, the transfer "
                                             "uses the first transfer_rows of the others, the finetune "
                                             "draws from the first finetune_rows"})
    summary = {"command": a.command, "args": asdict(a), "layers": L,
               "transfer_inputs": None if a.control else stream,   # the transfer's (an --init's: DIR's)
               "finetune_steps_done": state["finetune_done"], "finetune_loss": a.finetune_loss,
               "finetune_dtype": a.finetune_dtype, "finetune_clip": a.finetune_clip,
               "finetune_schedule": a.finetune_schedule, "finetune_linear_every": a.finetune_linear_every,
               "finetune_log": state["finetune_log"], "device": str(g.device), "processes": g.world,
               "compute_seconds": round(state["seconds"], 1),
               "wall_seconds_this_run": round(time.monotonic() - t0, 1),
               "mean_relative_transfer_loss": sum(relative) / max(len(relative), 1)}
    write_json(out / "linearize.json", summary)
    write_json(out / "config.json", config)     # last: a directory with config.json is complete
    return summary


__all__ = ["LinearizeArgs", "linearize", "check_args"]
