"""`gen bench` bookkeeping, not the clock: state bytes vs formulas, JSON keys, plot, refusals."""
import dataclasses
import json
import sys

import pytest
import torch
from click.testing import CliRunner

import engine.bench
from engine.bench import BenchSettings, run_bench, write_json
from engine.bench.memory import (DepthTooLargeError, check_fits, kv_cache_bytes, linear_state_bytes, run_bytes)
from engine.bench.report import decode_crossover
from engine.bench.sweep import BenchError, measure, percentile
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("small_copy_buffer")   # tests/conftest.py: no test here checks the floor

RESULT_KEYS = {"attention", "context", "prefill_tokens_per_s", "decode_ms_per_token", "decode_ms_per_token_p90",
               "decode_tokens_per_s", "state_bytes", "peak_rss_bytes"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved random model in the Hugging Face layout (no tokenizer), 32 trained positions."""
    from models.weights import save_pretrained
    out = tmp_path_factory.mktemp("bench_model")
    save_pretrained(tiny_model(seed=4, num_key_value_heads=2, max_position_embeddings=32,
                               trained_for=("softmax", "linear")), str(out))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["Hkv4", "Hkv2", "Hkv1"])
@pytest.mark.parametrize("slots", [1, 37])
def test_kv_cache_bytes_formula_matches_the_state(dtype, kv_heads, slots):
    model = tiny_model(num_key_value_heads=kv_heads, dtype=dtype)
    cfg = model.config
    state = model.init_state(1, max_len=slots, attention="softmax")
    explicit = 2 * cfg.num_hidden_layers * kv_heads * cfg.head_dim * slots * torch.finfo(dtype).bits // 8
    assert state.nbytes == kv_cache_bytes(cfg, slots, dtype) == explicit


@pytest.mark.parametrize("fmap,width", [("elu1", 16), ("cos1", 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["Hkv4", "Hkv1"])
def test_linear_state_bytes_formula_matches_the_state(fmap, width, dtype, kv_heads):
    """L * Hkv * (F * Dv + F) * 4 whatever the weights' dtype: the state is fp32, per kv head."""
    model = tiny_model(num_key_value_heads=kv_heads, dtype=dtype)
    cfg = model.config
    state = model.init_state(1, attention="linear", feature_map=fmap)
    explicit = cfg.num_hidden_layers * kv_heads * (width * cfg.head_dim + width) * 4
    assert state.nbytes == linear_state_bytes(cfg, fmap, dtype) == explicit


def test_measure_reports_bytes_from_the_state_and_flags_untrained_depths():
    model = tiny_model(max_position_embeddings=24)
    recs = {(a, c): measure(model, a, c, steps=3, warmup=1) for a in ("softmax", "linear") for c in (4, 20)}
    for (attention, context), r in recs.items():
        assert RESULT_KEYS - {"peak_rss_bytes"} <= set(r)
        assert r["state_bytes"] == r["state_bytes_formula"]
        assert r["beyond_trained_positions"] == (context + 1 + 3 > 24)
        assert r["decode_ms_per_token"] <= r["decode_ms_per_token_p90"]
    assert recs["softmax", 20]["state_slots"] == 24
    assert recs["softmax", 20]["state_bytes"] == kv_cache_bytes(model.config, 24, torch.float32)
    assert recs["linear", 4]["state_bytes"] == recs["linear", 20]["state_bytes"]


def test_run_bench_json_and_plot(model_dir, tmp_path):
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(40, 8), steps=3, warmup=1, isolate=False),
                       progress=False)
    write_json(report, tmp_path / "bench.json")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {"settings", "results", "summary"} <= set(data) and "targets" not in data
    s = data["settings"]
    assert s["contexts"] == [8, 40] and s["machine"]["torch"] == torch.__version__ and s["dtype"] == "float32"
    assert [(r["attention"], r["context"]) for r in data["results"]] == [
        ("softmax", 8), ("linear", 8), ("softmax", 40), ("linear", 40)]
    for r in data["results"]:
        assert RESULT_KEYS <= set(r) and r["peak_rss_bytes"] > 0
    assert [r["beyond_trained_positions"] for r in data["results"]] == [False, False, True, True]
    lin = [r for r in data["results"] if r["attention"] == "linear"]
    assert len({r["state_bytes"] for r in lin}) == 1
    assert all(r["state_bytes"] == r["state_bytes_formula"] for r in data["results"] if r["attention"] == "softmax")
    assert "decode_crossover" in data["summary"]

    from engine.bench.plot import plot
    out = plot(report, tmp_path / "bench.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_isolated_configuration_measures_its_own_peak_rss(model_dir):
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(8,), attentions=("linear",), steps=2,
                                     warmup=1, threads=1), progress=False)
    (rec,) = report["results"]
    assert "fresh subprocess" in rec["rss_method"]
    assert rec["peak_rss_bytes"] >= rec["rss_after_load_bytes"] > 0


