"""`gen chat`: talk to an instruction-tuned model in a terminal, one reply streamed per message.

    gen chat --model smollm2 [--attention linear] [--system TEXT] [sampling options]

Each line you type is a user message; the reply streams back. The conversation and its decoding
state are kept (engine.chat), so a turn prefills only what it adds. `/reset` starts a new
conversation, `/exit` or Ctrl-D leaves, Ctrl-C stops a reply (the session and what was said so
far stay), `/help` lists these. Any other single word after a slash (`/exti`) is an unknown command, not
a message (ollama's rule); such a one-word message is written with two slashes (`//etc` sends `/etc`;
`// TODO` and `/usr/bin is a path` are messages as they are). Lines read from a pipe
work too (one message per line), without the `> ` prompt.
"""
from __future__ import annotations

import re
import signal
import sys

import click

from cli.common import (backend_option, dtype_options, run_options, check_stdio, given, prefill_chunk_option, run_guarded, activations_option,
                        device_option, sampling_options, threads_option, user_text, writing_stdout)
from cli.generate import load_quietly, summary, turn_timing
from engine.api import make_config
from engine.errors import EngineError
from engine.sampling import CHAT_DEFAULTS, describe_sampling

HELP_LINE = "/reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops a reply, /help"
COMMAND = re.compile(r"/[A-Za-z?][\w?-]*")   # what reads as a command: a slash and one word


@click.command("chat", short_help="Chat with an instruction-tuned model in the terminal.")
@click.option("-m", "--model", "model_name", default="smollm2", show_default=True,
              help="registered name or path of a model with a chat template (GGUF, tokenizer_config.json)")
@run_options()
@click.option("--system", help="a system message for the conversation (default: the template's own, if any; "
                                "\"\" for none at all)")
@click.option("-n", "--max-new-tokens", default=512, show_default=True, type=int, help="per reply")
@sampling_options({k: f"the model's, else {v:g}" for k, v in {**CHAT_DEFAULTS, "repetition_penalty": 1.0}.items()})
@click.option("--seed", type=int, help="default: a fresh seed per reply")
@device_option
@dtype_options
@click.option("-c", "--max-context", type=click.IntRange(min=1), help="softmax KV cache capacity in tokens for the whole conversation "
                                                      "(default: the model's context)")
@backend_option
@threads_option()
@click.option("-v", "--verbose", is_flag=True, help="the full summary line (prompt, speed, memory) after each reply")
@prefill_chunk_option
@activations_option
def chat_cmd(model_name, attention, softmax_layers, window, feature_map, system, max_new_tokens, temperature, top_k, top_p, min_p,
             repetition_penalty, seed, device, dtype, kv_dtype, max_context, backend, threads, verbose, prefill_chunk,
             activations, sparse_keys=None):
    """Chat with a model that has a chat template: each line you type is a message, the reply streams back.

    /reset starts a new conversation, /exit or Ctrl-D leaves, Ctrl-C stops a reply (the conversation
    stays). Lines piped in work too, one message per line (exit code 2 when one got an error instead
    of a reply). After each reply a line on stderr gives its tokens and speed.

    Sampling: each option you give wins; the others come from the model's generation config
    (generation_config.json beside the weights, or a GGUF's general.sampling.* keys) where it names
    them, else llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05.
    """
    settings = given(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     min_p=min_p, repetition_penalty=repetition_penalty, seed=seed)

    def run():
        check_stdio(stdin="gen chat reads your messages from it: run it in a terminal or pipe lines in")
        make_config(**settings)                      # bad settings fail before the model loads
        llm = load_quietly(model_name, attention, feature_map, device, dtype, backend, threads,
                           softmax_layers=softmax_layers, window=window, kv_dtype=kv_dtype,
                           prefill_chunk=prefill_chunk, activations=activations, sparse_keys=sparse_keys)
        session = llm.chat_session(system=system, max_context=max_context)
        sampling = describe_sampling({**llm.chat_sampling, **settings})   # a bad generation config fails here
        tty = sys.stdin.isatty()
        if tty:
            try:
                import readline  # noqa: F401  (line editing and input history for input(); optional)
            except ImportError:
                pass
            click.echo(f"gen chat: {model_name}, {llm.attention} attention, "
                       f"{sampling}. {HELP_LINE}.", err=True)
        with writing_stdout():
            failed = repl(session, settings, prompt="> " if tty else "", verbose=verbose)
        if failed and not tty:   # piped messages: a script must see that some got no reply
            sys.exit(2)

    run_guarded(run)


def repl(session, settings: dict, prompt: str = "> ", verbose: bool = False) -> int:
    """Read messages until /exit or end of input; returns how many got an error instead of a reply."""
    failed = 0
    while True:
        try:
            line = input(prompt)
        except EOFError:
            if prompt:
                click.echo("", err=True)
            return failed
        except KeyboardInterrupt:        # Ctrl-C at the prompt: a fresh line, the session stays
            click.echo("", err=True)
            continue
        command = line.strip()
        if not command:
            continue
        if command.lower() in ("/exit", "/quit"):
            return failed
        if command.lower() == "/reset":
            session.reset()
            click.echo("gen: conversation cleared", err=True)
            continue
        if command.lower() in ("/help", "/?"):
            click.echo("gen: /reset starts over, /exit (or /quit, Ctrl-D) leaves, Ctrl-C stops a reply; a message "
                       "that is one word after a slash is written with two (//etc is sent as /etc)", err=True)
            continue
        if COMMAND.fullmatch(command):   # a mistyped command must not go to the model as a message
            click.echo(f"gen: error: unknown command {command}: {HELP_LINE}; "
                       f"to send it as a message, write /{command}", err=True)
            failed += 1
            continue
        if command.startswith("//") and COMMAND.fullmatch(command[1:]):   # the escape, and only it: "// TODO" stays
            line = line.replace("/", "", 1)
        try:
            reply = session.send(line, **settings)
        except EngineError as e:         # e.g. the context is full: say so, keep the REPL
            click.echo(f"gen: error: {in_the_repl(user_text(e))}", err=True)
            failed += 1
            continue
        interrupted = stream_reply(reply)
        click.echo(summary(reply.result, interrupted=interrupted) if verbose else
                   turn_timing(reply.result, interrupted=interrupted), err=True)


def in_the_repl(text: str) -> str:
    """The API's advice in the REPL's words: its command and the CLI's option."""
    return text.replace("start a new one (reset), raise max_context",
                        "start a new one (/reset), raise --max-context")


class PrefillStopped(Exception):
    """Ctrl-C while a long message is read: raised between two prefill blocks."""


PREFILL_BLOCK = 256   # tokens: how often a long message's prefill looks for Ctrl-C (~1 s of SmolLM2 here)


def stream_reply(reply) -> bool:
    """Print a reply as it streams; Ctrl-C stops it between tokens (never inside a step, so the
    session's state stays whole), or while a long message is read, between two blocks of its prefill
    (the state then holds part of it: the session rebuilds at the next turn). Returns True if it was
    interrupted."""
    stop = []
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    out = sys.stdout

    def between_blocks(done, total):
        if stop:
            raise PrefillStopped
    reply.generation.on_prefill, reply.generation.prefill_block = between_blocks, PREFILL_BLOCK
    try:
        for chunk in reply:
            out.write(chunk)
            out.flush()
            if stop:
                reply.close()
                break
    except PrefillStopped:
        click.echo("(stopped while reading the message: it is not in the conversation)", err=True)
    finally:
        signal.signal(signal.SIGINT, previous)
        out.write("\n")
        out.flush()
    return bool(stop)
