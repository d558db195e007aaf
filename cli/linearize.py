"""`gen linearize`: learn feature maps so linear attention imitates a softmax model (engine.linearize)."""
from __future__ import annotations

import shlex
import sys

import click

from cli.common import device_option, run_guarded, threads_option
from engine.errors import InvalidArgumentError
from engine.linearize import FINETUNE_DTYPES, FINETUNE_SCHEDULES, TRANSFER_INPUTS, WEIGHT_DTYPES, LinearizeArgs, linearize
from engine.runspec import layer_numbers
from engine.threads import set_threads


@click.command("linearize", short_help="Learn linear-attention maps that imitate a checkpoint's softmax.")
@click.option("-m", "--model", "model_name", required=True, help="registered name or path of the softmax model")
@click.option("--data", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="training text, documents separated by '<|endoftext|>' lines (repeat for several files)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="output directory (new or empty)")
@click.option("--tokens", default=65536, show_default=True, help="transfer tokens, split evenly over the files")
@click.option("--finetune-tokens", type=int, help="finetune tokens (fresh rows beyond the transfer's; "
                                                   "default: the transfer's rows)")
@click.option("--seq-len", default=256, show_default=True)
@click.option("--layer-steps", default=300, show_default=True, help="Adam steps per layer (attention transfer)")
@click.option("--transfer-inputs", type=click.Choice(TRANSFER_INPUTS), default="softmax", show_default=True,
              help="what each layer's transfer learns on: the softmax model's residual stream, or linear: the "
                   "stream of the model whose earlier layers already run their transferred maps (layer by layer "
                   "on the linearized layers' outputs; every earlier layer linear, whatever --hybrid keeps)")
@click.option("--batch-size", default=8, show_default=True, help="rows per transfer step")
@click.option("--lr", default=1e-2, show_default=True)
@click.option("--finetune-steps", default=100, show_default=True, help="end-to-end steps of all maps (0: off)")
@click.option("--finetune-batch", default=4, show_default=True)
@click.option("--finetune-lr", default=1e-3, show_default=True)
@click.option("--finetune-loss", type=click.Choice(["lm", "kl"]), default="lm", show_default=True,
              help="lm: next-token cross-entropy; kl: KL(softmax model || linear model) on the logits")
@click.option("--finetune-dtype", type=click.Choice(FINETUNE_DTYPES), default="float32", show_default=True,
              help="the finetune's forward: float32, or bfloat16 under autocast (maps and adapters stay fp32; "
                   "faster where the CPU has bf16 instructions)")
@click.option("--finetune-schedule", type=click.Choice(FINETUNE_SCHEDULES), default="constant", show_default=True,
              help="the finetune's learning rate: constant, or cosine (a half cosine from --finetune-lr to 0 "
                   "over --finetune-steps; set the steps to what the budget allows)")
@click.option("--finetune-linear-every", default=0, show_default=True,
              help="every N-th finetune step trains every layer as a pure linear RNN, no window (what "
                   "--attention linear runs), the others the --hybrid/--window mix (0: never)")
@click.option("--finetune-clip", default=0.0, show_default=True, help="clip the finetune's gradient norm (0: off)")
@click.option("--grad-checkpoint", is_flag=True,
              help="recompute each layer's activations in the finetune's backward pass instead of keeping them "
                   "(activation checkpointing): memory for long rows (8,192 tokens of SmolLM2 on a 24 GB CPU "
                   "machine) for about a third more compute; the same gradients")
@click.option("--maps-lr", type=float, default=None,
              help="the maps' own learning rate (default: --finetune-lr); with --finetune-lr 0 the adapters "
                   "stay as they are and only the maps (and a decay and gate) train")
@click.option("--decay", is_flag=True,
              help="learn a decay per key/value head and feature in the finetune: S_i = diag(g) S_{i-1} + "
                   "phi(k_i) v_i^T, still a constant-size state (with --window: a key decays from the token it "
                   "leaves the window at)")
@click.option("--decay-lr", default=0.05, show_default=True,
              help="the decay logits' learning rate (on --finetune-schedule like --finetune-lr)")
@click.option("--gate", is_flag=True,
              help="make the decay depend on the token (gated linear attention: the factor read from the "
                   "token's value by a learned gate, fresh at zero); implies --decay")
@click.option("--gate-lr", default=3e-3, show_default=True,
              help="the gate's learning rate (on --finetune-schedule like --finetune-lr)")
@click.option("--lora-rank", default=0, show_default=True,
              help="low-rank adapters of this rank on the linear layers' q/k/v/o, trained with the finetune (0: none)")
@click.option("--hybrid", default=0, show_default=True,
              help="keep the K layers of highest relative transfer loss softmax during the finetune")
@click.option("--softmax-layers", "softmax_layers", metavar="2,9,11",
              help="instead of --hybrid: keep these layers softmax during the finetune (e.g. those a retrieval "
                   "score picks: benchmarks/retrieval_layers.py); recorded as the output's layer_attention")
@click.option("--window", default=0, show_default=True, help="sliding window + linear (0: off)")
@click.option("--budget", type=float, help="wall-time budget in minutes (half transfer, half finetune)")
@click.option("--seed", default=0, show_default=True)
@click.option("--resume", is_flag=True, help="continue an interrupted run in the same --out")
@click.option("--init", "init", type=click.Path(file_okay=False),
              help="a `gen linearize` output to start from: its maps and adapters (fresh ones of --lora-rank where it "
                   "has none, as after a transfer-only run, --finetune-steps 0), its transfer losses (for "
                   "--hybrid), its sparse cache (`sparse_keys`, kept with the same --window); no transfer, only the "
                   "finetune (with --control: a control's output, its adapters)")
@click.option("--control", is_flag=True,
              help="the softmax control: the same finetune (data, --lora-rank, learning rate, seed, steps) "
                   "with softmax attention and no maps, for comparing a linearized model fairly; writes "
                   "adapters that every layer reads (load it with --model OUT)")
@threads_option()
@device_option
@click.option("--dtype", type=click.Choice(WEIGHT_DTYPES), default="float32", show_default=True,
              help="the frozen model's weights: bfloat16 holds them in half the memory (an 8B model: 16 GB, not 32); "
                   "maps, adapters and Adam stay fp32")
def linearize_cmd(model_name, data, out, tokens, finetune_tokens, seq_len, layer_steps, transfer_inputs, batch_size, lr, finetune_steps,
                  finetune_batch, finetune_lr, finetune_loss, finetune_dtype, finetune_schedule, finetune_linear_every, finetune_clip, grad_checkpoint, maps_lr, decay, decay_lr, gate, gate_lr, lora_rank, hybrid, softmax_layers, window, budget, seed, resume, init, control, threads,
                  device, dtype):
    """With the model frozen, train per-layer hedgehog maps (transfer), then finetune them end to end."""
    def run():
        set_threads(threads)
        args = LinearizeArgs(model=model_name, data=list(data), out=out, seq_len=seq_len, tokens=tokens,
                             finetune_tokens=finetune_tokens, layer_steps=layer_steps, transfer_inputs=transfer_inputs, batch_size=batch_size, lr=lr, finetune_steps=finetune_steps,
                             finetune_batch=finetune_batch, finetune_lr=finetune_lr, finetune_loss=finetune_loss, finetune_dtype=finetune_dtype,
                             finetune_clip=finetune_clip, finetune_schedule=finetune_schedule,
                             finetune_linear_every=finetune_linear_every, grad_checkpoint=grad_checkpoint, maps_lr=maps_lr,
                             decay=decay or gate, decay_lr=decay_lr, gate=gate, gate_lr=gate_lr,
                             lora_rank=lora_rank,
                             hybrid=hybrid, softmax_layers=layer_list(softmax_layers), window=window, budget=budget, seed=seed, resume=resume, init=init,
                             control=control, device=device, dtype=dtype, command="gen " + shlex.join(sys.argv[1:]))
        try:
            summary = linearize(args, log=lambda m: click.echo(m, err=True))
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted; continue with the same command plus --resume", err=True)
            raise
        if summary is None:   # a rank other than 0 of a torchrun launch: rank 0 reports
            return
        transfer = "a softmax control (no transfer)" if control else \
            f"mean relative transfer loss {summary['mean_relative_transfer_loss']:.3f}"
        click.echo(f"wrote {out}: {transfer}, {summary['finetune_steps_done']} finetune steps, "
                   f"{summary['wall_seconds_this_run']:.0f} s this run")
    run_guarded(run)


def layer_list(text: str | None) -> list[int] | None:
    """--softmax-layers "2,9,11" -> [2, 9, 11] (each layer checked against the model later)."""
    if text is None:
        return None
    if text.strip().startswith("auto:"):
        raise InvalidArgumentError(f"--softmax-layers {text}: gen linearize chooses K layers by transfer loss with "
                                   f"--hybrid K; --softmax-layers lists them (2,9,11)")
    return layer_numbers(text)
