"""`gen [OPTIONS] PROMPT`: stream a continuation to stdout, then one summary line on stderr."""
from __future__ import annotations

import json
import sys
import threading
import time
import warnings

import click
from tqdm import tqdm

from cli.common import (backend_option, dtype_options, run_options, check_stdio, fail, given, native_backend,
                        prefill_chunk_option, run_guarded, activations_option, device_option, sampling_options,
                        threads_option, writing_stdout)
from engine.api import check_text, load, make_config
from engine.errors import InvalidArgumentError
from engine.steps import DEFAULT_ACTIVATIONS, DEFAULT_PREFILL_CHUNK


@click.command("generate", short_help="Continue a prompt (the default: gen PROMPT).")
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_opt", metavar="TEXT",
              help="the prompt as an option (also when it equals a subcommand's name)")
@click.option("-f", "--file", "prompt_file", metavar="PATH",
              help="read the prompt from this UTF-8 text file (llama.cpp's -f; one trailing newline dropped)")
@click.option("--ids", metavar="1,2,3", help="a prompt of token ids instead of text (no BOS added)")
@click.option("--chat", "chat_message", metavar="TEXT",
              help="answer this one user message with the model's chat template, then exit (see `gen chat`)")
@click.option("--system", metavar="TEXT", help="with --chat: a system message before it (default: the template's own, "
                                              "if any)")
@click.option("-m", "--model", "model_name", default="tiny", show_default=True, help="registered name or path")
@run_options()
@click.option("-n", "--max-new-tokens", default=256, show_default=True, type=int)
@sampling_options({"temperature": "0.8; with --chat as gen chat", "top_k": "0; with --chat as gen chat",
                   "top_p": "1; with --chat as gen chat", "min_p": "0; with --chat as gen chat",
                   "repetition_penalty": "1; with --chat as gen chat"})
@click.option("--seed", type=int, help="default: a fresh seed, shown in the summary")
@click.option("--stop", multiple=True, help="stop before this string (repeatable)")
@device_option
@dtype_options
@click.option("-c", "--max-context", type=int, help="softmax context in tokens, prompt included "
                                                      "(default: the model's max_position_embeddings)")
@click.option("--echo", is_flag=True, help="print the prompt before the streamed continuation (not with --json)")
@backend_option
@click.option("--native", is_flag=True, help="alias of --backend native")
@threads_option()
@click.option("--quantize", type=click.Choice(["q8_0", "q4_0", "q4_1"]),
              help="keep the matrices as quantized blocks (llama.cpp layouts), dequantized inside the native step")
@click.option("-v", "--verbose", is_flag=True, help="say which step form ran and why a faster one did not")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (text, ids, finish_reason, stop_reason, stats)")
@prefill_chunk_option
@activations_option
def generate_cmd(prompt, prompt_opt, prompt_file, ids, chat_message, system, model_name, attention, softmax_layers, window, feature_map, max_new_tokens,
                 temperature,
                 top_k, top_p, min_p, repetition_penalty, seed, stop, device, dtype, kv_dtype, max_context, echo, backend, native,
                 threads, quantize, verbose, as_json, prefill_chunk, activations, sparse_keys=None):
    """Generate a continuation of PROMPT ('-' reads it from stdin) and stream it to stdout.

    A prompt equal to a subcommand's name goes after `--` (`gen -- bench`) or in --prompt.
    Ctrl-C stops and keeps what was printed.
    """
    settings = given(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop or None,
                     max_context=max_context)

    def run():
        check_stdio(stdin="pipe the prompt in (gen - < prompt.txt) or give it as an argument"
                    if prompt == "-" else None)
        if chat_message is not None and (prompt, prompt_opt, prompt_file, ids) != (None, None, None, None):
            fail("--chat takes the message itself; give no PROMPT, --prompt, --file or --ids with it")
        if system is not None and chat_message is None:
            fail("--system goes with --chat MESSAGE (or gen chat --system TEXT for a conversation)")
        the_prompt = read_prompt(prompt, prompt_opt, ids, prompt_file) if chat_message is None else chat_message
        make_config(**settings)                      # bad settings fail before the model loads
        llm = load_quietly(model_name, attention, feature_map, device, dtype, native_backend(backend, native),
                          threads, quantize, softmax_layers=softmax_layers, window=window, kv_dtype=kv_dtype,
                          prefill_chunk=prefill_chunk, activations=activations, sparse_keys=sparse_keys)
        if chat_message is None and isinstance(the_prompt, str) and llm.tokenizer is None:
            fail(f"{model_name} ships no tokenizer, so it cannot read text; give the prompt as token ids: --ids 1,2,3")
        if chat_message is not None:   # keep the stream: dropping it would close its generation
            system_turn = [] if system is None else [{"role": "system", "content": system}]
            chat_stream = llm.chat([*system_turn, {"role": "user", "content": chat_message}], **settings)
            generation = chat_stream.generation
        else:
            generation = llm.start([the_prompt], **settings)
        generation.on_prefill = prefill_progress()
        if max_context is not None and generation.context is None:
            click.echo(f"gen: warning: --max-context is ignored: {llm.attention} attention has no context limit",
                       err=True)
        if kv_dtype is not None and llm.attention == "linear":   # (hybrid: its softmax layers' cache)
            click.echo("gen: warning: --kv-dtype is ignored: linear attention keeps no KV cache (a window's keys "
                       "are in the model's dtype)", err=True)
        if feature_map is not None and llm.attention != "linear":
            click.echo(f"gen: warning: --feature-map is ignored: {llm.attention} attention has no feature map",
                       err=True)
        if as_json and echo:
            click.echo("gen: warning: --echo is ignored with --json (its \"text\" is the continuation alone)", err=True)
        elif chat_message is not None and echo:   # it printed the message glued to the reply: "HiHello! ..."
            click.echo("gen: warning: --echo is ignored with --chat (the reply is an answer, not a continuation of "
                       "the message)", err=True)
        if as_json:
            try:
                result, code = generation.run()[0], 0
            except KeyboardInterrupt:   # Ctrl-C: what was generated so far, finish_reason "interrupted"
                generation.close()
                result, code = generation.result(0), 130
            with writing_stdout():
                click.echo(json.dumps({"text": result.text, "ids": result.ids,
                                       "finish_reason": result.finish_reason or "interrupted",
                                       "stop_reason": result.stop_reason,
                                       "stats": result.stats.to_dict()}, ensure_ascii=False))
            if code:
                sys.exit(code)
            return
        with writing_stdout():
            stream(llm, generation, the_prompt, echo and chat_message is None, verbose)

    run_guarded(run)


