"""`gen train`: train the tokenizer and a model on a corpus (see engine/train.py)."""
from __future__ import annotations

import click

from cli.common import check_stdio, device_option, run_guarded, threads_option, writing_stdout
from engine.train import AMP_DTYPES, TrainArgs, train


@click.command("train", short_help="Train a tokenizer and a small model on your documents.")
@click.option("--train", "train_file", required=True, type=click.Path(dir_okay=False), help="training corpus")
@click.option("--valid", "valid_file", type=click.Path(dir_okay=False), help="held-out corpus for evaluation")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="run directory (checkpoints); the same command again resumes it, and a resume that changes "
                   "the model, data or optimisation settings is refused (--steps may change)")
@click.option("--export", type=click.Path(file_okay=False),
              help="write the model here once the run reaches --steps (also when its checkpoint already has); "
                   "a directory holding another model is refused unless --force")
@click.option("--force", is_flag=True, help="replace the model files in a non-empty --export directory "
                                            "(as gen convert --force)")
@click.option("--vocab-size", default=4096, show_default=True)
@click.option("--tokenizer", type=click.Path(dir_okay=False), help="reuse this tokenizer.model")
@click.option("--dim", default=256, show_default=True)
@click.option("--layers", default=6, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", type=int)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--batch-size", default=32, show_default=True)
@click.option("--steps", default=800, show_default=True,
              help="train up to this step; a resumed run continues to it (0: only the tokenizer and the initial "
                   "model, saved and exported)")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--warmup", default=100, show_default=True)
@click.option("--paths", default="softmax,linear", show_default=True, help="attention paths whose losses are averaged")
@click.option("--feature-map", default="elu1", show_default=True)
@click.option("--linear-rope/--no-linear-rope", default=True, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--eval-every", default=200, show_default=True)
@click.option("--eval-docs", default=200, show_default=True)
@click.option("--save-every", default=20, show_default=True)
@threads_option("CPU threads, at most the cores this process may run on (default: PyTorch's)")
@click.option("--stop-after", type=int, help="save a checkpoint and stop at this step (resume later)")
@click.option("--amp", type=click.Choice([*AMP_DTYPES, "none"]), default="bfloat16", show_default=True,
              help="autocast dtype, or 'none'")
@device_option
def train_cmd(train_file, valid_file, out, export, paths, amp, **kw):
    """Train a tokenizer and a model on documents separated by '<|endoftext|>' lines.

    Progress lines go to stdout: a reader that leaves (`| head`) or a full stdout stops the run at the next
    whole step, its checkpoint saved (resume with the same command), as Ctrl-C does."""
    check_stdio()
    args = TrainArgs(train=train_file, valid=valid_file, out=out, export=export,
                     paths=tuple(p.strip() for p in paths.split(",") if p.strip()),
                     amp=None if amp == "none" else amp, **kw)
    unwritten = []   # the progress line stdout refused, raised again by train() once the checkpoint is saved

    def line(text: str) -> None:
        try:
            click.echo(text)
        except OSError as e:
            unwritten.append(e)
            raise

    def run():
        try:
            train(args, log=line)
        except OSError as e:
            if not any(e is u for u in unwritten):
                raise
            with writing_stdout():   # the reader left: exit 1, quietly; stdout full: one line, exit 2
                raise
    run_guarded(run)
