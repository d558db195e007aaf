"""A linearized directory may ship a second set of maps (config.json "variants", models.linearized):
every run whose linear layers have no window (all linear, hybrids without --window) loads the
"no_window" set; every other configuration the default set; a bad entry is one line."""
import json
import re

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from engine.adapters import LoRA
from engine.api import load
from engine.attention.feature_maps import Hedgehog
from engine.attention.hybrid import runtime_config
from engine.loader import load_model
from models.errors import CheckpointError
from models.linearized import read_maps, write_adapters, write_json, write_maps
from tests.test_linearize import corpus  # noqa: F401 - the corpus fixture


def random_maps(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return {f"hedgehog.{k}": v + torch.randn(v.shape, generator=g) * 0.3
            for k, v in Hedgehog.for_config(cfg).state_dict().items()}


def random_adapters(cfg, rank, seed):
    lora = LoRA.for_config(cfg, rank, seed)
    with torch.no_grad():
        for p in (lora.qkv_b, lora.o_b):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
    return lora.export()


@pytest.fixture
def two_sets(small_model_dir, tmp_path):
    """A linearized dir: a hybrid + window default with maps A and no adapters, and in linear/ a
    whole `gen linearize` output for every layer linear (maps B, rank-2 adapters)."""
    base, _ = load_model(small_model_dir)
    cfg = base.config.replace(feature_map="hedgehog")
    d, sub = tmp_path / "lin", tmp_path / "lin" / "linear"
    sub.mkdir(parents=True)
    layers = ["softmax"] + ["linear"] * (cfg.num_hidden_layers - 1)
    write_json(d / "config.json", {"base_model": str(small_model_dir), "feature_map": "hedgehog",
                                   "attention": "hybrid", "layer_attention": layers, "window": 4,
                                   "transfer_loss": [0.1 * (i + 1) for i in range(len(layers))],
                                   "variants": {"no_window": "linear"}})
    write_maps(d / "maps.safetensors", random_maps(cfg, 1))
    write_json(sub / "config.json", {"base_model": str(small_model_dir), "feature_map": "hedgehog",
                                     "attention": "linear", "lora_rank": 2})
    write_maps(sub / "maps.safetensors", random_maps(cfg, 2))
    write_adapters(sub / "adapters.safetensors", random_adapters(cfg, 2, 3))
    return d, cfg


def load_as(d, **kw):
    """load_model for the run `kw` asks for (attention, softmax_layers, window, as load())."""
    return load_model(d, configure=lambda cfg: runtime_config(cfg, **kw))


def maps_of(model):
    return {f"hedgehog.{k}": v for k, v in model.hedgehog.state_dict().items()}


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


@pytest.mark.parametrize("kw", [{"attention": "linear"}, {"attention": "hybrid"},
                                {"softmax_layers": [1]}, {"attention": "hybrid", "softmax_layers": "auto:1"}])
def test_runs_without_a_window_load_the_no_window_set(two_sets, kw):
    d, cfg = two_sets
    default, linear = read_maps(d / "maps.safetensors", cfg), read_maps(d / "linear" / "maps.safetensors", cfg)
    assert not same(default, linear)
    model, _ = load_as(d, **kw)
    assert same(maps_of(model), linear)
    assert all(layer.self_attn.adapted is not None for layer in model.layers)   # the set's adapters came too
    assert same(maps_of(load(str(d), **kw).model), linear)


@pytest.mark.parametrize("kw", [{}, {"attention": "linear", "window": 4}, {"attention": "hybrid", "window": 2},
                                {"attention": "softmax"}])
def test_every_other_run_loads_the_default_set(two_sets, kw):
    d, cfg = two_sets
    default = read_maps(d / "maps.safetensors", cfg)
    model, _ = load_as(d, **kw)
    assert same(maps_of(model), default)
    assert all(layer.self_attn.adapted is None for layer in model.layers)
    assert same(maps_of(load(str(d), **kw).model), default)


def test_eval_of_all_linear_scores_the_linear_set(two_sets, corpus):  # noqa: F811
    d, _ = two_sets

    def ppl(model, *flags):
        r = CliRunner().invoke(main, ["eval", "--model", str(model), "--data", str(corpus), "--max-docs", "3",
                                      "--json", *flags])
        assert r.exit_code == 0, r.output
        return json.loads(r.output.strip().splitlines()[-1])["perplexity"]

    via_parent = ppl(d, "--attention", "linear")
    assert via_parent == ppl(d / "linear", "--attention", "linear")   # the set itself, loaded alone
    config = json.loads((d / "config.json").read_text())
    del config["variants"]
    write_json(d / "config.json", config)
    assert ppl(d, "--attention", "linear") != via_parent              # without the entry: the default set


@pytest.mark.parametrize("variants, match", [
    ({"linear": "linear"}, "maps a configuration"),
    ({"no_window": 3}, "maps a configuration"),
    ({"no_window": "nowhere"}, "holds no config.json"),
])
def test_a_bad_variants_entry_is_one_line(two_sets, variants, match):
    d, _ = two_sets
    config = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", {**config, "variants": variants})
    with pytest.raises(CheckpointError, match=match) as e:
        load_model(d)
    assert "\n" not in str(e.value)
    r = CliRunner().invoke(main, ["--model", str(d), "--attention", "linear", "--max-new-tokens", "2", "hi"])
    assert r.exit_code == 2 and match in r.output and "Traceback" not in r.output


def test_a_set_made_from_another_base_model_is_refused(two_sets):
    d, _ = two_sets
    sub = d / "linear" / "config.json"
    write_json(sub, {**json.loads(sub.read_text()), "base_model": "tiny"})
    with pytest.raises(CheckpointError, match="another model") as e:
        load_model(d)
    assert "\n" not in str(e.value)


@pytest.mark.usefixtures("small_copy_buffer")   # tests/conftest.py: the floor is not checked here
def test_isolated_bench_rows_load_their_set_for_every_entry(two_sets):
    """Each isolated bench row resolves its entry (window and default too) before choosing the maps: with
    linear/'s maps unreadable the linear row's worker fails, the window and default rows' do not."""
    from engine.bench import BenchSettings, run_bench
    d, _ = two_sets
    (d / "linear" / "maps.safetensors").write_bytes(b"not safetensors")
    report = run_bench(BenchSettings(model=str(d), contexts=(8,), attentions=("window", "default"),
                                     steps=1, warmup=0, threads=1), progress=False)
    assert [r["entry"] for r in report["results"]] == ["window", "default"]
    assert [r["window"] for r in report["results"]] == [4, 4]
    failed = run_bench(BenchSettings(model=str(d), contexts=(8,), attentions=("linear",), steps=1, warmup=0,
                                     threads=1), progress=False)   # (a failed row is reported, the run goes on)
    assert failed["results"] == [] and len(failed["failed"]) == 1
    assert re.search(r"linear at context 8: .*linear/maps\.safetensors", failed["failed"][0]["error"])