def read_prompt(prompt, prompt_opt, ids, prompt_file=None):
    """Exactly one of PROMPT, --prompt, --file, --ids -> text or a list of ids."""
    given = [p for p in (prompt, prompt_opt, prompt_file, ids) if p is not None]
    if len(given) != 1:
        if not given:
            fail("give one prompt: PROMPT, --prompt TEXT, --file PATH or --ids 1,2,3")
        if prompt is not None and prompt_opt is not None and (ids, prompt_file) == (None, None):
            # gen -p Once upon: "upon" is PROMPT
            fail(f'give the prompt once: PROMPT, --prompt, --file or --ids, not several (a prompt of several words '
                 f'goes in quotes: --prompt "{prompt_opt} {prompt}")')
        fail("give the prompt once: PROMPT, --prompt, --file or --ids, not several")
    if ids is not None:
        try:
            out = [int(x) for x in ids.replace(" ", "").strip(",").split(",")] if ids.strip(" ,") else []
        except ValueError:
            fail(f"--ids takes comma-separated integers like 1,2,3, got {ids!r}")
        if not out:
            fail("the prompt is empty; --ids needs at least one token id")
        return out
    text, where = given[0], None
    if prompt == "-":
        raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        text, where = utf8_prompt(raw, "the prompt on stdin"), "stdin"
    elif prompt_file is not None:
        try:
            with open(prompt_file, "rb") as f:
                raw = f.read()
        except IsADirectoryError:
            fail(f"--file {prompt_file}: is a directory; give a text file")
        except OSError as e:
            fail(f"--file {prompt_file}: {e.strerror}")
        text, where = utf8_prompt(raw, f"--file {prompt_file}"), f"--file {prompt_file}"
    try:
        check_text(text, "the prompt")
    except InvalidArgumentError as e:
        if "empty" not in str(e):
            fail(str(e).removeprefix("the prompt: "))
        if where is not None:
            fail(f"the prompt read from {where} is empty or only whitespace; put the prompt's text there")
        fail("the prompt is empty or only whitespace; give some text (or '-' to read it from stdin)")
    if not text:
        fail("the prompt is empty; give some text (or '-' to read it from stdin)")
    return text


def utf8_prompt(raw: bytes, what: str) -> str:
    """A prompt's bytes as text, one trailing newline dropped (what `echo` and editors add)."""
    try:
        return raw.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as e:
        fail(f"{what} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); pass UTF-8 text")


LOADING_NOTICE_S = 1.0   # a load taking longer says so on stderr, when stderr is a terminal


def stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def prefill_progress():
    """Generation.on_prefill for a terminal: a prompt long enough to run in blocks (minutes, for
    100k tokens) shows a progress bar on stderr while it is read; None elsewhere."""
    if not stderr_is_terminal():
        return None
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="token", desc="gen: reading the prompt", leave=False, file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def load_quietly(model_name, attention, feature_map, device, dtype, backend="auto", threads=None, quantize=None,
                 softmax_layers=None, window=None, kv_dtype=None, prefill_chunk=DEFAULT_PREFILL_CHUNK, sparse_keys=None,
                 activations=DEFAULT_ACTIVATIONS):
    """Load; a warning (weights not trained for this attention path) becomes one stderr line. On a
    terminal, a load that takes over LOADING_NOTICE_S says "loading NAME ..." once that time has
    passed, then how long it took (logs and pipes get neither: they wait for nobody)."""
    notice = threading.Timer(LOADING_NOTICE_S, lambda: click.echo(f"gen: loading {model_name} ...", err=True))
    notice.daemon = True
    tty = stderr_is_terminal()
    t0 = time.perf_counter()
    if tty:
        notice.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm = load(model_name, attention=attention, feature_map=feature_map, device=device, dtype=dtype,
                       backend=backend, threads=threads, quantize=quantize, softmax_layers=softmax_layers,
                       window=window, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk, activations=activations,
                       sparse_keys=sparse_keys)
    finally:
        notice.cancel()
    took = time.perf_counter() - t0
    if tty and took >= LOADING_NOTICE_S:
        click.echo(f"gen: loaded {model_name} in {took:.1f} s", err=True)
    for w in caught:
        click.echo(f"gen: warning: {w.message}", err=True)
    return llm


def stream(llm, generation, prompt, echo: bool, verbose: bool = False) -> None:
    out = sys.stdout
    tok = llm.tokenizer
    try:
        if echo:
            out.write(prompt if isinstance(prompt, str) else
                      tok.decode(prompt) if tok is not None else " ".join(map(str, prompt)) + " ")
        for event in generation:
            # without a tokenizer there is no text: print the ids
            out.write(event.text if tok is not None else f"{event.id} ")
            out.flush()
        out.write("\n")
        out.flush()
    except KeyboardInterrupt:
        generation.close()
        out.write("\n")
        out.flush()
        click.echo(summary(generation.result(0), interrupted=True), err=True)
        sys.exit(130)
    except OSError:   # the reader left (`| head`) or stdout is full: the caller's writing_stdout says so
        generation.close()
        raise
    click.echo(summary(generation.result(0)), err=True)
    if verbose:
        stats = generation.result(0).stats
        form = stats.step_form or ("?" if stats.new_tokens > 1 else "none ran (the prompt block made the only token)")
        click.echo(f"gen: step form: {form}; forms available: {', '.join(llm.step.forms_available)} (--backend "
                   f"{llm.step.backend}: each step runs on the first that takes it); "
                   f"fallback: {llm.step.fallback or 'none'}", err=True)


def summary(result, interrupted: bool = False) -> str:
    """One line in the manner of llama.cpp's timings."""
    s = result.stats
    prefill_ms = s.prefill_s * 1e3
    prompt_rate = s.prompt_tokens / s.prefill_s if s.prefill_s > 0 else 0.0
    ms_per_token = 1e3 / s.decode_tokens_per_s if s.decode_tokens_per_s > 0 else 0.0
    what = {"softmax": "KV cache", "linear": "linear state"}.get(s.attention, f"{s.attention} state")   # hybrid: both
    finish = "interrupted" if interrupted else result.finish_reason
    stepped = s.new_tokens > 1   # the first token comes from the prompt's block
    decode = (f"{s.new_tokens} new tokens, {s.decode_tokens_per_s:.1f} tokens/s ({ms_per_token:.2f} ms/token)"
              if stepped else f"{s.new_tokens} new token{'s' * (s.new_tokens != 1)}, no decode step")
    return (f"gen: prompt {s.prompt_tokens} tokens in {prefill_ms:.1f} ms ({prompt_rate:.1f} tokens/s) | {decode}, "
            f"first token after {s.time_to_first_token_s * 1e3:.1f} ms | {what} {human_bytes(s.state_bytes)} | "
            f"{s.attention} attention, seed {s.seed} | step {s.step_form or ('?' if stepped else 'none')} | "
            f"finish: {finish}")


def turn_timing(result, interrupted: bool = False) -> str:
    """One short line per chat reply: its tokens and speed, the prompt it prefilled, why it ended."""
    s = result.stats
    finish = "interrupted" if interrupted else result.finish_reason
    rate = f"{s.decode_tokens_per_s:.1f} tokens/s" if s.new_tokens > 1 else "no decode step"
    return (f"gen: {s.new_tokens} tokens, {rate} | prompt {s.prompt_tokens} tokens in "
            f"{s.prefill_s * 1e3:.0f} ms | finish: {finish}")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
