"""Low-rank adapters of the linear layers (engine.adapters, `gen linearize --lora-rank`): merged they
equal the live low-rank form; every step form runs them as the module path; softmax layers never
read them; the file round-trips and refuses another model's; linearize trains, writes and resumes them."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
from engine.adapters import LoRA, attach, detach, merge
from engine.linearize import linearize
from engine.loader import load_model
from engine.quant import q8_reference, quantize_model
from engine.steps import Stepper
from models.errors import CheckpointError
from models.linearized import read_adapters, write_adapters, write_json, write_maps
from tests.conftest import tiny_model
from tests.test_linearize import args, corpus  # noqa: F401 - the corpus fixture
from tests.test_quant import decode


def random_adapters(model, rank=3, seed=5, scale=0.3):
    lora = LoRA.for_config(model.config, rank, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in (lora.qkv_b, lora.o_b):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return lora


def adapted_model(attention_kw=None, rank=3, **cfg):
    model = tiny_model(feature_map="hedgehog", **cfg)
    merge(model, random_adapters(model, rank).export())
    return model


def run(model, backend, attention, prompt, follow, threads=2, **state_kw):
    step = Stepper(model, backend, threads=threads)
    state = model.init_state(prompt.shape[0], 64, attention, **state_kw)
    out, forms = [step(prompt, state)[:, -1:]], set()
    for t in follow.T:
        out.append(step(t.reshape(-1, 1), state))
        forms.add(step.last_form)
    return torch.cat(out, 1), forms


def toks(batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, 5), generator=g), torch.randint(0, 97, (batch, 12), generator=g)


def test_merged_equals_live_low_rank_form():
    model = tiny_model(feature_map="hedgehog", num_key_value_heads=2)
    lora = random_adapters(model)
    x = torch.randint(0, 97, (2, 9))
    attach(model, lora)
    with torch.no_grad():
        live = model(x, "linear")
    detach(model)
    with torch.no_grad():
        base = model(x, "linear")
    merge(model, lora.export())
    with torch.no_grad():
        merged = model(x, "linear")
    assert (live - merged).abs().max().item() <= 1e-5
    assert (live - base).abs().max().item() > 1e-2, "the adapters changed nothing: the test is blind"


@pytest.mark.parametrize("attention", ["linear", "hybrid", "window"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_step_forms_run_the_adapters_as_the_module_path(attention, backend, native_built):
    cfg = {"num_key_value_heads": 2}
    if attention == "hybrid":
        cfg["layer_attention"] = ("softmax", "linear")
    if attention == "window":
        cfg["window"] = 4
    model = adapted_model(**cfg)
    prompt, follow = toks()
    path = "linear" if attention == "window" else attention
    ref, _ = run(model, "module", path, prompt, follow)
    got, forms = run(model, backend, path, prompt, follow)
    assert forms == {backend}
    assert (ref - got).abs().max().item() <= 1e-4
    plain = tiny_model(feature_map="hedgehog", **cfg)
    base, _ = run(plain, "module", path, prompt, follow)
    assert (ref - base).abs().max().item() > 1e-2, "the adapters changed nothing: the test is blind"


def test_softmax_never_reads_the_adapters(native_built):
    model, plain = adapted_model(), tiny_model(feature_map="hedgehog")
    prompt, follow = toks()
    for backend in ("module", "torch", "native"):
        a, _ = run(model, backend, "softmax", prompt, follow)
        b, _ = run(plain, backend, "softmax", prompt, follow)
        assert torch.equal(a, b), backend
    x = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(x, "softmax"), plain(x, "softmax"))
    # a hybrid's softmax layer keeps the base projections: only the linear layer's adapters count
    hyb = adapted_model(layer_attention=("softmax", "linear"))
    hyb.layers[0].self_attn.adapted = None
    with torch.no_grad():
        y = hyb(x, "hybrid")
        hyb2 = adapted_model(layer_attention=("softmax", "linear"))
        assert torch.equal(y, hyb2(x, "hybrid"))


def test_quantized_base_merges_into_q8_blocks_and_native_equals_its_reference(native_built):
    """As tests/test_quant.py holds the quantized step: against q8_reference (activations rounded to
    q8 blocks as qdot.c), 1e-5 on most steps (a q8 rounding tie may move a run ~1e-2, see there)."""
    model = tiny_model(feature_map="hedgehog", num_key_value_heads=2, tie_word_embeddings=False)
    quantize_model(model, "q4_1")
    merge(model, random_adapters(model, scale=0.05).export())
    assert {m.kind for layer in model.layers for m in layer.self_attn.adapted} == {"q8_0"}
    ref, _ = decode(model, q8_reference(model), "module", "linear")
    got, forms = decode(model, model, "native", "linear")
    per_step = (got - ref).abs().amax(-1)
    assert forms == {"native"}
    assert (per_step <= 1e-5).float().mean().item() >= 0.75 and per_step.max() <= 0.1
    detach(model)
    base, _ = decode(model, model, "native", "linear")
    assert (base - got).abs().max().item() > 1e-2, "the adapters changed nothing: the test is blind"


def test_adapters_follow_the_model_to_another_dtype():
    model = adapted_model()
    model.to(torch.float64)
    assert all(m.weight.dtype == torch.float64 for layer in model.layers for m in layer.self_attn.adapted)


def test_file_round_trip_and_another_models_adapters_refused(tmp_path):
    model = tiny_model(feature_map="hedgehog")
    lora = random_adapters(model, rank=4)
    write_adapters(tmp_path / "a.safetensors", lora.export())
    assert all(t.dtype == torch.float16 for t in load_file(tmp_path / "a.safetensors").values())
    back = read_adapters(tmp_path / "a.safetensors", model.config)
    for k, v in lora.export().items():
        assert (back[k] - v).abs().max().item() <= 1e-2 * (1 + v.abs().max().item())
    other = model.config.replace(num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="another model") as e:
        read_adapters(tmp_path / "a.safetensors", other)
    assert "\n" not in str(e.value)


def test_linearize_trains_writes_and_loads_adapters(small_model_dir, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "lin"
    linearize(args(small_model_dir, corpus, out, lora_rank=2), log=lambda m: None)
    assert (out / "adapters.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["lora_rank"] == 2
    b = load_file(out / "adapters.safetensors")["adapter.qkv.b"]
    assert b.abs().max().item() > 0, "B stayed zero: the adapters did not train"
    model, _ = load_model(out)
    assert all(layer.self_attn.adapted is not None for layer in model.layers)
    x = torch.randint(0, 50, (1, 8))
    plain, _ = load_model(small_model_dir)
    with torch.no_grad():
        assert torch.equal(model(x, "softmax"), plain(x, "softmax"))


def test_resume_with_adapters_equals_an_uninterrupted_run(small_model_dir, corpus, tmp_path):  # noqa: F811
    straight = tmp_path / "straight"
    linearize(args(small_model_dir, corpus, straight, lora_rank=2), log=lambda m: None)
    out, stops = tmp_path / "resumed", [("finetune", None, 3)]

    def interrupt(phase, layer, step):
        if stops and (phase, layer, step) == stops[0]:
            stops.pop(0)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        linearize(args(small_model_dir, corpus, out, lora_rank=2), log=lambda m: None, on_step=interrupt)
    linearize(args(small_model_dir, corpus, out, lora_rank=2, resume=True), log=lambda m: None)
    a, b = load_file(straight / "adapters.safetensors"), load_file(out / "adapters.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_refuses_a_directory_with_another_models_adapters(small_model_dir, tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    model, _ = load_model(small_model_dir)
    cfg = model.config.replace(feature_map="hedgehog")
    write_json(d / "config.json", {"base_model": str(small_model_dir), "feature_map": "hedgehog",
                                   "attention": "linear"})
    from engine.attention.feature_maps import Hedgehog
    write_maps(d / "maps.safetensors", {f"hedgehog.{k}": v for k, v in Hedgehog.for_config(cfg).state_dict().items()})
    write_adapters(d / "adapters.safetensors", LoRA.for_config(cfg.replace(num_hidden_layers=1), 2).export())
    r = CliRunner().invoke(main, ["--model", str(d), "--max-new-tokens", "2", "hi"])
    assert r.exit_code == 2 and "another model" in r.output and "Traceback" not in r.output


def test_quantize_and_dequantize_convert_the_adapted_projections_too():
    from engine.quant import QuantLinear, dequantize_model
    model = adapted_model()
    quantize_model(model, "q8_0")
    assert all(isinstance(m, QuantLinear) for layer in model.layers for m in layer.self_attn.adapted)
    dequantize_model(model)
    assert not any(isinstance(m, QuantLinear) for layer in model.layers for m in layer.self_attn.adapted)


def test_bad_lora_rank_is_one_line_and_writes_nothing(small_model_dir, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["linearize", "--model", str(small_model_dir), "--data", str(corpus),
                                  "--out", str(out), "--lora-rank", "-1"])
    assert r.exit_code == 2 and "--lora-rank" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_resume_with_another_lora_rank_is_one_line(small_model_dir, corpus, tmp_path):  # noqa: F811
    from engine.errors import InvalidArgumentError
    out = tmp_path / "lin"

    def interrupt(phase, layer, step):
        if phase == "finetune" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        linearize(args(small_model_dir, corpus, out, lora_rank=2), log=lambda m: None, on_step=interrupt)
    for rank in (0, 3):
        with pytest.raises(InvalidArgumentError, match="same value") as e:
            linearize(args(small_model_dir, corpus, out, lora_rank=rank, resume=True), log=lambda m: None)
        assert "\n" not in str(e.value)
    # another --maps-lr lays the optimizer out otherwise (two groups, not one): one line too
    with pytest.raises(InvalidArgumentError, match="--maps-lr .* same value") as e:
        linearize(args(small_model_dir, corpus, out, lora_rank=2, maps_lr=0.01, resume=True), log=lambda m: None)
    with pytest.raises(InvalidArgumentError, match="has no maps to train"):
        linearize(args(small_model_dir, corpus, tmp_path / "ctl", control=True, maps_lr=0.01), log=lambda m: None)


def test_a_directory_naming_adapters_it_lacks_is_refused(small_model_dir, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "lin"
    linearize(args(small_model_dir, corpus, out, lora_rank=2, layer_steps=1, finetune_steps=1), log=lambda m: None)
    (out / "adapters.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(out)


def test_saved_states_know_the_adapters():
    from engine.state_io import model_identity
    plain = tiny_model(feature_map="hedgehog")
    assert model_identity(adapted_model()) != model_identity(plain)


def test_weights_label_counts_the_adapted_copies():
    from engine.quant import weights_label
    model = tiny_model(feature_map="hedgehog", tie_word_embeddings=False)
    quantize_model(model, "q4_1")
    assert weights_label(model) == "q4_1"
    merge(model, random_adapters(model).export())
    assert weights_label(model) == "q4_1+q8_0"