def test_depth_beyond_memory_is_refused_up_front(model_dir, monkeypatch):
    import engine.bench as bench
    import engine.bench.sweep as sweep
    monkeypatch.setattr("engine.bench.memory.available_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(sweep, "measure", lambda *a, **k: pytest.fail("ran a configuration before refusing"))
    with pytest.raises(DepthTooLargeError, match=r"context 10000000 \((softmax|linear)\) needs \d+ bytes"):
        bench.run_bench(BenchSettings(model=str(model_dir), contexts=(8, 10_000_000), isolate=False),
                        progress=False)


def test_check_fits_names_the_bytes_needed():
    cfg = tiny_model().config
    parts = run_bytes(cfg, "softmax", 1000, 1072, torch.float32, weight_bytes=10**6)
    assert parts["state"] == kv_cache_bytes(cfg, 1072, torch.float32)
    check_fits([("softmax", 1000, parts)], available=10 * parts["total"])
    with pytest.raises(DepthTooLargeError, match=f"needs {parts['total']} bytes"):
        check_fits([("softmax", 1000, parts)], available=parts["total"])


def test_crossover_is_interpolated_in_log_depth():
    rec = lambda a, c, ms: {"attention": a, "context": c, "decode_ms_per_token": ms}  # noqa: E731
    res = [rec("softmax", 100, 1.0), rec("linear", 100, 2.0), rec("softmax", 10000, 3.0), rec("linear", 10000, 2.0)]
    cross = decode_crossover(res)
    assert cross["first_depth"] == 10000 and cross["estimate"] == 1000
    assert decode_crossover(res[:2])["first_depth"] is None
    assert decode_crossover([r for r in res if r["attention"] == "linear"]) is None


def test_report_holds_measurements_not_targets(model_dir):
    """The shipped report says what was measured; acceptance targets live in tests and docs."""
    from engine.bench.report import summary_lines
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(8,), steps=2, warmup=1, isolate=False),
                       progress=False)
    text = "\n".join(summary_lines(report))
    assert "target" not in text and "NOT met" not in text and "targets" not in report


def test_bench_output_directory_checked_before_measuring(model_dir, tmp_path):
    from cli.main import main
    r = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8", "--steps", "2",
                                  "--json", str(tmp_path / "missing" / "b.json")])
    assert r.exit_code == 2 and "does not exist" in r.output and ".tmp" not in r.output
    assert "decode" not in r.output   # nothing was measured


def test_percentile_nearest_rank():
    xs = list(range(1, 11))
    assert percentile(xs, 50) == 5 and percentile(xs, 90) == 9 and percentile(xs, 100) == 10


def test_cli_bench_table_json_plot(model_dir, tmp_path):
    from cli.main import main
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8,40", "--steps", "2",
                                    "--warmup", "1", "--no-isolate", "--quiet", "--threads", "1",
                                    "--json", str(out_json), "--plot", str(out_png)])
    assert res.exit_code == 0, res.output
    assert "decode ms/tok" in res.output and "crossover" in res.output and "torch" in res.output
    assert "beyond the model's trained positions" in res.output
    data = json.loads(out_json.read_text())
    assert len(data["results"]) == 4 and all(RESULT_KEYS <= set(r) for r in data["results"])
    assert out_png.stat().st_size > 0


