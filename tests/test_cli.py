"""`gen`: streaming, --json, options, stdin, prompts named like subcommands, bad input, Ctrl-C."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import tiny_model
from engine.api import load
from models.weights import save_pretrained
from cli.main import main

GREEDY = ["--temperature", "0", "--max-new-tokens", "12"]


def gen(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def gen_json(*args, input=None):
    r = gen("--json", *args, input=input)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def api_result(model_dir, prompt, attention=None, **kw):
    return load(str(model_dir), attention=attention).generate(prompt, temperature=0, max_new_tokens=12, **kw)


# ---------------------------------------------------------------------- generating
@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_stream_equals_json_and_the_api(small_model_dir, path):
    streamed = gen("--model", small_model_dir, "--attention", path, *GREEDY, "the cat sat")
    print(streamed.stdout, streamed.stderr)
    assert streamed.exit_code == 0
    as_json = gen_json("--model", small_model_dir, "--attention", path, *GREEDY, "the cat sat")
    api = api_result(small_model_dir, "the cat sat", attention=path)
    assert streamed.stdout == as_json["text"] + "\n" == api.text + "\n"
    assert as_json["ids"] == api.ids and as_json["finish_reason"] == api.finish_reason == "length"
    assert set(as_json["stats"]) >= {"prompt_tokens", "new_tokens", "time_to_first_token_s",
                                     "decode_tokens_per_s", "state_bytes"}
    assert as_json["stats"]["new_tokens"] == 12


@pytest.mark.parametrize("path,memory", [("softmax", "KV cache"), ("linear", "linear state"),
                                         ("hybrid", "hybrid state")])   # KV layers and linear ones: not "linear state"
def test_summary_line_on_stderr(small_model_dir, path, memory):
    hybrid = ("--softmax-layers", "0") if path == "hybrid" else ()
    r = gen("--model", small_model_dir, "--attention", path, *hybrid, *GREEDY, "the cat")
    lines = [line for line in r.stderr.strip().splitlines() if "warning: these weights were trained" not in line]
    print(lines)
    assert len(lines) == 1
    line = lines[0]
    prompt_tokens = len(load(str(small_model_dir)).encode("the cat"))
    for part in (f"prompt {prompt_tokens} tokens in", " ms", "12 new tokens", "tokens/s", memory, "finish: length"):
        assert part in line


def test_prompt_from_stdin(small_model_dir):
    piped = gen_json("--model", small_model_dir, *GREEDY, "-", input="the cat sat\n")
    direct = gen_json("--model", small_model_dir, *GREEDY, "the cat sat")
    assert piped == {**direct, "stats": piped["stats"]} and piped["stats"]["prompt_tokens"] == direct["stats"]["prompt_tokens"]


def test_prompt_from_a_file(small_model_dir, tmp_path):
    """-f / --file (llama.cpp's): the file's text is the prompt, as if piped in; a missing, undecodable,
    empty or directory file, or a second prompt beside it, is one line."""
    from conftest import one_line_error
    (tmp_path / "p.txt").write_text("the cat sat\n")
    direct = gen_json("--model", small_model_dir, *GREEDY, "the cat sat")
    for flag in ("-f", "--file"):
        got = gen_json("--model", small_model_dir, *GREEDY, flag, tmp_path / "p.txt")
        assert got == {**direct, "stats": got["stats"]} and got["stats"]["prompt_tokens"] == direct["stats"]["prompt_tokens"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("  \n")
    for path, words in ((tmp_path / "nope.txt", ("nope.txt", "No such file")),
                        (tmp_path / "latin1.txt", ("latin1.txt", "not valid UTF-8", "0xe9 at offset 3")),
                        (tmp_path / "blank.txt", ("read from --file", "blank.txt", "empty or only whitespace")),
                        (tmp_path, ("is a directory",))):
        one_line_error(gen("--model", small_model_dir, "--file", path), *words)
    one_line_error(gen("--model", small_model_dir, "--file", tmp_path / "p.txt", "the dog"), "give the prompt once",
                   "--file")
    one_line_error(gen("--model", small_model_dir, "--file", tmp_path / "p.txt", "--chat", "hi"), "--chat", "--file")


def test_prompt_of_token_ids(small_model_dir):
    out = gen_json("--model", small_model_dir, *GREEDY, "--ids", "1,40,41,42")
    api = api_result(small_model_dir, [1, 40, 41, 42])
    assert out["ids"] == api.ids and out["stats"]["prompt_tokens"] == 4


def test_repeatable_stop_strings(small_model_dir):
    full = gen_json("--model", small_model_dir, *GREEDY, "the cat")["text"]
    stop = full[4:6]
    cut = full.index(stop)
    out = gen_json("--model", small_model_dir, *GREEDY, "--stop", "never-there", "--stop", stop, "the cat")
    print(repr(full), repr(stop), out["text"])
    assert out["text"] == full[:cut] and out["finish_reason"] == "stop"
    streamed = gen("--model", small_model_dir, *GREEDY, "--stop", "never-there", "--stop", stop, "the cat")
    assert streamed.stdout == full[:cut] + "\n"


def test_sampling_options_reach_the_sampler(small_model_dir):
    args = ["--model", small_model_dir, "--max-new-tokens", "20", "--temperature", "1.3", "--top-k", "30",
            "--top-p", "0.9", "--min-p", "0.01", "--repetition-penalty", "1.2", "--seed", "5", "the cat"]
    a, b = gen_json(*args), gen_json(*args)
    api = load(str(small_model_dir)).generate("the cat", max_new_tokens=20, temperature=1.3, top_k=30, top_p=0.9,
                                              min_p=0.01, repetition_penalty=1.2, seed=5)
    assert a["ids"] == b["ids"] == api.ids and a["stats"]["seed"] == 5
    assert gen_json(*args[:-3], "--seed", "6", "the cat")["ids"] != a["ids"]


def test_context_finish_and_max_context_warning_for_linear(small_model_dir):
    out = gen_json("--model", small_model_dir, "--max-new-tokens", "50", "--max-context", "8", "--temperature", "0",
                   "--ids", "1,2,3")
    assert out["finish_reason"] == "context" and len(out["ids"]) == 6
    r = gen("--model", small_model_dir, "--attention", "linear", "--max-context", "8", "--max-new-tokens", "3",
            "--ids", "1,2,3")
    assert r.exit_code == 0 and "gen: warning: --max-context is ignored" in r.stderr


def test_kv_dtype_on_linear_attention_warns_it_is_ignored(small_model_dir):
    """Linear attention keeps no KV cache: --kv-dtype does nothing there (it was silent); softmax takes it."""
    args = ["--model", small_model_dir, "--kv-dtype", "float16", "--max-new-tokens", "2", "--ids", "1,2,3"]
    r = gen(*args, "--attention", "linear")
    assert r.exit_code == 0 and "gen: warning: --kv-dtype is ignored: linear attention keeps no KV cache" in r.stderr
    r = gen(*args, "--attention", "softmax")
    assert r.exit_code == 0 and "--kv-dtype is ignored" not in r.stderr


def test_echo_prints_the_prompt_first(small_model_dir):
    plain = gen("--model", small_model_dir, *GREEDY, "the cat")
    echoed = gen("--model", small_model_dir, *GREEDY, "--echo", "the cat")
    assert echoed.stdout == "the cat" + plain.stdout


def test_warning_when_the_weights_were_not_trained_for_the_path(tmp_path, small_tokenizer):
    model = tiny_model(vocab_size=small_tokenizer.vocab_size, trained_for=("softmax",))
    save_pretrained(model, str(tmp_path), tokenizer_path=small_tokenizer.path)
    r = gen("--model", tmp_path, "--attention", "linear", *GREEDY, "the cat")
    warning = [line for line in r.stderr.splitlines() if line.startswith("gen: warning:")]
    print(r.stderr)
    assert r.exit_code == 0 and len(warning) == 1 and "not linear" in warning[0]
    assert "warning" not in gen("--model", tmp_path, "--attention", "softmax", *GREEDY, "the cat").stderr


def test_model_without_tokenizer_takes_and_prints_ids(tmp_path):
    save_pretrained(tiny_model(), str(tmp_path))
    r = gen("--model", tmp_path, *GREEDY, "--ids", "1,2,3")
    api = load(str(tmp_path)).generate([1, 2, 3], temperature=0, max_new_tokens=12)
    assert r.exit_code == 0 and r.stdout.split() == [str(i) for i in api.ids]
    bad = gen("--model", tmp_path, *GREEDY, "some text")
    assert bad.exit_code == 2 and "no tokenizer" in bad.stderr


# ---------------------------------------------------------------------- subcommands and prompts
@pytest.fixture
def tiny_is(monkeypatch, small_model_dir):
    """Make the registered name `tiny` (the default --model) point at the small random model."""
    import models.registry
    monkeypatch.setitem(models.registry.REGISTRY, "tiny", small_model_dir)
    return small_model_dir


def test_a_prompt_named_like_a_subcommand(tiny_is):
    tok = load("tiny").tokenizer
    r = gen("--", "train")                         # `gen -- train`: the prompt "train"
    print(r.stderr)
    assert r.exit_code == 0 and f"prompt {len(tok.encode('train', bos=True))} tokens" in r.stderr
    want = gen_json(*GREEDY, "--prompt", "train")
    assert gen_json(*GREEDY, "--", "train")["ids"] == want["ids"]
    assert gen_json(*GREEDY, "train")["ids"] == want["ids"]       # after an option it is a prompt too
    assert want["stats"]["prompt_tokens"] == len(tok.encode("train", bos=True))


def test_subcommands_still_run():
    r = gen("train")                               # the real subcommand: it wants --train
    assert r.exit_code == 2 and "--train" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert gen("train", "--help").exit_code == 0 and "--vocab-size" in gen("train", "--help").stdout
    assert "--max-new-tokens" in gen("generate", "--help").stdout


def test_help_documents_prompts_named_like_subcommands():
    r = gen("--help")
    assert r.exit_code == 0 and "gen -- bench" in r.stdout and "generate" in r.stdout and "train" in r.stdout


def test_help_lists_each_command_in_one_whole_line():
    """gen --help's list of commands: one summary line each, not a docstring cut off at '...' (click's
    45-character cut: "bench  Prefill to each depth, then time decode steps, for each...")."""
    for width in (80, 200):   # click cuts a docstring's summary to fit, at any width
        r = CliRunner().invoke(main, ["--help"], terminal_width=width)
        lines = [line for line in r.stdout.split("Commands:\n", 1)[1].splitlines() if line.strip()]
        commands = {line.split()[0]: line for line in lines}
        assert set(commands) == {"bench", "chat", "convert", "eval", "generate", "linearize", "serve", "train"}, lines
        assert not [line for line in lines if line.endswith("...")], lines


# ---------------------------------------------------------------------- bad input
BAD = {
    "unknown-model": (["--model", "nosuchmodel", "hi"], "known models: tiny"),
    "misspelled-model": (["--model", "smolm2", "hi"], "unknown model 'smolm2'; did you mean smollm2? known models"),
    "unquoted-prompt": (["Once", "upon", "a", "time"], 'extra arguments (upon a time): a prompt of several words goes in quotes'),
    "unquoted-prompt-option": (["-p", "Once", "upon"], 'goes in quotes: --prompt "Once upon"'),
    "missing-path": (["--model", "./no/such/dir", "hi"], "no such file"),
    "temperature": (["--temperature", "-0.5", "hi"], "temperature"),
    "temperature-text": (["--temperature", "warm", "hi"], "--temperature"),
    "top-p-zero": (["--top-p", "0", "hi"], "top_p"),
    "top-p-big": (["--top-p", "1.5", "hi"], "top_p"),
    "top-k": (["--top-k", "-1", "hi"], "top_k"),
    "min-p-big": (["--min-p", "1.5", "hi"], "min_p"),
    "min-p-negative": (["--min-p", "-0.1", "hi"], "min_p"),
    "penalty-zero": (["--repetition-penalty", "0", "hi"], "repetition_penalty"),
    "penalty-negative": (["--repetition-penalty", "-1", "hi"], "repetition_penalty"),
    "max-new-tokens": (["--max-new-tokens", "0", "hi"], "max_new_tokens"),
    "empty-prompt": ([""], "empty"),
    "no-prompt": (["--temperature", "0"], "give one prompt"),
    "two-prompts": (["--ids", "1,2", "hi"], "not several"),
    "bad-ids": (["--ids", "1,x"], "comma-separated"),
    "empty-ids": (["--ids", ","], "empty"),
    "ids-with-a-hole": (["--ids", "1,,2"], "comma-separated"),   # (was read as 1,2)
    "stop-not-utf8": (["--stop", "a\udcff", "hi"], "stop string 'a\\udcff' is not valid UTF-8 (byte 0xff"),
    "native-and-another-backend": (["--native", "--backend", "torch", "hi"], "--native is --backend native"),
    "ids-outside-vocab": (["--ids", "1,100000"], "outside the vocabulary"),
    "prompt-longer-than-context": (["--max-context", "3", "the cat sat on the mat"], "context holds 3"),
    "empty-stop": (["--stop", "", "hi"], "stop"),
    "unknown-attention": (["--attention", "fast", "hi"], "unknown attention 'fast'"),   # the rule's own line
    "unknown-feature-map": (["--attention", "linear", "--feature-map", "tanh", "hi"], "feature map"),
    "unknown-dtype": (["--dtype", "int8", "hi"], "dtype"),
    "unknown-kv-dtype": (["--kv-dtype", "f8", "hi"], "unknown dtype 'f8'"),
    "unknown-device": (["--device", "gpu0", "hi"], "unknown device"),
    "unknown-option": (["--frobnicate", "hi"], "--frobnicate"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_and_exit_code_2(small_model_dir, name):
    args, expect = BAD[name]
    if "--model" not in args:
        args = ["--model", str(small_model_dir), *args]
    r = gen(*args)
    print(name, repr(r.stderr))
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error:") and expect in lines[0]
    assert "Traceback" not in r.output and r.stdout == ""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_one_line(small_model_dir):
    r = gen("--model", small_model_dir, "--device", "cuda", "hi")
    print(repr(r.stderr))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "no CUDA" in r.stderr and "Traceback" not in r.output


def test_echo_with_json_warns_that_it_is_ignored(small_model_dir):
    r = gen("--model", small_model_dir, "--json", "--echo", *GREEDY, "the cat")
    assert r.exit_code == 0 and "gen: warning: --echo is ignored with --json" in r.stderr
    assert json.loads(r.stdout)["text"] == gen_json("--model", small_model_dir, *GREEDY, "the cat")["text"]


def test_feature_map_with_softmax_warns_that_it_is_ignored(small_model_dir):
    r = gen("--model", small_model_dir, "--attention", "softmax", "--feature-map", "relu", "--max-new-tokens", "2", "hi")
    assert r.exit_code == 0 and "--feature-map is ignored: softmax attention" in r.stderr


def test_empty_stdin_prompt(small_model_dir):
    r = gen("--model", small_model_dir, "-", input="")
    assert r.exit_code == 2 and "the prompt read from stdin is empty" in r.stderr   # not "or '-' to read it from stdin"
    assert "'-'" not in r.stderr


# ---------------------------------------------------------------------- the installed command
def installed_gen() -> str:
    exe = shutil.which("gen") or str(Path(sys.executable).parent / "gen")
    if not os.path.exists(exe):
        pytest.skip("the `gen` console script is not installed (pip install -e .)")
    return exe


def test_installed_gen_runs(small_model_dir):
    proc = subprocess.run([installed_gen(), "--model", str(small_model_dir), *GREEDY, "the cat"],
                          capture_output=True, text=True, timeout=120)
    print(proc.stdout, proc.stderr)
    api = api_result(small_model_dir, "the cat")
    assert proc.returncode == 0 and proc.stdout == api.text + "\n"
    assert "finish: length" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_stops_cleanly_and_keeps_the_output(small_model_dir):
    proc = subprocess.Popen([installed_gen(), "--model", str(small_model_dir), "--attention", "linear",
                             "--max-new-tokens", "1000000", "--temperature", "0", "the cat"],   # greedy: no EOS
                            # in 20,000 tokens on this model
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # as from a terminal: a suite started in the background (`cmd &` in a script)
                            # inherits SIGINT ignored, an ignored signal stays ignored in a child, and Python
                            # then installs no KeyboardInterrupt handler
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        got, deadline = b"", time.time() + 60
        while len(got) < 20 and time.time() < deadline:     # wait until text is streaming
            if select.select([proc.stdout], [], [], 1)[0]:
                got += os.read(proc.stdout.fileno(), 4096)
        assert got, "no output before the deadline"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill() if proc.poll() is None else None
    err = err.decode()
    print(err)
    assert proc.returncode == 130
    assert "Traceback" not in err and "finish: interrupted" in err
    assert (got + out).endswith(b"\n") and len(got + out) > 20


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """code in a fresh interpreter started as from a terminal (SIGINT at its default: a suite run in the
    background inherits it ignored), without the user's OpenMP settings unless env gives them."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_the_gen_command_shortens_openmp_spinning_and_keeps_ctrl_c():
    """`gen` imports the engine before torch, so the engine's GOMP_SPINCOUNT reaches libgomp in every
    command (engine/__init__.py), and once its imports are in, Ctrl-C is Python's KeyboardInterrupt again
    (what stops a generation and keeps its text)."""
    proc = _python("import os, signal, cli.main; "
                   "print(os.environ.get('GOMP_SPINCOUNT'), signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    assert proc.stdout.split() == ["10000", "True"], proc.stderr


def test_ctrl_c_while_the_command_imports_is_quiet():
    """Ctrl-C in the second or two `gen` spends importing torch and its commands ends it as the signal
    does, with no KeyboardInterrupt traceback out of a library's import."""
    code = ("import importlib.abc, os, signal, sys\n"
            "class CtrlC(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'cli.generate':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, CtrlC())\n"
            "import cli.main\n"
            "print('imported')\n")
    proc = _python(code)
    assert proc.returncode == -signal.SIGINT and proc.stdout == "" and proc.stderr == "", proc.stderr


def test_an_import_that_fails_gives_ctrl_c_back():
    """Whatever a command's import raises, Python's Ctrl-C handler is back after it (not left at the
    signal's default, which would end the importing process with no KeyboardInterrupt)."""
    code = ("import importlib.abc, signal, sys\n"
            "class Broken(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'cli.serve':\n"
            "            raise ImportError('broken on purpose')\n"
            "sys.meta_path.insert(0, Broken())\n"
            "try:\n"
            "    import cli.main\n"
            "except ImportError:\n"
            "    pass\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    proc = _python(code)
    assert proc.stdout.split() == ["True"], proc.stderr
