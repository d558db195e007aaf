"""Train a small decoder-only model (and its tokenizer) on a corpus of documents.

    gen train --train train.txt --valid valid.txt --out runs/tiny --export weights/tiny

Every document becomes BOS + text + EOS; the token stream is cut into random windows.
`--paths softmax,linear` trains one set of weights on the mean of both paths' losses, so
one checkpoint serves both. Checkpoints (`OUT/checkpoint.pt`) are written atomically every
`--save-every` steps; starting again with the same OUT resumes from the last one.
Batches are a pure function of (seed, step), so a resumed run sees the batches an
uninterrupted one would have; a resume that changes the model, its data or its optimisation
(RESUME_SAME, the training text, the tokenizer) is refused in one line before any work.
A run that fails before its first checkpoint removes what it created (OUT, OUT/tokenizer.model).
`--export DIR` writes the model once the checkpoint is at --steps (also when it already was);
a DIR holding anything but this run's own earlier export is refused unless `force`.
"""
from __future__ import annotations

import filecmp
import json
import math
import os
import random
import re
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.errors import CheckpointError, InvalidArgumentError
from engine.evaluate import evaluate
from engine.loader import parse_device
from engine.threads import set_threads
from engine.transformer import Transformer
from models.config import FEATURE_MAP_NAMES, LAYER_PATHS, ModelConfig
from models.corpus import file_sha256, read_documents
from models.hf_dir import remove_model_files
from models.replace import replacing
from models.tokenizer import Tokenizer, train_tokenizer
from models.weights import save_pretrained


@dataclass
class TrainArgs:
    train: str
    valid: str | None
    out: str
    export: str | None = None
    vocab_size: int = 4096
    tokenizer: str | None = None          # an existing tokenizer.model instead of training one
    dim: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int | None = None
    intermediate: int | None = None       # default: ~8/3 dim rounded to 32
    seq_len: int = 512
    batch_size: int = 16
    steps: int = 4000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    paths: tuple[str, ...] = ("softmax", "linear")
    feature_map: str = "elu1"
    linear_rope: bool = True
    seed: int = 0
    eval_every: int = 500
    eval_docs: int = 200
    save_every: int = 100
    threads: int | None = None
    export_dtype: str = "float16"
    amp: str | None = "bfloat16"          # autocast dtype for the forward pass; None: fp32
    device: str = "cpu"                   # where the model trains (cpu, cuda, cuda:N)
    stop_after: int | None = None         # save and stop at this step (the schedule still spans `steps`)
    force: bool = False                   # replace a model already in `export` (not this run's own export)
    progress: bool = True

    def model_config(self, tok: Tokenizer) -> ModelConfig:
        inter = self.intermediate or int(round(self.dim * 8 / 3 / 32) * 32)
        return ModelConfig(
            hidden_size=self.dim, intermediate_size=inter, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads or self.heads,
            vocab_size=tok.vocab_size, max_position_embeddings=self.seq_len, rms_norm_eps=1e-5,
            tie_word_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
            attention=self.paths[0], feature_map=self.feature_map, linear_rope=self.linear_rope,
            trained_for=tuple(self.paths))


AMP_DTYPES = ("bfloat16", "float16")   # what autocast runs in on the CPU and on CUDA (None: fp32)
MIN_VOCAB = 260   # the tokenizer's 256 byte pieces, unk, bos and eos, and at least one character