def test_cli_refuses_a_plot_format_before_measuring(model_dir, tmp_path, monkeypatch):
    """--plot x.txt: one line and exit 2 before anything runs (it measured the whole sweep and then
    ended in matplotlib's traceback); a name without an extension gets a PNG under that very name
    (matplotlib would have written x.png while gen said it wrote x)."""
    from cli.main import main
    import cli.bench
    monkeypatch.setattr(cli.bench, "run_bench", lambda *a, **k: pytest.fail("measured before refusing"))
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--plot", str(tmp_path / "x.txt")])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "cannot write a plot as .txt" in res.output and ".png" in res.output
    assert not (tmp_path / "x.txt").exists()
    monkeypatch.undo()
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8", "--steps", "1",
                                    "--warmup", "0", "--no-isolate", "--quiet", "--threads", "1",
                                    "--plot", str(tmp_path / "noext"), "--attention", "linear"])
    assert res.exit_code == 0, res.output
    assert f"wrote {tmp_path / 'noext'}" in res.output and not (tmp_path / "noext.png").exists()
    assert (tmp_path / "noext").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, says", [
    (["--weights", "f16", "--dtype", "float32"], "--weights f16 runs float16 weights, --dtype float32 other ones"),
    (["--weights", "q4_0", "--dtype", "bfloat16"], "(quantized blocks of an fp32 model)"),
    (["--json", "{same}", "--plot", "{same}"], "the plot would replace the JSON"),
])
def test_cli_refuses_options_that_contradict_each_other_before_measuring(model_dir, tmp_path, monkeypatch, args, says):
    """Each ran and exited 0: --weights set the dtype over an explicit --dtype (the table said another
    dtype than the one asked for), and --json X --plot X wrote the JSON, then the PNG over it."""
    from cli.main import main
    import cli.bench
    monkeypatch.setattr(cli.bench, "run_bench", lambda *a, **k: pytest.fail("measured before refusing"))
    args = [a.format(same=tmp_path / "same.png") for a in args]
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), *args])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and says in res.output, res.output
    for agree in (["--weights", "f16", "--dtype", "fp16"], ["--weights", "q8_0", "--dtype", "float32"]):
        monkeypatch.setattr(cli.bench, "run_bench", lambda *a, **k: {"results": [], "settings": {}})
        assert CliRunner().invoke(main, ["bench", "--model", str(model_dir), *agree]).exit_code == 0


def test_cli_refuses_a_depth_the_machine_cannot_hold(model_dir):
    from cli.main import main
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8,100000000000",
                                    "--no-isolate", "--quiet"])
    assert res.exit_code == 2
    assert "needs" in res.output and "bytes" in res.output and "MemAvailable" in res.output


def test_cli_rejects_bad_contexts(model_dir):
    from cli.main import main
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8,x"])
    assert res.exit_code == 2 and "comma-separated" in res.output


def test_compare_hf_reports_both_rates(model_dir):
    pytest.importorskip("transformers")
    from engine.bench.hf_compare import compare_hf
    from engine.loader import load_model
    model, tok = load_model(model_dir)
    res = compare_hf(model_dir, model, tok, new_tokens=4, repeats=1)
    assert {"engine_tokens_per_s", "hf_tokens_per_s", "ratio"} <= set(res)
    assert res["ratio"] == pytest.approx(res["engine_tokens_per_s"] / res["hf_tokens_per_s"])
    assert res["same_tokens"] is True      # greedy on the same fp32 weights: the same ids


def test_compare_hf_without_transformers_says_how_to_install(model_dir, monkeypatch):
    from engine.bench.hf_compare import compare_hf
    from engine.loader import load_model
    monkeypatch.setitem(sys.modules, "transformers", None)     # import transformers -> ImportError
    model, tok = load_model(model_dir)
    with pytest.raises(BenchError, match="pip install"):
        compare_hf(model_dir, model, tok, new_tokens=4, repeats=1)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_model_info_counts_quantized_matrices(kind):
    """A quantized model has as many parameters as its float self (the bench report said 0.04M for
    SmolLM2-135M: only the norms were counted), and fewer weight bytes."""
    from engine.bench import model_info
    from engine.quant import quantize_model
    model = tiny_model(seed=3, hidden_size=64, intermediate_size=128)
    before = model_info(model)
    assert quantize_model(model, kind) == []
    after = model_info(model)
    assert after["parameters"] == before["parameters"]
    assert 0 < after["weight_bytes"] < before["weight_bytes"] / 3


