"""Loading real and written checkpoints: llama2.c files (legacy, v1), Hugging Face dirs (single,
sharded, tied, bf16/fp16), the llama2.c -> HF converter, memory mapping, the linear-path warning."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import main as gen
from models.hf_dir import read_hf_dir, write_safetensors
from models.llama2c import convert_llama2c, export_llama2c, read_header, read_llama2c
from engine.loader import build, load_model
from models.registry import path_warning
from models.weights import half_to_interleaved, interleaved_to_half, save_pretrained
from tests.conftest import shared_path, tiny_model

STORIES = ("checkpoints", "stories260K")
BOS = 1


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def tokens(n=24, vocab=97, seed=0):
    t = torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))
    t[:, 0] = BOS
    return t


def logits(model, x):
    with torch.no_grad():
        return model(x)


def greedy(model, steps: int) -> list[int]:
    """Greedy ids from BOS with the decode step, one token at a time."""
    state = model.init_state(batch=1, max_len=steps + 1, attention="softmax")
    tok, out = torch.tensor([[BOS]]), []
    for _ in range(steps):
        tok = model.step(tok, state)[:, -1].argmax(-1, keepdim=True)
        out.append(tok.item())
    return out


# ---------------------------------------------------------------------------- the real checkpoint
def test_stories260k_llama2c_and_hf_dir_give_identical_greedy_tokens():
    bin_path = shared_path(*STORIES, "llama2c", "stories260K.bin")
    hf_dir = shared_path(*STORIES, "hf")
    from_bin, tok_a = load_model(bin_path)
    from_dir, tok_b = load_model(hf_dir)
    assert tok_a is None and tok_b is None
    assert from_bin.config.num_key_value_heads == 4 and from_bin.config.num_attention_heads == 8
    a, b = greedy(from_bin, 200), greedy(from_dir, 200)
    print("first 20 greedy ids:", a[:20])
    assert a == b
    assert len(set(a)) > 20          # a story, not one token repeated
    assert max_diff(logits(from_bin, tokens(40, 512)), logits(from_dir, tokens(40, 512))) == 0.0


def test_convert_cli_reproduces_the_shared_hf_dir(tmp_path):
    bin_path = shared_path(*STORIES, "llama2c", "stories260K.bin")
    ref = load_file(shared_path(*STORIES, "hf", "model.safetensors"))
    out = tmp_path / "hf"
    result = CliRunner().invoke(gen, ["convert", "llama2c", str(bin_path), str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    ours = load_file(out / "model.safetensors")
    # llama2.c's classifier is shared: we write tie_word_embeddings, the shared dir an lm_head copy
    assert set(ref) - set(ours) == {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, t in ours.items():    # q/k permuted exactly as the independent conversion did
        assert torch.equal(t, ref[name]), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["trained_for"] == ["softmax"]
    again = CliRunner().invoke(gen, ["convert", "llama2c", str(bin_path), str(out), "--no-progress"])
    assert again.exit_code == 2 and "--force" in again.output


def test_linear_attention_runs_on_a_softmax_checkpoint_with_a_warning():
    model, _ = load_model(shared_path(*STORIES, "llama2c", "stories260K.bin"))
    assert model.config.trained_for == ("softmax",)
    warning = path_warning(model.config, "linear")
    print(warning)
    assert warning and "softmax" in warning and "linear" in warning and "\n" not in warning
    assert path_warning(model.config, "softmax") is None and path_warning(model.config, None) is None
    with torch.no_grad():
        assert torch.isfinite(model(tokens(16, 512), attention="linear")).all()


def test_path_warning_is_silent_for_trained_paths():
    cfg = tiny_model().config.replace(trained_for=("softmax", "linear"))
    assert path_warning(cfg, "linear") is None and path_warning(cfg, "softmax") is None
    assert "trained for linear" in path_warning(cfg.replace(trained_for=("linear",)), "softmax")


# ---------------------------------------------------------------------------- llama2.c files
LLAMA2C = [pytest.param(v, tied, id=f"v{v}-{'shared' if tied else 'separate'}-classifier")
           for v in (0, 1) for tied in (True, False)]


@pytest.mark.parametrize("version,tied", LLAMA2C)
def test_llama2c_file_loads_and_converts(tmp_path, version, tied):
    model = tiny_model(seed=3, num_key_value_heads=2, tie_word_embeddings=tied)
    path = tmp_path / "model.bin"
    export_llama2c(model, path, version=version)
    h = read_header(path)
    assert (h.version, h.shared_classifier, h.n_kv_heads, h.vocab_size) == (version, tied, 2, 97)
    loaded, _ = load_model(path)
    assert loaded.config.tie_word_embeddings == tied and loaded.config.trained_for == ("softmax",)
    x = tokens()
    assert max_diff(logits(loaded, x), logits(model, x)) == 0.0     # fp32 throughout: bit-exact
    convert_llama2c(path, tmp_path / "hf")
    converted, _ = load_model(tmp_path / "hf")
    assert max_diff(logits(converted, x), logits(model, x)) == 0.0


def test_rotary_permutation_roundtrips_and_rotates_pairs():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)      # 2 heads of D=8, C=3
    half = interleaved_to_half(w, 2).reshape(16, 3)
    # head 0: Meta rows 0,2,4,6 (pair firsts) become rows 0..3, rows 1,3,5,7 become rows 4..7
    assert half[:8, 0].tolist() == [0, 6, 12, 18, 3, 9, 15, 21]
    assert torch.equal(half_to_interleaved(half, 2), w)


def test_llama2c_tensors_are_memory_mapped_and_copied_once(tmp_path):
    model = tiny_model(seed=4, num_key_value_heads=2)
    export_llama2c(model, tmp_path / "m.bin", version=1)
    cfg, tensors = read_llama2c(tmp_path / "m.bin")
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1              # every tensor is a view of the one file mapping
    built = build(cfg, tensors, "cpu", torch.float32, interleaved_rotary=True)
    assert built.embed_tokens.weight.data_ptr() == tensors["model.embed_tokens.weight"].data_ptr()
    assert built.layers[1].mlp.down_proj.weight.data_ptr() == tensors["model.layers.1.mlp.down_proj.weight"].data_ptr()


# ---------------------------------------------------------------------------- Hugging Face dirs
HF = [pytest.param(dict(num_key_value_heads=2), id="GQA-untied"),
      pytest.param(dict(num_key_value_heads=2, tie_word_embeddings=True), id="GQA-tied"),
      pytest.param(dict(num_key_value_heads=1, rope_theta=500000.0), id="MQA-theta5e5")]


@pytest.mark.parametrize("overrides", HF)
def test_hf_dir_roundtrip(tmp_path, overrides):
    model = tiny_model(seed=5, **overrides)
    save_pretrained(model, tmp_path, dtype=torch.float32)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in names) != model.config.tie_word_embeddings
    loaded, _ = load_model(tmp_path)
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.embed_tokens.weight
    x = tokens()
    assert max_diff(logits(loaded, x), logits(model, x)) == 0.0


def test_plain_weights_are_memory_mapped_not_copied(tmp_path):
    save_pretrained(tiny_model(seed=6), tmp_path, dtype=torch.float32)
    cfg, tensors = read_hf_dir(tmp_path)
    model = build(cfg, tensors, "cpu", torch.float32)
    for runtime, name in [(model.embed_tokens.weight, "model.embed_tokens.weight"),
                          (model.lm_head.weight, "lm_head.weight"),
                          (model.layers[0].self_attn.o_proj.weight, "model.layers.0.self_attn.o_proj.weight")]:
        assert runtime.data_ptr() == tensors[name].data_ptr(), name
    # the fused matrices are the one copy: new memory, holding q;k;v
    qkv = model.layers[0].self_attn.qkv.weight
    assert qkv.data_ptr() != tensors["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    assert torch.equal(qkv[: cfg.hidden_size], tensors["model.layers.0.self_attn.q_proj.weight"])


def shard(src_dir, n_shards: int) -> dict:
    """Split src_dir/model.safetensors into Hugging Face style shards + index, in place."""
    tensors = load_file(src_dir / "model.safetensors")
    (src_dir / "model.safetensors").unlink()
    names, weight_map = sorted(tensors), {}
    for i in range(n_shards):
        file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::n_shards]}
        save_file(part, src_dir / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in tensors.values())}, "weight_map": weight_map}
    (src_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_sharded_dir_loads(tmp_path):
    model = tiny_model(seed=7, num_key_value_heads=2)
    save_pretrained(model, tmp_path, dtype=torch.float32)
    shard(tmp_path, 3)
    loaded, _ = load_model(tmp_path)
    x = tokens()
    assert max_diff(logits(loaded, x), logits(model, x)) == 0.0


DTYPES = [pytest.param(torch.bfloat16, "bfloat16", 5e-2, id="bf16-file-bf16-compute"),
          pytest.param(torch.float16, "float16", 1e-2, id="fp16-file-fp16-compute"),
          pytest.param(torch.bfloat16, "float32", 5e-2, id="bf16-file-fp32-compute"),
          pytest.param(torch.float32, "bfloat16", 5e-2, id="fp32-file-bf16-compute")]


@pytest.mark.parametrize("file_dtype,compute,tol", DTYPES)
def test_half_precision_weights_compute_in_the_dtype_asked_for(tmp_path, file_dtype, compute, tol):
    model = tiny_model(seed=8, num_key_value_heads=2)
    save_pretrained(model, tmp_path, dtype=file_dtype)
    loaded, _ = load_model(tmp_path, dtype=compute)
    want = getattr(torch, compute)
    assert {p.dtype for p in loaded.parameters()} == {want}
    x = tokens()
    out = logits(loaded, x)
    assert out.dtype == want
    # reference: the same rounded weights, computed in fp32
    exact = tiny_model(seed=8, num_key_value_heads=2).to(file_dtype).float()
    assert max_diff(out, logits(exact, x)) <= tol
    if compute == "float32":     # upcasting is exact
        assert max_diff(out, logits(exact, x)) <= 1e-5


def test_streamed_safetensors_writer_is_readable_by_safetensors(tmp_path):
    a = torch.randn(6, 4)
    tensors = {"a": a, "b": torch.arange(5, dtype=torch.bfloat16), "p": interleaved_to_half(a, 1)}
    write_safetensors(tmp_path / "x.safetensors", tensors, shapes={"p": (6, 4)})
    back = load_file(tmp_path / "x.safetensors")
    assert torch.equal(back["a"], a) and torch.equal(back["b"], tensors["b"])
    assert torch.equal(back["p"], interleaved_to_half(a, 1).reshape(6, 4))
