"""What a new user meets first (issue 34): tracebacks, silent acceptance, chat defaults, habits."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from conftest import one_line_error
from engine.api import load


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny random chat model (ChatML template, byte-level BPE) in a Hugging Face directory."""
    from chat_fixtures import bpe_model_dir
    return bpe_model_dir(tmp_path_factory.mktemp("chat"))


def gen(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


# ---------------------------------------------------------------------- item 3: tracebacks
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_torch_step_in_a_16_bit_dtype(small_model_dir, dtype):
    """--backend torch --quantize q8_0 --dtype bfloat16 (the README's "every choice explicit" line) runs,
    and its torch step agrees with the module path on the same quantized weights."""
    prompt = "the cat sat"
    got = load(str(small_model_dir), backend="torch", quantize="q8_0", dtype=dtype).generate(
        prompt, temperature=0, max_new_tokens=8)
    ref = load(str(small_model_dir), backend="module", quantize="q8_0", dtype=dtype).generate(
        prompt, temperature=0, max_new_tokens=8)
    assert got.stats.step_form == "torch" and got.ids == ref.ids
    r = gen("--model", small_model_dir, "--backend", "torch", "--quantize", "q8_0", "--dtype", dtype,
            "--max-new-tokens", 4, prompt)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


def run_gen(*args, stdin=None, stdout=None, close=(), timeout=120):
    """The installed `gen` in a subprocess; close: file descriptors to close in the child first (0, 1)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    exe = str(Path(sys.executable).parent / "gen")
    if not os.path.exists(exe):
        pytest.skip("the `gen` console script is not installed (pip install -e .)")

    def closing():
        for fd in close:
            os.close(fd)
    return subprocess.run([exe, *map(str, args)], stdin=stdin, stdout=stdout or subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, preexec_fn=closing)


def check_one_line(proc, *words, code=2):
    print(proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and "Traceback" not in proc.stderr and len(lines) == 1
    assert lines[0].startswith("gen: error: ") and all(w in lines[0] for w in words)


def test_closed_stdin_is_one_line(small_model_dir, chat_dir):
    check_one_line(run_gen("--model", small_model_dir, "-", close=(0,)), "stdin is closed")
    check_one_line(run_gen("chat", "--model", chat_dir, close=(0,)), "stdin is closed")


def test_closed_stdout_is_one_line(small_model_dir):
    check_one_line(run_gen("--model", small_model_dir, "--max-new-tokens", 4, "the cat", close=(1,)),
                   "stdout is closed")


BENCH = ("bench", "--contexts", 8, "--steps", 1, "--warmup", 0, "--no-isolate", "--quiet", "--threads", 1,
         "--attention", "linear", "--backend", "torch")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full on this system")
def test_bench_into_a_closed_or_full_stdout_is_one_line_and_keeps_its_json(small_model_dir, tmp_path):
    """gen bench's table is its product: a closed stdout is refused before measuring (it measured and
    exited 0, the table lost); a full one is one line after the --json file is written."""
    out = tmp_path / "b.json"
    check_one_line(run_gen(*BENCH, "--model", small_model_dir, "--json", out, close=(1,)), "stdout is closed")
    assert not out.exists()
    with open("/dev/full", "w") as full:
        proc = run_gen(*BENCH, "--model", small_model_dir, "--json", out, stdout=full)
    check_one_line(proc, "cannot write to stdout", "No space left")
    assert json.loads(out.read_text())["results"]


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("json_out", [False, True], ids=["stream", "json"])
def test_full_stdout_is_one_line(small_model_dir, json_out):
    with open("/dev/full", "w") as full:
        proc = run_gen("--model", small_model_dir, "--max-new-tokens", 4, *(["--json"] if json_out else []),
                       "the cat", stdout=full)
    check_one_line(proc, "cannot write to stdout", "No space left")


def test_lone_surrogate_is_a_typed_error(small_model_dir):
    from engine.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match=r"generate\(\): the prompt is not valid UTF-8.*U\+D800"):
        load(str(small_model_dir)).generate("\ud800", max_new_tokens=2)
    one_line_error(gen("--model", small_model_dir, "ab\udfffc"), "U+DFFF")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full on this system")
def test_chat_into_a_full_stdout_is_one_line(chat_dir, tmp_path):
    (tmp_path / "in.txt").write_text("hello there\n")
    with open("/dev/full", "w") as full, open(tmp_path / "in.txt") as lines:
        proc = run_gen("chat", "--model", chat_dir, "--max-new-tokens", 8, "--seed", 0, stdin=lines, stdout=full)
    print(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "gen: error: cannot write to stdout: No space left on device" in proc.stderr.splitlines()


# ---------------------------------------------------------------------- item 5: silent acceptance
def test_more_threads_than_cores(small_model_dir):
    """The CLI refuses --threads above the cores this process may run on (one line, exit 2, before
    loading); the API honours it (tests run pools wider than the machine) but warns."""
    from engine.api import ThreadsWarning
    from engine.threads import available_cores
    too_many = available_cores() + 1
    for cmd in ([], ["chat"], ["bench"]):
        one_line_error(gen(*cmd, "--model", small_model_dir, "--threads", too_many, *([] if cmd else ["hi"])),
                       "--threads", f"give 1 to {available_cores()}")
    one_line_error(gen("--model", small_model_dir, "-t", 0, "hi"), "at least 1")
    assert gen("--model", small_model_dir, "--threads", available_cores(), "--max-new-tokens", 2, "hi").exit_code == 0
    with pytest.warns(ThreadsWarning, match=f"threads={too_many} is more than"):
        load(str(small_model_dir), threads=too_many)


def test_duplicate_softmax_layers(small_model_dir):
    from engine.errors import InvalidArgumentError
    one_line_error(gen("--model", small_model_dir, "--attention", "hybrid", "--softmax-layers", "1,1", "hi"),
                   "softmax layer 1 is listed twice")
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        load(str(small_model_dir), attention="hybrid", softmax_layers=[0, 1, 0])


def test_bytes_prompt_is_refused(small_model_dir):
    from engine.errors import InvalidArgumentError
    llm = load(str(small_model_dir))
    for call in (llm.generate, llm.stream, lambda p, **kw: llm.generate([p, p], **kw)):
        with pytest.raises(InvalidArgumentError, match=r"got bytes; decode it first"):
            call(b"Once", max_new_tokens=2)
    assert llm.generate([5, 6], max_new_tokens=2, temperature=0).stats.prompt_tokens == 2   # ids still work


def test_unknown_message_role(chat_dir):
    from engine.errors import InvalidArgumentError
    llm = load(str(chat_dir))
    with pytest.raises(InvalidArgumentError, match="unknown message role 'wizard'; valid: system, user, assistant"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidArgumentError, match=r"must be a non-empty list of \{"):
        llm.chat([])


# ---------------------------------------------------------------------- item 2: chat sampling defaults
def model_with_generation_config(chat_dir, tmp_path, **keys):
    import json
    import shutil
    out = tmp_path / "with_config"
    shutil.copytree(chat_dir, out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "do_sample": True, **keys}))
    return out


def sampling_of(run, monkeypatch):
    """The SamplingParams of every GenerationConfig the API builds while `run()` runs."""
    import engine.api
    seen, real = [], engine.api.make_config_for

    def spy(call, settings):
        config = real(call, settings)
        seen.append(config.sampling)
        return config
    monkeypatch.setattr(engine.api, "make_config_for", spy)
    run()
    return seen


def test_chat_defaults_are_llama_cpp_truncation(chat_dir, monkeypatch):
    from engine.sampling import CHAT_DEFAULTS, SamplingParams
    assert CHAT_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    llm = load(str(chat_dir))
    assert llm.chat_sampling == CHAT_DEFAULTS
    msgs = [{"role": "user", "content": "hello there"}]
    assert llm.chat(msgs, seed=1, max_new_tokens=2).generation.config.sampling == SamplingParams(**CHAT_DEFAULTS,
                                                                                                   seed=1)
    reply = llm.chat_session().send("hello there", seed=1, max_new_tokens=2, top_k=5)   # a setting given wins
    assert reply.generation.config.sampling == SamplingParams(**{**CHAT_DEFAULTS, "top_k": 5}, seed=1)
    assert llm.generate("hello", max_new_tokens=2).stats is not None   # plain generation: unchanged defaults
    # the CLI passes only what was typed: `gen chat` and `gen --chat` sample with the chat defaults
    for args in (["chat", "--model", chat_dir, "-n", 2, "--top-k", 7],
                 ["--model", chat_dir, "-n", 2, "--top-k", 7, "--chat", "hello there"]):
        seen = sampling_of(lambda: gen(*args, input="hello there\n"), monkeypatch)
        assert [(s.temperature, s.top_k, s.top_p, s.min_p) for s in seen] == [(0.8, 7, 0.95, 0.05)], args
    r = gen("chat", "--help")
    assert "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05" in " ".join(r.stdout.split())
    assert "generation_config.json" in r.stdout


def test_chat_defaults_from_the_models_generation_config(chat_dir, tmp_path, monkeypatch):
    from engine.errors import ConfigError
    from engine.sampling import SamplingParams
    model = model_with_generation_config(chat_dir, tmp_path, temperature=0.6, top_p=0.9, repetition_penalty=1.1)
    llm = load(str(model))
    assert llm.sampling == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    assert llm.chat_sampling == {"temperature": 0.6, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                 "repetition_penalty": 1.1}
    stream = llm.chat([{"role": "user", "content": "hi"}], seed=2, max_new_tokens=2, temperature=0.3)
    assert stream.generation.config.sampling == SamplingParams(temperature=0.3, top_k=40, top_p=0.9, min_p=0.05,
                                                               repetition_penalty=1.1, seed=2)
    seen = sampling_of(lambda: gen("chat", "--model", model, "-n", 2, input="hi\n"), monkeypatch)
    assert [(s.temperature, s.top_p, s.repetition_penalty) for s in seen] == [(0.6, 0.9, 1.1)]
    bad = model_with_generation_config(chat_dir, tmp_path / "bad", top_p=0)
    with pytest.raises(ConfigError, match="generation config: top_p must be in"):
        load(str(bad)).chat([{"role": "user", "content": "hi"}])
    one_line_error(gen("chat", "--model", bad, input="hi\n"), "generation config", "top_p")


def test_gguf_sampling_keys():
    from models.errors import CheckpointError
    from models.generation_config import gguf_sampling
    assert gguf_sampling({"general.name": "x"}) == {}
    assert gguf_sampling({"general.sampling.temp": 0.7, "general.sampling.top_k": 20,
                          "general.sampling.penalty_repeat": 1.05}) == {"temperature": 0.7, "top_k": 20,
                                                                        "repetition_penalty": 1.05}
    with pytest.raises(CheckpointError, match="top_k must be an integer"):
        gguf_sampling({"general.sampling.top_k": 2.5}, "m.gguf")


# ---------------------------------------------------------------------- item 6: internals in user text
def test_cli_messages_name_no_python_calls(tmp_path):
    from cli.common import user_text
    from conftest import tiny_model
    from models.weights import save_pretrained
    save_pretrained(tiny_model(), str(tmp_path))                      # no tokenizer
    line = one_line_error(gen("--model", tmp_path, "the cat"), "ships no tokenizer", "--ids 1,2,3")
    assert "()" not in line
    assert user_text(ValueError("chat_session().send(): the message is empty")) == "the message is empty"
    assert user_text(ValueError("start(): x (see start())")) == "x (see start())"


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "train", "linearize", "convert"])
def test_help_names_no_internals(command):
    text = " ".join(gen(command, "--help").stdout.split())
    for internal in ("module doc", "README 'Threads'", "engine.", "default_threads()"):
        assert internal not in text, internal


# ---------------------------------------------------------------------- item 7: habits
def test_short_aliases(small_model_dir, chat_dir):
    import json
    long = gen("--json", "--model", small_model_dir, "--prompt", "the cat", "--max-new-tokens", 5, "--threads", 1,
               "--temperature", 0, "--max-context", 40)
    short = gen("--json", "-m", small_model_dir, "-p", "the cat", "-n", 5, "-t", 1, "--temp", 0, "-c", 40)
    assert long.exit_code == short.exit_code == 0, short.output
    assert json.loads(short.stdout)["ids"] == json.loads(long.stdout)["ids"]
    one_line_error(gen("-m", small_model_dir, "-c", 3, "the cat sat on the mat"), "context holds 3")
    r = gen("chat", "-m", chat_dir, "-n", 3, "--temp", 0, "-t", 1, "-c", 200, input="hello\n")
    expected = "".join(load(str(chat_dir)).chat([{"role": "user", "content": "hello"}], temperature=0,
                                                max_new_tokens=3))
    assert r.exit_code == 0 and r.stdout == expected + "\n", r.output
    assert "-m, --model" in gen("bench", "--help").stdout and "-t, --threads" in gen("bench", "--help").stdout


def test_version():
    import re
    r = gen("--version")
    assert r.exit_code == 0 and re.fullmatch(r"gen \S+ \(torch \S+, Python \S+\)\n", r.stdout), r.output


def test_loading_line_when_a_load_is_slow(small_model_dir, monkeypatch):
    import json

    import cli.generate
    monkeypatch.setattr(cli.generate, "LOADING_NOTICE_S", 0.0)
    r = gen("--json", "-m", small_model_dir, "-n", 2, "the cat")
    assert r.exit_code == 0 and "loaded" not in r.stderr                      # stderr is no terminal: silent
    monkeypatch.setattr(cli.generate, "LOADING_NOTICE_S", 1e9)
    monkeypatch.setattr(cli.generate, "stderr_is_terminal", lambda: True)
    r = gen("--json", "-m", small_model_dir, "-n", 2, "the cat")
    assert r.exit_code == 0 and "loading" not in r.stderr and "loaded" not in r.stderr   # a fast load: silent
    monkeypatch.setattr(cli.generate, "LOADING_NOTICE_S", 0.0)                          # every load is slow
    for json_out in (True, False):
        r = gen(*(["--json"] if json_out else []), "-m", small_model_dir, "-n", 2, "the cat")
        assert r.exit_code == 0 and f"gen: loaded {small_model_dir} in " in r.stderr, r.output
        assert "loaded" not in r.stdout
        if json_out:
            assert json.loads(r.stdout)["ids"]            # stdout stays one JSON object


def test_chat_prints_a_timing_line_per_turn(chat_dir):
    r = gen("chat", "-m", chat_dir, "-n", 4, "--seed", 0, input="hello\nhow are you\n")
    print(r.stderr)
    timings = [ln for ln in r.stderr.splitlines() if " tokens/s " in ln]
    assert r.exit_code == 0 and len(timings) == 2
    assert all(ln.startswith("gen: ") and "tokens, " in ln and "finish: " in ln for ln in timings)


# ---------------------------------------------------------------------- item 4: work lost, memory spent
BENCH = ["bench", "--contexts", "8,16", "--steps", 1, "--warmup", 0, "--no-isolate", "--quiet", "-t", 1]


def test_bench_refuses_an_uncreatable_output_before_measuring(small_model_dir, monkeypatch):
    import engine.bench
    monkeypatch.setattr(engine.bench, "run_bench", lambda *a, **k: pytest.fail("measured before the path check"))
    for where in ("/sys", "/proc"):      # root passes os.access there, yet no file can be created
        if __import__("os").path.isdir(where):
            one_line_error(gen(*BENCH, "-m", small_model_dir, "--json", f"{where}/b.json"), "cannot create a file")


@pytest.mark.usefixtures("small_copy_buffer")   # tests/conftest.py: the floor is not checked here
def test_bench_ctrl_c_prints_the_finished_rows(small_model_dir, tmp_path, monkeypatch):
    import json

    import engine.bench
    real, calls = engine.bench.run_in_process, []

    def interrupted_third(*args):
        calls.append(args[2:])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(engine.bench, "run_in_process", interrupted_third)
    r = gen(*BENCH, "-m", small_model_dir, "--json", tmp_path / "b.json")
    print(r.output)
    assert r.exit_code == 130 and "Traceback" not in r.output
    assert "gen bench: interrupted after 2 of 4 configurations" in r.stderr
    table = r.stdout.split("\n\n")[0].splitlines()[2:]           # the rows under the header and its rule
    assert [row.split()[0] for row in table] == ["linear", "softmax"] and all(" 8 " in row for row in table)
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["interrupted"] == {"finished": 2, "configurations": 4} and len(report["results"]) == 2


def test_a_prompt_longer_than_the_context_allocates_no_cache_for_it(small_model_dir, monkeypatch):
    """300k tokens on the softmax path used to allocate a 3.9 GB cache before the context error."""
    from engine.errors import InvalidArgumentError
    llm = load(str(small_model_dir), attention="softmax")
    asked, real = [], llm.model.init_state
    monkeypatch.setattr(llm.model, "init_state", lambda **kw: asked.append(kw["max_len"]) or real(**kw))
    context = llm.model.config.max_position_embeddings
    with pytest.raises(InvalidArgumentError, match=f"the prompt has {50 * context} tokens but the context holds"):
        llm.generate([5] * (50 * context), max_new_tokens=2)
    assert asked == [1]


def test_a_state_that_cannot_fit_is_one_line(small_model_dir):
    one_line_error(gen("-m", small_model_dir, "--attention", "softmax", "-c", 10 ** 12, "-n", 10 ** 12, "hi"),
                   "does not fit in memory")
    # linear layers' exact keys: the window and the sparse cache are named (it said "a state for 4 tokens ...
    # or use linear attention", to a run on linear attention)
    for args, held in ((["--window", 10 ** 12], "a window of 1,000,000,000,000 keys"),
                       (["--window", 4, "--sparse-keys", 10 ** 12], "and 1,000,000,000,000 sparse keys")):
        one_line_error(gen("-m", small_model_dir, "--attention", "linear", *args, "-n", 3, "hi"),
                       "does not fit in memory", held, "lower --window / --sparse-keys")


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_a_long_prompt_reports_its_prefill(small_model_dir, monkeypatch, attention):
    """With on_prefill set, a long prompt runs in blocks of whole prefill chunks and reports after each:
    the same tokens as one call (the step cuts the same chunks)."""
    import engine.generate
    llm = load(str(small_model_dir), attention=attention, backend="torch", prefill_chunk=4)
    prompt = [(7 * i) % 200 + 3 for i in range(50)]
    whole = llm.generate(prompt, temperature=0, max_new_tokens=6, max_context=64)
    monkeypatch.setattr(engine.generate, "PROGRESS_BLOCK", 18)        # blocks of 16: four whole chunks of 4
    blocks, real = [], type(llm.step)._block      # one chunk of a prompt block
    monkeypatch.setattr(type(llm.step), "_block",
                        lambda self, tokens, *a, **k: blocks.append(tokens.shape[1]) or real(self, tokens, *a, **k))
    generation, heard = llm.start([prompt], temperature=0, max_new_tokens=6, max_context=64), []
    generation.on_prefill = lambda done, total: heard.append((done, total))
    reported = generation.run()[0]
    assert heard == [(16, 50), (32, 50), (48, 50), (50, 50)]
    assert blocks == [4] * 12 + [2]    # the chunks of one whole call (decode steps do not pass here)
    assert reported.ids == whole.ids and reported.stats.prompt_tokens == 50


def test_the_cli_shows_progress_for_a_long_prompt_on_a_terminal(small_model_dir, monkeypatch):
    import cli.generate
    import engine.generate
    monkeypatch.setattr(engine.generate, "PROGRESS_BLOCK", 4)
    monkeypatch.setattr(cli.generate, "stderr_is_terminal", lambda: True)
    r = gen("-m", small_model_dir, "--attention", "linear", "-n", 2, "the cat sat on the mat and the dog ran home")
    assert r.exit_code == 0 and "gen: reading the prompt" in r.stderr, r.output
    monkeypatch.setattr(cli.generate, "stderr_is_terminal", lambda: False)
    r = gen("-m", small_model_dir, "--attention", "linear", "-n", 2, "the cat sat on the mat and the dog ran home")
    assert r.exit_code == 0 and "reading the prompt" not in r.stderr


def test_one_new_token_reports_no_decode_step(small_model_dir):
    """-n 1: the prompt's block makes the only token, so no step form ran and there is no decode rate.
    The summary said "1 new tokens, 0.0 tokens/s (0.00 ms/token) ... step module" and -v "step form:
    module ... fallback: none" (the prompt block's form, or a previous call's)."""
    llm = load(str(small_model_dir), backend="torch")
    llm.generate("the cat", temperature=0, max_new_tokens=3)           # a call that stepped, before
    one = llm.generate("the cat", temperature=0, max_new_tokens=1)
    assert one.stats.new_tokens == 1 and one.stats.step_form is None and one.stats.decode_tokens_per_s == 0.0
    r = gen("--model", small_model_dir, "-n", 1, "-v", "--backend", "torch", "the cat")
    assert r.exit_code == 0, r.output
    summary, verbose = r.stderr.strip().splitlines()[-2:]
    assert "| 1 new token, no decode step, first token after" in summary and "| step none |" in summary, summary
    assert verbose.startswith("gen: step form: none ran"), verbose
    r = gen("--model", small_model_dir, "-n", 3, "-v", "--backend", "torch", "--temperature", 0, "the cat")
    summary, verbose = r.stderr.strip().splitlines()[-2:]
    assert "3 new tokens, " in summary and "| step torch |" in summary and verbose.startswith("gen: step form: torch;")
