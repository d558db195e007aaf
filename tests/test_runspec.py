"""RunSpec (engine/runspec.py): every run rule written once, resolved once; the model's config never
reassigned by a load; a server request's attention options mean what the CLI's mean on the same model;
the native step's thread count comes from the spec, not from a module global."""
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import engine.loader
import engine.threads
from cli.main import main
from engine.api import load
from engine.attention.feature_maps import Hedgehog
from engine.errors import InvalidArgumentError
from engine.runspec import RunSpec, ThreadsError, UnknownAttentionError, WindowError
from engine.threads import default_threads
from models.linearized import write_json, write_maps
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- each rule once
RULES = {   # a rule's message, as its one definition spells it: (rule, typed error, a call that breaks it)
    "unknown attention": (UnknownAttentionError, lambda cfg: RunSpec.resolve(cfg, attention="flash")),
    "--window must be at least 1": (WindowError, lambda cfg: RunSpec.resolve(cfg, attention="linear", window=0)),
    "threads must be an integer >= 1": (ThreadsError, lambda cfg: RunSpec.resolve(cfg, threads=0)),
}


@pytest.mark.parametrize("layers", ["\u0661", "1_0", "\uff11", "1.0", "one"])
def test_softmax_layers_are_ascii_layer_numbers(layers):
    with pytest.raises(InvalidArgumentError, match="give layer numbers like 2,9,11"):
        RunSpec.resolve(tiny_config(), attention="hybrid", softmax_layers=layers)


@pytest.mark.parametrize("message", list(RULES))
def test_each_rule_raises_its_typed_one_line_error(message):
    kind, breaks = RULES[message]
    with pytest.raises(kind) as e:
        breaks(tiny_config())
    assert isinstance(e.value, InvalidArgumentError) and message in str(e.value) and "\n" not in str(e.value)


def test_native_with_another_backend_is_refused_as_the_cli_refuses_it():
    """load(native=True, backend="torch") ran the native step and said so (`gen --native --backend torch`: exit 2)."""
    with pytest.raises(InvalidArgumentError, match="native=True is backend='native', and backend='torch' asks"):
        RunSpec.resolve(tiny_config(), native=True, backend="torch")
    assert RunSpec.resolve(tiny_config(), native=True).backend == RunSpec.resolve(tiny_config(), backend="native").backend


def source_files():
    return [p for d in ("engine", "cli") for p in (ROOT / d).rglob("*.py")]


@pytest.mark.parametrize("message", list(RULES) + ["hybrid attention needs the softmax layers"])
def test_each_rule_message_is_defined_once_in_the_source(message):
    """git grep's check: the message's text is written in one place of engine/ and cli/."""
    stem = message.split(" {")[0]
    where = [f"{p.relative_to(ROOT)}:{i + 1}" for p in source_files()
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()) if stem in line]
    assert len(where) == 1, where


def test_no_module_global_thread_count_and_the_default_lives_in_one_place():
    assert not hasattr(engine.threads, "_CURRENT")
    assert RunSpec.resolve(tiny_config()).threads == default_threads()
    assert RunSpec.resolve(tiny_config()).torch_threads == 1
    spec = RunSpec.resolve(tiny_config(), threads=1)
    assert (spec.threads, spec.torch_threads) == (1, 1)


@pytest.mark.parametrize("args, says", [
    (["--attention", "linear", "--window", "0"], "--window must be at least 1"),
    (["--attention", "flash"], "unknown attention 'flash'"),
])
def test_cli_exits_2_with_the_rules_own_line(small_model_dir, args, says):
    with pytest.raises(InvalidArgumentError) as e:
        RunSpec.resolve(tiny_config(), **dict(zip(("attention", "window"),
                                                  [a for a in args[1::2]][:1] + [int(a) for a in args[3::2]])))
    r = CliRunner().invoke(main, ["-m", str(small_model_dir), *args, "-n", "2", "hello"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"gen: error: {e.value}"] and says in r.output


# ---------------------------------------------------------------------- a hybrid + window default
@pytest.fixture
def hybrid_window_dir(small_model_dir, tmp_path):
    """A linearized dir (one set of random learned maps) whose default is hybrid (layer 0 softmax)
    with a window of 4, as smollm2-linear's is hybrid + window 256."""
    cfg = json.loads((Path(small_model_dir) / "config.json").read_text())
    layers = ["softmax"] + ["linear"] * (cfg["num_hidden_layers"] - 1)
    d = tmp_path / "lin"
    d.mkdir()
    write_json(d / "config.json", {"base_model": str(small_model_dir), "feature_map": "hedgehog",
                                   "attention": "hybrid", "layer_attention": layers, "window": 4,
                                   "transfer_loss": [0.1 * (i + 1) for i in range(len(layers))]})
    g = torch.Generator().manual_seed(1)
    fresh = Hedgehog(cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg.get("num_key_value_heads") or
                     cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]).state_dict()
    write_maps(d / "maps.safetensors", {f"hedgehog.{k}": v + torch.randn(v.shape, generator=g) * 0.5
                                        for k, v in fresh.items()})
    return d


