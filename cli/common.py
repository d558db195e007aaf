"""What every command shares: turning engine errors into one line on stderr and exit code 2."""
from __future__ import annotations

import errno
import os
import re
import sys
import tempfile
from contextlib import contextmanager

import click

from engine.attention import PATHS
from engine.errors import EngineError
from engine.loader import parse_device
from engine.steps import ACTIVATIONS, BACKENDS, DEFAULT_ACTIVATIONS, DEFAULT_PREFILL_CHUNK
from engine.threads import available_cores, default_threads


def fail(message: str, code: int = 2) -> None:
    click.echo(f"gen: error: {message}", err=True)
    sys.exit(code)


def check_output_path(path: str) -> None:
    """An output file's directory must exist and take a new file; else one line, exit 2, before any
    work. Tried by creating (and removing) a file there: permission bits do not tell (root passes
    os.access on /sys, whose files cannot be created)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        fail(f"{path}: directory {parent} does not exist; create it first")
    if os.path.isdir(path):
        fail(f"{path}: is a directory; give a file name")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".gen-probe-"):
            pass
    except OSError as e:
        fail(f"{path}: cannot create a file in {parent} ({e.strerror}); choose a writable directory")


def check_stdio(stdin: str | None = None) -> None:
    """A closed stdout (`>&-`), or a closed stdin when `stdin` says what it is read for: one line, exit 2,
    before any work (Python leaves sys.stdout / sys.stdin None when the descriptor is closed)."""
    if sys.stdout is None:
        fail("stdout is closed (>&-); send it somewhere instead, e.g. > out.txt or > /dev/null")
    if stdin is not None and sys.stdin is None:
        fail(f"stdin is closed (<&-); {stdin}")


OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


@contextmanager
def writing_stdout():
    """Around code that writes its product to stdout: a reader that left (`| head`) ends the run
    quietly (exit 1, as `cat` does); a full disk or a broken descriptor (`> /dev/full`) is one line,
    exit 2. Either way stdout then points at /dev/null, so the interpreter's last flush cannot fail."""
    try:
        yield
    except BrokenPipeError:
        _drop_stdout()
        sys.exit(1)
    except OSError as e:
        if e.errno not in OUTPUT_ERRNOS:
            raise
        _drop_stdout()
        fail(f"cannot write to stdout: {e.strerror}")