def check_args(a: TrainArgs) -> None:
    """Bad input: one line (InvalidArgumentError), before the tokenizer trains or OUT is created."""
    if a.tokenizer is None and a.vocab_size < MIN_VOCAB:
        raise InvalidArgumentError(f"--vocab-size must be at least {MIN_VOCAB} (256 byte pieces, 3 special ones "
                                   f"and the text's characters), got {a.vocab_size}")
    for name, v in (("dim", a.dim), ("layers", a.layers), ("heads", a.heads), ("seq_len", a.seq_len),
                    ("batch_size", a.batch_size), ("eval_every", a.eval_every), ("save_every", a.save_every),
                    ("stop_after", a.stop_after)):
        if v is not None and v < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    for name, v in (("steps", a.steps), ("warmup", a.warmup), ("eval_docs", a.eval_docs)):
        if v < 0:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be 0 or more, got {v}")
    if a.dim % a.heads:
        raise InvalidArgumentError(f"--dim must be a multiple of --heads ({a.heads}), got {a.dim}")
    if a.dim // a.heads % 2:
        raise InvalidArgumentError(f"--dim / --heads (the head size) must be even for rotary embeddings, "
                                   f"got {a.dim} / {a.heads} = {a.dim // a.heads}")
    if a.kv_heads is not None and (a.kv_heads < 1 or a.heads % a.kv_heads):
        raise InvalidArgumentError(f"--kv-heads must be at least 1 and divide --heads ({a.heads}), got {a.kv_heads}")
    if not math.isfinite(a.lr) or a.lr < 0:
        raise InvalidArgumentError(f"--lr must be a finite number, 0 or more, got {a.lr}")
    if a.amp is not None and a.amp not in AMP_DTYPES:
        raise InvalidArgumentError(f"--amp must be one of {', '.join(AMP_DTYPES)}, none; got {a.amp!r}")
    if not a.paths or any(p not in LAYER_PATHS for p in a.paths):
        raise InvalidArgumentError(f"--paths must list attention paths of {', '.join(LAYER_PATHS)}, "
                                   f"e.g. softmax,linear; got {','.join(a.paths)!r}")
    if a.feature_map not in FEATURE_MAP_NAMES:
        raise InvalidArgumentError(f"--feature-map must be one of {', '.join(FEATURE_MAP_NAMES)}, got {a.feature_map!r}")
    if a.tokenizer is not None and not os.path.isfile(a.tokenizer):
        raise InvalidArgumentError(f"--tokenizer {a.tokenizer}: no such file; give a tokenizer.model")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise InvalidArgumentError(f"{a.out}: exists and is not a directory")
    # any other rule of the model's config, on a stand-in vocabulary (the real one comes with the tokenizer)
    a.model_config(SimpleNamespace(vocab_size=MIN_VOCAB, bos_id=1, eos_id=2))


def trained_tokenizer(docs: list[str], path: str, vocab_size: int) -> None:
    """train_tokenizer, with SentencePiece's word on a --vocab-size this text cannot fill as one line."""
    try:
        train_tokenizer(docs, path, vocab_size)
    except RuntimeError as e:
        low = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        high = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", str(e))
        if low:
            raise InvalidArgumentError(f"--vocab-size {vocab_size} is too small for this text: give at least "
                                       f"{low.group(1)} (256 byte pieces, 3 special ones and its characters)") from None
        if high:
            raise InvalidArgumentError(f"--vocab-size {vocab_size} is more pieces than this text yields: give at most "
                                       f"{high.group(1)}, or more text") from None
        raise


def lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def tokenize_corpus(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc, bos=True, eos=True)
    return torch.tensor(ids, dtype=torch.int32)


def get_batch(stream: torch.Tensor, a: TrainArgs, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - a.seq_len - 1, (a.batch_size,), generator=g)
    return torch.stack([stream[s:s + a.seq_len + 1] for s in starts.tolist()]).long()


def loss_fn(model: Transformer, batch: torch.Tensor, paths, feature_map) -> dict[str, torch.Tensor]:
    x, y = batch[:, :-1], batch[:, 1:]
    return {p: F.cross_entropy(model(x, attention=p, feature_map=feature_map).float().flatten(0, 1),
                               y.flatten()) for p in paths}


def _atomic_save(obj, path: str) -> None:
    with replacing(path) as tmp:   # a failed write (a full disk) leaves neither a half-written checkpoint nor a temporary
        torch.save(obj, tmp)