def test_load_never_reassigns_the_models_config(hybrid_window_dir, monkeypatch):
    built = []
    real = engine.loader.build

    def recording(cfg, *a, **kw):
        built.append(cfg)
        return real(cfg, *a, **kw)
    monkeypatch.setattr(engine.loader, "build", recording)
    llm = load(str(hybrid_window_dir), attention="hybrid", softmax_layers=[1], window=2)
    assert llm.model.config is built[0]                               # the checkpoint's, as built
    assert (llm.model.config.window, llm.model.config.layer_attention[:2]) == (4, ("softmax", "linear"))
    assert (llm.spec.window, llm.spec.layer_attention[:2]) == (2, ("linear", "softmax"))   # the run's
    state = llm.model.init_state(1, 8, spec=llm.spec)
    assert state.layer_paths[:2] == ("window", "softmax") and state.parts[-1].window == 2


def test_a_requests_attention_means_what_the_cli_means(hybrid_window_dir):
    """A server on the hybrid + window default: a request's `attention: linear` runs every layer a
    pure linear RNN (no window), exactly what `gen --attention linear` and load(attention="linear")
    run (same greedy tokens); before RunSpec it kept the default's window of 4."""
    httpx = pytest.importorskip("httpx")
    from engine.serve import PrefixCache, Server
    from tests.test_serve_support import LiveServer
    prompt = [1, 5, 9, 20, 3, 7]
    r = CliRunner().invoke(main, ["-m", str(hybrid_window_dir), "--attention", "linear", "--ids",
                                  ",".join(map(str, prompt)), "-n", "10", "--temperature", "0", "--json"])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.output.strip().splitlines()[-1])
    api = load(str(hybrid_window_dir), attention="linear").generate(prompt, max_new_tokens=10, temperature=0,
                                                                      ignore_eos=True)
    windowed = load(str(hybrid_window_dir), attention="linear", window=4).generate(
        prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert cli["ids"] == api.ids[:len(cli["ids"])] and api.text != windowed.text   # the window matters here
    live = LiveServer(Server(load(str(hybrid_window_dir)), "small", cache=PrefixCache(max_entries=0)))
    try:
        def ask(**extra):
            res = httpx.post(live.url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra})
            return res
        res = ask(attention="linear")
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["text"] == api.text
        assert ask().json()["choices"][0]["text"] == load(str(hybrid_window_dir)).generate(
            prompt, max_new_tokens=10, temperature=0, ignore_eos=True).text           # the default: unchanged
        bad = ask(attention="linear", window=0)
        assert bad.status_code == 400
        err = bad.json()["error"]
        with pytest.raises(WindowError) as e:
            RunSpec.resolve(live.server.llm.model.config, attention="linear", window=0)
        assert err["message"] == str(e.value) and err["param"] == "window"
        bad = ask(attention="flash")
        assert bad.status_code == 400 and "unknown attention 'flash'" in bad.json()["error"]["message"]
        bad = ask(attention="")    # an empty name is not the default (null is)
        assert bad.status_code == 400 and "unknown attention ''" in bad.json()["error"]["message"]
        bad = ask(attention="hybrid", softmax_layers="\u0661")   # ARABIC-INDIC DIGIT ONE: int() reads it, a layer list not
        assert bad.status_code == 400 and "give layer numbers like 2,9,11" in bad.json()["error"]["message"]
    finally:
        live.stop()


# ---------------------------------------------------------------------- threads reach the native step
def test_the_native_steps_thread_count_comes_from_the_spec(small_model_dir, native_built):
    llm = load(str(small_model_dir), backend="native", threads=1)
    native = next(f for f in llm.step.forms if f.name == "native")
    assert llm.spec.threads == 1 and native.threads == 1
    engine.threads.set_threads(None)   # another caller's setting: the loaded run keeps its own count
    try:
        state = llm.model.init_state(1, 16, spec=llm.spec)
        llm.step(torch.tensor([[1]]), state)
        assert llm.step.last_form == "native" and native.plans[state].threads == 1
    finally:
        torch.set_num_threads(1)
    other = load(str(small_model_dir), backend="native")
    assert next(f for f in other.step.forms if f.name == "native").threads == default_threads()


def test_source_has_no_config_reassignment_outside_a_build():
    """`model.config` is assigned only where a model is built (Transformer.__init__)."""
    hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in source_files()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines())
            if re.search(r"\.config = ", line)]
    assert hits == ["engine/transformer.py:" + hits[0].split(":")[1]] and len(hits) == 1, hits


def test_every_command_offers_the_engines_backends_from_one_declaration():
    """--backend is declared once (cli.common.backend_option): gen, chat, bench and serve offer exactly
    engine.runspec.BACKENDS, and no command spells the list itself."""
    import pathlib

    from cli.main import main as cli_main
    from engine.runspec import BACKENDS
    commands = {n: cli_main.get_command(None, n) for n in ("generate", "chat", "bench", "serve")}
    for name, cmd in commands.items():
        option = next(p for p in cmd.params if p.name == "backend")
        assert tuple(option.type.choices) == BACKENDS, name
    cli_dir = pathlib.Path(__file__).resolve().parent.parent / "cli"
    spelled = [f.name for f in cli_dir.glob("*.py") if '"--backend"' in f.read_text()]
    assert spelled == ["common.py"], spelled