def _drop_stdout() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no real descriptor (a test runner's buffer)
        pass


API_CALL = re.compile(r"^[a-z_]+\(\)(?:\.[a-z_]+\(\))?: ")   # "start(): ", "chat_session().send(): "


def user_text(error: Exception) -> str:
    """An engine error's message for a CLI user: without the Python call it names for API users."""
    return API_CALL.sub("", str(error), count=1)


def run_guarded(fn):
    """Run fn(); an EngineError (or bad file) becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except EngineError as e:
        fail(user_text(e))
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        fail(f"{e.filename}: {e.strerror}")
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(130)


FEATURE_MAP_HELP = ("linear attention feature map: elu1, relu, softmax, cos1, or hedgehog (the learned maps a "
                    "model such as smollm2-linear ships); zero switches the linear branch off (with --window: "
                    "sliding-window attention alone, an ablation)")

KV_DTYPE_HELP = ("the KV cache's dtype (default: the model's): float32, float16, bfloat16; float16 under fp32 "
                 "weights halves the cache, as llama.cpp keeps it")


def prefill_chunk_option(fn):
    """`--prefill-chunk N`, one declaration for every command that generates (gen, chat, serve)."""
    return click.option("--prefill-chunk", type=click.IntRange(min=0), default=DEFAULT_PREFILL_CHUNK,
                        show_default="16 on the C step, 512 on the PyTorch path (a GPU, fp32 / bf16 weights)",
                        help="prefill prompts in blocks of at most N tokens (0: one block); the server feeds "
                             "one block between decode steps. The same N gives the same tokens in gen, "
                             "the Python API and gen serve")(fn)


def check_device(ctx, param, value):
    """--device: one this machine has (cpu, cuda, cuda:N); else one line, exit 2, before any work."""
    try:
        parse_device(value)
    except EngineError as e:
        fail(user_text(e))
    return value


def dtype_options(fn):
    """`--dtype` and `--kv-dtype`, one declaration for the commands that generate (gen, chat, serve)."""
    fn = click.option("--kv-dtype", help=KV_DTYPE_HELP)(fn)
    return click.option("--dtype", help="float32 (default), bfloat16, float16")(fn)


def native_backend(backend: str, native: bool) -> str:
    """--native is --backend native: with another --backend the two contradict (one line, exit 2)."""
    if native and backend not in ("auto", "native"):
        fail(f"--native is --backend native, and --backend {backend} asks for another step form; give one of them")
    return "native" if native else backend


def backend_option(fn):
    """`--backend`, one declaration for every command that decodes (gen, chat, bench, serve); the choices are
    engine.runspec.BACKENDS."""
    return click.option("--backend", type=click.Choice(list(BACKENDS)), default="auto", show_default=True,
                        help="decode step form: auto = the CUDA graph step on a GPU, the C step where it "
                             "applies, else PyTorch; graph / compiled: the step captured as a CUDA graph "
                             "(compiled: through torch.compile first)")(fn)


def device_option(fn):
    """`--device`, one declaration for every command that runs a model."""
    return click.option("--device", default="cpu", show_default=True, callback=check_device,
                        help="where the model runs: cpu, cuda or cuda:N")(fn)


def check_threads(ctx, param, value):
    """--threads N: 1 up to the cores this process may run on. More threads than cores wait on each
    other at every step (smollm2: 272 ms a token at 999 threads, 0.4 ms at 2), so that is refused."""
    if value is None:
        return None
    cores = available_cores()
    if value < 1 or value > cores:
        raise click.BadParameter(f"{value}: give 1 to {cores} (the cores this process may run on)"
                                 if value > cores else f"{value}: give at least 1")
    return value


def threads_option(help: str | None = None):
    """`-t/--threads N`; its help states the default from where it lives (engine.threads.default_threads,
    what RunSpec.resolve takes when none is given)."""
    if help is None:
        help = (f"CPU threads, at most the cores this process may run on (default: every core for the C step, "
                f"{default_threads()} here, and 1 for PyTorch)")
    return click.option("-t", "--threads", type=int, callback=check_threads, help=help)


def run_options(attention_help: str = "default: the model's own"):
    """The run's attention options, declared once for gen, chat, eval and serve: --attention,
    --softmax-layers, --window, --sparse-keys, --feature-map. Their values go to engine.runspec.RunSpec.resolve
    unchanged, so a bad one is the rule's own line (exit 2), the same as a server request's 400."""
    options = [click.option("--attention", metavar="NAME", help=f"{', '.join(PATHS)} ({attention_help})"),
               click.option("--softmax-layers", help="hybrid: layers that keep a KV cache, e.g. 2,9,11, or auto:K"),
               click.option("--window", type=int, help="linear layers also attend exactly to the last W keys (W >= 1)"),
               click.option("--sparse-keys", type=int, help="with a window: each linear layer and head also keeps the M "
                            "keys its state recalls worst exact (LoLA's sparse cache; 0: off; default: the model's own)"),
               click.option("--feature-map", help=FEATURE_MAP_HELP)]

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


SAMPLING_HELP = {"temperature": "0 = greedy", "top_k": "0 = off", "top_p": "1 = off", "min_p": "0 = off",
                 "repetition_penalty": "1 = off; > 1 discourages tokens already in the prompt or output"}


def sampling_options(defaults: dict[str, str]):
    """--temperature (--temp), --top-k, --top-p, --min-p, --repetition-penalty, declared once. Each
    defaults to None (not given: the command's own defaults, described by `defaults`, apply)."""
    options = [click.option("--temperature", "--temp", "temperature", type=float,
                            help=f"{SAMPLING_HELP['temperature']}  [default: {defaults['temperature']}]")]
    for name, kind in (("top_k", int), ("top_p", float), ("min_p", float), ("repetition_penalty", float)):
        options.append(click.option(f"--{name.replace('_', '-')}", name, type=kind,
                                    help=f"{SAMPLING_HELP[name]}  [default: {defaults[name]}]"))

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


def given(**settings) -> dict:
    """The settings the user gave (None: not given, so the engine's default applies)."""
    return {k: v for k, v in settings.items() if v is not None}


def activations_option(fn):
    """`--activations`, one declaration for gen, chat and serve."""
    return click.option("--activations", type=click.Choice(ACTIVATIONS), default=DEFAULT_ACTIVATIONS,
                        show_default=True,
                        help="what quantized weights (q8_0/q4_0/q4_1 blocks) multiply in the C step: f32-prompt "
                             "reads the prompt with fp32 activations and decodes with q8 ones; f32 is PyTorch's "
                             "arithmetic throughout (slowest); q8 is llama.cpp's throughout (fastest prompt)")(fn)
