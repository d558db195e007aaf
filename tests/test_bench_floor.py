"""`gen bench`'s bandwidth floor (engine.bench.floor): the bytes a step must read, counted from the model
and the state, the copy bandwidth measured once per run, and floor_ms / x_floor beside every row (table
and JSON). Bookkeeping only: no timing is asserted."""
import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from engine.bench import BenchSettings, run_bench
from engine.bench.floor import copy_bandwidth, floor_ms, weight_bytes_read
from engine.bench.memory import kv_cache_bytes, linear_state_bytes
from engine.bench.report import format_table
from engine.bench.sweep import measure
from tests.conftest import tiny_model


def param_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_weights_read_are_every_matrix_once_and_one_embedding_row_a_sequence(tied, batch):
    model = tiny_model(tie_word_embeddings=tied, dtype=torch.bfloat16)
    state = model.init_state(batch, 8, "softmax")
    unique = {id(p): p for p in model.parameters()}.values()   # a tied lm_head is the embedding
    emb = model.embed_tokens.weight
    expected = param_bytes(*unique) - (0 if tied else param_bytes(emb)) + batch * emb.shape[1] * 2
    assert weight_bytes_read(model, state) == expected


def test_a_linear_step_also_reads_the_learned_maps():
    model = tiny_model(feature_map="hedgehog")
    soft, lin = (weight_bytes_read(model, model.init_state(1, 8, a)) for a in ("softmax", "linear"))
    assert lin - soft == param_bytes(*model.hedgehog.parameters()) > 0


def test_state_read_is_the_cache_at_the_median_steps_depth_or_the_linear_state():
    model = tiny_model(num_key_value_heads=2, max_position_embeddings=64)
    soft = measure(model, "softmax", 20, steps=4, warmup=2, batch=2)
    lin = measure(model, "linear", 20, steps=4, warmup=2, batch=2)
    assert soft["state_bytes_read"] == kv_cache_bytes(model.config, 20 + 2 + 2, torch.float32, batch=2)
    assert lin["state_bytes_read"] == linear_state_bytes(model.config, None, torch.float32, batch=2)
    assert floor_ms(soft, 1e9) == pytest.approx((soft["weight_bytes_read"] + soft["state_bytes_read"]) / 1e6)


def test_copy_bandwidth_is_measured_on_the_device():
    bw = copy_bandwidth("cpu", copies=2)
    assert bw["bytes_per_s"] > 0 and bw["buffer_bytes"] == 256 << 20 and "read + written" in bw["method"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from models.weights import save_pretrained
    out = tmp_path_factory.mktemp("floor_model")
    save_pretrained(tiny_model(seed=4, max_position_embeddings=64, trained_for=("softmax", "linear")), str(out))
    return out


def test_every_row_has_its_floor_in_the_json_and_the_table(model_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "8,32", "--steps", "3",
                                  "--warmup", "1", "--no-isolate", "--quiet", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    bw = data["settings"]["copy_bandwidth"]["bytes_per_s"]
    for rec in data["results"]:
        assert rec["floor_ms"] == pytest.approx((rec["weight_bytes_read"] + rec["state_bytes_read"]) / bw * 1e3)
        assert rec["x_floor"] == pytest.approx(rec["decode_ms_per_token"] / rec["floor_ms"])
        assert {"decode_ms_per_token", "state_bytes", "peak_rss_bytes"} <= set(rec)   # the old keys stay
    head = r.output.splitlines()[0]
    assert "floor ms" in head and "x floor" in head
    assert any(line.startswith("floor: ") for line in r.output.splitlines())
    soft = {rec["context"]: rec["floor_ms"] for rec in data["results"] if rec["attention"] == "softmax"}
    assert soft[32] > soft[8]   # the deeper cache is more bytes to read


def test_a_table_of_records_from_before_the_floor_has_no_floor_columns(model_dir):
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(8,), attentions=("linear",), steps=2,
                                     warmup=1, isolate=False), progress=False)
    rec = {k: v for k, v in report["results"][0].items() if k not in ("floor_ms", "x_floor")}
    assert "floor ms" not in format_table([rec]) and "floor ms" in format_table(report["results"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU script)")
def test_the_cuda_floor_copies_a_gibibyte_on_the_device(model_dir):
    assert copy_bandwidth("cuda", copies=2)["buffer_bytes"] == 1 << 30
    report = run_bench(BenchSettings(model=str(model_dir), contexts=(16,), steps=3, warmup=1, device="cuda"),
                       progress=False)
    assert report["settings"]["copy_bandwidth"]["method"].endswith("bytes read + written per second")
    assert "on cuda" in report["settings"]["copy_bandwidth"]["method"]
    assert all(rec["floor_ms"] > 0 and rec["x_floor"] > 0 for rec in report["results"])
