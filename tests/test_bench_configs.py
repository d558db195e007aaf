"""`gen bench` over hybrid and window configurations, and depths reached by repeating a short prefill."""
import json

import pytest
import torch
from click.testing import CliRunner

from engine.attention.hybrid import state_bytes
from engine.bench import BenchSettings, run_bench
from engine.bench.configs import parse_attentions
from engine.bench.depth import extend_to_depth
from engine.bench.sweep import measure_entry
from engine.errors import InvalidArgumentError
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("small_copy_buffer")   # tests/conftest.py: no test here checks the floor

NEW_KEYS = {"entry", "configuration", "softmax_layers", "window", "prefill_tokens", "depth_fill"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from models.weights import save_pretrained
    out = tmp_path_factory.mktemp("bench_cfg_model")
    save_pretrained(tiny_model(seed=5, num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=64,
                               trained_for=("softmax", "linear")), str(out))
    return out


@pytest.mark.parametrize("entry,layers,window,paths", [
    ("hybrid", "0,2", None, ("softmax", "linear", "softmax")),
    ("hybrid", "1", 3, ("linear", "softmax", "linear")),
    ("window", None, 5, ("linear",) * 3),
    ("linear", None, 4, ("linear",) * 3),
])
def test_state_bytes_come_from_the_state_and_equal_the_per_layer_formula(entry, layers, window, paths):
    model = tiny_model(num_hidden_layers=3, num_key_value_heads=2)
    cfg = model.config
    rec = measure_entry(model, entry, 6, steps=2, warmup=1, softmax_layers=layers, window=window)
    slots = 6 + 1 + 2
    formula = state_bytes(cfg, paths, slots, feature_dim=cfg.head_dim, window=window or 0)
    assert rec["state_bytes"] == rec["state_bytes_formula"] == formula
    assert NEW_KEYS <= set(rec) and rec["entry"] == entry and rec["window"] == (window or 0)
    assert rec["state_slots"] == (slots if "softmax" in paths else None)
    assert model.config is cfg   # the model gets its own config back


def test_run_bench_all_four_configurations_side_by_side(model_dir, tmp_path):
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(8, 24), attentions=("all",),
                                     softmax_layers="1", window=4, steps=2, warmup=1, isolate=False), progress=False)
    labels = ["softmax", "linear", "hybrid 1/3 softmax", "linear + window 4"]
    assert [r["configuration"] for r in report["results"]] == labels * 2
    res = {(r["configuration"], r["context"]): r for r in report["results"]}
    assert res["linear", 8]["window"] == 0 and res["hybrid 1/3 softmax", 8]["window"] == 0
    assert res["hybrid 1/3 softmax", 24]["softmax_layers"] == [1]
    assert res["linear + window 4", 8]["state_bytes"] == res["linear + window 4", 24]["state_bytes"]
    assert res["hybrid 1/3 softmax", 8]["state_bytes"] < res["hybrid 1/3 softmax", 24]["state_bytes"]
    vs = report["summary"]["vs_softmax"]
    assert set(vs) == set(labels[1:])
    assert vs["linear"]["24"]["state_bytes_ratio"] == pytest.approx(
        res["linear", 24]["state_bytes"] / res["softmax", 24]["state_bytes"])
    assert set(report["summary"]["configurations"]) == set(labels)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from engine.bench.plot import plot
    seen = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *a, **k):
        seen.extend(line.get_label() for line in fig.axes[0].get_lines())
        return real_savefig(fig, *a, **k)
    plt.Figure.savefig = spy
    try:
        plot(report, tmp_path / "four.png")
    finally:
        plt.Figure.savefig = real_savefig
    assert [s for s in seen if not s.startswith(("crossover", "_"))] == [
        "softmax", "linear (elu1)", "hybrid 1/3 softmax (elu1)", "linear + window 4 (elu1)"]


def test_window_without_a_window_entry_windows_linear_and_hybrid_as_gen_does(model_dir):
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(8,), attentions="softmax,linear,hybrid",
                                     softmax_layers="0", window=3, steps=1, warmup=0, isolate=False, threads=1),
                       progress=False)
    got = {r["entry"]: (r["configuration"], r["window"]) for r in report["results"]}
    assert got == {"softmax": ("softmax", 0), "linear": ("linear + window 3", 3),
                   "hybrid": ("hybrid 1/3 softmax + window 3", 3)}


