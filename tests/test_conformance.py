"""Conformance with Hugging Face transformers' LlamaForCausalLM (optional: `pip install -e .[hf]`).

Both directions: checkpoints transformers writes load here with the same logits, and the
checkpoints we write load in transformers with the same logits. fp32, 40-token sequences.
"""
import pytest
import torch

from engine.loader import load_model
from models.registry import REGISTRY
from models.weights import save_pretrained
from tests.conftest import shared_path, tiny_model

transformers = pytest.importorskip("transformers", reason="transformers not installed (optional extra: .[hf])")

TOL = 1e-4
T = 40


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |logit diff| = {d:.3e} (logits up to {b.abs().max().item():.1f})")
    return d


def sequence(vocab: int, seed: int = 0) -> torch.Tensor:
    x = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))
    x[0, 0] = 1   # BOS
    return x


def theirs(path, **kw):
    return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager", **kw).eval()


def compare(ours, hf_model, vocab):
    x = sequence(vocab)
    with torch.no_grad():
        return max_diff(ours(x), hf_model(x).logits)


def randomize_(model, seed):
    """Weights far enough from init that a wrong mapping or permutation shows (norms included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


# ---------------------------------------------------------------------------- the real checkpoint
@pytest.mark.parametrize("source", ["hf", "llama2c"])
def test_stories260k_matches_transformers(source):
    hf_dir = shared_path("checkpoints", "stories260K", "hf")
    path = hf_dir if source == "hf" else shared_path("checkpoints", "stories260K", "llama2c", "stories260K.bin")
    ours, _ = load_model(path)
    assert compare(ours, theirs(hf_dir), 512) <= TOL


# ---------------------------------------------------------------------------- transformers -> us
RANDOM_HF = [pytest.param(dict(num_key_value_heads=2), id="GQA-untied"),
             pytest.param(dict(num_key_value_heads=2, tie_word_embeddings=True), id="GQA-tied"),
             pytest.param(dict(num_key_value_heads=4, tie_word_embeddings=True), id="MHA-tied"),
             pytest.param(dict(num_key_value_heads=1, rope_theta=500000.0), id="MQA-untied-theta5e5"),
             pytest.param(dict(num_key_value_heads=2, head_dim=24), id="GQA-head_dim24")]


def hf_random(seed=0, **overrides):
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    base.update(overrides)
    return randomize_(transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)), seed).eval()


@pytest.mark.parametrize("overrides", RANDOM_HF)
def test_random_transformers_model_loads_and_matches(tmp_path, overrides):
    model = hf_random(**overrides)
    model.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path)
    assert ours.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert compare(ours, model, 97) <= TOL


def test_comparison_detects_a_wrong_rotary_layout(tmp_path):
    """Negative control: the exact matches above are not vacuous. Reading the q/k rows as if
    they were llama2.c's interleaved layout must move the logits far outside the tolerance."""
    from models.hf_dir import read_hf_dir
    from engine.loader import build
    model = hf_random(num_key_value_heads=2)
    model.save_pretrained(tmp_path)
    cfg, tensors = read_hf_dir(tmp_path)
    wrong = build(cfg, tensors, "cpu", torch.float32, interleaved_rotary=True)
    assert compare(wrong, model, 97) > 100 * TOL


def test_sharded_transformers_save_loads(tmp_path):
    model = hf_random(num_key_value_heads=2)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    ours, _ = load_model(tmp_path)
    assert compare(ours, model, 97) <= TOL


def test_bf16_transformers_save_loads_and_upcasts(tmp_path):
    model = hf_random(num_key_value_heads=2)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, dtype="float32")
    assert compare(ours, theirs(tmp_path, dtype=torch.float32), 97) <= TOL
    ours_bf16, _ = load_model(tmp_path, dtype="bfloat16")
    assert ours_bf16.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- us -> transformers
OURS = [pytest.param(dict(num_key_value_heads=2), id="GQA-untied"),
        pytest.param(dict(num_key_value_heads=2, tie_word_embeddings=True), id="GQA-tied"),
        pytest.param(dict(num_key_value_heads=1, rope_theta=500000.0, trained_for=("softmax", "linear")),
                     id="MQA-theta5e5-both-paths")]


@pytest.mark.parametrize("overrides", OURS)
def test_our_export_loads_in_transformers(tmp_path, overrides):
    ours = randomize_(tiny_model(**overrides), seed=1)
    save_pretrained(ours, tmp_path, dtype=torch.float32)
    model = theirs(tmp_path)
    assert model.config.tie_word_embeddings == ours.config.tie_word_embeddings
    assert compare(ours, model, 97) <= TOL


def test_shipped_tiny_model_exports_to_transformers(tmp_path):
    if not (REGISTRY["tiny"] / "config.json").is_file():
        pytest.skip(f"{REGISTRY['tiny']} has no model yet (weights/ is not in git)")
    ours, _ = load_model("tiny", dtype="float32")
    if ours.config.position_encoding != "rope":
        pytest.skip("the tiny model has no RoPE: LlamaForCausalLM always applies it")
    save_pretrained(ours, tmp_path, dtype=torch.float32)
    assert compare(ours, theirs(tmp_path), ours.config.vocab_size) <= TOL
