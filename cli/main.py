"""The `gen` command: generate text by default, or run a subcommand (train, eval, convert, ...).

    gen [OPTIONS] PROMPT          generate (the `generate` subcommand, implied)
    gen COMMAND [ARGS]...         a subcommand

Only the first argument decides: if it names a subcommand, that subcommand runs; anything
else (an option, a prompt) goes to `generate`. So a prompt that equals a subcommand's name
goes after `--` (`gen -- bench`), after any option (`gen --model tiny bench`), or in
`--prompt` (`gen --prompt bench`). New subcommands are registered with one line each below.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def quiet_sigint():
    """Ctrl-C while modules import (torch and the commands at start, a second or two; `gen serve`'s stack
    when named) ends the process quietly, as the signal's default does, instead of a KeyboardInterrupt
    traceback out of some library's import; Python's handler comes back once they are in, whatever an
    import raised (a SIGINT that was ignored stays ignored)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


with quiet_sigint():
    import importlib
    import importlib.metadata
    import platform
    import sys

    import click

    import engine  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which libgomp reads once as torch loads)
    import torch

    from cli.bench import bench_cmd
    from cli.chat import chat_cmd
    from cli.common import OUTPUT_ERRNOS, writing_stdout
    from cli.convert import convert_cmd
    from cli.eval import eval_cmd
    from cli.generate import generate_cmd
    from cli.linearize import linearize_cmd
    from cli.train import train_cmd

DEFAULT_COMMAND = "generate"
# Subcommands imported only when named (`gen serve`, `gen --help`): the server's stack (FastAPI, pydantic,
# uvicorn, sse-starlette) takes ~0.5 s to import, a fifth of every other command's start. name -> (module, attribute)
LAZY_COMMANDS = {"serve": ("cli.serve", "serve_cmd")}


class GenGroup(click.Group):
    """A click group whose arguments go to `generate` unless the first one names a subcommand,
    and whose usage errors (its own and its subcommands') are one line on stderr, exit code 2."""

    def list_commands(self, ctx):
        return sorted({*self.commands, *LAZY_COMMANDS})

    def get_command(self, ctx, name):
        if name not in self.commands and name in LAZY_COMMANDS:
            module, attribute = LAZY_COMMANDS[name]
            with quiet_sigint():
                self.add_command(getattr(importlib.import_module(module), attribute), name)
        return self.commands.get(name)

    def parse_args(self, ctx, args):
        names = self.list_commands(ctx)
        if args and args[0] not in names and args[0] not in (*ctx.help_option_names, "--version"):
            if not ctx.resilient_parsing:
                note_misspelled_command(args, names)
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx, formatter):
        formatter.write_usage(ctx.command_path, "[OPTIONS] PROMPT | COMMAND [ARGS]...")

    def make_context(self, *args, **kwargs):
        with one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with one_line_errors():
            return super().invoke(ctx)

    def main(self, *args, **kwargs):
        """Help or --version into a full stdout (`gen --help > /dev/full`): one line, exit 2, as generation's
        output is (writing_stdout); a reader that left (`| head`) stays quiet, as click leaves it."""
        try:
            return super().main(*args, **kwargs)
        except OSError as e:
            if not echoing_stdout(e):
                raise
            with writing_stdout():
                raise


def echoing_stdout(error: OSError) -> bool:
    """Whether `error` is a full or broken stdout that click.echo met (help, --version, a command's lines),
    not some other file's."""
    if error.errno not in OUTPUT_ERRNOS:
        return False
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is click.utils.echo.__code__:
            file = tb.tb_frame.f_locals.get("file")
            try:
                return file is sys.stdout or file.fileno() == 1
            except (AttributeError, OSError, ValueError):
                return False
        tb = tb.tb_next
    return False


def note_misspelled_command(args, commands) -> None:
    """`gen bnech`: a bare word is a prompt (and generates), but one that is a typo of a subcommand gets a
    note on stderr saying so, and how to run the command. A typo: the name in other case, two neighbouring
    letters swapped, or one letter left out of a word of 4 or more, past the first letter (typing slips;
    not "cat" for chat, "rain" for train, "veal" for eval or "beach" for bench, which are prompts)."""
    if len(args) != 1 or not args[0].isalpha():
        return
    word = args[0].lower()
    for name in commands:
        swapped = any(word == name[:i] + name[i + 1] + name[i] + name[i + 2:] for i in range(1, len(name) - 1))
        dropped = len(word) >= 4 and any(word == name[:i] + name[i + 1:] for i in range(1, len(name)))
        if word == name or swapped or dropped:
            click.echo(f'gen: note: generating from the prompt "{args[0]}"; for the command, gen {name}', err=True)
            return


@contextmanager
def one_line_errors():
    """click's usage errors print a usage block; print `gen: error: <what>` instead."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.ClickException as e:
        hint = f" (see {command_path(e.ctx)} --help)" if isinstance(e, click.UsageError) else ""
        if (isinstance(e, click.UsageError) and e.message.startswith("Got unexpected extra argument")
                and e.ctx is not None and e.ctx.info_name == "generate"):   # gen Once upon a time
            hint = ': a prompt of several words goes in quotes, as in gen "Once upon a time"'
        click.echo(f"gen: error: {e.format_message()}{hint}", err=True)
        raise click.exceptions.Exit(e.exit_code) from None


def command_path(ctx) -> str:
    """`gen eval` for eval's context: the subcommands' names under `gen`, however the program was started
    (`python -m cli.main`, a test runner)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["gen", *reversed(names)])


def version() -> str:
    """This package's installed version (pyproject.toml; "unknown" when it runs uninstalled), and torch's."""
    try:
        own = importlib.metadata.version("gen-engine")
    except importlib.metadata.PackageNotFoundError:
        own = "unknown (not installed: pip install -e .)"
    return f"{own} (torch {torch.__version__}, Python {platform.python_version()})"


@click.group(cls=GenGroup, no_args_is_help=True)
@click.version_option(version(), "--version", prog_name="gen", message="%(prog)s %(version)s")
def main():
    """Run a decoder-only language model with softmax or linear attention.

    `gen [OPTIONS] PROMPT` generates (see `gen generate --help` for the options);
    `gen COMMAND ...` runs a subcommand. A prompt that equals a subcommand's name goes after
    `--`, as in `gen -- bench`, or in --prompt: `gen --prompt bench`.
    """


main.add_command(generate_cmd)
main.add_command(train_cmd)
main.add_command(eval_cmd)
main.add_command(convert_cmd)
main.add_command(bench_cmd)
main.add_command(chat_cmd)
main.add_command(linearize_cmd)

if __name__ == "__main__":
    main()
