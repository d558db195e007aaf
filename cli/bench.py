"""`gen bench`: decode latency and memory of softmax vs linear attention as the context grows."""
from __future__ import annotations

import os
import shlex
import sys

import click
from click.core import ParameterSource

from cli.common import (backend_option, KV_DTYPE_HELP, check_output_path, check_stdio, device_option, fail,
                        native_backend, run_guarded, threads_option, writing_stdout)
from engine.bench import DEFAULT_CONTEXTS, BenchSettings, run_bench, write_json
from engine.bench.configs import parse_attentions
from engine.bench.output import written_in_place
from engine.errors import InvalidArgumentError
from engine.runspec import parse_dtype
from engine.bench.plot import plot, plot_format
from engine.bench.report import format_table, summary_lines
from engine.bench.sweep import WEIGHTS


def parse_contexts(ctx, param, value):
    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers such as 128,2048, got {value!r}") from None
    if not out or any(c < 1 for c in out):
        raise click.BadParameter(f"context depths must be positive integers, got {value!r}")
    return out


def parse_attention(ctx, param, value):
    try:
        return parse_attentions(value)
    except InvalidArgumentError as e:
        raise click.BadParameter(str(e)) from None


@click.command("bench", short_help="Decode time and memory of each attention path, side by side.")
@click.option("-m", "--model", "model_name", default="tiny", show_default=True, help="registered name or path")
@click.option("--contexts", callback=parse_contexts, metavar="N,N,...",
              help="context depths to sweep  [default: 128,512,2048,8192,32768]")
@click.option("--attention", default="both", show_default=True, callback=parse_attention, metavar="A,A,...",
              help="configurations, comma-separated: softmax, linear, hybrid, window, default (the model's own); "
                   "both = softmax,linear; all = softmax,linear,hybrid,window")
@click.option("--softmax-layers", help="hybrid: the layers that keep a KV cache, e.g. 2,9,11 or auto:K "
                                       "(default: the config's layer_attention)")
@click.option("--window", type=int, help="sliding window W of the window configuration (without a window entry: "
                                         "of linear and hybrid, as in gen)")
@click.option("--sparse-keys", type=int, metavar="M", help="with a window: M hard keys per layer and head kept exact "
                                                          "(as in gen; 0: off; default: the model's own)")
@click.option("--prefill-tokens", type=int, metavar="P",
              help="prefill P real tokens per depth and fill the KV cache to the depth by repeating their "
                   "keys/values (decode time depends on the depth, not the values) [default: the whole depth]")
@click.option("--feature-map", help="linear attention feature map (default: the model's)")
@click.option("--steps", default=64, show_default=True, help="timed decode steps per depth")
@click.option("--warmup", default=8, show_default=True, help="untimed decode steps before them")
@threads_option()
@click.option("--dtype", default="float32", show_default=True)
@click.option("--kv-dtype", help=KV_DTYPE_HELP)
@device_option
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the report as JSON here")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="write the two-panel plot here (PNG; .svg, .pdf and the other formats matplotlib writes by their "
                   "extension)")
@click.option("--compare-hf", is_flag=True, help="also time transformers' generate on the same checkpoint")
@click.option("--hf-new-tokens", default=128, show_default=True, help="greedy tokens per --compare-hf run")
@click.option("--hf-repeats", default=3, show_default=True, help="timed runs per side (median counts)")
@click.option("--isolate/--no-isolate", default=True, show_default=True,
              help="a fresh subprocess per configuration, so peak RSS is that configuration's own")