@pytest.mark.parametrize("attention", ["softmax", "hybrid"])
def test_extend_to_depth_repeats_the_prefilled_keys_and_moves_the_counters(attention):
    model = tiny_model(num_hidden_layers=3, num_key_value_heads=2)
    if attention == "hybrid":
        model.config = model.config.replace(attention="hybrid", layer_attention=("linear", "softmax", "linear"))
    tokens = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    state = model.init_state(1, max_len=20, attention=attention)
    model.step(tokens, state)
    kv = state if attention == "softmax" else state.parts[0]
    before = kv.k[:, :, :, :5].clone()
    kv.k[:, :, :, 5:].fill_(float("nan"))      # what is written from here on, and what is not
    extend_to_depth(state, 13)
    assert state.slots == 13 and state.lengths.tolist() == [13] and kv.slots == 13
    assert torch.equal(kv.k[:, :, :, 5:10], before) and torch.equal(kv.k[:, :, :, 10:13], before[:, :, :, :3])
    assert torch.equal(kv.v[:, :, :, 10:13], kv.v[:, :, :, :3])
    assert kv.k[:, :, :, 13:].isnan().all()          # nothing written past the depth
    logits = model.step(tokens[:, :1], state)       # a decode step reads all 14 slots
    assert torch.isfinite(logits).all() and state.slots == 14


def test_prefill_tokens_reaches_the_depth_with_a_short_prefill(model_dir):
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(4, 40), attentions="softmax,hybrid",
                                     softmax_layers="2", prefill_tokens=6, steps=2, warmup=1, isolate=False),
                       progress=False)
    for r in report["results"]:
        assert r["prefill_tokens"] == min(r["context"], 6)
        assert r["depth_fill"] == ("repeat" if r["context"] > 6 else "prefill")
        assert r["state_bytes"] == r["state_bytes_formula"]
    soft40 = next(r for r in report["results"] if r["entry"] == "softmax" and r["context"] == 40)
    assert soft40["state_slots"] == 40 + 1 + 2


def test_parse_attentions():
    assert parse_attentions("both") == ("softmax", "linear")
    assert parse_attentions("all,default") == ("softmax", "linear", "hybrid", "window", "default")
    assert parse_attentions("hybrid, softmax,hybrid") == ("hybrid", "softmax")
    with pytest.raises(InvalidArgumentError, match="unknown attention 'sigmoid'"):
        parse_attentions("softmax,sigmoid")


@pytest.mark.parametrize("args,message", [
    (["--attention", "hybrid", "--softmax-layers", "99"], "softmax layer 99 does not exist"),
    (["--attention", "linear", "--window", "0"], "--window must be at least 1"),
    (["--attention", "softmax", "--softmax-layers", "1"], "add hybrid to --attention"),
    (["--attention", "window"], "needs --window W"),
    (["--attention", "softmax,bogus"], "unknown attention 'bogus'"),
    (["--attention", "hybrid", "--softmax-layers", "auto:2"], "needs the transfer losses"),
    (["--prefill-tokens", "0"], "prefill_tokens must be >= 1"),
])
def test_cli_bad_configuration_one_line_exit_2_nothing_written(model_dir, tmp_path, args, message):
    from cli.main import main
    out = tmp_path / "b.json"
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8", "--steps", "1",
                                    "--no-isolate", "--quiet", "--json", str(out), *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert "decode ms/tok" not in res.output and not out.exists() and not (tmp_path / "b.json.tmp").exists()


def test_cli_four_way_json_keeps_the_old_keys(model_dir, tmp_path):
    from cli.main import main
    out = tmp_path / "b.json"
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8", "--steps", "1",
                                    "--warmup", "0", "--no-isolate", "--quiet", "--attention", "all",
                                    "--softmax-layers", "0,1", "--window", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [r["attention"] for r in data["results"]] == ["softmax", "linear", "hybrid", "linear"]
    assert data["settings"]["attentions"] == ["softmax", "linear", "hybrid", "window"]
    assert "hybrid 2/3 softmax vs softmax" in res.output


@pytest.mark.parametrize("entry,options", [
    ("softmax", {"attention": "softmax"}),
    ("linear", {"attention": "linear", "window": 4}),
    ("hybrid", {"attention": "hybrid", "softmax_layers": "0,2"}),
    ("window", {"attention": "linear", "window": 5}),
    ("default", {}),
])
def test_each_entry_is_the_runspec_gen_resolves_for_the_same_options(entry, options):
    """A bench row runs what `gen` / engine.load run with the same options: the entry's preset is
    RunSpec.resolve's spec, dtypes, threads and quantization included."""
    from engine.bench.configs import preset
    from engine.runspec import RunSpec
    cfg = tiny_model(num_hidden_layers=3, num_key_value_heads=2).config
    settings = {"dtype": "float16", "kv_dtype": "float32", "threads": 1, "quantize": "q8_0"}
    got = preset(cfg, entry, options.get("softmax_layers"), options.get("window"), **settings)
    assert isinstance(got, RunSpec)
    assert got == RunSpec.resolve(cfg, **options, **settings)
    settings_ = BenchSettings(attentions=(entry,), softmax_layers=options.get("softmax_layers"),
                              window=options.get("window"), weights="q8_0", threads=1)
    spec, keys = settings_.preset(cfg, entry)
    assert spec == RunSpec.resolve(cfg, **options, dtype="float32", threads=1, quantize="q8_0")
    assert keys["entry"] == entry and settings_.runtime(cfg, entry)[0] == spec.run_config(cfg)
