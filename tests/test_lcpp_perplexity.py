"""benchmarks/lcpp_perplexity.py reads llama-perplexity's --kl-divergence-base file and scores gen on the
same windows: a file written here the way perplexity.cpp writes one (its log_softmax's 16-bit rows),
from gen's own logits on a small K-quant GGUF, must read back as zero divergence and equal perplexity;
a wrong offset or decoding would not."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import lcpp_perplexity  # noqa: E402
from chat_fixtures import write_gguf  # noqa: E402
from conftest import tiny_model  # noqa: E402

import engine  # noqa: E402

CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, rope_theta=10000.0)
N_CTX, N_CHUNK = 32, 3


def llama_rows(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp's log_softmax(n_vocab, logits, log_prob, tok): per row 2 fp32 (scale, the smallest
    log-prob kept, at most 16 below the top) and the logits as 16-bit steps above that minimum."""
    rows = []
    for x in logits.astype(np.float32):
        mx, mn = x.max(), max(x.min(), x.max() - 16)
        lse = np.float32(np.log(np.exp((x - mx).astype(np.float64)).sum()))
        scale = np.float32((mx - mn) / np.float32(65535))
        q = np.where(x > mn, np.rint((x - mn) * (np.float32(1) / scale)), 0).astype(np.uint16)
        head = np.array([scale, mn - mx - lse], dtype=np.float32).view(np.uint16)
        rows.append(np.concatenate([head, q, np.zeros(len(x) % 2, np.uint16)]))
    return np.stack(rows)


def write_base(path: Path, tokens: np.ndarray, logits) -> None:
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([N_CTX, CFG["vocab_size"], N_CHUNK], dtype=np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        for c in range(N_CHUNK):
            f.write(llama_rows(logits(c)).tobytes())


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("lcpp") / "k.gguf"
    kinds = {"ffn_down": Q.Q6_K, "attn_v": Q.Q6_K}
    write_gguf(path, tiny_model(seed=3, **CFG), None, template=None,
               qtype_of=lambda name, shape: kinds.get(name.split(".")[-2], Q.Q4_K) if shape[-1] % 256 == 0 else Q.Q8_0,
               write_tokenizer=lambda w: None)
    return path


def run(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["lcpp_perplexity.py", *map(str, args)])
    lcpp_perplexity.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_gen_against_its_own_logits_reads_as_zero_divergence(kquant_file, tmp_path, monkeypatch, capsys):
    model = engine.load(str(kquant_file), attention="softmax").model
    tokens = np.random.default_rng(0).integers(0, CFG["vocab_size"], size=(N_CHUNK, N_CTX))
    first = N_CTX // 2
    def logits(c):
        with torch.inference_mode():
            return model(torch.from_numpy(tokens[c:c + 1]).long()[:, :-1])[0, first:].float().numpy()

    write_base(tmp_path / "base.kld", tokens, logits)
    write_base(tmp_path / "shifted.kld", tokens, lambda c: logits(c) + np.arange(CFG["vocab_size"]) / 50)
    rec = run(monkeypatch, capsys, kquant_file, tmp_path / "base.kld", tmp_path / "shifted.kld",
              "--forms", "torch,native", "--threads", 1, "--batch-size", 2)
    assert rec["chunks"] == N_CHUNK and rec["targets_per_chunk"] == N_CTX - 1 - first
    torch_form, native = rec["forms"]["torch"], rec["forms"]["native"]
    assert torch_form["targets"] == N_CHUNK * (N_CTX - 1 - first)
    same, shifted = torch_form["against"]["base"], torch_form["against"]["shifted"]
    assert same["same_top"] == 1.0
    assert abs(same["kld_mean"]) < 1e-5      # only the stored rows' 16-bit steps and fp32 header
    assert abs(torch_form["ppl"] / same["ppl_llama"] - 1) < 1e-5
    assert shifted["kld_mean"] > 0.01 and abs(torch_form["ppl"] / shifted["ppl_llama"] - 1) > 1e-3   # each base its own
    assert native["against"]["base"]["kld_mean"] < 1e-3 and native["step_form"] == "native"   # the C step's q8 rounding


def test_another_models_file_is_refused(kquant_file, tmp_path, monkeypatch, capsys):
    tokens = np.zeros((N_CHUNK, N_CTX), dtype=np.int32)
    other = np.zeros((N_CHUNK * (N_CTX - 1 - N_CTX // 2), 4 + CFG["vocab_size"] + 2), dtype=np.uint16)
    head = b"_logits_" + np.array([N_CTX, CFG["vocab_size"] + 1, N_CHUNK], dtype=np.int32).tobytes() + tokens.tobytes()
    (tmp_path / "other.kld").write_bytes(head + other.tobytes())
    with pytest.raises(SystemExit, match="not the same model"):
        run(monkeypatch, capsys, kquant_file, tmp_path / "other.kld")
    (tmp_path / "short.kld").write_bytes(head + other[:-1].tobytes())
    with pytest.raises(SystemExit, match="cut short"):
        run(monkeypatch, capsys, kquant_file, tmp_path / "short.kld")
    (tmp_path / "bad.kld").write_bytes(b"not a logits file")
    with pytest.raises(SystemExit, match="kl-divergence-base"):
        run(monkeypatch, capsys, kquant_file, tmp_path / "bad.kld")


def test_weights_are_checked_against_a_float_copy(kquant_file, tmp_path):
    """--f32: gen's decoded blocks against a float copy of the same file (llama-quantize's F32 in real
    runs; here one written from gen's own decoding): equal, and one changed weight is named."""
    from engine.quant import dequantize_model
    model = engine.load(str(kquant_file), attention="softmax").model
    floats = engine.load(str(kquant_file), attention="softmax").model
    dequantize_model(floats)
    write_gguf(tmp_path / "f32.gguf", floats, None, template=None, write_tokenizer=lambda w: None)
    rec = lcpp_perplexity.weights_against(model, str(tmp_path / "f32.gguf"))
    assert rec["max_abs_diff"] == 0 and rec["differing"] == [] and {"q4_k", "q6_k"} <= set(rec["block_kinds"])
    with torch.no_grad():
        floats.layers[1].mlp.down_proj.weight[3, 7] += 1e-3
    write_gguf(tmp_path / "off.gguf", floats, None, template=None, write_tokenizer=lambda w: None)
    rec = lcpp_perplexity.weights_against(model, str(tmp_path / "off.gguf"))
    assert rec["differing"] == ["layers.1.mlp.down_proj.weight"] and rec["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