def test_quantize_is_gen_s_name_for_bench_s_weights(model_dir, tmp_path):
    """`gen --quantize q8_0` and `gen bench --weights q8_0` are one thing: bench takes --quantize too."""
    from cli.main import main
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--quantize", "q8_0", "--contexts", "8",
                                  "--steps", "1", "--warmup", "0", "--attention", "linear", "--no-isolate",
                                  "--quiet", "--threads", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["settings"]["weights"] == "q8_0" and data["results"][0]["weights"] == "q8_0"


def test_a_failed_configuration_leaves_the_others_in_the_table_json_and_plot(model_dir, tmp_path, monkeypatch):
    """A worker killed (for memory, say) lost every finished row: no table, JSON or plot. Now its line comes
    after the table, the others are kept (the JSON names what failed) and the exit code is 2."""
    from cli.main import main
    real = engine.bench.run_in_process

    def killed_at_40(model, settings, attention, context):
        if (attention, context) == ("softmax", 40):
            raise BenchError("softmax at context 40: worker exited with code -9: no output")
        return real(model, settings, attention, context)
    monkeypatch.setattr(engine.bench, "run_in_process", killed_at_40)
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8,40", "--steps", "2",
                                    "--warmup", "1", "--no-isolate", "--quiet", "--threads", "1",
                                    "--json", str(out_json), "--plot", str(out_png)])
    assert res.exit_code == 2
    assert "worker exited with code -9" in res.output and "1 configuration failed" in res.output
    data = json.loads(out_json.read_text())
    assert sorted((r["attention"], r["context"]) for r in data["results"]) == [("linear", 8), ("linear", 40),
                                                                               ("softmax", 8)]
    assert data["failed"] == [{"attention": "softmax", "context": 40,
                               "error": "softmax at context 40: worker exited with code -9: no output"}]
    assert out_png.stat().st_size > 0

    def killed(model, settings, attention, context):
        raise BenchError(f"{attention} at context {context}: worker exited with code -9: no output")
    monkeypatch.setattr(engine.bench, "run_in_process", killed)   # every one: the JSON still says which
    res = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8", "--steps", "2",
                                    "--no-isolate", "--quiet", "--threads", "1", "--json", str(out_json)])
    assert res.exit_code == 2 and "2 configurations failed (above); none finished" in res.output
    assert json.loads(out_json.read_text())["results"] == [] and len(json.loads(out_json.read_text())["failed"]) == 2


def test_the_memory_crossover_counts_the_caches_own_dtype(model_dir):
    """With --kv-dtype float16 a KV slot is half an fp32 one: the crossover was computed at the weights' dtype."""
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(8,), steps=2, warmup=1, isolate=False,
                                     kv_dtype="float16"), progress=False)
    cfg = tiny_model(seed=4, num_key_value_heads=2).config
    per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2   # K and V, fp16
    linear = report["summary"]["linear_state_bytes"]
    assert report["summary"]["memory_crossover_slots"] == -(-linear // per_slot)


def test_prefill_tokens_fill_a_window_and_its_sparse_cache_as_at_the_depth():
    """`--prefill-tokens P` below a window state's span timed an empty sparse cache (no cached key read): a
    window run prefills at least W + M + 128 real tokens."""
    model = tiny_model(max_position_embeddings=512)
    spec = dataclasses.replace(model.run_spec("linear", None, None), window=8, sparse_keys=4)
    rec = measure(model, "linear", 400, steps=2, warmup=1, prefill_tokens=16, spec=spec)
    assert rec["prefill_tokens"] == 8 + 4 + 128 and rec["depth_fill"] == "repeat"
    assert measure(model, "softmax", 400, steps=2, warmup=1, prefill_tokens=16)["prefill_tokens"] == 16