# what a resumed run must give as its checkpoint recorded it: they change the model, its data or its optimisation
# (it mixed them silently: a new --lr or --seed trained on, a new --dim was a traceback). --steps may change (more
# steps is what resuming is for), and so may --valid, the evaluation and save intervals, --stop-after, --export,
# --device and --threads; the training text and the tokenizer are compared by content (check_resume_data,
# check_tokenizer).
RESUME_SAME = ("dim", "layers", "heads", "kv_heads", "intermediate", "seq_len", "batch_size", "lr", "min_lr_ratio",
               "warmup", "weight_decay", "paths", "feature_map", "linear_rope", "seed", "amp")

EXPORTS = "exports.json"   # in OUT: the --export directories this run has written (its own: rewritten freely)
EXPORT_WRITES = {"config.json", "model.safetensors", "model.safetensors.tmp", "tokenizer.model"}   # save_pretrained's


def _flag(key: str, value) -> str:
    """A setting as the command line gives it: --lr 0.1, --paths softmax,linear, --no-linear-rope, no --kv-heads."""
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return name if value else "--no-" + key.replace("_", "-")
    if value is None:
        return f"{name} none" if key == "amp" else f"no {name}"
    if isinstance(value, (list, tuple)):
        return f"{name} {','.join(map(str, value))}"
    return f"{name} {value}"


