"""RoPE frequency scaling (Llama 3.1+'s `llama3`, `linear`) against transformers' own LlamaForCausalLM,
from a Hugging Face directory and from a GGUF file written the way llama.cpp's converter writes it
(a `rope_freqs.weight` tensor of per-frequency divisors, no scaling metadata key).

A small `original_max_position_embeddings` (16) puts most of the 48-token sequence past the original
context, where the scaled frequencies differ most from plain RoPE; every step form and a padded batch
are held to the same logits."""
import math

import numpy as np
import pytest
import torch

from engine.loader import load_model
from engine.steps import make_step
from models.config import ModelConfig
from models.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="transformers not installed (test extra)")
from tests.test_families import max_diff, stepwise  # noqa: E402 (after the skip: it needs transformers)

TOL = 1e-4
T = 48
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def hf_random(rope_scaling, seed=0, **overrides):
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=False, rope_scaling=dict(rope_scaling))
    base.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08 if p.dim() >= 2 else 1 + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def sequence(vocab=97, seed=0):
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))




def llama_cpp_rope_freqs(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """The `rope_freqs` tensor as llama.cpp's convert_hf_to_gguf.py computes it (written out here
    from its formula: 1, `factor`, or 1 / the smooth interpolation, per frequency)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_hf_directory_with_rope_scaling_matches_transformers(tmp_path, scaling):
    theirs = hf_random(scaling)
    theirs.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, dtype="float32")
    assert ours.config.rope_scaling["rope_type"] == scaling["rope_type"]
    every_form_matches(ours, theirs)


def every_form_matches(ours, theirs):
    """The module forward, and every step form token by token, give transformers' logits."""
    x = sequence()
    with torch.no_grad():
        ref = theirs(x).logits
        assert max_diff(ours(x), ref) <= TOL
        for backend in ours_backends(ours):
            assert max_diff(stepwise(ours, x, backend), ref) <= TOL, backend


def ours_backends(model):
    return ["module", "torch"] + (["native"] if "native" in make_step(model).forms_available else [])


def test_scaling_matters_here():
    """Negative control: the sequence reaches far enough past the original context that plain RoPE
    gives other logits, so the matches above are not vacuous."""
    theirs = hf_random(LLAMA3)
    plain = hf_random({"rope_type": "default"})
    x = sequence()
    with torch.no_grad():
        assert max_diff(theirs(x).logits, plain(x).logits) > 100 * TOL


def test_padded_batch_with_llama3_scaling_equals_each_alone(tmp_path):
    hf_random(LLAMA3).save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, dtype="float32")
    a, b = sequence(seed=1)[0, :40].tolist(), sequence(seed=2)[0, :23].tolist()
    from engine.api import LLM
    llm = LLM(ours, None)
    both = llm.generate([a, b], max_new_tokens=8, temperature=0)
    alone = [llm.generate([p], max_new_tokens=8, temperature=0)[0] for p in (a, b)]
    assert [r.ids for r in both] == [r.ids for r in alone]


def test_round_trip_through_our_config(tmp_path):
    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=97, rope_scaling=dict(LLAMA3))
    cfg.to_json(tmp_path / "config.json")
    assert ModelConfig.from_json(tmp_path / "config.json") == cfg


@pytest.mark.parametrize("raw, words", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs a positive number low_freq_factor"),
    ({"rope_scaling": {"type": "linear", "factor": -1}}, "needs a positive number factor"),
    ({"rope_scaling": "llama3"}, "must be an object"),
])
def test_bad_rope_scaling_is_one_line(raw, words):
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=97)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**base, **raw})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_transformers5_rope_parameters_spelling():
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=97)
    cfg = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == LLAMA3


# ---------------------------------------------------------------------------- GGUF: rope_freqs.weight
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")


def write_llama3_gguf(path, theirs, with_freqs=True):
    """`theirs` as llama.cpp's converter writes a Llama 3.1 file: q/k rows interleaved, the scaling as
    a `rope_freqs.weight` tensor, no rope.scaling.* key."""
    from engine.loader import build
    from models.hf_dir import read_hf_dir
    from tests.chat_fixtures import write_gguf
    directory = path.parent / f"{path.stem}-hf"
    theirs.save_pretrained(directory)
    cfg, tensors = read_hf_dir(directory)
    plain = build(cfg.replace(rope_scaling=None), tensors, "cpu", torch.float32)   # the file's weights
    freqs = llama_cpp_rope_freqs(LLAMA3, cfg.head_dim, cfg.rope_theta)
    write_gguf(path, plain, None, template=None, extra_tensors={"rope_freqs.weight": freqs} if with_freqs else None)
    return freqs


def test_llama3_gguf_rope_freqs_match_transformers(tmp_path):
    theirs = hf_random(LLAMA3)
    path = tmp_path / "llama3.gguf"
    freqs = write_llama3_gguf(path, theirs)
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert "rope_freqs.weight" in names     # llama.cpp's own reader sees the tensor where llama.cpp looks
    ours, _ = load_model(path, dtype="float32")
    assert ours.config.rope_freq_factors == pytest.approx(freqs.tolist())
    every_form_matches(ours, theirs)


def test_llama3_gguf_without_its_tensor_is_plain_rope(tmp_path):
    """The same file without `rope_freqs.weight` is a plain-RoPE model: far from transformers' llama3
    logits, so the test above would catch a loader that skipped the tensor."""
    theirs = hf_random(LLAMA3)
    path = tmp_path / "plain.gguf"
    write_llama3_gguf(path, theirs, with_freqs=False)
    ours, _ = load_model(path, dtype="float32")
    assert ours.config.rope_freq_factors is None
    with torch.no_grad():
        assert max_diff(ours(sequence()), theirs(sequence()).logits) > 100 * TOL


def test_linear_scaling_gguf_metadata_matches_transformers(tmp_path, monkeypatch):
    """llama.cpp writes linear scaling as metadata: rope.scaling.type linear + rope.scaling.factor."""
    from engine.loader import build
    from models.hf_dir import read_hf_dir
    from tests.chat_fixtures import write_gguf
    theirs = hf_random(LINEAR)
    theirs.save_pretrained(tmp_path / "hf")
    cfg, tensors = read_hf_dir(tmp_path / "hf")
    plain = build(cfg.replace(rope_scaling=None), tensors, "cpu", torch.float32)
    header = gguf.GGUFWriter.write_header_to_file

    def with_scaling(self, *a, **kw):
        self.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        self.add_rope_scaling_factor(LINEAR["factor"])
        return header(self, *a, **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_scaling)
    path = tmp_path / "linear.gguf"
    write_gguf(path, plain, None, template=None)
    ours, _ = load_model(path, dtype="float32")
    assert ours.config.rope_scaling == LINEAR
    with torch.no_grad():
        assert max_diff(ours(sequence()), theirs(sequence()).logits) <= TOL