@backend_option
@click.option("--native", is_flag=True, help="alias of --backend native")
@click.option("--weights", "--quantize", "weights", type=click.Choice(["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]),
              help="weight type: f16/bf16 set --dtype; q8_0/q4_0/q4_1 quantize the fp32 model at load (--quantize: gen's "
                   "name for it)")
@click.option("--batch", default=1, show_default=True, help="sequences decoded together (tokens/s: aggregate)")
@click.option("--quiet", is_flag=True, help="no progress bar")
def bench_cmd(model_name, contexts, attention, softmax_layers, window, prefill_tokens, feature_map, steps, warmup,
              threads, dtype, kv_dtype, device, json_path, plot_path, compare_hf, hf_new_tokens, hf_repeats, isolate, backend,
              native, weights, batch, quiet, sparse_keys=None):
    """Prefill to each depth, then time decode steps, for each attention path, on one checkpoint.

    Prints a table and a summary naming the crossover depth; --json and --plot save them.
    """
    dtype_given = click.get_current_context().get_parameter_source("dtype") is not ParameterSource.DEFAULT

    def run():
        check_stdio()   # the table is the product: a closed stdout is one line before measuring
        if weights is not None and dtype_given and parse_dtype(dtype) != parse_dtype(WEIGHTS[weights][0]):
            fail(f"--weights {weights} runs {WEIGHTS[weights][0]} weights"
                 f"{' (quantized blocks of an fp32 model)' if WEIGHTS[weights][1] else ''}, --dtype {dtype} other ones: "
                 f"give one of them")
        if json_path and plot_path and os.path.realpath(json_path) == os.path.realpath(plot_path):
            fail(f"--json and --plot both name {plot_path}: the plot would replace the JSON; give each its own file")
        for out in (json_path, plot_path):   # fail before measuring, not after the whole run
            if out and not written_in_place(out):   # (a device or FIFO is opened, nothing created beside it)
                check_output_path(os.path.realpath(out) if os.path.islink(out) else out)   # a link: its target's
        if plot_path:
            plot_format(plot_path)   # an extension matplotlib cannot write: one line now
        settings = BenchSettings(model=model_name, contexts=contexts or DEFAULT_CONTEXTS,
                                 attentions=attention, softmax_layers=softmax_layers, window=window,
                                 sparse_keys=sparse_keys,
                                 prefill_tokens=prefill_tokens,
                                 feature_map=feature_map, steps=steps, warmup=warmup, threads=threads,
                                 dtype=dtype, kv_dtype=kv_dtype, device=device, isolate=isolate,
                                 backend=native_backend(backend, native), weights=weights, batch=batch)
        report = run_bench(settings, compare_hf=compare_hf, hf_new_tokens=hf_new_tokens,
                           hf_repeats=hf_repeats, progress=not quiet)
        report["settings"]["command"] = " ".join(["gen", *map(shlex.quote, sys.argv[1:])])
        stopped = report.get("interrupted")
        # the files first: a stdout that fails below (a full disk, a reader gone) loses no measurement; a file
        # that cannot be written (--json /dev/full) is one line after the table, which keeps the measurements
        written, unwritten = [], None
        for out, write in ((json_path, write_json), (plot_path, plot)):
            # (the JSON also when every configuration failed: its `failed` says what; a plot needs a row)
            if out and (report["results"] or (write is write_json and report.get("failed"))):
                try:
                    write(report, out)
                    written.append(out)
                except InvalidArgumentError as e:
                    unwritten = unwritten or str(e)
        with writing_stdout():
            if report["results"]:
                click.echo(format_table(report["results"]))
                click.echo("")
                for line in summary_lines(report):
                    click.echo(line)
            for path in written:
                click.echo(f"wrote {path}")
        for bad in report.get("failed", ()):
            click.echo(f"gen bench: {bad['error']}", err=True)
        if stopped:
            click.echo(f"gen bench: interrupted after {stopped['finished']} of {stopped['configurations']} "
                       f"configurations finished (the rows above)", err=True)
        if unwritten:
            fail(f"{unwritten}; the measurements are in the table above")
        if stopped:   # Ctrl-C first: the user stopped the run
            sys.exit(130)
        if report.get("failed"):
            n = len(report["failed"])
            fail(f"{n} configuration{'s' if n > 1 else ''} failed (above); "
                 + (("the rows that finished are in the table" + (" and the files" if written else ""))
                    if report["results"] else "none finished" + (f" ({', '.join(written)} says which failed)"
                                                                  if written else "")))
    run_guarded(run)