def read_checkpoint(path: str) -> dict | None:
    """OUT/checkpoint.pt, or None where there is none; one that cannot be read is one line."""
    if not os.path.exists(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:   # a truncated file, another format, no permission
        raise CheckpointError(f"{path}: cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"remove it to start the run over, or give a new --out") from None
    if not isinstance(saved, dict) or not {"model", "optimizer", "step"} <= set(saved):
        raise CheckpointError(f"{path}: not a gen train checkpoint; remove it to start the run over, "
                              f"or give a new --out")
    return saved


def check_resume_settings(saved: dict, a: TrainArgs, ckpt: str) -> None:
    """One line naming the first setting a resumed run changes, with both values."""
    recorded = saved.get("args")
    if not isinstance(recorded, dict):
        return
    recorded = json.loads(json.dumps(recorded, default=str))   # lists, not tuples, on both sides
    now = json.loads(json.dumps(asdict(a)))
    for key in RESUME_SAME:
        if key in recorded and recorded[key] != now[key]:
            raise InvalidArgumentError(f"{_flag(key, now[key])}, but {a.out} was trained with "
                                       f"{_flag(key, recorded[key])} ({ckpt}, step {saved['step']}); resume with "
                                       f"the same value, or give a new --out")


def check_resume_data(saved: dict, a: TrainArgs, ckpt: str, digest: str) -> None:
    """The training text of a resumed run is the one it started on (by content: the file may have moved)."""
    recorded = (saved.get("args") or {}).get("train")
    if saved.get("train_sha256") is not None:
        same = saved["train_sha256"] == digest
    else:   # a checkpoint from before the text's digest was kept: by path (./data.txt is data.txt)
        same = recorded is None or os.path.realpath(recorded) == os.path.realpath(a.train)
    if not same:
        was = f" ({recorded} when the run started)" if recorded and recorded != a.train else ""
        raise InvalidArgumentError(f"--train {a.train}: not the text {a.out} was trained on{was} ({ckpt}, step "
                                   f"{saved['step']}); resume with the same text, or give a new --out")


def check_tokenizer(a: TrainArgs, tok_path: str, resumed: bool) -> None:
    """--tokenizer must be a SentencePiece model with BOS and EOS, and the one OUT already holds (a resumed
    run's); without it, OUT's tokenizer must have --vocab-size pieces. Before anything is copied or trained."""
    held = "was trained with" if resumed else "already holds"
    if a.tokenizer is not None:
        try:
            tok = Tokenizer(a.tokenizer)
        except CheckpointError as e:
            raise InvalidArgumentError(f"--tokenizer {e}; give a SentencePiece tokenizer.model") from None
        if tok.bos_id < 0 or tok.eos_id < 0:
            raise InvalidArgumentError(f"--tokenizer {a.tokenizer}: has no BOS or EOS piece (every document is "
                                       f"BOS + text + EOS); give a tokenizer with both")
        a.model_config(tok)   # any rule of the model's config on its vocabulary
        if os.path.isfile(tok_path) and not filecmp.cmp(a.tokenizer, tok_path, shallow=False):
            raise InvalidArgumentError(f"--tokenizer {a.tokenizer} differs from {tok_path}, the tokenizer {a.out} "
                                       f"{held}; give that one (--tokenizer {tok_path}), or give a new --out")
    elif os.path.isfile(tok_path):
        try:
            pieces = Tokenizer(tok_path).vocab_size
        except CheckpointError as e:
            raise InvalidArgumentError(f"{e}; remove it, or give a new --out") from None
        if pieces != a.vocab_size:
            raise InvalidArgumentError(f"--vocab-size {a.vocab_size}, but {tok_path}, the tokenizer {a.out} {held}, "
                                       f"has {pieces} pieces; give --vocab-size {pieces} (or --tokenizer {tok_path}), "
                                       f"or give a new --out")


def _own_export(a: TrainArgs, held: list[str]) -> bool:
    """Whether --export holds only what this run wrote there before (a rerun rewrites it without --force)."""
    return os.path.realpath(a.export) in _exports(a) and set(held) <= EXPORT_WRITES


def _exports(a: TrainArgs) -> list[str]:
    """The --export directories OUT/exports.json records as this run's (none where it cannot be read)."""
    try:
        with open(os.path.join(a.out, EXPORTS)) as f:
            return list(json.load(f)["dirs"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _export_holds(a: TrainArgs) -> list[str]:
    return sorted(os.listdir(a.export)) if os.path.isdir(a.export) else []


def check_export(a: TrainArgs) -> None:
    """--export: a directory, not OUT, and empty, this run's own earlier export, or `force` (before training)."""
    if a.export is None:
        return
    if os.path.exists(a.export) and not os.path.isdir(a.export):
        raise InvalidArgumentError(f"--export {a.export}: exists and is not a directory; give a directory "
                                   f"for the model")
    if os.path.realpath(a.export) == os.path.realpath(a.out):
        raise InvalidArgumentError(f"--export {a.export} is the run directory (--out); give another directory")
    held = _export_holds(a)
    if held and not a.force and not _own_export(a, held):
        more = ", ..." if len(held) > 4 else ""
        raise InvalidArgumentError(f"--export {a.export}: is not empty (holds {', '.join(held[:4])}{more}); pass "
                                   f"--force to replace the model files in it, or give a new directory")


class _Lines:
    """The run's progress lines through `log` (above any progress bar). The first that cannot be written
    (OSError: the reader left, stdout is full) is kept in `error` and no later one is tried; the training
    loop then saves its checkpoint and raises it."""

    def __init__(self, log):
        self.log, self.error = log, None

    def __call__(self, line: str) -> None:
        if self.error is not None:
            return
        try:
            with tqdm.external_write_mode():
                self.log(line)
        except OSError as e:
            self.error = e


class _Created:
    """OUT and OUT/tokenizer.model as they were before the run: what the run created of them is removed
    when it fails before its first checkpoint, so bad input leaves no files, and no tokenizer that a
    rerun would silently take."""

    def __init__(self, out: str, tok_path: str):
        self.out, self.tok_path = out, tok_path
        self.new_out, self.new_tok = not os.path.exists(out), not os.path.exists(tok_path)

    def remove(self) -> None:
        try:
            if self.new_out:
                shutil.rmtree(self.out, ignore_errors=True)
            elif self.new_tok and os.path.exists(self.tok_path):
                os.remove(self.tok_path)
        except OSError:   # the run's own error is the one to report
            pass


def train(a: TrainArgs, log=print) -> Transformer:
    """Train (or resume) the run in `a.out` and return the model. Every check of the input comes before any
    file is written; a run that fails before its first checkpoint removes what it created.

    `log` takes each progress line; the first it cannot write (OSError: the reader left, stdout is full)
    stops the run at the next whole step: the checkpoint is saved (and the export written when the run
    had finished), then that error is raised. With `a.force`, another model's files in the --export
    directory (models.hf_dir.MODEL_FILES) are removed just before this model's are written there."""
    check_args(a)
    tok_path = os.path.join(a.out, "tokenizer.model")
    ckpt = os.path.join(a.out, "checkpoint.pt")
    saved = read_checkpoint(ckpt)
    if saved is not None:
        check_resume_settings(saved, a, ckpt)
    check_tokenizer(a, tok_path, resumed=saved is not None)
    check_export(a)
    train_docs = read_documents(a.train)
    valid_docs = read_documents(a.valid)[: a.eval_docs] if a.valid else []
    digest = file_sha256(a.train)
    if saved is not None:
        check_resume_data(saved, a, ckpt, digest)
    if a.threads:
        set_threads(a.threads)
    random.seed(a.seed)
    torch.manual_seed(a.seed)

    say = _Lines(log)
    created = _Created(a.out, tok_path)
    try:
        return _train(a, say, saved, train_docs, valid_docs, digest, tok_path, ckpt)
    except BaseException:
        if not os.path.exists(ckpt):   # nothing of this run was saved: it leaves nothing behind
            created.remove()
        raise


def _train(a, say, saved, train_docs, valid_docs, digest, tok_path, ckpt) -> Transformer:
    if not os.path.exists(tok_path):
        if a.tokenizer:
            os.makedirs(a.out, exist_ok=True)
            shutil.copyfile(a.tokenizer, tok_path)   # (checked by check_tokenizer)
        else:
            say(f"training tokenizer: {a.vocab_size} pieces on {len(train_docs)} documents")
            trained_tokenizer(train_docs, tok_path, a.vocab_size)
    tok = Tokenizer(tok_path)
    stream = tokenize_corpus(tok, train_docs)
    if len(stream) <= a.seq_len + 1:
        raise InvalidArgumentError(f"{a.train}: {len(stream)} tokens, fewer than one window of {a.seq_len + 1}; "
                                   f"give more text or a smaller --seq-len")
    say(f"corpus: {len(train_docs)} documents, {len(stream)} tokens "
        f"({sum(len(d.encode()) for d in train_docs) / len(stream):.2f} bytes/token)")

    cfg = a.model_config(tok)
    model = Transformer(cfg)
    _init_weights(model, cfg)   # on the CPU, from the seed: the same initial weights on every device
    model.to(parse_device(a.device))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    step, history = 0, []
    if saved is not None:
        try:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{ckpt}: does not fit this model ({str(e).strip().splitlines()[-1].strip()}); "
                                  f"give the settings it was trained with, or a new --out") from None
        step, history = saved["step"], saved.get("history", [])
        torch.set_rng_state(saved["torch_rng"])
        say(f"resumed from {ckpt} at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, dim {cfg.hidden_size}, "
        f"paths {','.join(a.paths)}, feature map {a.feature_map}")

    def save(step: int):
        _atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                      "history": history, "torch_rng": torch.get_rng_state(), "args": asdict(a),
                      "train_sha256": digest, "config": cfg.to_dict()}, ckpt)

    end = min(a.steps, a.stop_after) if a.stop_after else a.steps
    if step >= end:
        if saved is None:   # --steps 0: the initial model, saved so the run resumes and exports like any other
            save(step)
            say(f"--steps 0: nothing to train; saved the initial model to {ckpt}")
        else:
            limit = f"--steps {a.steps}" if step >= a.steps else f"--stop-after {a.stop_after}"
            say(f"{ckpt} is already at step {step} ({limit}): nothing to train")
    else:
        step = _loop(model, opt, stream, a, step, end, history, save, valid_docs, tok, say, ckpt)
    model.eval()
    if a.export:
        if step >= a.steps:
            export(model, a, tok_path)
            say(f"exported step {step} to {a.export}")
        else:
            say(f"stopped at step {step} of {a.steps} (--stop-after): {a.export} is written when the run reaches "
                f"--steps; run the same command without --stop-after to finish it")
    if say.error is not None:
        raise say.error
    return model


def _loop(model, opt, stream, a, step, end, history, save, valid_docs, tok, say, ckpt) -> int:
    """Steps up to `end`; a Ctrl-C, or a progress line that could not be written, stops it at a whole step,
    saved."""
    bar = None
    if a.progress and say.error is None:
        bar = tqdm(total=a.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    model.train()
    t_last, tok_since = time.perf_counter(), 0
    try:
        with StopOnInterrupt() as interrupt:
            while step < end:
                if interrupt.requested or say.error is not None:   # the last step finished whole; keep it
                    save(step)
                    if say.error is not None:
                        raise say.error
                    if bar:
                        bar.close()
                        bar = None
                    say(f"interrupted: saved step {step} of {a.steps} to {ckpt}; run the same command again "
                        f"to resume")
                    raise KeyboardInterrupt
                step, t_last, tok_since = _one_step(model, opt, stream, a, step, end, bar, t_last, tok_since,
                                                    history, save, valid_docs, tok, say)
    finally:
        if bar:
            bar.close()
    return step


def _one_step(model, opt, stream, a, step, end, bar, t_last, tok_since, history, save, valid_docs, tok, log):
    """One optimizer step (+ checkpoint and evaluation when due); returns (step, t_last, tok_since)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, a)
    with torch.autocast(device_type=model.device.type, dtype=getattr(torch, a.amp or "float32"), enabled=bool(a.amp)):
        losses = loss_fn(model, get_batch(stream, a, step).to(model.device), a.paths, a.feature_map)
    loss = sum(losses.values()) / len(losses)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    step += 1
    tok_since += a.batch_size * a.seq_len
    now = time.perf_counter()
    tps = tok_since / max(now - t_last, 1e-9)
    values = {k: v.item() for k, v in losses.items()}
    history.append({"step": step, **{k: round(v, 4) for k, v in values.items()}})
    if bar:
        bar.set_postfix({**{k: f"{v:.3f}" for k, v in values.items()}, "tok/s": f"{tps:.0f}"})
        bar.update(1)
    if step % 20 == 0:
        t_last, tok_since = now, 0
    if step % a.save_every == 0 or step == end:
        save(step)
    if valid_docs and (step % a.eval_every == 0 or step == a.steps):
        model.eval()
        res = {p: evaluate(model, tok, valid_docs, attention=p, feature_map=a.feature_map) for p in a.paths}
        model.train()
        msg = "  ".join(f"{p} {r.bits_per_byte:.4f} bpb ({r.nats_per_token:.3f} nats/tok)" for p, r in res.items())
        log(f"step {step} lr {lr_at(step, a):.2e} eval: {msg}")
        history.append({"step": step, "eval": {p: r.to_dict() for p, r in res.items()}})
        save(step)
        with open(os.path.join(a.out, "history.json"), "w") as f:
            json.dump(history[-2000:], f)
    return step, t_last, tok_since


class StopOnInterrupt:
    """Within the block, the first Ctrl-C (SIGINT) only sets `requested`, so the training loop can finish
    the step it is in and save; a second Ctrl-C interrupts at once. Outside the main thread: a no-op."""

    def __init__(self):
        self.requested, self._old = False, None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:   # not the main thread: signals cannot be caught here
            self._old = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def export(model: Transformer, a: TrainArgs, tok_path: str) -> None:
    """The model into --export. Another model's files there (allowed by `force`) go first; the
    directory is recorded as this run's own before it is written, so a rerun rewrites a half-written one."""
    check_export(a)   # (it passed before training; something may have written there since)
    held = _export_holds(a)
    if held and not _own_export(a, held):   # another model's, and --force
        remove_model_files(a.export)
    path, dirs = os.path.join(a.out, EXPORTS), _exports(a)
    if os.path.realpath(a.export) not in dirs:
        with replacing(path) as tmp, open(tmp, "w") as f:
            json.dump({"dirs": dirs + [os.path.realpath(a.export)]}, f)
    save_pretrained(model, a.export, dtype=getattr(torch, a.export_dtype), tokenizer_path=tok_path)


def _init_weights(model: Transformer, cfg: ModelConfig) -> None:
    """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, mean=0.0, std=std)
